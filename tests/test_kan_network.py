"""Multi-layer KAN (functional and flax.nnx): construction, forward against the reference, error messages, a
training run whose loss curve is the same through the custom VJP and through jax.grad of the reference, and one
optax step through nnx equal to the functional step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxgrad.kan.layer import kan_linear
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init, kan_widths, trainable_mask
from jaxgrad.kan.nnx import KAN, KANGrid, KANLinear


def _split(params):
    return [{k: v for k, v in p.items() if k != "grid"} for p in params], [p["grid"] for p in params]


def _merge(trainable, grids):
    return [{**t, "grid": g} for t, g in zip(trainable, grids)]


# ---------------------------------------------------------------------------------------------------------------
# functional network
# ---------------------------------------------------------------------------------------------------------------
def test_kan_init_shapes_and_widths():
    params = kan_init(jax.random.key(0), [3, 7, 5, 2], grid_size=4, spline_order=2, bias=True)
    assert isinstance(params, list) and len(params) == 3
    assert kan_widths(params) == [3, 7, 5, 2]
    for p, (i, o) in zip(params, [(3, 7), (7, 5), (5, 2)]):
        assert p["base_weight"].shape == (o, i)
        assert p["spline_weight"].shape == (o, i, 4 + 2)
        assert p["grid"].shape == (i, 4 + 2 * 2 + 1)
        assert p["bias"].shape == (o,)
    assert trainable_mask(params)[1] == {"base_weight": True, "spline_weight": True, "spline_scaler": True,
                                         "grid": False, "bias": True}
    # deterministic, and different layers get different keys
    again = kan_init(jax.random.key(0), [3, 7, 5, 2], grid_size=4, spline_order=2, bias=True)
    jax.tree.map(np.testing.assert_array_equal, params, again)


@pytest.mark.parametrize("shape", [(3,), (10, 3), (2, 5, 3)])
def test_kan_apply_matches_reference(shape):
    params = kan_init(jax.random.key(1), [3, 6, 2], bias=True)
    x = jax.random.uniform(jax.random.key(2), shape, jnp.float32, -1.5, 1.5)
    y = jax.jit(kan_apply)(params, x)
    assert y.shape == shape[:-1] + (2,)
    np.testing.assert_allclose(y, jax.jit(kan_apply_reference)(params, x), rtol=1e-5, atol=1e-6)
    reference_backend = jax.jit(lambda p, x: kan_apply(p, x, backend="reference"))
    np.testing.assert_allclose(y, reference_backend(tuple(params), x), rtol=1e-5, atol=1e-6)


def test_network_errors_are_clear():
    params = kan_init(jax.random.key(3), [3, 4, 2])
    with pytest.raises(ValueError, match="layer 1 takes 5 inputs but layer 0 produces 4"):
        kan_apply([params[0], kan_init(jax.random.key(4), [5, 2])[0]], jnp.zeros((1, 3)))
    with pytest.raises(TypeError, match="non-empty list/tuple"):
        kan_apply([], jnp.zeros((1, 3)))
    with pytest.raises(TypeError, match="non-empty list/tuple"):
        kan_apply(params[0], jnp.zeros((1, 3)))
    with pytest.raises(ValueError, match=r"'x' must have shape \[\.\.\., 3\]"):
        kan_apply(params, jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match="widths"):
        kan_init(jax.random.key(0), [3])
    with pytest.raises(ValueError, match="widths"):
        kan_init(jax.random.key(0), [3, 0, 2])
    with pytest.raises(TypeError, match="widths"):
        kan_init(jax.random.key(0), [3, 2.5])
    with pytest.raises(TypeError, match=r"'widths' must be a list of layer widths \[in, h_1, \.\.\., out\], got int 4"):
        kan_init(jax.random.key(0), 4)
    with pytest.raises(TypeError, match="in_features"):
        kan_init(jax.random.key(0), [3, 2], in_features=3)
    with pytest.raises(ValueError, match="backend"):
        kan_apply(params, jnp.zeros((1, 3)), backend="cuda")


# ---------------------------------------------------------------------------------------------------------------
# training: custom VJP vs jax.grad(reference), float64, 100 Adam steps
# ---------------------------------------------------------------------------------------------------------------
def _train(apply, trainable, grids, x, y, steps=100, lr=2e-2):
    tx = optax.adam(lr)

    def loss(t):
        return jnp.mean((apply(_merge(t, grids), x) - y) ** 2)

    def step(carry, _):
        t, state = carry
        value, g = jax.value_and_grad(loss)(t)
        updates, state = tx.update(g, state, t)
        return (optax.apply_updates(t, updates), state), value

    @jax.jit
    def run(t):
        (t, _), losses = jax.lax.scan(step, (t, tx.init(t)), length=steps)
        return t, jnp.append(losses, loss(t))

    return run(trainable)


def test_training_loss_curves_match_and_converge():
    with jax.enable_x64(True):
        params = kan_init(jax.random.key(5), [2, 5, 1], dtype=jnp.float64, bias=True)
        trainable, grids = _split(params)
        x = jax.random.uniform(jax.random.key(6), (128, 2), jnp.float64, -1.0, 1.0)
        y = (jnp.sin(jnp.pi * x[:, 0]) + x[:, 1] ** 2)[:, None]
        t_vjp, losses_vjp = _train(kan_apply, trainable, grids, x, y)
        t_ref, losses_ref = _train(kan_apply_reference, trainable, grids, x, y)
    losses_vjp, losses_ref = np.asarray(losses_vjp), np.asarray(losses_ref)
    np.testing.assert_allclose(losses_vjp, losses_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(t_vjp), jax.tree.leaves(t_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    for losses in (losses_vjp, losses_ref):
        assert losses[-1] < losses[0] / 10, f"loss {losses[0]:.3g} -> {losses[-1]:.3g}: no 10x drop"


# ---------------------------------------------------------------------------------------------------------------
# flax.nnx wrappers
# ---------------------------------------------------------------------------------------------------------------
def test_nnx_kanlinear_is_the_functional_layer():
    layer = KANLinear(3, 4, rngs=nnx.Rngs(0), grid_size=6, spline_order=2, bias=True)
    params = layer.to_params()
    assert params["spline_weight"].shape == (4, 3, 8) and params["grid"].shape == (3, 11)
    x = jax.random.uniform(jax.random.key(7), (5, 3), jnp.float32, -1.2, 1.2)
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(layer, x), jax.jit(kan_linear)(params, x))
    assert isinstance(layer.grid, KANGrid) and not isinstance(layer.grid, nnx.Param)
    trained = nnx.state(layer, nnx.Param)
    assert "grid" not in trained and {"base_weight", "spline_weight", "spline_scaler", "bias"} <= set(trained)
    wrapped = KANLinear.from_params(params)
    jax.tree.map(np.testing.assert_array_equal, wrapped.to_params(), params)
    with pytest.raises(TypeError, match="rngs"):
        KANLinear(3, 4)
    with pytest.raises(ValueError, match="spline_order"):
        KANLinear(3, 4, rngs=nnx.Rngs(0), spline_order=7)
    with pytest.raises(ValueError, match="backend"):
        KANLinear(3, 4, rngs=nnx.Rngs(0), backend="tpu")


def test_nnx_optax_step_equals_functional_step():
    model = KAN([2, 4, 3], rngs=nnx.Rngs(1), bias=True, grid_size=4)
    params0 = model.to_params()
    x = jax.random.uniform(jax.random.key(8), (16, 2), jnp.float32, -1.0, 1.0)
    y = jnp.stack([jnp.sin(3 * x[:, 0]), x[:, 1] ** 2, x[:, 0] * x[:, 1]], axis=-1)
    tx = optax.adam(1e-2)

    # nnx
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    loss_nnx = nnx_step(model, optimizer)

    # functional
    trainable, grids = _split(params0)

    @jax.jit
    def functional_step(t):
        loss, g = jax.value_and_grad(lambda t: jnp.mean((kan_apply(_merge(t, grids), x) - y) ** 2))(t)
        updates, _ = tx.update(g, tx.init(t), t)
        return loss, optax.apply_updates(t, updates)

    loss_fn, trainable1 = functional_step(trainable)
    np.testing.assert_allclose(loss_nnx, loss_fn, rtol=1e-6)
    after = model.to_params()
    for got, want, grid in zip(after, trainable1, grids):
        np.testing.assert_array_equal(got["grid"], grid)  # the grid is not trained
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert not np.allclose(after[0]["base_weight"], params0[0]["base_weight"])  # the step did something


def test_nnx_kan_from_params_roundtrip():
    params = kan_init(jax.random.key(9), [3, 5, 2], bias=False)
    model = KAN.from_params(params)
    assert model.widths == [3, 5, 2]
    x = jax.random.uniform(jax.random.key(10), (4, 3), jnp.float32, -1.0, 1.0)
    call = nnx.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(call(model, x), jax.jit(kan_apply)(params, x))
    jax.tree.map(np.testing.assert_array_equal, model.to_params(), params)
    ref_model = KAN.from_params(params, backend="reference")
    np.testing.assert_allclose(call(ref_model, x), call(model, x), rtol=1e-6, atol=1e-6)
