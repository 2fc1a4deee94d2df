"""scripts/kan_fit.py --quick runs end to end (refine + grid updates + Adam + L-BFGS), writes its JSON, and
plot_activations writes a PNG."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxgrad.kan.layer import KANConfig, init

ROOT = pathlib.Path(__file__).resolve().parents[1]
# pykan's reported RMSE series for this task (docs Example_1_function_fitting), as committed with the full run
PYKAN_SERIES = ROOT / "benchmarks/results/kan-fit-cpu-f64-20261122-025328.json"
# The --quick run may be this many times pykan's RMSE at G=3 (the coarsest G of pykan's series; pykan reports no
# G=5, and a finer grid fully trained only does better). Why 25: the quick run trains 200 samples for 50 Adam steps
# plus 20 L-BFGS iterations per G, where pykan (and our full run, which is within 1.4x of pykan at every G) trains
# 1000 samples for 4000 L-BFGS iterations per G; with seed 1 it measured 19.5x / 19.3x (train / test) at G=3 and
# 5.1x / 7.6x at G=5 (float64 on CPU, deterministic; the same to 3 digits without the XLA flag below), so 25 leaves
# 1.3x headroom. It fails a constant predictor (test RMSE 1.39 = 91x), the best linear fit (0.99 = 65x) and the poor
# fit that the quick run reaches with seeds 2 and 3 (0.76-0.79 = 50-52x).
QUICK_VS_PYKAN_FACTOR = 25


def _have_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_kan_fit_quick_runs(tmp_path):
    plot = _have_matplotlib()
    env = dict(os.environ)
    # the quick run is dominated by XLA compile time; the unoptimised CPU backend compiles ~1.5x faster
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(ROOT / "scripts/kan_fit.py"), "--quick", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd + ([] if plot else ["--no-plot"]), capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (js,) = tmp_path.glob("kan-fit-quick-cpu-f64-*.json")
    res = json.loads(js.read_text())
    assert [r["G"] for r in res["results"]] == [3, 5]
    pykan = {r["G"]: r for r in json.loads(PYKAN_SERIES.read_text())["results"]}[3]
    for r in res["results"]:
        assert 0 < r["train_rmse"] < QUICK_VS_PYKAN_FACTOR * pykan["pykan_train_rmse"], r
        assert 0 < r["test_rmse"] < QUICK_VS_PYKAN_FACTOR * pykan["pykan_test_rmse"], r
    assert res["results"][1]["test_rmse"] < res["results"][0]["test_rmse"]  # refining to G=5 helps
    if plot:  # without matplotlib the script ran with --no-plot
        png = js.with_suffix(".png")
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_activations_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxgrad.kan.plot import edge_activations, plot_activations

    ka, kb = jax.random.split(jax.random.key(0))
    init_jit = jax.jit(init, static_argnums=1)  # eager init compiles op by op
    net = [init_jit(ka, KANConfig(2, 3, grid_size=4)), init_jit(kb, KANConfig(3, 1, grid_size=4))]
    path = plot_activations(net, tmp_path / "act.png", num=50)
    assert pathlib.Path(path).read_bytes()[:4] == b"\x89PNG"
    plot_activations(net[0], tmp_path / "one.png", x_range=(-2, 2), num=20)
    assert (tmp_path / "one.png").stat().st_size > 1000
    x = jnp.linspace(-1, 1, 7)[:, None].repeat(2, 1)
    phi, spline = jax.jit(edge_activations)(net[0], x)
    assert phi.shape == spline.shape == (7, 3, 2)
    # summing the edges over inputs gives the layer output
    from jaxgrad.kan.layer import kan_linear_reference

    assert jnp.allclose(phi.sum(-1), jax.jit(kan_linear_reference)(net[0], x), atol=1e-5)
