"""A LoRA run's checkpoint written on N devices resumes on M (8 -> 1, 1 -> 8, 4 -> 2; the layouts differ too:
``fsdp`` 8, the plain single-device path, ``data`` 2 x ``fsdp`` 2, ``fsdp`` 2): the restored state equals the
saved one bit for bit, lies on the new devices, and the next steps equal the N-device run's (float64, 1e-12).
QLoRA too (8 -> 1): its NF4 projections are not in the checkpoint (the frozen base's constants, sharded as the
resuming layout says).

The device count must be set before JAX starts, so the checks run in a subprocess of their own."""


import pytest
from fake_devices import run_report


_CHILD = r"""
import json, shutil, sys, tempfile, pathlib
import chex
chex.set_n_cpu_devices(8)
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from jaxgrad.train import TrainConfig, data_mesh, fit
from jaxgrad.train.mesh import train_mesh
from jaxgrad.lora.task import make_task
from jaxgrad.lora.sharding import make_sharded_task
from jaxgrad.lora.task_config import LoraFit

lora = LoraFit(mode="lora", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, seq_len=16, batch_size=8, n_bytes=4096, dtype="float64",
               init_lora_weights=False)
qlora = LoraFit(**{**lora.__dict__, "mode": "qlora", "nf4_blocksize": 32, "double_quant": True})
LAYOUTS = {8: ("fsdp", 8, None), 1: None, 4: ("data,fsdp", 4, 2), 2: ("fsdp", 2, None)}

def run(out, devices, steps, resuming, fit_cfg=lora):
    cfg = TrainConfig(steps=steps, optimizer="adam", lr=1e-2, seed=3, checkpoint_every=1, log_every=1)
    if LAYOUTS[devices] is None:  # the plain single-device path
        task, mesh, plan = make_task(fit_cfg, device=("cpu", None)), data_mesh(1), None
    else:
        mesh = train_mesh(*LAYOUTS[devices])
        task, plan = make_sharded_task(fit_cfg, mesh, device=("cpu", None))
    res = fit(task, cfg, out, resuming=resuming, mesh=mesh, plan=plan, say=lambda m: None)
    return res.state

def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]

def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

report = {}
root = pathlib.Path(tempfile.mkdtemp())
for n, m, fit_cfg in ((8, 1, lora), (1, 8, lora), (4, 2, lora), (8, 1, qlora)):
    name = f"{fit_cfg.mode} {n}->{m}"
    a, b = root / f"{name}-a", root / f"{name}-b"
    saved = run(a, n, 2, False, fit_cfg)
    shutil.copytree(a, b)
    restored = run(b, m, 2, True, fit_cfg)  # at its total already: the restored state, nothing trained
    emb = restored["params"]["base"]["embed_tokens"]["weight"]
    on_n = run(a, n, 4, True, fit_cfg)
    on_m = run(b, m, 4, True, fit_cfg)
    report[name] = {
        "bitwise": all(np.array_equal(x, y) for x, y in zip(leaves(restored), leaves(saved))),
        "devices": len(emb.sharding.device_set),
        "next_steps": max(rel(x, y) for x, y in zip(leaves(on_m["params"]["lora"]), leaves(on_n["params"]["lora"]))),
        "opt_state": max(rel(x, y) for x, y in zip(leaves(on_m["opt_state"]), leaves(on_n["opt_state"]))
                         if x.dtype.kind == "f"),
        "moved": max(rel(x, y) for x, y in zip(leaves(on_m["params"]["lora"]), leaves(saved["params"]["lora"])))}
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow
def test_a_checkpoint_of_n_devices_resumes_on_m_bit_identically_and_trains_on_identically():
    report = run_report(_CHILD)
    assert set(report) == {"lora 8->1", "lora 1->8", "lora 4->2", "qlora 8->1"}
    for name, r in report.items():
        m = int(name.split("->")[1])
        assert r["bitwise"], (name, r)
        assert r["devices"] == m, (name, r)
        assert r["next_steps"] <= 1e-12 and r["opt_state"] <= 1e-12, (name, r)
        assert r["moved"] > 1e-6, (name, r)  # the two further steps did train
