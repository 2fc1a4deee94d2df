"""jaxgrad.cnn.precision: rounding vs layout bugs in the denoiser's gradients, at tiny sizes on the CPU.

Also executes notebooks/02_cnn_precision.ipynb the way tests/test_notebooks.py does (code cells in order, one
namespace) and checks what it computed. Budget: the whole file < 60 s on 2 CPU cores.
"""

import json
import math
import pathlib

import jax
import pytest

from jaxgrad.cnn import precision as cp

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "02_cnn_precision.ipynb"
SIZES = (8, 16)


@pytest.fixture(scope="module")
def rows():
    return cp.precision_study(SIZES, seed=0)


def _kind(rows, kind):
    return [r for r in rows if r["kind"] == kind]


def test_rows_cover_sizes_precisions_layers(rows):
    rnd = _kind(rows, "rounding")
    assert {(r["size"], r["precision"], r["layer_index"]) for r in rnd} == {
        (s, p, li) for s in SIZES for p in ("highest", "default") for li in range(3)}
    assert all(r["n_terms"] == 2 * r["size"] ** 2 and r["batch"] == 2 for r in rnd)
    assert all(r["platform"] == jax.default_backend() and r["device"] for r in rows)
    assert {r["effective_precision"] for r in rnd if r["precision"] == "highest"} == {"f32"}
    json.dumps(rows, allow_nan=False)  # plain, finite, JSON-ready


def test_exact_f32_errors_are_tiny(rows):
    for r in _kind(rows, "rounding"):
        if r["effective_precision"] != "f32":
            continue
        for field in ("loss_rel_err", "w_rel_err", "b_rel_err", "w_max_abs_ratio"):
            assert r[field] < 1e-5, (r["size"], r["layer"], field, r[field])
        # per entry, rounding stays under the verifier's bound (and is a few u_f32 at most)
        assert r["w_normalized_err"] <= r["w_bound"] and r["b_normalized_err"] <= r["b_bound"]
        assert r["w_normalized_units"] < 100


def test_bug_rows_are_orders_of_magnitude_above_rounding(rows):
    bugs = _kind(rows, "bug")
    assert {r["bug"] for r in bugs} == set(cp.BUGS)
    assert {r["layer_index"] for r in bugs if r["bug"] == "swap-io"} == {1}  # only 16->16 has Cin == Cout
    rnd = _kind(rows, "rounding")
    worst_f32 = max(max(r["w_rel_err"], r["b_rel_err"]) for r in rnd if r["effective_precision"] == "f32")
    worst_any = max(max(r["w_rel_err"], r["b_rel_err"]) for r in rnd)  # TF32 rows included on a GPU
    for r in bugs:
        assert r["w_rel_err"] >= 1e-2 and r["w_max_abs_ratio"] >= 1e-2, (r["bug"], r["layer"], r["w_rel_err"])
        assert r["w_rel_err"] >= 1e3 * worst_f32  # exact f32 rounding: >= 3 orders of magnitude below any bug
        # TF32 rounding (GPU) is ~1e-2 at these sizes (H100: 6.2e-3 at 8^2/16^2, 1.1e-2 at 64^2): >= 30x below
        assert r["w_rel_err"] >= 30 * worst_any
        assert r["w_rel_over_highest"] >= 1e3


def test_planted_bugs_match_their_transforms():
    import numpy as np

    g = np.arange(3 * 3 * 16 * 16, dtype=float).reshape(3, 3, 16, 16)
    assert np.array_equal(cp._plant("flip", g), g[::-1, ::-1])
    assert np.array_equal(cp._plant("transpose", g), g.transpose(1, 0, 2, 3))
    assert np.array_equal(cp._plant("swap-io", g), g.transpose(0, 1, 3, 2))
    assert cp._plant("swap-io", g[:, :, :1]) is None
    assert np.array_equal(cp._plant("shift", g)[1:], g[:-1])


def test_report_and_verdict_are_computed_from_the_rows(rows):
    table = cp.format_table(rows)
    assert "conv2 (16->16)" in table and "swap-io" in table
    slopes = cp.growth_exponents(rows)
    assert len(slopes) == 6 and all(math.isfinite(v) for v in slopes.values())
    text = cp.verdict(rows)
    assert "Verdict:" in text and "not float32 accumulation error" in text
    assert f"{max(r['w_rel_err'] for r in _kind(rows, 'bug')):.2f}" in text


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision must be one of"):
        cp.precision_study([8], precisions=("tf16",))
    with pytest.raises(ValueError, match="sizes"):
        cp.precision_study([])
    with pytest.raises(ValueError, match="oracle"):
        cp.precision_study([8], oracle="numpy")


def test_notebook_executes_and_verifier_names_the_flip(capsys):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)  # noqa: S102
    correct, flipped = namespace["demo"]
    assert correct["passed"] and correct["w_diagnosis"] is None
    assert not flipped["passed"] and flipped["w_diagnosis"] == "flip"
    # Far outside the bound: > 1e3x at exact f32 (CPU); 75x at the looser TF32 bound (H100), whose ReLU kink term
    # (pre-activations within TF32 rounding of zero) widens the bound of the entries they feed
    assert flipped["w_normalized_err"] > 30 * flipped["w_bound"]
    assert "Verdict:" in capsys.readouterr().out
