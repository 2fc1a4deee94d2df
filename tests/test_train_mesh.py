"""The engine on a mesh of 8 (fake CPU) devices gives the single-device gradients and optimizer step (float64,
1e-14 relative: only the order of the cross-device sum differs), for the KAN, the CNN and the LoRA model on packed
rows of a data file, custom VJPs and Pallas kernels (interpret mode) included; a batch that does not divide over the mesh is a clear error.
``jaxgrad train lora`` runs on a ``data`` x ``fsdp`` mesh (``[mesh]``) and resumes on another layout; a family without
a sharded layout is refused before its run starts.

The device count must be set before JAX starts, so the checks run in a subprocess of their own."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from fake_devices import run_report

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys
import chex
chex.set_n_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()
from jaxgrad.train import TrainConfig, build, data_mesh, init_state, shard_batch
from jaxgrad.kan.task import KANFit, make_task as kan_task
from jaxgrad.cnn.task import make_task as cnn_task
from jaxgrad.cnn.synthetic import SyntheticPairs

def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

def compare(task, batch, cfg):
    out = {}
    results = {}
    for d in (1, 8):
        mesh, steps = build(task, cfg, mesh=data_mesh(d))
        state = init_state(task, cfg, steps, mesh)
        s, n, g = steps.grad_sums(state["params"], shard_batch(batch, mesh))
        state, loss, ok = steps.train_step(state, shard_batch(batch, mesh))
        results[d] = (s, n, g, state["params"], loss)
    (s1, n1, g1, p1, l1), (s8, n8, g8, p8, l8) = results[1], results[8]
    out["n"] = [float(n1), float(n8)]
    out["loss"] = rel(s8, s1)
    out["grad"] = max(rel(a, b) for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)))
    out["params_after_step"] = max(rel(a, b) for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)))
    trained = g1["lora"] if isinstance(g1, dict) and "lora" in g1 else g1  # LoRA: the frozen base gets none
    out["grad_nonzero"] = all(float(np.max(np.abs(np.asarray(a)))) > 0 for a in jax.tree.leaves(trained)
                              if np.asarray(a).size)
    first = batch[0] if isinstance(batch, tuple) else batch["input_ids"] if isinstance(batch, dict) else None
    sharded = shard_batch(batch, data_mesh(8))
    sharded_first = sharded[0] if isinstance(batch, tuple) else sharded["input_ids"]
    out["sharded_over"] = None if first is None else len(sharded_first.sharding.device_set)
    return out

report = {}
cfg = TrainConfig(steps=1, optimizer="sgd", lr=0.1, seed=3)
fit = KANFit(widths=(2, 3, 1), grids=(4,), n_train=32, n_test=8, dtype="float64")
for backend in ("xla", "pallas"):
    task = kan_task(KANFit(**{**fit.__dict__, "backend": backend}), 1)
    batch = next(task.batches(0))
    report[f"kan/{backend}"] = compare(task, batch, cfg)
stream = SyntheticPairs(8, 16, snr=0.5, seed=1, batches_per_epoch=1)
for backend in ("xla", "pallas"):
    task = cnn_task(stream, channels=(1, 3, 1), backend=backend, precision="highest", dtype=jnp.float64)
    x, y = next(task.batches(0))
    report[f"cnn/{backend}"] = compare(task, (x.astype(np.float64), y.astype(np.float64)), cfg)
# the LoRA model on packed rows of a JSONL file (segment ids, per-segment positions), the block's custom VJP
import pathlib, tempfile
from jaxgrad.lora.task import make_task as lora_task
from jaxgrad.lora.task_config import LoraFit
from jaxgrad.lora.tokenizer import train_bpe_tokenizer
tmp = pathlib.Path(tempfile.mkdtemp())
recs = [{"prompt": f"q{i} " + "alpha beta " * (i % 5 + 1), "completion": "gamma delta " * (i % 3 + 1)}
        for i in range(120)]
train_bpe_tokenizer([r["prompt"] + r["completion"] for r in recs], 300).save(tmp / "tok")
(tmp / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
task = lora_task(LoraFit(mode="lora", tokenizer=str(tmp / "tok"), data_path=str(tmp / "t.jsonl"), seq_len=32,
                         batch_size=8, dtype="float64", init_lora_weights=False), device=("cpu", None))
batch = next(iter(task.batches(0)))
assert batch["segment_ids"].max() > 1
report["lora/xla packed"] = compare(task, batch, TrainConfig(steps=1, optimizer="adam", lr=1e-3, seed=3))
# a batch that does not divide over the mesh
try:
    shard_batch((np.zeros((12, 2)), np.zeros((12, 1))), data_mesh(8))
    report["indivisible"] = None
except ValueError as err:
    report["indivisible"] = str(err)
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow
def test_eight_fake_devices_match_one_device():
    report = run_report(_CHILD)
    for name, r in report.items():
        if name == "indivisible":
            continue
        assert r["n"][0] == r["n"][1] > 0, (name, r)
        assert r["grad_nonzero"], (name, r)
        assert r["sharded_over"] == 8, (name, r)
        for key in ("loss", "grad", "params_after_step"):
            assert r[key] <= 1e-14, (name, key, r)
    msg = report["indivisible"]
    assert msg is not None and "batch size 12" in msg and "8 devices" in msg, msg


_CLI_CHILD = r"""
import sys
from jaxgrad.cli import main
sys.exit(main(sys.argv[1:]))
"""
_TINY = ["--set", "model.mode=lora", "--set", "model.hidden_size=32", "--set", "model.num_hidden_layers=2",
         "--set", "model.num_attention_heads=4", "--set", "model.num_key_value_heads=2",
         "--set", "model.intermediate_size=64", "--set", "model.seq_len=16", "--set", "data.n_bytes=4096",
         "--no-progress"]


def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, "-c", _CLI_CHILD, "train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_jaxgrad_train_lora_on_a_data_by_fsdp_mesh_resumes_on_another_layout(tmp_path):
    out = tmp_path / "run"
    first = _cli("lora", "--out", str(out), "--set", "train.steps=2", "--set", "mesh.axes=data,fsdp",
                 "--set", "mesh.fsdp=2", *_TINY)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "fsdp 2: frozen base" in first.stdout and "data 2 x fsdp 2" in first.stdout
    assert "gathered weights kept" not in first.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 2} and summary["state_bytes_per_device"] > 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # a run saved before mesh.reshard_after_forward existed resumes, here with the gathered weights kept
    run = json.loads((out / "run.json").read_text())
    del run["config"]["mesh"]["reshard_after_forward"]
    (out / "run.json").write_text(json.dumps(run))
    again = _cli("lora", "--out", str(out), "--resume", "--set", "train.steps=3", "--set", "mesh.axes=fsdp",
                 "--set", "mesh.fsdp=none", "--set", "mesh.reshard_after_forward=false", "--no-progress")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "mesh.axes: 'data,fsdp' -> 'fsdp'" in again.stdout
    assert "gathered weights kept for the backward" in again.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 4} and summary["step"] == 3


def test_keeping_gathered_weights_without_an_fsdp_axis_is_refused_by_name(tmp_path):
    out = tmp_path / "keep"
    proc = _cli("lora", "--out", str(out), "--set", "mesh.reshard_after_forward=false", *_TINY)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "mesh.reshard_after_forward = false" in proc.stderr and "mesh.axes = 'data'" in proc.stderr
    assert not out.exists()


def test_a_family_without_a_sharded_layout_is_refused_before_the_run_starts(tmp_path):
    out = tmp_path / "kan"
    proc = _cli("kan", "--out", str(out), "--set", "mesh.axes=fsdp", "--no-progress")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "mesh.axes = 'fsdp': family 'kan' has no sharded layout" in proc.stderr
    assert not out.exists()
