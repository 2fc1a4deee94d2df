"""Every notebook under notebooks/ runs top to bottom in a real Jupyter kernel (nbclient, the venv's ``python3``
kernel), and is stored without outputs (run results belong to whoever runs it, not to git).

The kernel inherits ``JAXGRAD_NOTEBOOK_SIZE=small``: the notebooks that read it (03, 04) run at CI size (about a
minute of CPU each); the others pick small sizes on a CPU by themselves. A notebook that ends with a
``SUMMARY {json}`` line has its numbers checked here as well (the notebooks assert them too; this names them in
the test report)."""

import json
import math
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# the two notebooks predate nbformat 4.5's cell ids; nbformat adds them in memory and warns
pytestmark = pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")

NOTEBOOK_DIR = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _summary(nb):
    """The JSON of the last ``SUMMARY {...}`` line the notebook printed, or None."""
    found = None
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                for line in out["text"].splitlines():
                    if line.startswith("SUMMARY "):
                        found = json.loads(line[len("SUMMARY "):])
    return found


def _check_kan(s):
    rmse = s["test_rmse"]
    assert s["grids"] == sorted(s["grids"]) and len(rmse) >= 3
    assert all(a > b for a, b in zip(rmse, rmse[1:])), f"test RMSE must fall with each refinement: {rmse}"
    assert rmse[-1] < 2e-3, rmse
    assert max(s["refine_change"]) < 0.2, f"refinement must keep the function: {s['refine_change']}"
    assert min(s["edge_r2"]) > 0.99, s["edge_r2"]
    assert s["pde_rel_l2"] < 0.1, f"Poisson solution vs exact: relative L2 {s['pde_rel_l2']}"
    assert s["laplacian_vjp_vs_reference"] < 1e-10
    assert s["check_vjp_passed"]


def _check_lora(s):
    p = s["perplexity"]
    assert all(math.isfinite(v) and 1 < v < 256 for v in p.values()), p
    assert p["lora"] < p["base"], f"LoRA must beat the base on the new text: {p}"
    assert p["qlora"] < p["base_nf4"] and p["qlora"] < p["base"], f"QLoRA must beat its NF4 base: {p}"
    assert s["adapter_reload_bit_identical"]
    assert s["block_check_vjp_passed"]


SUMMARY_CHECKS = {"03_kan_exploration.ipynb": _check_kan, "04_lora_finetune.ipynb": _check_lora}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("JAXGRAD_NOTEBOOK_SIZE", "small")  # the kernel is a child process: it inherits this
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=900, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except CellExecutionError as err:  # the cell's source and the kernel's traceback, in the test report
        pytest.fail(f"{path.name}: {err}", pytrace=False)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)  # every cell really ran
    summary = _summary(nb)
    if path.name in SUMMARY_CHECKS:
        assert summary is not None, f"{path.name} printed no SUMMARY line"
        assert summary["size"] == "small"
        print(f"{path.name}: {json.dumps(summary)}")
        SUMMARY_CHECKS[path.name](summary)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    raw = json.loads(path.read_text())
    for i, cell in enumerate(raw["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs: strip them before committing"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
        assert not set(cell.get("metadata", {})) & {"execution", "scrolled", "collapsed"}, \
            f"{path.name} cell {i} has run metadata {sorted(cell['metadata'])}"


def test_there_is_a_notebook():
    assert NOTEBOOKS


def test_the_kan_and_lora_notebooks_are_there():
    names = {p.name for p in NOTEBOOKS}
    assert set(SUMMARY_CHECKS) <= names, sorted(names)
