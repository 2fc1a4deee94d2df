"""efficient-kan state_dict conversion (jaxgrad.kan.convert) and forward parity with efficient-kan's formula.

The parity fixture (tests/fixtures/efficient_kan_fixture.npz) was not produced by efficient-kan: it comes from a
transliteration of efficient-kan's forward inside this repo (tests/fixtures/make_efficient_kan_fixture.py, NumPy). These
tests check our forward against that transliteration, not against efficient-kan's own code.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.convert import from_efficient_kan, to_efficient_kan
from jaxgrad.kan.layer import kan_linear_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/efficient_kan_fixture.npz"
_fwd = jax.jit(kan_linear_reference)


def _synthetic_layer(rng, fin, fout, G=5, k=3):
    h = 2.0 / G
    grid = np.broadcast_to(np.arange(-k, G + k + 1) * h - 1.0, (fin, G + 2 * k + 1)).astype(np.float32)
    return {
        "base_weight": rng.standard_normal((fout, fin)).astype(np.float32),
        "spline_weight": rng.standard_normal((fout, fin, G + k)).astype(np.float32),
        "spline_scaler": rng.standard_normal((fout, fin)).astype(np.float32),
        "grid": np.ascontiguousarray(grid),
    }


def test_single_layer_round_trip():
    rng = np.random.default_rng(0)
    sd = _synthetic_layer(rng, 3, 4)
    p = from_efficient_kan(sd)
    assert isinstance(p, dict) and set(p) == set(sd)
    for n, v in sd.items():
        assert p[n].shape == v.shape and p[n].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p[n]), v)
    back = to_efficient_kan(p)
    assert set(back) == set(sd)
    for n, v in sd.items():
        assert isinstance(back[n], np.ndarray)
        np.testing.assert_array_equal(back[n], v)


def test_network_round_trip_with_outer_prefix_and_any_key_order():
    rng = np.random.default_rng(1)
    layers = [_synthetic_layer(rng, 3, 4), _synthetic_layer(rng, 4, 2, G=7)]
    sd = {f"layers.{i}.{n}": v for i, layer in enumerate(layers) for n, v in layer.items()}
    keys = list(sd)[::-1]
    params = from_efficient_kan({f"model.{key}": sd[key] for key in keys})
    assert isinstance(params, list) and len(params) == 2
    assert params[1]["spline_weight"].shape == (2, 4, 10)
    back = to_efficient_kan(params)
    assert set(back) == set(sd)
    for key, v in sd.items():
        np.testing.assert_array_equal(back[key], v)


def test_missing_scaler_means_ones_and_dtype_cast():
    rng = np.random.default_rng(2)
    sd = _synthetic_layer(rng, 2, 3)
    del sd["spline_scaler"]  # enable_standalone_scale_spline=False
    p = from_efficient_kan(sd, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(p["spline_scaler"]), np.ones((3, 2), np.float32))


def test_duck_typed_tensors_are_detached():
    class FakeTensor:  # what a torch.Tensor looks like to the converter
        def __init__(self, a):
            self.a = a
            self.calls = []

        def detach(self):
            self.calls.append("detach")
            return self

        def cpu(self):
            self.calls.append("cpu")
            return self

        def __array__(self, dtype=None, copy=None):
            return self.a if dtype is None else self.a.astype(dtype)

    rng = np.random.default_rng(3)
    sd = {n: FakeTensor(v) for n, v in _synthetic_layer(rng, 2, 2).items()}
    p = from_efficient_kan(sd)
    np.testing.assert_array_equal(np.asarray(p["base_weight"]), sd["base_weight"].a)
    assert sd["grid"].calls == ["detach", "cpu"]


def test_conversion_errors():
    rng = np.random.default_rng(4)
    layer = _synthetic_layer(rng, 3, 4)
    with pytest.raises(KeyError, match="unexpected key"):
        from_efficient_kan({**{f"layers.0.{n}": v for n, v in layer.items()}, "layers.0.foo": layer["grid"]})
    with pytest.raises(KeyError, match="lacks"):
        from_efficient_kan({f"layers.0.{n}": v for n, v in layer.items() if n != "grid"})
    with pytest.raises(ValueError, match="spline_weight"):
        from_efficient_kan({**layer, "spline_weight": layer["spline_weight"][:, :2]})
    with pytest.raises(KeyError, match="indices"):
        from_efficient_kan({f"layers.1.{n}": v for n, v in layer.items()})
    other = _synthetic_layer(rng, 5, 2)
    with pytest.raises(ValueError, match="in_features"):
        from_efficient_kan({**{f"layers.0.{n}": v for n, v in layer.items()},
                            **{f"layers.1.{n}": v for n, v in other.items()}})
    p = from_efficient_kan(layer)
    assert "bias" not in to_efficient_kan({**p, "bias": jnp.zeros(4)})
    with pytest.raises(ValueError, match="bias"):
        to_efficient_kan({**p, "bias": jnp.ones(4)})


def _load_fixture():
    data = np.load(FIXTURE)
    sd = {key[3:]: data[key] for key in data.files if key.startswith("sd/")}
    return sd, data["x"], data["y"]


def test_fixture_parity_float64():
    """Our forward on converted weights == this repo's NumPy transliteration of efficient-kan's forward
    (tests/fixtures/make_efficient_kan_fixture.py; not efficient-kan itself) on a [3, 4, 2] net with non-uniform grids and
    non-unit scalers."""
    with jax.enable_x64(True):
        sd, x, y = _load_fixture()
        params = from_efficient_kan(sd)
        assert [p["base_weight"].shape for p in params] == [(4, 3), (2, 4)]
        assert params[0]["grid"].dtype == jnp.float64
        h = jnp.asarray(x)
        for p in params:
            h = _fwd(p, h)
        np.testing.assert_allclose(np.asarray(h), y, rtol=0, atol=1e-6)
        assert float(np.max(np.abs(np.asarray(h) - y))) < 1e-12  # in fact agrees to rounding
        # and the weights convert back bit for bit
        back = to_efficient_kan(params)
        for key, v in sd.items():
            np.testing.assert_array_equal(back[key], v)


def test_fixture_generator_is_reproducible(tmp_path):
    spec = importlib.util.spec_from_file_location("make_fixture", ROOT / "tests/fixtures/make_efficient_kan_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "fx.npz"
    mod.main(["--out", str(out)])
    a, b = np.load(out), np.load(FIXTURE)
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        # Same values up to the summation order of NumPy's float64 BLAS, which may change with threading and load
        # (seen once: 1 ulp in one of 128 entries under pytest-xdist); a wrong fixture differs by far more.
        if np.issubdtype(b[key].dtype, np.floating):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-13, atol=1e-15)
        else:
            np.testing.assert_array_equal(a[key], b[key])


def test_torch_efficient_kan_formula_matches_fixture():
    """With torch installed: the transliteration's torch version (efficient-kan's b_splines + F.linear, as written in
    tests/fixtures/make_efficient_kan_fixture.py; not efficient-kan's package) reproduces the committed outputs."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("make_fixture", ROOT / "tests/fixtures/make_efficient_kan_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sd, x, y = _load_fixture()
    np.testing.assert_allclose(mod.forward_torch(sd, x), y, rtol=0, atol=1e-12)
