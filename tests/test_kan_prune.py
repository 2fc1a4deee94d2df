"""Pruning as pykan defines it: the attribution scores (checked against a transliteration of pykan's
``MultKAN.attribute``), node pruning that shrinks the params, edge pruning with masks, the function preserved to a
measured tolerance, and masks that stay pruned through optimiser steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrad.kan.grid import update_grids
from jaxgrad.kan.network import kan_apply_reference, kan_init, kan_widths, trainable_mask
from jaxgrad.kan.plot import edge_activations
from jaxgrad.kan.prune import (apply_edge_masks, attribution, freeze_edges, prune, prune_edges, prune_nodes)
from jaxgrad.kan.regularization import kan_regularization

apply_ref = jax.jit(kan_apply_reference)


@pytest.fixture(autouse=True)
def x64():
    jax.config.update("jax_enable_x64", True)  # restored by conftest's x64_as_it_was


def _net(widths=(2, 3, 2), seed=0):
    return kan_init(jax.random.key(seed), list(widths), grid_size=5, dtype=jnp.float64)


def _data(n=300, d=2, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(-1, 1, (n, d)))


def _pykan_attribute(params, x):
    """pykan's ``attribute()`` step by step in NumPy: a score matrix per queried output (``eye``), back-propagated
    through ``edge_actscale`` and ``subnode_actscale``, then the mean over the queried outputs."""
    acts, edge_std, node_std = [np.asarray(x)], [], []
    for p in params:
        phi = np.asarray(edge_activations(p, jnp.asarray(acts[-1]))[0])  # [n, out, in]
        edge_std.append(np.std(phi, axis=0, ddof=1))
        out = phi.sum(-1)
        node_std.append(np.std(out, axis=0, ddof=1))
        acts.append(out)
    n_out = params[-1]["base_weight"].shape[0]
    node_score = np.eye(n_out)  # [queried output k, node j]
    node_all, edge_all = [node_score], []
    for l in range(len(params) - 1, -1, -1):
        edge_score = np.einsum("ij,ki,i->kij", edge_std[l], node_score, 1 / (node_std[l] + 1e-4))
        node_score = edge_score.sum(axis=1)
        edge_all.append(edge_score)
        node_all.append(node_score)
    return [s.mean(0) for s in node_all[::-1]], [e.mean(0) for e in edge_all[::-1]]


def test_attribution_is_pykans():
    params, x = _net((2, 4, 3, 2)), _data()
    att = attribution(params, x)
    nodes, edges = _pykan_attribute(params, x)
    assert [s.shape for s in att.node_scores] == [(2,), (4,), (3,), (2,)]
    for got, want in zip(att.node_scores + att.edge_scores, nodes + edges):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-14)
    # the output nodes share the unit of attribution equally; each layer's node scores sum its edge scores
    np.testing.assert_allclose(np.asarray(att.node_scores[-1]), [0.5, 0.5])
    for l in range(3):
        np.testing.assert_allclose(np.asarray(att.edge_scores[l].sum(0)), np.asarray(att.node_scores[l]), rtol=1e-12)


def _kill_outgoing(params, layer, node, factor=0.0):
    """Scale node ``node``'s outgoing edges (column ``node`` of ``params[layer]``) by ``factor``."""
    params = [dict(p) for p in params]
    p = params[layer]
    p["base_weight"] = p["base_weight"].at[:, node].multiply(factor)
    p["spline_weight"] = p["spline_weight"].at[:, node].multiply(factor)
    return params


def test_a_dead_hidden_node_is_removed_and_the_function_kept_exactly():
    params, x = _net((2, 3, 1)), _data()
    dead = _kill_outgoing(params, 1, 1)
    att = attribution(dead, x)
    assert float(att.node_scores[1][1]) == 0.0 and float(att.node_scores[1].min(initial=1.0, where=np.arange(3) != 1)) > 1e-2
    small, kept = prune_nodes(dead, x)
    assert kan_widths(small) == [2, 2, 1]
    assert [k.tolist() for k in kept] == [[0, 1], [0, 2], [0]]
    # the remaining rows/columns are the original ones
    np.testing.assert_array_equal(np.asarray(small[0]["spline_weight"]), np.asarray(dead[0]["spline_weight"])[[0, 2]])
    np.testing.assert_array_equal(np.asarray(small[1]["grid"]), np.asarray(dead[1]["grid"])[[0, 2]])
    # a node with zero outgoing edges carried nothing: the output is unchanged to rounding (stated: 1e-12)
    x_test = _data(500, seed=1)
    assert float(jnp.max(jnp.abs(apply_ref(small, x_test) - apply_ref(dead, x_test)))) <= 1e-12


def test_a_nearly_dead_node_costs_exactly_its_centred_contribution():
    params, x = _net((2, 3, 1)), _data()
    weak = _kill_outgoing(params, 1, 1, factor=1e-3)
    assert 0 < float(attribution(weak, x).node_scores[1][1]) <= 1e-2
    h = apply_ref(weak[:1], x)
    phi = edge_activations(weak[1], h)[0][:, 0, 1]  # the removed node's only outgoing edge
    small, kept = prune_nodes(weak, x)
    assert kan_widths(small) == [2, 2, 1] and kept[1].tolist() == [0, 2]
    change = (apply_ref(small, x) - apply_ref(weak, x))[:, 0]
    # keep_mean: the edge's mean moved into the output bias, so the change is exactly -(phi - mean phi)
    np.testing.assert_allclose(np.asarray(change), -np.asarray(phi - phi.mean()), atol=1e-12)
    assert float(small[1]["bias"][0]) == pytest.approx(float(phi.mean()), rel=1e-12)
    # pykan drops the mean as well: the change is -phi
    small_pykan, _ = prune_nodes(weak, x, keep_mean=False)
    assert "bias" not in small_pykan[1]
    np.testing.assert_allclose(np.asarray((apply_ref(small_pykan, x) - apply_ref(weak, x))[:, 0]),
                               -np.asarray(phi), atol=1e-12)


def test_edges_at_or_below_the_threshold_are_masked_and_zeroed():
    params, x = _net((2, 3, 2)), _data()
    att = attribution(params, x)
    th = float(np.median(np.asarray(att.edge_scores[0])))  # prunes half of layer 0's edges
    new, masks = prune_edges(params, x, threshold=th)
    for l in range(2):
        np.testing.assert_array_equal(masks[l], np.asarray(att.edge_scores[l]) > th)
        off = ~masks[l]
        assert float(jnp.abs(new[l]["base_weight"][off]).max(initial=0)) == 0.0
        assert float(jnp.abs(new[l]["spline_weight"][off]).max(initial=0)) == 0.0
        assert float(jnp.abs(new[l]["spline_scaler"][off]).max(initial=0)) == 0.0
    assert (~masks[0]).sum() >= 3
    # a mask passed in stays applied (pykan multiplies the old mask)
    keep_all = [np.ones_like(m) for m in masks]
    keep_all[1][0, 0] = False
    _, masks2 = prune_edges(params, x, threshold=0.0, masks=keep_all)
    assert not masks2[1][0, 0] and masks2[0].all()


def test_pruned_edges_stay_pruned_through_training():
    params, x = _net((2, 3, 1)), _data(100)
    y = jnp.sin(x[:, :1]) * x[:, 1:]
    masks = [np.array([[True, False], [True, True], [False, True]]), np.array([[True, True, False]])]
    p = apply_edge_masks(params, masks)
    # AdamW with its decay kept off the knot grid (trainable_mask); freeze_edges last
    opt = optax.chain(optax.adamw(1e-2, weight_decay=1e-2, mask=trainable_mask(p)), freeze_edges(masks))
    state = opt.init(p)
    grads = jax.jit(jax.grad(lambda p: jnp.mean((kan_apply_reference(p, x) - y) ** 2)))
    assert float(jnp.abs(grads(p)[0]["base_weight"][0, 1])) > 0  # the gradient itself is not zero there
    for _ in range(5):
        upd, state = opt.update(grads(p), state, p)
        p = optax.apply_updates(p, upd)
    for l, m in enumerate(masks):
        for name in ("base_weight", "spline_weight", "spline_scaler"):
            assert float(jnp.abs(p[l][name][~m]).max()) == 0.0, (l, name)
        assert float(jnp.abs(p[l]["base_weight"][m] - params[l]["base_weight"][m]).min()) > 0  # the rest trained


def test_prune_reports_the_measured_change():
    params, x = _net((2, 3, 1)), _data()
    weak = _kill_outgoing(params, 1, 1, factor=1e-3)
    r = prune(weak, x)
    diff = apply_ref(r.params, x) - apply_ref(weak, x)
    assert r.max_abs_change == pytest.approx(float(jnp.max(jnp.abs(diff))), rel=1e-9)
    assert r.rms_change == pytest.approx(float(jnp.sqrt(jnp.mean(diff ** 2))), rel=1e-9)
    assert [m.shape for m in r.edge_masks] == [(2, 2), (1, 2)]


def test_pruning_a_sparsified_network_finds_the_211_structure():
    """pykan's hellokan: [2, 5, 1] on exp(sin(pi x) + y^2) with its L1 + entropy penalty (lamb 1e-3) prunes to
    [2, 1, 1]. Here: 1000 full-batch Adam steps (grid updates every 200) on 300 samples, seed 0."""
    x = _data(300)
    y = jnp.exp(jnp.sin(jnp.pi * x[:, :1]) + x[:, 1:] ** 2)
    params = _net((2, 5, 1))
    opt = optax.adam(1e-2)

    def loss(p):
        return jnp.mean((kan_apply_reference(p, x) - y) ** 2) + 1e-3 * kan_regularization(p, x)

    @jax.jit
    def phase(p):
        def step(carry, _):
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p), s, p)
            q = optax.apply_updates(p, u)
            return ([{**a, "grid": b["grid"]} for a, b in zip(q, p)], s), None

        return jax.lax.scan(step, (p, opt.init(p)), None, length=200)[0][0]

    for _ in range(5):
        params = phase(update_grids(params, x))
    rmse = float(jnp.sqrt(jnp.mean((apply_ref(params, x) - y) ** 2)))
    r = prune(params, x)
    assert kan_widths(r.params) == [2, 1, 1]
    assert all(m.all() for m in r.edge_masks)
    # the function is kept well within the fit's own error (measured: 1.4e-3 max, 3.5e-4 RMS; fit RMSE 6.5e-3)
    assert r.rms_change < 0.2 * rmse and r.max_abs_change < 5e-3


def test_bad_arguments_are_named():
    params, x = _net((2, 3, 1)), _data(20)
    with pytest.raises(TypeError, match="list of layer dicts"):
        prune(params[0], x)
    with pytest.raises(ValueError, match=r"'x' must be data of shape \[n, 2\]"):
        prune(params, x[:, :1])
    with pytest.raises(ValueError, match="at least 2 samples"):
        attribution(params, x[:1])
    with pytest.raises(ValueError, match="'threshold' must be a finite number >= 0"):
        prune_nodes(params, x, threshold=-1.0)
    with pytest.raises(ValueError, match="every node of hidden layer 1 scores <= threshold=100"):
        prune_nodes(params, x, threshold=100.0)
    with pytest.raises(ValueError, match=r"'masks'\[1\] must have shape \(1, 3\)"):
        apply_edge_masks(params, [np.ones((3, 2), bool), np.ones((3, 1), bool)])
