"""The network diagram (pykan's ``plot``): one panel per drawn edge with that edge's activation, opacity
tanh(beta * edge score), pruned edges absent, symbolic edges in red with their function's name."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.network import kan_init
from jaxgrad.kan.prune import apply_edge_masks, attribution
from jaxgrad.kan.symbolic import SymbolicEdges, fix_symbolic

pytest.importorskip("matplotlib")
from jaxgrad.kan.plot import network_figure, plot_network  # noqa: E402


@pytest.fixture(scope="module")
def net_and_data():
    params = kan_init(jax.random.key(0), [2, 3, 1], grid_size=5)
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (200, 2)), jnp.float32)
    return params, x


def _panels(fig):
    return {ax.edge: ax for ax in fig.axes[1:]}


def test_every_edge_gets_a_panel_with_its_activation_and_score_opacity(net_and_data):
    params, x = net_and_data
    fig = network_figure(params, x, beta=3.0, num=40)
    panels = _panels(fig)
    assert sorted(panels) == sorted([(0, o, i) for o in range(3) for i in range(2)] + [(1, 0, i) for i in range(3)])
    att = attribution(params, x)
    for (l, o, i), ax in panels.items():
        (line,) = ax.lines
        assert line.get_alpha() == pytest.approx(float(np.tanh(3.0 * att.edge_scores[l][o, i])), rel=1e-5)
        u, v = line.get_data()
        assert len(u) == 40
    # the panel of edge (0, o, i) spans input i's range on the data
    u, _ = panels[(0, 2, 1)].lines[0].get_data()
    assert u[0] == pytest.approx(float(x[:, 1].min()), abs=1e-6) and u[-1] == pytest.approx(float(x[:, 1].max()),
                                                                                            abs=1e-6)


def test_pruned_edges_are_not_drawn(net_and_data):
    params, x = net_and_data
    masks = [np.array([[True, True], [False, True], [True, False]]), np.array([[True, True, True]])]
    fig = network_figure(apply_edge_masks(params, masks), x)
    assert (0, 1, 0) not in _panels(fig) and (0, 2, 1) not in _panels(fig)
    assert len(_panels(fig)) == 7


def test_symbolic_edges_are_red_and_named(net_and_data, tmp_path):
    params, x = net_and_data
    new, sym = fix_symbolic(params, None, (1, 0, 2), "sin")
    sym = SymbolicEdges(sym.edges, jnp.asarray([[2.0, 0.0, 0.5, 0.1]], jnp.float32))
    fig = network_figure(new, x, symbolic=sym, in_vars=["x", "y"], out_vars=["f"], title="t")
    ax = _panels(fig)[(1, 0, 2)]
    assert ax.get_title() == "sin"
    assert ax.lines[0].get_color() == "tab:red"
    u, v = ax.lines[0].get_data()
    np.testing.assert_allclose(v, 0.5 * np.sin(2.0 * u) + 0.1, atol=1e-5)  # the numerical part is zero
    path = plot_network(new, x, tmp_path / "net.png", symbolic=sym)
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_named(net_and_data):
    params, x = net_and_data
    with pytest.raises(ValueError, match="'beta' must be a number > 0"):
        network_figure(params, x, beta=0)
    with pytest.raises(ValueError, match="'in_vars' must name 2 variables"):
        network_figure(params, x, in_vars=["x"])
