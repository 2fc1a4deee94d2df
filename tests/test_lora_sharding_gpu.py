"""On 2 or more GPUs: the LoRA model in bfloat16 (the run's own path: on a Hopper the Mosaic block with cuDNN
attention, each inside ``shard_map`` on its device's rows), sharded over every layout the GPUs allow, has the
gradient ``jaxgrad.verify.check_vjp`` accepts against ``jax.grad`` of the plain model on one device; and in
float32 every layout gives the loss of one GPU (to float32 rounding of a differently ordered sum).

Run on a machine with 2 or 4 GPUs: ``NCCL_NVLS_ENABLE=0 bash scripts/gpu_check.sh tests
tests/test_lora_sharding_gpu.py`` (or ``NCCL_NVLS_ENABLE=0 .venv/bin/python -m pytest -m gpu -q
tests/test_lora_sharding_gpu.py``); every GPU of the machine is used."""

import dataclasses
import os

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _gpus() -> int:
    return sum(d.platform == "gpu" for d in jax.devices())


def _layouts(n: int):
    out = [("data", None), ("fsdp", None)]
    if n >= 4:
        out.append(("data,fsdp", 2))
    return out


def _fit(dtype: str):
    from jaxgrad.lora.task_config import LoraFit

    return LoraFit(mode="lora", hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=512, seq_len=128, batch_size=8, n_bytes=1 << 16, dtype=dtype,
                   init_lora_weights=False)


def _sharded_mean(task, plan, mesh, params, batch):
    """``lora -> mean token loss`` over the mesh, differentiable (the engine's sharded loss)."""
    from jaxgrad.lora.task import lora_mask
    from jaxgrad.train.grads import plan_sum_loss
    from jaxgrad.train.mesh import shard_batch
    from jaxgrad.train.step import split_trainable

    total = plan_sum_loss(plan, mesh)
    _, frozen = split_trainable(params, lora_mask(params))
    sharded = shard_batch(batch, mesh)
    none_base = jax.tree.map(lambda _: None, params["base"])

    def mean(lora):
        s, n = total(({"base": none_base, "lora": lora}, frozen), plan.consts, sharded)
        return s / n.astype(s.dtype)
    return mean


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("layout", ["data", "fsdp", "data,fsdp", "fsdp-kept"])
def test_bf16_lora_gradient_over_the_gpus_passes_the_verifier(layout):
    from jaxgrad.lora.sharding import make_sharded_task
    from jaxgrad.lora.task import make_task
    from jaxgrad.train.mesh import train_mesh
    from jaxgrad.verify import check_vjp

    n = _gpus()
    kept = layout == "fsdp-kept"  # fsdp with the forward's gathered weights kept for the backward
    layout = "fsdp" if kept else layout
    fsdp = dict(_layouts(n)).get(layout, "skip")
    if fsdp == "skip":
        pytest.skip(f"layout {layout} needs 4 GPUs")
    fit = _fit("bfloat16")
    mesh = train_mesh(layout, n, fsdp)
    task, plan = make_sharded_task(fit, mesh, reshard_after_forward=not kept)
    params = task.init(jax.random.key(0))
    batch = next(iter(task.batches(0)))
    fn = _sharded_mean(task, plan, mesh, params, batch)
    # the reference runs in float32 and float64 too (the verifier's oracle), where cuDNN has no attention: XLA's
    one = make_task(dataclasses.replace(fit, attention="xla"), base_params=params["base"], grad_path="reference")

    def reference(lora):  # the verifier runs it in float64 too: the base follows the adapters' dtype
        dtype = jax.tree.leaves(lora)[0].dtype
        base = jax.tree.map(lambda x: x.astype(dtype), params["base"])
        s, cnt = one.reference_loss({"base": base, "lora": lora}, batch)
        return s / cnt.astype(s.dtype)

    report = check_vjp(fn, reference, params["lora"], float64=False, fd=False, structural=False,
                       name=f"lora bf16 over {n} GPUs, {layout}{' (gathered weights kept)' if kept else ''}")
    assert report.passed, report


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
def test_f32_loss_of_every_layout_equals_one_gpu():
    with jax.default_matmul_precision("highest"):  # float32 products, not TF32: the runs differ in sum order only
        _f32_loss_of_every_layout_equals_one_gpu()


def _f32_loss_of_every_layout_equals_one_gpu():
    from jaxgrad.lora.sharding import make_sharded_task
    from jaxgrad.lora.task import make_task
    from jaxgrad.train import TrainConfig, build, data_mesh, init_state, shard_batch
    from jaxgrad.train.mesh import train_mesh

    fit = _fit("float32")
    cfg = TrainConfig(steps=1, optimizer="adam", lr=1e-3, seed=3)
    task = make_task(fit)
    batch = next(iter(task.batches(0)))
    mesh, steps = build(task, cfg, mesh=data_mesh(1))
    s1, _, g1 = steps.grad_sums(init_state(task, cfg, steps, mesh)["params"], shard_batch(batch, mesh))
    for layout, fsdp in _layouts(_gpus()):
        mesh = train_mesh(layout, _gpus(), fsdp)
        stask, plan = make_sharded_task(fit, mesh)
        _, steps = build(stask, cfg, mesh=mesh, plan=plan)
        s, _, g = steps.grad_sums(init_state(stask, cfg, steps, mesh)["params"], shard_batch(batch, mesh))
        assert abs(float(s) - float(s1)) <= 1e-5 * abs(float(s1)), layout
        for a, b in zip(jax.tree.leaves(g["lora"]), jax.tree.leaves(g1["lora"])):
            a, b = np.asarray(a), np.asarray(b)
            # float32 sums of up to 2^19 terms (1024 tokens x 512 features) in another order: ~u sqrt(K) = 4e-5 of
            # the largest entry; TF32 products (the GPU's default) would differ by ~2^-11 and are not what is tested
            assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b)), layout
