"""Two processes on this machine (loopback, CPU backend with gloo collectives, 4 fake devices each) are one JAX
program of 8 devices (:mod:`jaxgrad.train.distributed`): the LoRA model sharded over ``fsdp`` 8 across both
processes gives the loss, every LoRA gradient and the Adam step of one process with 8 devices (float64, 1e-12).
The environment settings are read as documented, and partial ones are refused naming the variable."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from jaxgrad.train.distributed import settings_from_env
from jaxgrad.train.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os
from jaxgrad.train.distributed import initialize
multi = initialize()
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()
from jaxgrad.train import TrainConfig, build, init_state, shard_batch
from jaxgrad.train.mesh import train_mesh
from jaxgrad.lora.sharding import make_sharded_task
from jaxgrad.lora.task_config import LoraFit
fit = LoraFit(mode="lora", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, seq_len=16, batch_size=8, n_bytes=4096, dtype="float64", init_lora_weights=False)
cfg = TrainConfig(steps=1, optimizer="adam", lr=1e-3, seed=3)
mesh = train_mesh("fsdp", 8)
task, plan = make_sharded_task(fit, mesh, device=("cpu", None))
_, steps = build(task, cfg, mesh=mesh, plan=plan)
state = init_state(task, cfg, steps, mesh)
batch = shard_batch(next(iter(task.batches(0))), mesh)
s, n, g = steps.grad_sums(state["params"], batch)
new, loss, ok = steps.train_step(state, batch)
out = {"processes": jax.process_count(), "local_devices": jax.local_device_count(), "s": float(s), "n": float(n),
       "grads": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(g["lora"])],
       "lora": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(new["params"]["lora"])], "ok": bool(ok)}
if jax.process_index() == 0:
    print("REPORT" + json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    return dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                                    "--xla_backend_optimization_level=0", **extra)


def _report(stdout: str) -> dict:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("REPORT")]
    return json.loads(line[len("REPORT"):])


def test_two_processes_of_four_devices_train_as_one_process_of_eight():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    one = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, text=True, capture_output=True, timeout=300,
                         env=_env(8))
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-4000:]
    two, single = _report(outs[0][0]), _report(one.stdout)
    assert (two["processes"], two["local_devices"]) == (2, 4)
    assert (single["processes"], single["local_devices"]) == (1, 8)
    assert two["ok"] and two["n"] == single["n"] > 0
    assert abs(two["s"] - single["s"]) <= 1e-12 * abs(single["s"])
    for key in ("grads", "lora"):
        for a, b in zip(two[key], single[key], strict=True):
            scale = max(max(abs(x) for x in b), 1e-300)
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-12 * scale, key


def test_the_environment_names_the_processes():
    assert settings_from_env({}) is None
    assert settings_from_env({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2",
                              "JAX_PROCESS_ID": "1"}) == {"coordinator_address": "h:1234", "num_processes": 2,
                                                          "process_id": 1}
    assert settings_from_env({"JAXGRAD_DISTRIBUTED": "auto"}) == {}          # JAX detects the cluster
    assert settings_from_env({"SLURM_NTASKS": "4"}) == {}                    # srun of 4 tasks
    assert settings_from_env({"SLURM_NTASKS": "1"}) is None                  # one task: one process
    assert settings_from_env({"SLURM_NTASKS": "4", "JAXGRAD_DISTRIBUTED": "off"}) is None
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
        settings_from_env({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID = 2 must be < JAX_NUM_PROCESSES = 2"):
        settings_from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES must be an integer"):
        settings_from_env({"JAX_NUM_PROCESSES": "two"})


_CLI = r"""
import sys
from jaxgrad.cli import main
sys.exit(main(sys.argv[1:]))
"""
_TINY = ["--set", "model.mode=lora", "--set", "model.hidden_size=32", "--set", "model.num_hidden_layers=2",
         "--set", "model.num_attention_heads=4", "--set", "model.num_key_value_heads=2",
         "--set", "model.intermediate_size=64", "--set", "model.seq_len=16", "--set", "data.n_bytes=4096",
         "--set", "model.dtype=float64", "--set", "train.steps=3", "--set", "train.checkpoint_every=2",
         "--set", "mesh.axes=fsdp", "--no-progress"]


def _adapter(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow  # three runs of jaxgrad train (~60 s on the 2-core CPU)
def test_jaxgrad_train_in_two_processes_equals_one_process(tmp_path):
    """``jaxgrad train lora`` launched twice with the environment of a 2-process job (one run directory on a shared
    file system: process 0 writes the logs, both write their checkpoint shards) trains as one process of 8 devices."""
    port = _free_port()
    two, one = tmp_path / "two", tmp_path / "one"
    procs = [subprocess.Popen([sys.executable, "-c", _CLI, "train", "lora", "--out", str(two), *_TINY], cwd=ROOT,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    single = subprocess.run([sys.executable, "-c", _CLI, "train", "lora", "--out", str(one), *_TINY], cwd=ROOT,
                            text=True, capture_output=True, timeout=300, env=_env(8))
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-4000:]
    s2, s1 = (json.loads((d / "summary.json").read_text()) for d in (two, one))
    assert s2["processes"] == 2 and s1["processes"] == 1 and s2["mesh"] == s1["mesh"] == {"data": 1, "fsdp": 8}
    assert abs(s2["final_loss"] - s1["final_loss"]) <= 1e-12 * abs(s1["final_loss"])
    a2, a1 = _adapter(two), _adapter(one)
    assert sorted(a2) == sorted(a1) and a1
    for name in a1:
        scale = max(float(abs(a1[name]).max()), 1e-300)
        assert float(abs(a2[name] - a1[name]).max()) <= 1e-12 * scale, name
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["2", "3"]
    assert all((two / "checkpoints" / s / "jaxgrad-checksums.json").is_file() for s in ("2", "3"))
