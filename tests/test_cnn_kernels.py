"""3x3 conv kernels (jaxgrad.cnn.kernels): forward (bias + ReLU fused), input grad and weight/bias grad (ReLU'
fused) against a float64 reference built from ``lax.conv_general_dilated`` (NHWC/HWIO, 'SAME') and ``jax.vjp``.

Error model: every output entry is judged against the magnitude ``M = sum |terms|`` of its sum (the same conv /
VJP evaluated on absolute values), with ``tol = k_op u_op + (2 sqrt(n) + 2) u_f32``: ``n`` is the length of the
reduction (``9 Cin`` + bias for y, ``9 Cout`` for dx, ``N H W`` for dw/db), ``sqrt(n) u`` the statistical growth of
f32 accumulation error (factor 2 slack, +2 for the final rounding and the bias/epilogue), and ``k_op u_op`` the
operand rounding of the dot: 0 in interpret mode (exact f32 products), ``8 u_tf32`` for TF32 operands on the GPU
(both operands rounded, possibly truncated: <= 4u per product, slack 2), ``2 u_bf16`` for bf16 outputs (products of
bf16 are exact in f32; the result is rounded to bf16 once). Inputs are fresh random normals (never zeros, half
negative, so the ReLU masks cut about half of the entries); the ReLU' mask source ``y`` is an independent random
array so that the mask does not correlate with ``g``.

CPU tests run the kernels in interpret mode at odd sizes (H != W, none a multiple of a block); the ``gpu`` tests
compile them with Triton at larger sizes in TF32, IEEE f32 and bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.extend import core as jex_core

from jaxgrad.cnn import kernels as K

F32_U = 2.0**-24
TF32_U = 2.0**-11
BF16_U = 2.0**-8
HP = jax.lax.Precision.HIGHEST


# On a GPU machine the interpret-mode tests run on its CPU (exact-f32 tolerances); ``gpu`` tests on the GPU.
pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")


# ---------------------------------------------------------------------------------------------------------------
# Inputs, float64 reference, magnitudes
# ---------------------------------------------------------------------------------------------------------------
def make_inputs(seed, n, h, w, cin, cout, dtype=jnp.float32):
    """x, w (He-scaled), b, g, y (the ReLU' mask source): numpy-generated (no per-shape XLA compiles)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h, w, cin))
    wt = rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin)
    b = rng.standard_normal(cout)
    g = rng.standard_normal((n, h, w, cout))
    y = rng.standard_normal((n, h, w, cout))
    return tuple(jnp.asarray(a, dtype) for a in (x, wt, b, g, y))


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=HP)


@jax.jit
def _ref_and_mags(x, w, b, g, mask):
    """(y_pre, dx, dw, db) for the cotangent gz = g * mask, and their sum|terms| magnitudes."""
    gz = g * mask
    y_pre = _conv(x, w) + b
    _, vjp = jax.vjp(_conv, x, w)
    dx, dw = vjp(gz)
    ax, aw, agz = jnp.abs(x), jnp.abs(w), jnp.abs(gz)
    m_y = _conv(ax, aw) + jnp.abs(b)
    (m_dx,) = jax.vjp(lambda x_: _conv(x_, aw), ax)[1](agz)
    (m_dw,) = jax.vjp(lambda w_: _conv(ax, w_), aw)[1](agz)
    return (y_pre, dx, dw, gz.sum((0, 1, 2))), (m_y, m_dx, m_dw, agz.sum((0, 1, 2)))


def reference64(x, w, b, g, y):
    """float64 values and magnitudes from the inputs exactly as the kernels see them (``y`` None: no mask)."""
    cpu = jax.devices("cpu")[0]  # on the GPU machine too: exact f64 convs, no GPU compile
    with jax.enable_x64(True):
        a64 = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (x, w, b, g)]
        mask = jnp.ones_like(a64[3]) if y is None else jax.device_put(np.asarray(y, np.float64) > 0, cpu)
        vals, mags = _ref_and_mags(*a64, mask.astype(jnp.float64))
        return [np.asarray(v) for v in vals], [np.asarray(m) for m in mags]


def tol_for(n_terms, k_op=0.0, u_op=0.0):
    return k_op * u_op + (2 * np.sqrt(n_terms) + 2) * F32_U


def assert_close_to_magnitude(name, got, want, mag, tol):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.abs(got - want)
    bound = tol * mag + 1e-30
    bad = err > bound
    if bad.any():
        idx = np.unravel_index(np.argmax(err / bound), err.shape)
        raise AssertionError(f"{name}: {bad.sum()} of {err.size} entries exceed tol*M (tol={tol:.3g}); worst at {idx}: "
                             f"got {got[idx]!r}, want {want[idx]!r}, M={mag[idx]!r}, err/M={err[idx] / mag[idx]:.3g}")


def check_all(x, w, b, g, y, *, use_bias, relu, use_y, interpret=True, precision=None, k_op=0.0, u_op=0.0,
              fwd=None, igrad=None, wgrad=None, weight_grad=True):
    """Forward, input grad and weight grad against the float64 reference. ``k_op u_op`` is the operand-rounding
    part of the tolerance (see the module docstring); ``fwd`` / ``igrad`` / ``wgrad`` are block options."""
    n, h, wd, cin = x.shape
    cout = w.shape[3]
    bb = b if use_bias else jnp.zeros_like(b)
    ymask = y if use_y else None
    (y_pre, dx_w, dw_w, db_w), (m_y, m_dx, m_dw, m_db) = reference64(x, w, bb, g, ymask)
    y_w = np.maximum(y_pre, 0) if relu else y_pre
    if relu:
        frac = float(np.mean(y_pre > 0))
        assert 0.2 < frac < 0.8, f"ReLU mask is trivial ({frac:.2f} positive)"
    if use_y:
        frac = float(np.mean(np.asarray(y, np.float64) > 0))
        assert 0.2 < frac < 0.8, f"y mask is trivial ({frac:.2f} positive)"

    out = K.conv3x3_forward(x, w, b if use_bias else None, relu=relu, precision=precision, interpret=interpret,
                            **(fwd or {}))
    assert out.dtype == x.dtype and out.shape == (n, h, wd, cout)
    assert_close_to_magnitude("y", out, y_w, m_y, tol_for(9 * cin + 1, k_op, u_op))

    dx = K.conv3x3_input_grad(g, w, y=ymask, precision=precision, interpret=interpret, **(igrad or {}))
    assert dx.dtype == g.dtype and dx.shape == x.shape
    assert_close_to_magnitude("dx", dx, dx_w, m_dx, tol_for(9 * cout, k_op, u_op))

    if not weight_grad:
        return
    dw, db = K.conv3x3_weight_grad(x, g, y=ymask, precision=precision, interpret=interpret, **(wgrad or {}))
    out_dt = jnp.result_type(x.dtype, g.dtype)
    assert dw.dtype == out_dt and db.dtype == out_dt and dw.shape == w.shape and db.shape == (cout,)
    assert_close_to_magnitude("dw", dw, dw_w, m_dw, tol_for(n * h * wd, k_op, u_op))
    assert_close_to_magnitude("db", db, db_w, m_db, tol_for(n * h * wd, k_op, u_op))


# ---------------------------------------------------------------------------------------------------------------
# CPU (interpret mode)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, h, w, cin, cout, use_bias, relu, use_y, blocks",
    [
        # 126 positions in 8 blocks of 16 (last one ragged), weight grad in 3 interleaved splits
        (2, 7, 9, 3, 5, True, True, True, dict(block_p=16)),
        # first layer of the denoiser: 1 input channel, one 128-position block (65 real)
        (1, 5, 13, 1, 16, False, False, False, {}),
        # last layer: 1 output channel; W=3 < the tap reach, blocks straddle the two images
        (2, 17, 3, 16, 1, True, False, True, dict(block_p=32)),
        # middle layer: 16 -> 16, several splits of several blocks each
        (1, 7, 9, 16, 16, True, True, True, dict(block_p=16, num_splits=2)),
        # widest supported: 32 -> 32 (and a non-power-of-two H, W = 13)
        (1, 5, 13, 32, 32, False, True, False, dict(block_p=32)),
    ],
    ids=["N2-7x9-3to5", "N1-5x13-1to16", "N2-17x3-16to1", "N1-7x9-16to16", "N1-5x13-32to32"],
)
def test_f32_matches_reference(n, h, w, cin, cout, use_bias, relu, use_y, blocks):
    x, wt, b, g, y = make_inputs(1000 * n + 10 * h + w + cin + cout, n, h, w, cin, cout)
    wgrad = dict(blocks)
    fwd = {k: v for k, v in blocks.items() if k != "num_splits"}
    check_all(x, wt, b, g, y, use_bias=use_bias, relu=relu, use_y=use_y, fwd=fwd, igrad=fwd, wgrad=wgrad)


@pytest.mark.parametrize("n, h, w, cin, cout, relu, blocks", [
    (2, 7, 9, 3, 5, True, dict(block_p=16, rows_per_program=3)),  # 14 rows in chunks of 3 (last one ragged)
    (1, 9, 40, 1, 16, True, dict(block_p=16, rows_per_program=2)),  # 3 strips per row, the last one ragged
    (1, 17, 3, 16, 1, False, dict(block_p=16, rows_per_program=4)),  # strip wider than the row
], ids=["N2-7x9-3to5", "N1-9x40-1to16", "N1-17x3-16to1"])
def test_row_strip_variant_matches_reference(n, h, w, cin, cout, relu, blocks):
    """``rows_per_program``: the forward / input-grad variant that keeps the shifted rows in registers."""
    x, wt, b, g, y = make_inputs(17 + h + w, n, h, w, cin, cout)
    check_all(x, wt, b, g, y, use_bias=True, relu=relu, use_y=True, fwd=blocks, igrad=blocks, weight_grad=False)


def test_bf16_accumulates_in_f32_and_returns_bf16():
    x, wt, b, g, y = make_inputs(7, 2, 5, 13, 16, 16, jnp.bfloat16)
    check_all(x, wt, b, g, y, use_bias=True, relu=True, use_y=True, k_op=2, u_op=BF16_U,
              fwd=dict(block_p=32), igrad=dict(block_p=32), wgrad=dict(block_p=32))


def test_f64_interpret_is_exact_to_1e12_and_degenerate_widths():
    """float64 in interpret mode (the verifier's re-run) at W=1 (every dx != 1 tap masked) and H=2."""
    with jax.enable_x64(True):
        x, wt, b, g, y = (a.astype(jnp.float64) for a in make_inputs(3, 2, 9, 1, 3, 5))
        (y_pre, dx_w, dw_w, db_w), (m_y, m_dx, m_dw, m_db) = reference64(x, wt, b, g, y)
        out = K.conv3x3_forward(x, wt, b, relu=True, interpret=True, block_p=16)
        dx = K.conv3x3_input_grad(g, wt, y=y, interpret=True, block_p=16)
        dw, db = K.conv3x3_weight_grad(x, g, y=y, interpret=True, block_p=16)
        assert out.dtype == dx.dtype == dw.dtype == jnp.float64
        for name, got, want, mag in (("y", out, np.maximum(y_pre, 0), m_y), ("dx", dx, dx_w, m_dx),
                                     ("dw", dw, dw_w, m_dw), ("db", db, db_w, m_db)):
            assert_close_to_magnitude(name, got, want, mag, 1e-12)


def test_weight_grad_is_independent_of_blocking_and_splits():
    """Same sums in a different order: 1 split x 1 block vs 5 splits of 16-position blocks."""
    x, wt, b, g, y = make_inputs(5, 1, 9, 7, 3, 5)
    (_, _, dw_w, db_w), (_, _, m_dw, m_db) = reference64(x, wt, b, g, y)
    for blocks in (dict(block_p=64, num_splits=1), dict(block_p=16, num_splits=5)):
        dw, db = K.conv3x3_weight_grad(x, g, y=y, interpret=True, **blocks)
        assert_close_to_magnitude(f"dw {blocks}", dw, dw_w, m_dw, tol_for(63))
        assert_close_to_magnitude(f"db {blocks}", db, db_w, m_db, tol_for(63))


def test_no_im2col_or_padded_copy_outside_the_kernels():
    """No value of the wrappers' jaxprs (outside the kernels) is as large as an im2col matrix (9 N H W Cin), and on
    the GPU path (interpret=False traced, not run) no pad of the activations exists at all."""
    n, h, w, cin, cout = 2, 32, 32, 4, 4  # activations (8192 values) > padded weights (9*16*16)
    x, wt, b, g, y = make_inputs(9, n, h, w, cin, cout)
    im2col = 9 * n * h * w * cin

    def sizes(jaxpr, acc):
        for eqn in jaxpr.eqns:
            acc.append((eqn.primitive.name, max([int(np.prod(v.aval.shape)) for v in eqn.outvars
                                                 if hasattr(v.aval, "shape")] or [0])))
            if eqn.primitive.name == "pallas_call":
                continue
            for sub in jex_core.jaxprs_in_params(eqn.params):
                sizes(sub, acc)
        return acc

    for interp in (True, False):
        for f in (lambda: K.conv3x3_forward(x, wt, b, relu=True, interpret=interp),
                  lambda: K.conv3x3_input_grad(g, wt, y=y, interpret=interp),
                  lambda: K.conv3x3_weight_grad(x, g, y=y, interpret=interp)):
            closed = jax.make_jaxpr(f)()
            found = sizes(closed.jaxpr, [])
            assert "pallas_call" in str(closed)
            assert max(s for _, s in found) < im2col, found
            if not interp:
                assert not any(name == "pad" and s >= n * h * w * cin for name, s in found), found


def test_bad_arguments_are_named():
    x, wt, b, g, y = make_inputs(11, 1, 4, 5, 3, 2)
    fwd, igrad, wgrad = K.conv3x3_forward, K.conv3x3_input_grad, K.conv3x3_weight_grad
    with pytest.raises(ValueError, match=r"'x' must have shape \[N, H, W, Cin\] \(NHWC\), got \(4, 5, 3\)"):
        fwd(x[0], wt)
    with pytest.raises(ValueError, match=r"'w' must have shape \[3, 3, Cin, Cout\] \(HWIO, a 3x3 kernel\)"):
        fwd(x, wt[:2])
    with pytest.raises(ValueError, match=r"'w' must have shape \[3, 3, Cin, Cout\]"):
        fwd(x, wt[..., 0])
    with pytest.raises(ValueError, match=r"channel mismatch: 'w' has Cin=2 .* but 'x' has 3 channels"):
        fwd(x, wt[:, :, :2])
    with pytest.raises(ValueError, match=r"'x' has 33 channels \(Cin\); these kernels support 1..32"):
        fwd(jnp.zeros((1, 4, 5, 33)), jnp.zeros((3, 3, 33, 2)))
    with pytest.raises(ValueError, match=r"'w' has Cout=40; these kernels support 1..32"):
        fwd(x, jnp.zeros((3, 3, 3, 40)))
    with pytest.raises(ValueError, match=r"'b' must have shape \(2,\) = \[Cout\] or be None, got \(3,\)"):
        fwd(x, wt, jnp.zeros(3))
    with pytest.raises(ValueError, match="'relu' must be a bool"):
        fwd(x, wt, relu="yes")
    with pytest.raises(ValueError, match="'x' must be a floating-point array, got int32"):
        fwd(x.astype(jnp.int32), wt)
    with pytest.raises(TypeError, match="'w' must be a floating-point array"):  # also a TypeError, like KAN
        fwd(x, wt.astype(jnp.int8))
    with pytest.raises(ValueError, match=r"channel mismatch: 'w' has Cout=2 .* but 'g' has 3 channels"):
        igrad(x, wt)
    with pytest.raises(ValueError, match=r"'y' \(the forward output whose ReLU mask .*\) must have the shape of "
                                         r"'g' \(1, 4, 5, 2\), got \(1, 4, 5, 3\)"):
        igrad(g, wt, y=x)
    with pytest.raises(ValueError, match=r"'g' must have shape \[1, 4, 5, Cout\] \(N, H, W of 'x'"):
        wgrad(x, g[:, :3])
    with pytest.raises(ValueError, match="'y' must be a floating-point array, got bool"):
        wgrad(x, g, y=y > 0)
    with pytest.raises(ValueError, match=r"'g' must have shape \[N, H, W, Cout\]"):
        wgrad(x, g[0])
    with pytest.raises(ValueError, match="'block_p' .* must be a power of two >= 16, got 48"):
        fwd(x, wt, block_p=48)
    with pytest.raises(ValueError, match=r"unknown keyword arguments \['block_q'\]"):
        igrad(g, wt, block_q=16)
    with pytest.raises(ValueError, match="'num_splits' must be a positive int, got 0"):
        wgrad(x, g, num_splits=0)
    with pytest.raises(ValueError, match=r"unknown keyword arguments \['num_splits'\]"):
        fwd(x, wt, num_splits=2)


def test_empty_batch():
    x, wt, b, g, y = make_inputs(13, 1, 4, 5, 3, 2)
    assert K.conv3x3_forward(x[:0], wt, b).shape == (0, 4, 5, 2)
    assert K.conv3x3_input_grad(g[:0], wt).shape == (0, 4, 5, 3)
    dw, db = K.conv3x3_weight_grad(x[:0], g[:0])
    assert dw.shape == wt.shape and db.shape == (2,) and not np.any(np.asarray(dw)) and not np.any(np.asarray(db))


# ---------------------------------------------------------------------------------------------------------------
# GPU (Triton): compiled kernels on an H100/H200
# ---------------------------------------------------------------------------------------------------------------
GPU_MODES = {  # name: (dtype, precision, k_op, u_op)
    "f32-tf32": (jnp.float32, None, 8, TF32_U),
    "f32-highest": (jnp.float32, HP, 0, 0.0),
    "bf16": (jnp.bfloat16, None, 2, BF16_U),
    # three TF32 products per f32 product (hi*hi + hi*lo + lo*hi; lo*lo dropped): ~2^-21 per product
    "f32-3xtf32": (jnp.float32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, 8, 2.0 ** -21),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(GPU_MODES))
@pytest.mark.parametrize("n, h, w, cin, cout", [(2, 256, 256, 16, 16), (1, 129, 67, 1, 16), (1, 129, 67, 16, 1),
                                                 (1, 129, 67, 3, 5), (2, 67, 129, 32, 32)])
def test_gpu_triton_matches_reference(mode, n, h, w, cin, cout):
    dtype, precision, k_op, u_op = GPU_MODES[mode]
    x, wt, b, g, y = make_inputs(n * h + w + cin * cout, n, h, w, cin, cout, dtype)
    check_all(x, wt, b, g, y, use_bias=True, relu=True, use_y=True, interpret=False, precision=precision,
              k_op=k_op, u_op=u_op)
    strip = dict(block_p=64, rows_per_program=8)
    check_all(x, wt, b, g, y, use_bias=False, relu=False, use_y=False, interpret=False, precision=precision,
              k_op=k_op, u_op=u_op, fwd=strip, igrad=strip,
              wgrad=dict(block_p=64, num_splits=7))
