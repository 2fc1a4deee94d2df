"""The ``lora_model`` benchmark suite (``python -m jaxgrad.bench lora_model``, :mod:`jaxgrad.bench.lora_model`): the
FLOP count at the issue's shape, the training step it times (a real step: the loss falls; the custom VJP's step equals
jax.grad's in float64), and an end-to-end ``--sizes small`` run here (each variant in its own process, the torch one skipped
with its reason where torch is missing)."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.bench import lora_block as bench, lora_model as bench_model
from jaxgrad.lora.model import apply, count_items

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_step_flops_at_the_full_shape():
    s = bench_model.SIZES["full"]
    assert {k: s[k] for k in bench.SIZES["full"]} == bench.SIZES["full"] and (s["vocab"], s["layers"]) == (32000, 4)
    f = bench_model.step_flops(s)
    n = 4 * 2048
    assert f["blocks"] == 4 * bench.block_flops(**bench.SIZES["full"])["total"]
    # layer 0's q, k, v dX (base and LoRA): their input is the embedding's output, whose gradient nobody needs
    assert -f["first_layer_qkv_dx_not_needed"] == 2 * n * (2048 + 1024 + 1024) * 2048 + 3 * 2 * n * 16 * 2048
    assert f["head_fwd"] == f["head_bwd_dx"] == 2 * n * 32000 * 2048
    assert f["total"] == 9_135_798_091_776
    assert f["total"] / 989e12 * 1e3 == pytest.approx(9.2374, abs=1e-4)
    lines = bench_model.floor_lines("full")
    assert any("FLOPs = 9.136e+12" in line for line in lines) and any("886,829 tokens/s" in line for line in lines)


def test_variant_names_and_specs():
    # the fastest of ours first, then the two it is compared with (a budget cuts the tail)
    assert bench_model.variant_names(True) == ["custom_vjp cudnn mosaic", bench_model.TORCH_VARIANT,
                                               "jax.grad(reference) cudnn", "custom_vjp cudnn"]
    assert bench_model.variant_names(False) == [bench_model.TORCH_VARIANT, "jax.grad(reference) sdpa(xla)",
                                                "custom_vjp sdpa(xla)"]
    assert bench_model.jax_spec("custom_vjp cudnn mosaic") == ("mosaic", "cudnn")
    assert bench_model.jax_spec("jax.grad(reference) sdpa(xla)") == ("reference", "sdpa:xla")
    with pytest.raises(ValueError, match="unknown variant"):
        bench_model.jax_spec("custom_vjp xla-attn nf4")
    with pytest.raises(ValueError, match="selects none"):
        bench_model.suite_lora_model("small", "default", variants=["zzz"], say=lambda _: None)


def _steps(backend, attention, dtype, n_steps=3):
    s = bench_model.SIZES["small"]
    cfg, lcfg = bench_model.configs(s)
    params, lora = bench_model.jax_model_inputs(s, dtype, dtype)
    ids = jnp.asarray(bench_model.host_tokens(s))
    n_items = jnp.asarray(count_items(np.asarray(ids)), jnp.int32)
    opt = bench_model.adamw()
    step = jax.jit(bench_model.make_train_step(cfg, lcfg, opt, backend=backend, attention=attention))
    state, losses = (lora, opt.init(lora)), []
    for _ in range(n_steps):
        new_lora, new_opt, loss = step(*state, params, ids, ids, n_items)
        state = (new_lora, new_opt)
        losses.append(float(loss))
    return lora, state[0], losses


def test_the_custom_vjp_step_equals_the_jax_grad_step_in_float64_and_trains():
    with jax.enable_x64(True):
        lora0, ours, loss_ours = _steps("xla", "xla", jnp.float64)
        _, ref, loss_ref = _steps("reference", "xla", jnp.float64)
        _, ours_sdpa, loss_sdpa = _steps("xla", "sdpa:xla", jnp.float64)  # the cuDNN code path, XLA attention
        lora0, ours, ref, ours_sdpa = (jax.tree.map(np.asarray, t) for t in (lora0, ours, ref, ours_sdpa))
    assert loss_ours[0] > loss_ours[1] > loss_ours[2]  # a real training step: the loss falls
    np.testing.assert_allclose(loss_ours, loss_ref, rtol=1e-12)
    # jax.nn.dot_product_attention(implementation="xla") takes its softmax in float32 even for float64 inputs
    np.testing.assert_allclose(loss_sdpa, loss_ref, rtol=1e-7)
    moved = 0
    for a, b, c, before in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), jax.tree.leaves(ours_sdpa),
                               jax.tree.leaves(lora0)):
        assert a.dtype == before.dtype == np.float64
        # Adam's step is ~lr in size: compare the updates (after - before) relative to it, tightly
        np.testing.assert_allclose(a - before, b - before, rtol=0, atol=1e-12)
        # the f32 softmax's rounding, which Adam's normalised step g / sqrt(v) amplifies where a gradient is near 0
        np.testing.assert_allclose(c - before, b - before, rtol=0, atol=3e-6)
        moved += int(np.sum(np.abs(a - before) > 1e-5))  # 3 steps of ~1e-4 each
    assert moved > 0.9 * sum(x.size for x in jax.tree.leaves(lora0))  # every factor has a gradient


def test_the_cpu_stand_in_for_cudnn_is_private_and_refused_with_a_kernel_backend():
    # apply takes attention 'xla', 'cudnn' or 'pallas' only; the suite reaches "sdpa:xla" (the cuDNN code path with
    # XLA's implementation, on a CPU) through the private _apply, which refuses it with a kernel backend
    from jaxgrad.lora.model import _apply

    s = bench_model.SIZES["small"]
    cfg, lcfg = bench_model.configs(s)
    params, lora = bench_model.jax_model_inputs(s, np.float32, np.float32)
    with pytest.raises(ValueError, match="'attention' must be one of 'xla', 'cudnn', 'pallas', got 'sdpa:xla'"):
        apply(params, lora, bench_model.host_tokens(s), cfg, lcfg, attention="sdpa:xla")
    with pytest.raises(ValueError, match="needs backend 'xla' or 'reference'"):
        _apply(params, lora, bench_model.host_tokens(s), cfg, lcfg, backend="pallas", attention="sdpa:xla")


def test_bench_lora_model_small_runs_here_each_variant_in_its_own_process(tmp_path):
    on_gpu = jax.default_backend() == "gpu"
    cmd = [sys.executable, "-m", "jaxgrad.bench", "lora_model", "--sizes", "small", "--repeats", "2",
           "--warmup", "1", "--out", str(tmp_path), "--variants", "custom_vjp,reference,torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("lora_model-*-bf16-*.json")
    data = json.loads(path.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == set(bench_model.variant_names(on_gpu))
    env = data["environment"]
    assert " -m jaxgrad.bench lora_model --sizes small" in env["command"] and env["commit"]
    assert any(line.startswith("FLOPs = ") for line in env["suite_notes"])
    txt = path.with_suffix(".txt").read_text()
    assert txt.startswith("# device: ") and "# FLOPs = " in txt and "tokens/s" in txt and "fresh process" in txt
    s = bench_model.SIZES["small"]
    losses = {}
    for name, r in rows.items():
        if name == bench_model.TORCH_VARIANT and r["median_ms"] is None:
            continue
        assert r["median_ms"] > 0 and r["compile_ms"] > 0 and r["suite"] == "lora_model"
        assert r["flops"] == bench_model.step_flops(s)["total"] and (r["peak_bytes"] is not None) == on_gpu
        tps = float(re.search(r"tokens/s=([0-9.e+]+)", r["notes"]).group(1))
        assert tps == pytest.approx(s["batch"] * s["seq"] / (r["median_ms"] * 1e-3), rel=1e-5)
        assert any(line.startswith(f"{name}: ") and "tokens/s" in line for line in env["suite_notes"])
        losses[name] = [float(v) for v in r["notes"].split("losses of steps 1-3: ")[1].split(", ")]
    torch_row = rows[bench_model.TORCH_VARIANT]
    if bench.torch_missing():
        assert torch_row["median_ms"] is None and torch_row["notes"] == bench.torch_missing()
        assert "not installed" in torch_row["notes"] and "skipped" in proc.stdout
    # every variant trains the same model from the same weights and tokens: the first losses agree to bf16 rounding
    want = losses["jax.grad(reference) cudnn" if on_gpu else "jax.grad(reference) sdpa(xla)"]
    for name, got in losses.items():
        assert got[0] == pytest.approx(want[0], rel=5e-3), (name, got, want)
