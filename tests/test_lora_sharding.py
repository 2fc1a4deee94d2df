"""The LoRA / QLoRA model sharded over a mesh of 8 (fake CPU) devices trains as on one device.

For every layout -- ``data`` 8, ``fsdp`` 8, ``data`` 2 x ``fsdp`` 4, ``fsdp`` 8 with the adapters and Adam's state
sharded too, and QLoRA (NF4 bytes sharded) under ``fsdp`` 8 and ``data`` 2 x ``fsdp`` 4, and ``fsdp`` 8 keeping the
gathered weights for the backward (``reshard_after_forward`` false) for both -- the loss, every LoRA
gradient and the parameters after one Adam step equal the single-device run's (float64, 1e-12 relative: only the
order of the cross-device sums differs). The frozen base lies 1/F per device, and the compiled step all-gathers
each layer's weights twice (for its forward, which the backward's recompute shares, and again for its backward's
dY W: no layer's whole weights are kept from the forward; once when they are kept); XLA's memory analysis of a 4-layer step shows the base's
1/8 as arguments, about one layer's whole weights added to the temporaries (the next layer's gather may overlap
the current one) and the same FLOPs per device as the data layout (measured: arguments 15.9 -> 2.3 MiB,
temporaries 9.0 -> 12.7 MiB with layers of 3.75 MiB; FLOPs equal to 1e-4). Bad layouts are refused with the key
named.

The device count must be set before JAX starts, so the checks run in a subprocess of their own."""


import pytest
from fake_devices import run_report

pytestmark = pytest.mark.slow  # one subprocess for the module: ~60 s on the 2-core CPU, mostly XLA compiles

_CHILD = r"""
import json
import chex
chex.set_n_cpu_devices(8)
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from jaxgrad.train import TrainConfig, build, data_mesh, init_state, shard_batch
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.mesh import train_mesh
from jaxgrad.lora.task import make_task
from jaxgrad.lora.sharding import make_sharded_task
from jaxgrad.lora.task_config import LoraFit

def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

def lora_leaves(tree):
    return jax.tree.leaves(tree["lora"])

def fit_of(mode):
    extra = {"nf4_blocksize": 32, "double_quant": True} if mode == "qlora" else {}
    return LoraFit(mode=mode, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, seq_len=16, batch_size=8, n_bytes=4096, dtype="float64",
                   init_lora_weights=False, **extra)

cfg = TrainConfig(steps=1, optimizer="adam", lr=1e-3, seed=3)
report = {}
for mode, layouts in (("lora", (("data", None, False, True), ("fsdp", None, False, True),
                                ("data,fsdp", 4, False, True), ("fsdp", None, True, True), ("fsdp", None, False, False))),
                      ("qlora", (("fsdp", None, False, True), ("data,fsdp", 4, False, True),
                                 ("fsdp", None, False, False)))):
    fit = fit_of(mode)
    task = make_task(fit, device=("cpu", None))
    batch = next(iter(task.batches(0)))
    mesh, steps = build(task, cfg, mesh=data_mesh(1))
    state = init_state(task, cfg, steps, mesh)
    s1, n1, g1 = steps.grad_sums(state["params"], shard_batch(batch, mesh))
    one, _, _ = steps.train_step(state, shard_batch(batch, mesh))
    for layout, f, shard_trainable, reshard in layouts:
        mesh = train_mesh(layout, 8, f)
        stask, plan = make_sharded_task(fit, mesh, device=("cpu", None), shard_trainable=shard_trainable,
                                        reshard_after_forward=reshard)
        _, steps = build(stask, cfg, mesh=mesh, plan=plan)
        state = init_state(stask, cfg, steps, mesh)
        sharded = shard_batch(batch, mesh)
        s, n, g = steps.grad_sums(state["params"], sharded)
        gs = steps.grad_sums  # a partial binding the plan's constants (QLoRA's NF4 weights), or the jitted function
        jitted, kw = (gs.func, gs.keywords) if hasattr(gs, "func") else (gs, {})
        hlo = jitted.lower(state["params"], sharded, **kw).compile().as_text()
        new, _, ok = steps.train_step(state, sharded)
        emb = new["params"]["base"]["embed_tokens"]["weight"]
        lora_a = new["params"]["lora"]["layers"][0]["self_attn"]["q_proj"]["lora_A"]
        report[f"{mode} {layout} {f} {shard_trainable} {reshard}"] = {
            "n": [float(n1), float(n)], "loss": rel(s, s1),
            "grad": max(rel(a, b) for a, b in zip(lora_leaves(g), lora_leaves(g1))),
            "grad_nonzero": all(float(np.max(np.abs(np.asarray(a)))) > 0 for a in lora_leaves(g1)),
            "step": max(rel(a, b) for a, b in zip(lora_leaves(new["params"]), lora_leaves(one["params"]))),
            "ok": bool(ok), "fsdp": mesh.shape["fsdp"],
            "embed_rows_per_device": emb.sharding.shard_shape(emb.shape)[0], "embed_rows": emb.shape[0],
            "lora_a_replicated": bool(lora_a.sharding.is_fully_replicated),
            "all_gathers": sum(1 for ln in hlo.splitlines() if " all-gather(" in ln or " all-gather-start(" in ln),
            # table lookups (gather ops): each NF4 dequantisation reads the code table and the absmax codes' table
            "lookups": sum(1 for ln in hlo.splitlines() if " gather(" in ln and "all-gather" not in ln),
            "describe": plan.describe, "shard_trainable": shard_trainable, "reshard": reshard}
# compiled memory per device of the gradient step, a 4-layer model: the base's 1/8 as arguments, and no more than
# about one layer's whole weights gathered at a time among the temporaries
big = LoraFit(mode="lora", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=1024, seq_len=64, batch_size=8, n_bytes=1 << 15, dtype="float32")
memory = {}
for name, layout, reshard in (("data", "data", True), ("fsdp", "fsdp", True), ("fsdp kept", "fsdp", False)):
    mesh = train_mesh(layout, 8)
    stask, plan = make_sharded_task(big, mesh, device=("cpu", None), reshard_after_forward=reshard)
    _, steps = build(stask, cfg, mesh=mesh, plan=plan)
    state = init_state(stask, cfg, steps, mesh)
    compiled = steps.grad_sums.lower(state["params"], shard_batch(next(iter(stask.batches(0))), mesh)).compile()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    layer = sum(int(np.prod(x.shape)) * x.dtype.itemsize for g in ("self_attn", "mlp")
                for x in jax.tree.leaves(state["params"]["base"]["layers"][0][g]))
    memory[name] = {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes, "layer": layer,
                      "flops": float(cost["flops"])}
report["memory"] = memory
errors = {}
for name, args in (("axes", ("model", 8, None)), ("fsdp_with_data", ("data", 8, 2)),
                   ("data_fsdp_without_fsdp", ("data,fsdp", 8, None)), ("indivisible", ("data,fsdp", 8, 3)),
                   ("fsdp_not_all", ("fsdp", 8, 4))):
    try:
        train_mesh(*args)
        errors[name] = None
    except ConfigError as err:
        errors[name] = str(err)
try:
    make_sharded_task(LoraFit(mode="full", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, seq_len=16, n_bytes=4096),
                      train_mesh("fsdp", 8), device=("cpu", None))
    errors["full"] = None
except ConfigError as err:
    errors["full"] = str(err)
report["errors"] = errors
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return run_report(_CHILD)


def _runs(report):
    return {k: v for k, v in report.items() if k not in ("errors", "memory")}


def test_every_layout_gives_the_single_device_loss_gradients_and_adam_step(report):
    runs = _runs(report)
    assert len(runs) == 8
    for name, r in runs.items():
        assert r["n"][0] == r["n"][1] > 0, (name, r)
        assert r["grad_nonzero"] and r["ok"], (name, r)
        assert r["loss"] <= 1e-12 and r["grad"] <= 1e-12 and r["step"] <= 1e-12, (name, r)


def test_the_frozen_base_lies_one_fsdp_th_per_device_and_each_layer_is_gathered_for_its_forward_and_backward(report):
    layers, projections = 2, 7
    for name, r in _runs(report).items():
        assert r["embed_rows_per_device"] * r["fsdp"] == r["embed_rows"], (name, r)
        assert f"fsdp {r['fsdp']}" in r["describe"], (name, r)
        shard_trainable = r["shard_trainable"]
        if r["fsdp"] > 1:
            # the embedding and the head once; every projection for its forward (its backward's recompute shares
            # it) and again for its backward's dY W, except the first layer's q, k and v, whose dY W (the gradient
            # of the frozen embedding's output) is not needed (NF4: its packed bytes and its absmax codes; the
            # one-element absmax2 stays whole); sharded adapters, A and B of each projection, once. With the
            # gathered weights kept (reshard_after_forward false) the backward shares the forward's gathers
            per_projection = 2 if name.startswith("qlora") else 1
            adapters = 2 * layers * projections if shard_trainable else 0
            gathered = 2 * layers * projections - 3 if r["reshard"] else layers * projections
            assert r["all_gathers"] == 2 + gathered * per_projection + adapters, (name, r)
            assert ("gathered weights kept for the backward" in r["describe"]) is (not r["reshard"]), (name, r)
        assert r["lora_a_replicated"] is (not shard_trainable), (name, r)


def test_keeping_qloras_gathered_weights_also_dequantises_each_projection_once(report):
    layers, projections = 2, 7
    runs = _runs(report)
    again, kept = runs["qlora fsdp None False True"], runs["qlora fsdp None False False"]
    # with the weights gathered again, every projection but the first layer's q, k, v is dequantised a second time
    # for its backward's dY W (two table lookups each, double quantisation); kept, XLA shares the forward's
    assert again["lookups"] - kept["lookups"] == 2 * (layers * projections - 3), (again, kept)


def test_bad_layouts_are_refused_naming_the_key(report):
    e = report["errors"]
    assert "mesh.axes" in e["axes"] and "'model'" in e["axes"]
    assert "mesh.fsdp = 2" in e["fsdp_with_data"] and "'data'" in e["fsdp_with_data"]
    assert "needs mesh.fsdp" in e["data_fsdp_without_fsdp"]
    assert "mesh.fsdp = 3 does not divide the 8 devices" in e["indivisible"]
    assert "mesh.fsdp = 4" in e["fsdp_not_all"] and "data,fsdp" in e["fsdp_not_all"]
    assert "mode 'full'" in e["full"] and "mesh.axes = 'data'" in e["full"]


def test_fsdp_keeping_gathered_weights_holds_them_all_to_the_backward_for_the_same_arithmetic(report):
    data, kept = report["memory"]["data"], report["memory"]["fsdp kept"]
    assert kept["arguments"] < data["arguments"] / 5, report["memory"]  # the base at rest stays split
    # every layer's whole weights live from its forward to its backward (4 layers here), as the data layout's do
    assert kept["temporaries"] - data["temporaries"] > 2.5 * data["layer"], report["memory"]
    assert kept["flops"] < 1.02 * data["flops"], report["memory"]


def test_fsdp_holds_an_eighth_of_the_base_and_gathers_about_one_layer_at_a_time(report):
    data, fsdp = report["memory"]["data"], report["memory"]["fsdp"]
    # arguments: the base (15.5 MiB), the adapters and the batch; with fsdp 8 the base is 1/8 of it
    assert fsdp["arguments"] < data["arguments"] / 5, report["memory"]
    # temporaries: the activations, plus the whole weights of the layer being computed (not all 4 layers')
    assert fsdp["temporaries"] - data["temporaries"] < 1.5 * data["layer"], report["memory"]
    # and the same arithmetic per device: the blocks' VJPs keep their shared recompute (jax.checkpoint around a block
    # would recompute its whole forward in the backward: +28% here)
    assert fsdp["flops"] < 1.02 * data["flops"], report["memory"]
