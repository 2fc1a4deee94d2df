"""Fused NF4 dequantise + matmul (Pallas kernels in interpret mode on CPU): odd sizes, a partial last NF4 block
and rows starting mid-byte, f32 / bf16 / f64 x, forward against the reference within the rounding model and the
VJP (x only; the weight is frozen) judged by jaxgrad.verify."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.lora.nf4 import nf4_absmax, nf4_dequantize, nf4_quantize
from jaxgrad.ops.nf4_matmul import nf4_matmul, nf4_matmul_dx_pallas, nf4_matmul_fwd_pallas, nf4_matmul_reference
from jaxgrad.verify import assert_vjp_matches

# (out, in): 100x96 = 150 whole 64-blocks; 101x95 = 149 blocks + a partial one of 59 (odd count, odd rows)
SHAPES = [(100, 96), (101, 95)]
TOKENS = 77


def _weight(shape, seed=0, **kw):
    w = 0.05 * np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))
    return nf4_quantize(w, **kw)


def _x(n, k, dtype, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, k), jnp.float32).astype(dtype)


def _kernel(w, **kw):
    # small tiles so the grid and the in-kernel reduction loop both take several steps
    kw = dict(backend="pallas", interpret=True, block_m=32, block_n=32, block_k=32) | kw
    return lambda x: nf4_matmul(x, w, **kw)


def _within_rounding(y, x, w, dtype):
    """|y - y_ref| <= one rounding of the output (both sides) + f32 accumulation over K, per entry."""
    wd = np.float64(nf4_dequantize(w, dtype).astype(jnp.float32))
    xf = np.float64(np.float32(x))
    exact = xf @ wd.T
    terms = np.abs(xf) @ np.abs(wd).T
    u_out = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
    bound = 2 * u_out * np.abs(exact) + 4 * (x.shape[-1] + 2) * 2.0**-24 * terms + 1e-30
    err = np.abs(np.float64(np.float32(y)) - exact)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_reference_within_rounding(shape, dtype):
    w = _weight(shape)
    x = _x(TOKENS, shape[1], dtype)
    y = _kernel(w)(x)
    assert y.dtype == dtype and y.shape == (TOKENS, shape[0])
    _within_rounding(y, x, w, dtype)
    _within_rounding(nf4_matmul_reference(x, w), x, w, dtype)


@pytest.mark.parametrize(("shape", "dtype"), [(SHAPES[0], jnp.float32), (SHAPES[1], jnp.float32),
                                              (SHAPES[1], jnp.bfloat16)])
def test_vjp_of_x_is_verified(shape, dtype):
    w = _weight(shape, seed=2)
    x = _x(TOKENS, shape[1], dtype, seed=3)
    assert_vjp_matches(_kernel(w), lambda a: nf4_matmul_reference(a, w), x, arg_names=("x",))


def test_float64_and_leading_axes():
    w = _weight(SHAPES[1], seed=4)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (2, 7, SHAPES[1][1]), jnp.float64)
        y, vjp = jax.vjp(_kernel(w), x)
        y0, vjp0 = jax.vjp(lambda a: nf4_matmul_reference(a, w), x)
        assert y.dtype == jnp.float64 and y.shape == (2, 7, SHAPES[1][0])
        np.testing.assert_allclose(y, y0, rtol=1e-13, atol=1e-13)
        g = jax.random.normal(jax.random.key(6), y.shape, jnp.float64)
        np.testing.assert_allclose(vjp(g)[0], vjp0(g)[0], rtol=1e-13, atol=1e-13)


def test_float64_compiled_for_a_gpu_takes_the_xla_path():
    # the compiled (Triton) kernels gave a wrong float64 dx on the H100: float64 that would be compiled
    # (interpret=False) is routed to dequantise + dot, the same numbers as backend="xla", and never reaches Triton
    # (on this CPU a compile attempt would raise); the LoRA block's kernel switch does the same
    from jaxgrad.lora.kernels import BlockKernels
    from jaxgrad.ops.nf4_matmul import compiled_f64

    w = _weight(SHAPES[1], seed=4)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (3, SHAPES[1][1]), jnp.float64)
        assert compiled_f64(x.dtype, False) and not compiled_f64(x.dtype, True)
        assert not compiled_f64(jnp.float32, False)
        y, vjp = jax.vjp(lambda a: nf4_matmul(a, w, backend="pallas", interpret=False), x)
        y0, vjp0 = jax.vjp(lambda a: nf4_matmul(a, w, backend="xla"), x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
        g = jax.random.normal(jax.random.key(6), y.shape, jnp.float64)
        np.testing.assert_array_equal(np.asarray(vjp(g)[0]), np.asarray(vjp0(g)[0]))
        kern = BlockKernels("pallas", interpret=False)
        assert kern.base_fwd(x, w) is None and kern.base_dx(y, w, jnp.float64) is None
        assert BlockKernels("pallas", interpret=True).base_fwd(x, w) is not None


def test_double_quant_and_blocksize_128_and_xla_path():
    w = _weight(SHAPES[1], seed=7, blocksize=128, double_quant=True)
    x = _x(TOKENS, SHAPES[1][1], jnp.float32, seed=8)
    y0 = nf4_matmul_reference(x, w)
    for backend in ("pallas", "xla"):
        np.testing.assert_allclose(_kernel(w, backend=backend)(x), y0, rtol=1e-5, atol=1e-5)


def test_weight_and_output_dtypes_the_lora_block_asks_for():
    # The LoRA block (bf16 forward) wants the base product unrounded in fp32 (it adds the LoRA term, then rounds
    # once) and dY W with its fp32 dY against the bf16-rounded weight its forward used.
    w = _weight(SHAPES[1], seed=9)
    ops = (jnp.asarray(w.packed, jnp.uint8), nf4_absmax(w), tuple(w.shape), w.blocksize)
    wb = np.float64(nf4_dequantize(w, jnp.bfloat16).astype(jnp.float32))  # the weight rounded to bf16
    x = _x(TOKENS, SHAPES[1][1], jnp.bfloat16, seed=10)
    y = nf4_matmul_fwd_pallas(x, *ops, interpret=True, block_m=32, block_n=32, block_k=32, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, np.float64(np.float32(x)) @ wb.T, rtol=0, atol=1e-5)  # f32 sums, no bf16 rounding
    g = _x(TOKENS, SHAPES[1][0], jnp.float32, seed=11)
    dx = nf4_matmul_dx_pallas(g, *ops, interpret=True, block_m=32, block_n=32, block_k=32, w_dtype=jnp.bfloat16)
    assert dx.dtype == jnp.float32
    np.testing.assert_allclose(dx, np.float64(g) @ wb, rtol=0, atol=1e-5)
    # the f32-dequantised weight differs from the bf16-rounded one by ~2^-9 relative: visible at this tolerance
    assert np.max(np.abs(np.float64(nf4_matmul_dx_pallas(g, *ops, interpret=True)) - np.float64(g) @ wb)) > 1e-4


def test_weight_is_never_dequantised_in_the_graph():
    w = _weight(SHAPES[0])
    x = _x(TOKENS, SHAPES[0][1], jnp.float32)
    g = jnp.ones((TOKENS, SHAPES[0][0]))

    def texts(backend):  # the printed forward and backward jaxprs, inner jaxprs (kernel bodies) included
        f = _kernel(w, backend=backend)
        return str(jax.make_jaxpr(f)(x)) + str(jax.make_jaxpr(jax.vjp(f, x)[1])(g))

    dense = ("[100,96]", "[9600]")  # the weight as a matrix, or its 9600 codes unpacked
    assert all(d not in texts("pallas") for d in dense)
    assert any(d in texts("xla") for d in dense)  # the probe can see it: the XLA path does dequantise


def test_bad_input_is_named():
    w = _weight(SHAPES[0])
    with pytest.raises(ValueError, match=r"'x' must be \[\.\.\., in\] with in = w.shape\[1\] = 96"):
        nf4_matmul(jnp.ones((3, 95)), w)
    with pytest.raises(TypeError, match="'w' must be an NF4Weight"):
        nf4_matmul(jnp.ones((3, 96)), jnp.ones((100, 96)))
    with pytest.raises(ValueError, match="backend must be 'xla' or 'pallas'"):
        nf4_matmul(jnp.ones((3, 96)), w, backend="cuda")


# ---------------------------------------------------------------------------------------------------------------
# The tiled path (K even and a multiple of the blocksize: contiguous byte tiles, nibbles split by shifts)
# ---------------------------------------------------------------------------------------------------------------
# (out, in, blocksize, block_k): odd row counts everywhere; 192 = 1.5 k-tiles of 128 (a partial tile, two scales per
# tile); 256 with blocksize 128 and 32-wide tiles (one scale spans four tiles); 320 with blocksize 32 (four scales
# per 128-tile, a partial last tile)
TILED = [(101, 192, 64, 128), (37, 256, 128, 32), (45, 320, 32, 128)]


def _ops(w):
    return jnp.asarray(w.packed, jnp.uint8), nf4_absmax(w), tuple(w.shape), w.blocksize


def test_path_choice():
    from jaxgrad.ops.nf4_matmul import tiled_path_applies

    assert all(tiled_path_applies((o, k), b) for o, k, b, _ in TILED)
    assert tiled_path_applies((5632, 2048), 64) and tiled_path_applies((2048, 5632), 64)
    assert not any(tiled_path_applies(s, 64) for s in SHAPES)  # 96 % 64, 95 odd: the general path
    w = _weight(SHAPES[1], seed=20)
    with pytest.raises(ValueError, match="tiled path needs K even and a multiple of the blocksize"):
        nf4_matmul_fwd_pallas(jnp.ones((3, 95)), *_ops(w), interpret=True, path="tiled")


@pytest.mark.parametrize("lut", ["gather", "select"])
@pytest.mark.parametrize("case", TILED)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiled_forward_and_dx_match_reference(case, dtype, lut):
    o, k, bsz, bk = case
    seed = 100 + 7 * o + k  # fresh inputs per case
    w = _weight((o, k), seed=seed, blocksize=bsz)
    x = _x(TOKENS, k, dtype, seed=seed + 1)
    blocks = dict(block_m=32, block_n=32, block_k=bk)
    y = nf4_matmul_fwd_pallas(x, *_ops(w), interpret=True, path="tiled", lut=lut, **blocks)
    assert y.dtype == dtype and y.shape == (TOKENS, o)
    _within_rounding(y, x, w, dtype)
    # dx = g W: the same tile function on [bo, bk] tiles of W (block_n bounds the K tile, block_k the O loop)
    g = _x(TOKENS, o, dtype, seed=seed + 2)
    dx = nf4_matmul_dx_pallas(g, *_ops(w), interpret=True, path="tiled", lut=lut, block_m=32, block_n=bk,
                              block_k=32, out_dtype=jnp.float32)
    wd = np.float64(nf4_dequantize(w, dtype).astype(jnp.float32))
    gf = np.float64(np.float32(g))
    bound = 4 * (o + 2) * 2.0**-24 * (np.abs(gf) @ np.abs(wd)) + 1e-30
    assert np.all(np.abs(np.float64(dx) - gf @ wd) <= bound)


@pytest.mark.parametrize("case", TILED)
def test_tiled_equals_general_path_and_float64(case):
    o, k, bsz, bk = case
    w = _weight((o, k), seed=200 + o, blocksize=bsz, double_quant=(bsz == 64))
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(201 + o), (2, 7, k), jnp.float64)
        g = jax.random.normal(jax.random.key(202 + o), (2, 7, o), jnp.float64)
        kw = dict(interpret=True, block_m=16, block_n=32, block_k=bk)
        y_t = nf4_matmul_fwd_pallas(x, *_ops(w), path="tiled", **kw)
        y_g = nf4_matmul_fwd_pallas(x, *_ops(w), path="general", **kw)
        y0 = nf4_matmul_reference(x, w)
        assert y_t.dtype == jnp.float64 and y_t.shape == (2, 7, o)
        np.testing.assert_allclose(y_t, y0, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(y_t, y_g, rtol=1e-13, atol=1e-13)
        dx_t = nf4_matmul_dx_pallas(g, *_ops(w), path="tiled", **kw)
        wd = np.asarray(nf4_dequantize(w, jnp.float64))
        np.testing.assert_allclose(dx_t, np.asarray(g) @ wd, rtol=1e-13, atol=1e-13)


def test_tiled_vjp_of_x_is_verified():
    o, k, bsz, bk = TILED[0]
    w = _weight((o, k), seed=300, blocksize=bsz)
    x = _x(TOKENS, k, jnp.float32, seed=301)
    f = _kernel(w, block_k=bk)  # path=None picks the tiled kernels for this shape
    assert_vjp_matches(f, lambda a: nf4_matmul_reference(a, w), x, arg_names=("x",))


def test_tiled_weight_and_output_dtypes_the_lora_block_asks_for():
    # as the general-path test above: bf16 forward with an fp32 result, and fp32 dY against the bf16-rounded weight
    # (the three-bf16-pass dot: exact products, so within f32 summation of the float64 product)
    o, k, bsz, bk = TILED[2]
    w = _weight((o, k), seed=400, blocksize=bsz)
    wb = np.float64(nf4_dequantize(w, jnp.bfloat16).astype(jnp.float32))
    x = _x(TOKENS, k, jnp.bfloat16, seed=401)
    kw = dict(interpret=True, path="tiled", block_m=32, block_n=32, block_k=bk)
    y = nf4_matmul_fwd_pallas(x, *_ops(w), out_dtype=jnp.float32, **kw)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, np.float64(np.float32(x)) @ wb.T, rtol=0, atol=1e-5)
    g = _x(TOKENS, o, jnp.float32, seed=402)
    for split in (True, False):
        dx = nf4_matmul_dx_pallas(g, *_ops(w), w_dtype=jnp.bfloat16, f32_split=split,
                                  **(kw | dict(block_n=bk, block_k=32)))
        assert dx.dtype == jnp.float32
        np.testing.assert_allclose(dx, np.float64(g) @ wb, rtol=0, atol=1e-5)


def test_tiled_weight_is_never_dequantised_in_the_graph():
    o, k, bsz, bk = TILED[0]
    w = _weight((o, k), seed=500, blocksize=bsz)
    x = _x(TOKENS, k, jnp.float32)
    f = _kernel(w, block_k=bk)
    text = str(jax.make_jaxpr(f)(x)) + str(jax.make_jaxpr(jax.vjp(f, x)[1])(jnp.ones((TOKENS, o))))
    assert "nf4_matmul_fwd" in text and "nf4_matmul_dx" in text
    assert f"[{o},{k}]" not in text and f"[{o * k}]" not in text


# ---------------------------------------------------------------------------------------------------------------
# GPU: the compiled (Triton) kernels at the LoRA block's MLP shapes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("o", "k"), [(5632, 2048), (2048, 5632)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_compiled_kernels_at_the_block_shapes(o, k, dtype):
    """Forward (out in x's dtype and in fp32) and dx (the block's fp32 dY against the weight rounded to ``dtype``)
    compiled by Triton, against float32 ``HIGHEST`` products of the dequantised weight, per entry within the
    rounding model (both sides' f32 sums, plus one rounding of the output)."""
    n = 8192
    w = _weight((o, k), seed=600)
    x = _x(n, k, dtype, seed=601)
    g = _x(n, o, jnp.float32, seed=602)
    ops = _ops(w)
    with jax.default_matmul_precision("highest"):
        wd = nf4_dequantize(w, dtype).astype(jnp.float32)
        xf = x.astype(jnp.float32)
        exact_y, terms_y = xf @ wd.T, jnp.abs(xf) @ jnp.abs(wd).T
        exact_dx, terms_dx = g @ wd, jnp.abs(g) @ jnp.abs(wd)

    def check(got, exact, terms, red, u_out):
        bound = 2 * u_out * jnp.abs(exact) + 8 * (red + 2) * 2.0**-24 * terms + 1e-30
        ratio = float(jnp.max(jnp.abs(got.astype(jnp.float32) - exact) / bound))
        assert ratio <= 1.0, f"max err/bound {ratio:.3g}"

    u = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
    def compiled(fn, **kw):
        return jax.jit(functools.partial(fn, shape=ops[2], blocksize=ops[3], interpret=False, **kw))

    check(compiled(nf4_matmul_fwd_pallas)(x, ops[0], ops[1]), exact_y, terms_y, k, u)
    check(compiled(nf4_matmul_fwd_pallas, out_dtype=jnp.float32)(x, ops[0], ops[1]), exact_y, terms_y, k, 2.0**-24)
    check(compiled(nf4_matmul_dx_pallas, w_dtype=dtype)(g, ops[0], ops[1]), exact_dx, terms_dx, o, 2.0**-24)


def test_the_module_imports_first():
    """``import jaxgrad.ops.nf4_matmul`` in a fresh interpreter (it imports ``jaxgrad.lora``, whose block imports it
    back: a circular import that used to fail when this module came first)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import jaxgrad.ops.nf4_matmul as m; print(m.nf4_matmul.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "nf4_matmul", proc.stderr[-2000:]
