"""The Mosaic GPU LoRA projection forward (``jaxgrad.ops.lora_linear_mgpu``): what it accepts, that it lowers, and --
on a Hopper GPU -- that it computes ``X W^T + s (X A^T) B^T`` to the rounding of its own arithmetic.

Error model (both the kernel and XLA's ``lora_linear_fwd(fold_b=True)``): bf16 operands, fp32 accumulation over
``K`` (and ``r``) terms, ``sU`` rounded once to bf16, ``Y`` rounded once to bf16. Against the float64 value of the
same formula on the same bf16 operands an entry may be off by at most
``u_bf16 |Y| + u_bf16 s |U| |B|^T + gamma (|X| |W|^T + s |U| |B|^T) + s |X| |A|^T |B|^T gamma`` with
``gamma = (K + r) u_f32`` (the worst-case accumulation bound); the tests ask every entry to be within it, and the
kernel's RMS error to be within 1.5x XLA's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.ops.lora_linear import lora_linear_fwd
from jaxgrad.ops.lora_linear_mgpu import (TileConfig, _call, lora_linear_dx_mgpu, lora_linear_fwd_mgpu, supported,
                                          supported_dx)

U_BF16, U_F32 = 2.0**-8, 2.0**-24
SCALE = 2.0


def _operands(seed, m, k, n, r, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes, sds = [(m, k), (n, k), (r, k), (n, r)], [1.0, k**-0.5, k**-0.5, 1.0]  # B ~ N(0, 1): never zero
    return tuple((sd * jax.random.normal(kk, s, jnp.float32)).astype(dtype) for kk, s, sd in zip(keys, shapes, sds))


def _bound_and_truth(x, w, a, b, s):
    x, w, a, b = (np.asarray(t, np.float64) for t in (x, w, a, b))
    u = x @ a.T
    truth = x @ w.T + (s * u) @ b.T  # sU unrounded: its rounding is in the bound
    k, r = x.shape[1], a.shape[0]
    gamma = (k + r) * U_F32
    lora_abs = np.abs(s * u) @ np.abs(b).T
    bound = (U_BF16 * np.abs(truth) + U_BF16 * lora_abs + gamma * (np.abs(x) @ np.abs(w).T + lora_abs)
             + gamma * s * (np.abs(x) @ np.abs(a).T) @ np.abs(b).T)
    return truth, bound


def test_supported_names_what_does_not_fit():
    x, w, a, b = _operands(0, 512, 256, 128, 16)
    assert supported(x, w, a, b) is None
    # sizes off the tiles are zero-padded by the public functions: they qualify
    assert supported(x[:500, :200], w[:120, :200], a[:8, :200], b[:120, :8]) is None
    assert "one 16-bit dtype" in supported(x.astype(jnp.float32), w, a, b)
    assert "b [N, r]" in supported(x, w, a, b.T)
    with pytest.raises(ValueError, match=r"lora_linear_fwd_mgpu: the operands must share one 16-bit dtype"):
        lora_linear_fwd_mgpu(x.astype(jnp.float32), w, a, b, SCALE)
    dy = x[:, :128]  # [M, N] for w [N, K] = [128, 256]
    assert supported_dx(dy, w, a, b) is None
    assert supported_dx(dy[:, :96], w[:96, :192], a[:, :192], b[:96]) is None
    with pytest.raises(ValueError, match=r"lora_linear_dx_mgpu: shapes must be dy \[M, N\]"):
        lora_linear_dx_mgpu(dy, w.T, a, b, SCALE)


@pytest.mark.parametrize("mode", ["fwd", "dx"])
def test_odd_sizes_lower_through_zero_padding(mode, monkeypatch):
    # seq 77 x batch 2 rows, hidden 96, out 160, r 4: the operands are padded to the tiles, the kernel lowers at the
    # padded shape and the results are sliced back (lowered for CUDA on this CPU)
    import jaxgrad.ops.lora_linear_mgpu as mod

    monkeypatch.setattr(mod, "_num_sms", lambda: 132)
    m, k, n, r = 154, 96, 160, 4
    x, w, a, b = _operands(3, m, k, n, r)
    if mode == "fwd":
        f = functools.partial(lora_linear_fwd_mgpu, scale=SCALE, return_su=True)
        args, want = (x, w, a, b), ((m, n), (m, r))
    else:
        dy = jax.random.normal(jax.random.key(4), (m, n), jnp.float32).astype(x.dtype)
        f = functools.partial(lora_linear_dx_mgpu, scale=SCALE, out_dtype=jnp.bfloat16, return_sg=True)
        args, want = (dy, w, a, b), ((m, k), (m, r))
    out = jax.eval_shape(f, *args)
    assert [o.shape for o in out] == list(want)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert "tensor<256x" in call.split("->")[-1]  # the padded rows


@pytest.mark.parametrize("mkn", [(512, 256, 128), (8192, 2048, 1024), (256, 5632, 384), (256, 384, 5632)])
def test_the_kernel_lowers_for_hopper_on_any_machine(mkn):
    # Mosaic GPU lowers to its MLIR in Python: shapes, layouts, shared-memory budget are checked without a GPU
    m, k, n = mkn
    cfg = TileConfig()
    spec = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(m, k), (n, k), (16, k), (n, 16)]]
    low = _call.trace(*spec, scale=SCALE, config=cfg, num_sms=132).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()
    # the backward's dX kernel: dy [M, N=n], w [n, k] -> dX [M, k] in fp32 and in bf16
    spec = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(m, n), (n, k), (16, k), (n, 16)]]
    for out_dtype in (jnp.float32, jnp.bfloat16):
        low = _call.trace(*spec, scale=SCALE, config=cfg, num_sms=132, mode="dx",
                          out_dtype=jnp.dtype(out_dtype)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in low.as_text()


@pytest.mark.parametrize("mode", ["fwd", "dx"])
def test_the_kernel_reads_the_rank_product_and_returns_y_alone(mode):
    # the rank-r product s L R2 ([M, r] in the operand dtype) is XLA's, an operand of the kernel; the kernel's one
    # result is Y, and emit_rank hands the same [M, r] product back beside it (for the backward's dA / dB)
    m, k, n = 512, 256, 384
    shapes = [(m, k), (n, k), (16, k), (n, 16)] if mode == "fwd" else [(m, n), (n, k), (16, k), (n, 16)]
    spec = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    out = {} if mode == "fwd" else {"out_dtype": jnp.dtype(jnp.float32)}
    y_type = f"tensor<{m}x{n if mode == 'fwd' else k}x{'bf16' if mode == 'fwd' else 'f32'}>"
    traced = _call.trace(*spec, scale=SCALE, config=TileConfig(), num_sms=132, mode=mode, emit_rank=True, **out)
    y, rank = traced.out_info
    assert rank.shape == (m, 16) and rank.dtype == jnp.bfloat16 and y.shape == (m, n if mode == "fwd" else k)
    (call,) = [line for line in traced.lower(lowering_platforms=("cuda",)).as_text().splitlines()
               if "custom_call @mosaic_gpu" in line]
    operand_types = re.search(r": \(([^()]*)\) -> [^>]*>$", call).group(1)
    assert call.split("->")[-1].strip().startswith(y_type) and f"tensor<{m}x16xbf16>" in operand_types


@pytest.mark.gpu
@pytest.mark.parametrize("mkn", [(512, 256, 128), (768, 320, 384), (8192, 2048, 1024), (8192, 5632, 2048)])
def test_gpu_kernel_matches_the_formula_to_its_rounding(mkn):
    m, k, n = mkn
    x, w, a, b = _operands(sum(mkn), m, k, n, 16)
    y = np.asarray(lora_linear_fwd_mgpu(x, w, a, b, SCALE), np.float64)
    y_xla = np.asarray(jax.jit(functools.partial(lora_linear_fwd, scale=SCALE, fold_b=True))(x, w, a, b), np.float64)
    truth, bound = _bound_and_truth(x, w, a, b, SCALE)
    err, err_xla = np.abs(y - truth), np.abs(y_xla - truth)
    assert float(np.max(err / bound)) <= 1.0, f"worst entry {np.max(err / bound):.3g} of the bound"
    assert float(np.max(err_xla / bound)) <= 1.0  # the model holds for the reference too
    rms, rms_xla = float(np.sqrt(np.mean(err**2))), float(np.sqrt(np.mean(err_xla**2)))
    assert rms <= 1.5 * rms_xla, (rms, rms_xla)
    # the LoRA term is really there: without it the error would be the whole s U B^T
    lora = np.asarray(x, np.float64) @ np.asarray(a, np.float64).T @ np.asarray(b, np.float64).T * SCALE
    assert rms < 0.01 * float(np.sqrt(np.mean(lora**2)))


@pytest.mark.gpu
def test_gpu_odd_sizes_through_padding_match_the_formula():
    # batch 2 x seq 77 rows, hidden 96, out 160, r 4: every size off the tiles; forward and bf16 dX against their
    # error models, and the rank-r side outputs within two roundings of the exact products
    m, k, n, r = 154, 96, 160, 4
    x, w, a, b = _operands(77, m, k, n, r)
    y, su = lora_linear_fwd_mgpu(x.reshape(2, 77, k), w, a, b, SCALE, return_su=True)
    assert y.shape == (2, 77, n) and su.shape == (2, 77, r)
    truth, bound = _bound_and_truth(x, w, a, b, SCALE)
    assert float(np.max(np.abs(np.asarray(y, np.float64).reshape(m, n) - truth) / bound)) <= 1.0
    exact, rbound = _rank_bound(x, a, SCALE)
    assert float(np.max(np.abs(np.asarray(su, np.float64).reshape(m, r) - exact) / rbound)) <= 1.0
    dy = jax.random.normal(jax.random.key(78), (m, n), jnp.float32).astype(jnp.bfloat16)
    dx, sg = lora_linear_dx_mgpu(dy, w, a, b, SCALE, out_dtype=jnp.bfloat16, return_sg=True)
    assert dx.shape == (m, k) and sg.shape == (m, r)
    truth, bound = _dx_bound_and_truth(dy, w, a, b, SCALE, U_BF16)
    assert float(np.max(np.abs(np.asarray(dx, np.float64) - truth) / bound)) <= 1.0
    exact, rbound = _rank_bound(dy, np.asarray(b, np.float64).T, SCALE)
    assert float(np.max(np.abs(np.asarray(sg, np.float64) - exact) / rbound)) <= 1.0


@pytest.mark.gpu
def test_gpu_kernel_keeps_leading_axes_and_f16():
    x, w, a, b = _operands(7, 512, 256, 128, 16, jnp.float16)
    y = lora_linear_fwd_mgpu(x.reshape(2, 256, 256), w, a, b, SCALE)
    assert y.shape == (2, 256, 128) and y.dtype == jnp.float16
    truth, bound = _bound_and_truth(x, w, a, b, SCALE)
    # f16 rounds finer (2^-11) than the bf16 model it is held to
    assert float(np.max(np.abs(np.asarray(y, np.float64).reshape(512, 128) - truth) / bound)) <= 1.0


def _dx_bound_and_truth(dy, w, a, b, s, u_out=U_F32):
    """``u_out``: the unit roundoff of dX's one rounding to the output dtype (fp32 by default, U_BF16 for bf16)."""
    dy, w, a, b = (np.asarray(t, np.float64) for t in (dy, w, a, b))
    g = dy @ b
    truth = dy @ w + (s * g) @ a
    gamma = (dy.shape[1] + a.shape[0]) * U_F32
    lora_abs = np.abs(s * g) @ np.abs(a)
    bound = (u_out * np.abs(truth) + U_BF16 * lora_abs + gamma * (np.abs(dy) @ np.abs(w) + lora_abs)
             + gamma * s * (np.abs(dy) @ np.abs(b)) @ np.abs(a))
    return truth, bound


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mnk", [(512, 128, 256), (768, 320, 384), (8192, 1024, 2048), (8192, 2048, 5632)])
def test_gpu_dx_kernel_matches_the_formula_to_its_rounding(mnk, out_dtype):
    # dX = dY W + (s dY B) A for dy [M, N], w [N, K]: the block's backward product, fp32 or bf16 out (the block
    # asks for bf16: one bf16 rounding of the fp32 accumulator)
    m, n, k = mnk
    _, w, a, b = _operands(sum(mnk), m, k, n, 16)  # w [N, K], a [r, K], b [N, r]
    dy = jax.random.normal(jax.random.key(m * 7 + n), (m, n), jnp.float32).astype(jnp.bfloat16)
    dx = lora_linear_dx_mgpu(dy, w, a, b, SCALE, out_dtype=out_dtype)
    assert dx.dtype == out_dtype
    dx = np.asarray(dx, np.float64)
    truth, bound = _dx_bound_and_truth(dy, w, a, b, SCALE, U_F32 if out_dtype == jnp.float32 else U_BF16)
    assert float(np.max(np.abs(dx - truth) / bound)) <= 1.0, f"worst entry {np.max(np.abs(dx - truth) / bound):.3g}"
    # yardstick: the same arithmetic in XLA (dY W and (sG rounded to bf16) A, fp32 accumulation). Not the block's XLA
    # backward, which keeps G in fp32 (measured: the kernel's RMS error 6.6-8x that one's when s G A is large; PEFT's
    # bf16 autograd rounds dY B to bf16 as the kernel does)
    f32 = jnp.float32
    g = jnp.matmul(dy, b, preferred_element_type=f32)
    sg = (SCALE * g).astype(jnp.bfloat16)
    dx_xla = np.asarray((jnp.matmul(dy, w, preferred_element_type=f32) + jnp.matmul(sg, a, preferred_element_type=f32)
                         ).astype(out_dtype), np.float64)
    rms, rms_xla = (float(np.sqrt(np.mean((v - truth) ** 2))) for v in (dx, dx_xla))
    assert rms <= 1.5 * rms_xla, (rms, rms_xla)


def _rank_bound(lhs, rhs_t, s):
    """|fl(s L R^T) - fl'(s L R^T)| for two bf16 roundings of the same product accumulated in fp32 in two orders:
    one bf16 rounding each (u |s L R^T| apiece) and both accumulations' worst case (2 gamma_K s |L| |R|^T)."""
    lhs, rhs_t = np.asarray(lhs, np.float64), np.asarray(rhs_t, np.float64)
    exact = s * lhs @ rhs_t.T
    return exact, 2 * U_BF16 * np.abs(exact) + 2 * lhs.shape[1] * U_F32 * s * np.abs(lhs) @ np.abs(rhs_t).T


@pytest.mark.gpu
@pytest.mark.parametrize("mkn", [(768, 384, 640), (8192, 2048, 1024)])  # shapes both kernels take
def test_gpu_rank_side_outputs_are_the_rounded_rank_products(mkn):
    # sU = s X A^T and sG = s dY B as the epilogues used them: within two roundings of the exact product, and the
    # main result unchanged by asking for them
    m, k, n = mkn
    cfg = TileConfig()
    x, w, a, b = _operands(sum(mkn) + 1, m, k, n, 16)
    y, su = lora_linear_fwd_mgpu(x, w, a, b, SCALE, cfg, return_su=True)
    assert su.shape == (m, 16) and su.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(lora_linear_fwd_mgpu(x, w, a, b, SCALE, cfg)))
    exact, bound = _rank_bound(x, a, SCALE)
    worst = np.max(np.abs(np.asarray(su, np.float64) - exact) / bound)
    assert worst <= 1.0, f"sU: worst entry {worst:.3g} of its bound"
    dy = jax.random.normal(jax.random.key(m + n), (m, n), jnp.float32).astype(jnp.bfloat16)
    dx, sg = lora_linear_dx_mgpu(dy, w, a, b, SCALE, config=cfg, return_sg=True)
    assert sg.shape == (m, 16) and dx.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(lora_linear_dx_mgpu(dy, w, a, b, SCALE, config=cfg)))
    exact, bound = _rank_bound(dy, np.asarray(b, np.float64).T, SCALE)
    worst = np.max(np.abs(np.asarray(sg, np.float64) - exact) / bound)
    assert worst <= 1.0, f"sG: worst entry {worst:.3g} of its bound"
