"""The seed denoiser (1 -> 16 -> 16 -> 1): PyTorch parity from a committed fixture (and live when torch is
installed), every gradient proven through the whole network by jaxgrad.verify, backends agreeing, the custom-VJP
and jax.grad training paths giving the same loss curve, the flax.nnx wrapper, and bad input.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrad.cnn import denoiser, layout
from jaxgrad.cnn.nnx import Denoiser
from jaxgrad.verify import assert_vjp_matches

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "torch_denoiser_fixture.npz"


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _torch_case(data, dtype_name):
    """Fixture arrays -> (params, x, target, loss, grads) in jaxgrad layouts."""
    sd = {k.split("/param/")[1]: data[k] for k in data.files if k.startswith(f"{dtype_name}/param/")}
    grads = {k.split("/grad/")[1]: data[k] for k in data.files if k.startswith(f"{dtype_name}/grad/")}
    params = layout.from_torch_state_dict(sd)
    grad_layers = layout.from_torch_state_dict(grads)
    x = layout.nchw_to_nhwc(data[f"{dtype_name}/x_nchw"])
    t = layout.nchw_to_nhwc(data[f"{dtype_name}/target_nchw"])
    return params, x, t, float(data[f"{dtype_name}/loss"]), grad_layers, layout.nchw_to_nhwc(data[f"{dtype_name}/y_nchw"])


# ---------------------------------------------------------------------------------------------------------------
# PyTorch parity
# ---------------------------------------------------------------------------------------------------------------
def test_matches_pytorch_in_float64_from_the_committed_fixture():
    """Forward, loss, and every weight and bias gradient equal PyTorch's to float64 rounding, after converting
    PyTorch's OIHW gradients with the same axis permutation as the weights (no flip, no extra transpose)."""
    data = np.load(FIXTURE)
    params, x, t, loss_torch, grads_torch, y_torch = _torch_case(data, "float64")
    with jax.enable_x64(True):
        params = jax.tree.map(jnp.asarray, params)
        y = denoiser.apply(params, jnp.asarray(x))
        loss, grads = jax.value_and_grad(denoiser.mse_loss)(params, jnp.asarray(x), jnp.asarray(t))
    np.testing.assert_allclose(y, y_torch, rtol=1e-12, atol=1e-13)
    assert abs(float(loss) - loss_torch) <= 1e-13 * loss_torch
    for ours, theirs in zip(grads, grads_torch):
        for name in ("w", "b"):
            scale = np.max(np.abs(theirs[name]))
            np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-12 * scale, err_msg=name)


def test_matches_pytorch_in_float32_to_rounding():
    """float32 on the CPU (no TF32 on either side): normwise gradient error ~1e-7, far below the 25-175% the seed
    saw; the bound is sqrt(N) u_f32 with N = 2*24*40 summed terms per weight gradient entry, times 8."""
    data = np.load(FIXTURE)
    params, x, t, loss_torch, grads_torch, _ = _torch_case(data, "float32")
    loss, grads = jax.value_and_grad(denoiser.mse_loss)(jax.tree.map(jnp.asarray, params), jnp.asarray(x),
                                                        jnp.asarray(t), precision="highest")
    bound = 8 * np.sqrt(2 * 24 * 40 * 9 * 16) * 2.0 ** -24
    assert abs(float(loss) - loss_torch) <= bound * loss_torch
    for ours, theirs in zip(grads, grads_torch):
        for name in ("w", "b"):
            rel = np.linalg.norm(np.asarray(ours[name]) - theirs[name]) / np.linalg.norm(theirs[name])
            assert rel <= bound, (name, rel, bound)


def test_matches_pytorch_live_when_torch_is_installed():
    torch = pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fixture", pathlib.Path(__file__).parent / "fixtures" / "make_torch_denoiser_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = module.compute("float64", seed=7)
    keys = list(data)

    class _Npz(dict):
        files = keys

    params, x, t, loss_torch, grads_torch, _ = _torch_case(_Npz(data), "float64")
    with jax.enable_x64(True):
        loss, grads = jax.value_and_grad(denoiser.mse_loss)(jax.tree.map(jnp.asarray, params), jnp.asarray(x),
                                                            jnp.asarray(t))
    assert abs(float(loss) - loss_torch) <= 1e-13 * loss_torch, torch.__version__
    for ours, theirs in zip(grads, grads_torch):
        np.testing.assert_allclose(ours["w"], theirs["w"], atol=1e-12 * np.max(np.abs(theirs["w"])))


# ---------------------------------------------------------------------------------------------------------------
# every gradient of the network, proven
# ---------------------------------------------------------------------------------------------------------------
def _reference_loss(params, x, t):
    return denoiser.mse_loss(params, x, t, backend="reference")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_network_gradients_are_proven(backend):
    params = denoiser.init(jax.random.key(0))
    params = [{"w": layer["w"], "b": layer["b"] + 0.05 * _normal(i, layer["b"].shape)}
              for i, layer in enumerate(params)]
    x, t = _normal(1, (2, 13, 9, 1)), _normal(2, (2, 13, 9, 1))
    fn = jax.jit(functools.partial(denoiser.mse_loss, backend=backend))
    report = assert_vjp_matches(fn, jax.jit(_reference_loss), params, x, t, arg_names=("params", "x", "target"),
                                fd_directions=1)
    assert any("[2]['w']" in lf.name for lf in report.leaves)


def test_backends_agree_at_odd_sizes():
    params = denoiser.init(jax.random.key(3), denoiser.DenoiserConfig((1, 5, 3)))
    for shape in [(1, 7, 9, 1), (3, 5, 17, 1)]:
        x = _normal(4, shape)
        ys = [denoiser.apply(params, x, backend=b, precision="highest") for b in ("xla", "pallas", "reference")]
        np.testing.assert_allclose(ys[0], ys[2], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ys[1], ys[2], rtol=1e-5, atol=1e-6)


def test_init_follows_pytorch_default_bounds():
    params = denoiser.init(jax.random.key(5))
    assert [layer["w"].shape for layer in params] == [(3, 3, 1, 16), (3, 3, 16, 16), (3, 3, 16, 1)]
    for layer in params:
        bound = 1 / np.sqrt(9 * layer["w"].shape[2])
        for leaf in (layer["w"], layer["b"]):
            assert np.max(np.abs(leaf)) <= bound
        assert np.max(np.abs(layer["w"])) > 0.8 * bound  # uniform over the whole range


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------
def _pairs(n_batches, seed=0, shape=(4, 12, 12, 1)):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[: shape[1], : shape[2]]
    for _ in range(n_batches):
        c = rng.uniform(3, 9, size=(shape[0], 2))
        clean = np.exp(-((yy - c[:, :1, None]) ** 2 + (xx - c[:, 1:, None]) ** 2) / 8.0)[..., None]
        yield (clean + 0.3 * rng.standard_normal(shape)).astype(np.float32), clean.astype(np.float32)


def test_custom_vjp_and_jax_grad_training_give_the_same_loss_curve_and_converge():
    """30 Adam steps in float64: the hand-written VJP and jax.grad of the oracle agree to 1e-9 relative."""
    cfg = denoiser.DenoiserConfig((1, 4, 1))
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: a.astype(jnp.float64), denoiser.init(jax.random.key(6), cfg))
        batches = [(x.astype(np.float64), t.astype(np.float64)) for x, t in _pairs(30)]
        _, _, ours = denoiser.train(params, batches, optax.adam(3e-2), backend="xla")
        _, _, ref = denoiser.train(params, batches, optax.adam(3e-2), backend="reference")
    np.testing.assert_allclose(ours, ref, rtol=1e-9)
    assert np.mean(ours[-5:]) < 0.5 * np.mean(ours[:5])


def test_nnx_wrapper_is_the_functional_network():
    from flax import nnx

    model = Denoiser(denoiser.DenoiserConfig((1, 4, 1)), rngs=nnx.Rngs(0))
    params = model.to_params()
    x, t = next(_pairs(1))
    np.testing.assert_array_equal(model(jnp.asarray(x)), denoiser.apply(params, jnp.asarray(x)))
    again = Denoiser.from_params(params)
    np.testing.assert_array_equal(again(jnp.asarray(x)), model(jnp.asarray(x)))

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, t):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - t) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, jnp.asarray(x), jnp.asarray(t))) for x, t in _pairs(15, seed=1)]
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
def test_bad_input_is_named():
    params = denoiser.init(jax.random.key(7))
    with pytest.raises(ValueError, match=r"x must be \[N, H, W, 1\].*NCHW"):
        denoiser.apply(params, jnp.zeros((2, 1, 8, 8)))
    with pytest.raises(ValueError, match="target must have x's shape"):
        denoiser.mse_loss(params, jnp.zeros((2, 8, 8, 1)), jnp.zeros((2, 8, 9, 1)))
    with pytest.raises(ValueError, match="non-finite pixel"):
        denoiser.check_batch(np.array([[[[0.0]], [[np.nan]]]], np.float32), "x")
    with pytest.raises(ValueError, match="channels"):
        denoiser.DenoiserConfig((1,))
    with pytest.raises(ValueError, match="expects Cin=16 but layer 0 outputs 8"):
        denoiser.check_params([{"w": jnp.zeros((3, 3, 1, 8))}, {"w": jnp.zeros((3, 3, 16, 1))}])
