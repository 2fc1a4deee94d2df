"""conv2d: the hand-written VJP is proven by jaxgrad.verify (float64 re-run, finite differences, adjoint and
structural checks) for every stride / padding / dilation combination, matches ``jax.grad`` of the plain-JAX
oracle to float64 rounding over random geometries, and the Pallas backend agrees with both; layouts convert
PyTorch's OIHW/NCHW without flips; bad input gets errors that name the argument.

Test data are white noise, non-square kernels (3x5), Cin != Cout and H != W, so that every flip, transpose or
shift changes the answer (see ../shared/reference/gradcheck.md section 3).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cnn import layout
from jaxgrad.cnn.conv import conv2d, conv2d_input_grad, conv2d_reference, resolve_padding
from jaxgrad.verify import assert_vjp_matches, check_vjp


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _args(seed, n=2, hw=(9, 7), kernel=(3, 5), cin=2, cout=3, bias=True, dtype=jnp.float32):
    x = _normal(seed, (n, *hw, cin), dtype)
    w = (_normal(seed + 1, (*kernel, cin, cout)) / np.sqrt(kernel[0] * kernel[1] * cin)).astype(dtype)
    b = (_normal(seed + 2, (cout,)) * 0.3).astype(dtype) if bias else None
    return x, w, b


def _verify(geometry, x, w, b, **options):
    fn = jax.jit(functools.partial(conv2d, **geometry))
    ref = jax.jit(functools.partial(conv2d_reference, **geometry))
    args = (x, w) if b is None else (x, w, b)
    return assert_vjp_matches(fn, ref, *args, arg_names=("x", "w", "b")[: len(args)], fd_directions=1, **options)


# ---------------------------------------------------------------------------------------------------------------
# the verifier's verdict on every stride / padding / dilation combination
# ---------------------------------------------------------------------------------------------------------------
STRIDES = (1, 2, (1, 2))
PADDINGS = ("SAME", "VALID", ((2, 0), (1, 3)))
# every stride x padding pair, each with dilation 1 and 2 alternately (the float64 sweep below covers the full
# product and more; each check_vjp costs ~5 s of CPU compile time)
COMBOS = [(s, p, 1 + (i % 2)) for i, (s, p) in enumerate(itertools.product(STRIDES, PADDINGS))]


@pytest.mark.parametrize("stride,padding,dilation", COMBOS)
def test_vjp_is_proven_for_every_stride_padding_dilation(stride, padding, dilation):
    geometry = dict(stride=stride, padding=padding, dilation=dilation, activation="relu")
    x, w, b = _args(3, hw=(11, 13))
    report = _verify(geometry, x, w, b)
    assert {lf.name for lf in report.leaves} >= {"x", "w", "b"}


def test_vjp_without_bias_and_without_activation_is_proven():
    _verify(dict(stride=2, padding="SAME"), *_args(5, bias=False)[:2], None)


def test_vjp_in_bfloat16_is_judged_at_bf16_precision():
    x, w, b = _args(7, dtype=jnp.bfloat16)
    report = _verify(dict(padding="SAME", activation="relu"), x, w, b)
    assert report.precision.precision == "bf16"


def test_vjp_equals_jax_grad_of_the_oracle_in_float64_over_random_geometries():
    """Exact agreement (float64 rounding) for 12 random geometries: kernels 1x1 .. 4x2, strides, dilations and
    asymmetric paddings, including kernels as wide as the padded input and rows/columns the stride never reads."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        for case in range(12):
            kh, kw = rng.integers(1, 5, size=2)
            stride = tuple(int(s) for s in rng.integers(1, 4, size=2))
            dilation = tuple(int(d) for d in rng.integers(1, 3, size=2))
            padding = tuple(tuple(int(p) for p in rng.integers(0, 4, size=2)) for _ in range(2))
            h, wd = (int(v) for v in rng.integers(3, 12, size=2))
            pads = resolve_padding(padding, (h, wd), (kh, kw), stride, dilation)
            if any(n + lo + hi < (k - 1) * d + 1 for n, k, (lo, hi), d in zip((h, wd), (kh, kw), pads, dilation)):
                continue
            geometry = dict(stride=stride, padding=padding, dilation=dilation,
                            activation=("relu", None)[case % 2])
            x = jnp.asarray(rng.standard_normal((2, h, wd, 3)))
            w = jnp.asarray(rng.standard_normal((kh, kw, 3, 4)))
            b = jnp.asarray(rng.standard_normal(4))
            y_ref, vjp_ref = jax.vjp(jax.jit(functools.partial(conv2d_reference, **geometry)), x, w, b)
            y, vjp = jax.vjp(jax.jit(functools.partial(conv2d, **geometry)), x, w, b)
            g = jnp.asarray(rng.standard_normal(y.shape))
            np.testing.assert_allclose(y, y_ref, atol=1e-12, err_msg=str(geometry))
            for name, got, want in zip("xwb", vjp(g), vjp_ref(g)):
                np.testing.assert_allclose(got, want, atol=1e-11, err_msg=f"{name} {geometry}")


def test_oracle_matches_lax_conv_general_dilated_and_an_explicit_loop():
    """The oracle (strided slices + einsum) against XLA's convolution and a NumPy loop over the definition."""
    x, w, b = _args(11, n=1, hw=(6, 7), kernel=(3, 2), cin=2, cout=3)
    geometry = dict(stride=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2))
    got = conv2d_reference(x, w, b, precision="highest", **geometry)
    want = jax.lax.conv_general_dilated(x, w, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest") + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (1, 2), (0, 1), (0, 0)))
    wn = np.asarray(w, np.float64)
    loop = np.zeros(got.shape)
    for h, c, o in itertools.product(range(got.shape[1]), range(got.shape[2]), range(3)):
        loop[0, h, c, o] = b[o] + sum(xp[0, 2 * h + u, c + 2 * v, i] * wn[u, v, i, o]
                                      for u in range(3) for v in range(2) for i in range(2))
    np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5)


def test_strided_geometry_that_aborts_xla_cpu_on_lhs_dilated_convs_works():
    """2x4 kernel, stride 2, 10x5 input, padding 1: jax.grad of lax.conv_general_dilated aborts XLA's CPU
    compiler (jax 0.11.2); our input gradient pads explicitly behind an optimization barrier."""
    x, w, _ = _args(13, hw=(10, 5), kernel=(2, 4), cin=3, cout=4)
    with jax.enable_x64(True):
        x, w = x.astype(jnp.float64), w.astype(jnp.float64)
        f = functools.partial(conv2d, stride=2, padding=1)
        g = jnp.ones((2, 6, 2, 4))
        dx, dw = jax.jit(lambda x, w: jax.vjp(f, x, w)[1](g))(x, w)
        dx_ref, dw_ref = jax.vjp(functools.partial(conv2d_reference, stride=2, padding=1), x, w)[1](g)
    np.testing.assert_allclose(dx, dx_ref, atol=1e-12)
    np.testing.assert_allclose(dw, dw_ref, atol=1e-12)


def test_zero_cotangent_gives_exactly_zero_gradients_and_calls_are_independent():
    x, w, b = _args(17)
    f = jax.jit(lambda x, w, b: conv2d(x, w, b, activation="relu"))
    y, vjp = jax.vjp(f, x, w, b)
    for leaf in vjp(jnp.zeros_like(y)):
        assert not np.any(np.asarray(leaf))
    g = _normal(18, y.shape)
    first, second = vjp(g), vjp(g)
    for a, c in zip(first, second):
        np.testing.assert_array_equal(a, c)


def test_a_planted_kernel_flip_in_the_weight_gradient_is_caught_and_named():
    @jax.custom_vjp
    def bad_conv(x, w):
        return conv2d(x, w)

    def fwd(x, w):
        return bad_conv(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        dx, dw = jax.vjp(conv2d, x, w)[1](g)
        return dx, dw[::-1, ::-1]

    bad_conv.defvjp(fwd, bwd)
    x, w, _ = _args(19, hw=(12, 10), kernel=(3, 5))
    report = check_vjp(jax.jit(bad_conv), conv2d_reference, x, w, arg_names=("x", "w"), fd_directions=1)
    assert not report.passed
    assert report.leaf("w").diagnosis_kind == "flip"
    assert report.leaf("x").passed


# ---------------------------------------------------------------------------------------------------------------
# the Pallas backend (interpret mode on the CPU)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,hw,cin,cout,activation", [(1, (7, 9), 3, 16, "relu"), (2, (5, 13), 16, 1, None)])
def test_pallas_backend_vjp_is_proven(n, hw, cin, cout, activation):
    x, w, b = _args(23, n=n, hw=hw, kernel=(3, 3), cin=cin, cout=cout)
    fn = jax.jit(functools.partial(conv2d, activation=activation, backend="pallas"))
    ref = jax.jit(functools.partial(conv2d_reference, activation=activation))
    assert_vjp_matches(fn, ref, x, w, b, arg_names=("x", "w", "b"), fd_directions=1)


def test_pallas_backend_rejects_geometries_it_does_not_implement():
    x, w, b = _args(29, kernel=(3, 5))
    with pytest.raises(ValueError, match="backend='pallas' needs a 3x3 kernel"):
        conv2d(x, w, b, backend="pallas")
    x, w, b = _args(29, kernel=(3, 3))
    with pytest.raises(ValueError, match="stride 1"):
        conv2d(x, w, b, stride=2, backend="pallas")
    with pytest.raises(ValueError, match="padding 1"):
        conv2d(x, w, b, padding="VALID", backend="pallas")


# ---------------------------------------------------------------------------------------------------------------
# layouts: PyTorch OIHW / NCHW <-> HWIO / NHWC, no flips
# ---------------------------------------------------------------------------------------------------------------
def _torch_conv2d_numpy(x_nchw, w_oihw, b, padding):
    """PyTorch's documented formula: y[n,o,h,w] = b[o] + sum_{i,u,v} x[n,i,h+u,w+v] W[o,i,u,v] (cross-corr.)."""
    xp = np.pad(x_nchw, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    o_, i_, kh, kw = w_oihw.shape
    hout, wout = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    y = np.zeros((x_nchw.shape[0], o_, hout, wout))
    for u, v in itertools.product(range(kh), range(kw)):
        y += np.einsum("nihw,oi->nohw", xp[:, :, u:u + hout, v:v + wout], w_oihw[:, :, u, v])
    return y + b[None, :, None, None]


def test_torch_weights_and_data_convert_by_axis_order_only():
    rng = np.random.default_rng(31)
    x_nchw, w_oihw, b = rng.standard_normal((2, 3, 8, 6)), rng.standard_normal((4, 3, 3, 5)), rng.standard_normal(4)
    want = _torch_conv2d_numpy(x_nchw, w_oihw, b, padding=2)
    with jax.enable_x64(True):
        y = conv2d(jnp.asarray(layout.nchw_to_nhwc(x_nchw)), jnp.asarray(layout.torch_weight_to_hwio(w_oihw)),
                   jnp.asarray(b), padding=((1, 1), (2, 2)))
        np.testing.assert_allclose(layout.nhwc_to_nchw(np.asarray(y)), want[:, :, 1:-1, :], atol=1e-12)
    np.testing.assert_array_equal(layout.hwio_to_torch_weight(layout.torch_weight_to_hwio(w_oihw)), w_oihw)
    np.testing.assert_array_equal(layout.nhwc_to_nchw(layout.nchw_to_nhwc(x_nchw)), x_nchw)


def test_a_true_convolution_kernel_needs_a_flip():
    """scipy.signal.convolve2d-style convolution sum x[h-u, w-v] k[u, v] == correlation with flip_kernel(k)."""
    rng = np.random.default_rng(37)
    x, k = rng.standard_normal((7, 9)), rng.standard_normal((3, 5))
    full = np.zeros((7 + 2, 9 + 4))
    for u, v in itertools.product(range(3), range(5)):
        full[u:u + 7, v:v + 9] += k[u, v] * x
    valid = full[2:7, 4:9]  # the 'valid' part of the true convolution
    with jax.enable_x64(True):
        y = conv2d(jnp.asarray(x)[None, :, :, None], jnp.asarray(layout.flip_kernel(k[:, :, None, None])),
                   padding="VALID")
    np.testing.assert_allclose(np.asarray(y)[0, :, :, 0], valid, atol=1e-12)


def test_conv_transpose_weights_map_to_the_input_gradient():
    """ConvTranspose2d(W[Cin_t, Cout_t, kh, kw]), stride 1, padding p == correlation with the flipped, transposed
    kernel and padding k-1-p == the input gradient of Conv2d with OIHW weight W."""
    rng = np.random.default_rng(41)
    w_iohw = rng.standard_normal((4, 3, 3, 5))  # ConvTranspose2d(4 -> 3)
    g = rng.standard_normal((2, 6, 7, 4))
    with jax.enable_x64(True):
        w_fwd = jnp.asarray(layout.torch_weight_to_hwio(w_iohw))  # Conv2d(3 -> 4) with the same tensor
        pads = ((1, 1), (2, 2))
        want = conv2d_input_grad(jnp.asarray(g), w_fwd, (6, 7), stride=(1, 1), pads=pads, dilation=(1, 1))
        got = conv2d(jnp.asarray(g), jnp.asarray(layout.torch_transpose_weight_to_hwio(w_iohw)),
                     padding=((3 - 1 - 1, 3 - 1 - 1), (5 - 1 - 2, 5 - 1 - 2)))
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_state_dicts_round_trip():
    rng = np.random.default_rng(43)
    sd = {"0.weight": rng.standard_normal((16, 1, 3, 3)), "0.bias": rng.standard_normal(16),
          "2.weight": rng.standard_normal((1, 16, 3, 3)), "2.bias": rng.standard_normal(1)}
    layers = layout.from_torch_state_dict(sd)
    assert [layer["w"].shape for layer in layers] == [(3, 3, 1, 16), (3, 3, 16, 1)]
    back = layout.to_torch_state_dict(layers)
    for key in sd:
        np.testing.assert_array_equal(back[key], sd[key])
    with pytest.raises(ValueError, match="no 4-D"):
        layout.from_torch_state_dict({"fc.weight": np.zeros((3, 4))})


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
def test_nchw_input_is_named_as_such():
    x, w, b = _args(47, hw=(8, 8), cin=3, cout=4, kernel=(3, 3))
    with pytest.raises(ValueError, match="looks like NCHW"):
        conv2d(jnp.transpose(x, (0, 3, 1, 2)), w, b)


def test_oihw_weights_are_named_as_such():
    x, w, b = _args(53, hw=(8, 8), cin=2, cout=4, kernel=(3, 3))
    with pytest.raises(ValueError, match="OIHW"):
        conv2d(x, jnp.transpose(w, (3, 2, 0, 1)), b)


def _rgb(seed=71):
    return _normal(seed, (2, 8, 8, 3))


def test_an_oihw_weight_that_also_passes_as_hwio_is_refused_not_misread():
    # nn.Conv2d(3, 8, 3).weight, [8, 3, 3, 3], read as HWIO is an 8x3 kernel with 3 outputs: a wrong channel count
    w_oihw = _normal(72, (8, 3, 3, 3))
    for backend in ("xla", "reference"):
        with pytest.raises(ValueError, match=r"w \(8, 3, 3, 3\) is ambiguous.*layout\.torch_weight_to_hwio"):
            conv2d(_rgb(), w_oihw, backend=backend)
    with pytest.raises(ValueError, match="torch_weight_to_hwio"):  # at trace time too
        jax.jit(conv2d)(_rgb(), w_oihw)
    with pytest.raises(ValueError, match="torch_weight_to_hwio"):
        conv2d(_normal(73, (1, 6, 6, 1)), _normal(74, (16, 1, 1, 1)))  # a 1x1 conv on a grayscale image
    assert conv2d(_rgb(), jnp.asarray(layout.torch_weight_to_hwio(w_oihw))).shape == (2, 8, 8, 8)


def test_an_oihw_weight_with_its_bias_is_named_as_oihw_not_as_a_bad_bias():
    with pytest.raises(ValueError, match=r"reads as PyTorch's OIHW \[Cout=8, Cin=3, 3x3\].*torch_weight_to_hwio"):
        conv2d(_rgb(), _normal(75, (8, 3, 3, 3)), _normal(76, (8,)))
    with pytest.raises(ValueError, match="torch_weight_to_hwio"):  # even where the caller vouches for HWIO
        conv2d(_rgb(), _normal(75, (8, 3, 3, 3)), _normal(76, (8,)), layout="HWIO")


@pytest.mark.parametrize("shape", [(3, 3, 3, 16), (5, 5, 3, 3), (1, 1, 3, 8), (3, 5, 3, 4), (3, 3, 3, 3)])
def test_hwio_weights_whose_oihw_reading_is_implausible_or_impossible_just_work(shape):
    # square HWIO kernels (RGB -> 16, 5x5 3 -> 3, 1x1), a non-square one whose OIHW reading has the wrong Cin;
    # [3, 3, 3, 3] is the same shape in both layouts (documented: no shape rule can tell)
    assert conv2d(_rgb(), _normal(77, shape), padding="VALID").shape[-1] == shape[3]


def test_a_non_square_hwio_kernel_that_reads_as_oihw_is_accepted_with_layout_hwio_or_with_its_bias():
    w = _normal(78, (8, 3, 3, 3))  # an 8x3 HWIO kernel, 3 -> 3 channels
    y = conv2d(_normal(79, (1, 12, 6, 3)), w, padding="VALID", layout="HWIO")
    assert y.shape == (1, 5, 4, 3)
    np.testing.assert_allclose(y, conv2d_reference(_normal(79, (1, 12, 6, 3)), w, padding="VALID", layout="HWIO"),
                               rtol=1e-5, atol=1e-5)
    b = _normal(80, (3,))  # a bias of Cout = w.shape[3] entries settles it: HWIO
    assert conv2d(_normal(79, (1, 12, 6, 3)), w, b, padding="VALID").shape == (1, 5, 4, 3)
    with pytest.raises(ValueError, match="layout must be None or 'HWIO'"):
        conv2d(_rgb(), w, layout="OIHW")


@pytest.mark.parametrize("kwargs,match", [
    (dict(stride=0), "stride"), (dict(dilation=(1, 0)), "dilation"), (dict(padding="FULL"), "padding"),
    (dict(padding=-1), "padding"), (dict(padding=((1, 2),)), "padding"), (dict(activation="gelu"), "activation"),
    (dict(backend="cudnn"), "backend")])
def test_bad_options_are_named(kwargs, match):
    x, w, b = _args(59)
    with pytest.raises(ValueError, match=match):
        conv2d(x, w, b, **kwargs)


def test_kernel_larger_than_the_padded_input_is_an_error():
    x, w, b = _args(61, hw=(4, 9), kernel=(5, 3))
    with pytest.raises(ValueError, match="kernel spans 5 pixels along H"):
        conv2d(x, w, b, padding="VALID")


def test_bad_shapes_and_dtypes_are_named():
    x, w, b = _args(67)
    with pytest.raises(ValueError, match="x must have rank 4"):
        conv2d(x[0], w, b)
    with pytest.raises(ValueError, match="w must be floating"):
        conv2d(x, w.astype(jnp.int32), b)
    with pytest.raises(ValueError, match=r"b must have shape \(Cout,\) = \(3,\)"):
        conv2d(x, w, b[:2])
