"""Every notebook under notebooks/ runs top to bottom in a real Jupyter kernel (nbclient, the venv's ``python3``
kernel), and is committed *with* the outputs of such a run at its small size, so that a reader sees its tables and
plots on GitHub without running it.

The kernel inherits ``JAXGRAD_NOTEBOOK_SIZE=small``: the notebooks that read it (03, 04) run at CI size (about a
minute of CPU each); the others pick small sizes on a CPU by themselves. A notebook that ends with a
``SUMMARY {json}`` line has its numbers checked here as well (the notebooks assert them too; this names them in
the test report).

The committed outputs are refreshed by running this file as a script on a CPU::

    JAX_PLATFORMS=cpu python tests/test_notebooks.py                # every notebook
    JAX_PLATFORMS=cpu python tests/test_notebooks.py 03_kan_exploration.ipynb

which executes each notebook at its small size and writes it back without run-time metadata (no execution
timestamps) and without this machine's paths; ``test_the_committed_outputs_*`` check that what is committed is
such a run."""

import json
import math
import os
import pathlib
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# notebooks written before nbformat 4.5 have no cell ids; nbformat adds them in memory and warns
pytestmark = pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")

NOTEBOOK_DIR = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: An output mentioning one of these is specific to the machine that ran it (a home, a checkout, a temp folder).
MACHINE_PATH = re.compile(r"(/work/|/root/|/home/|/tmp/|/Users/|/private/var/)")
#: The most a committed notebook may weigh, and the most one HTML output may: plots at small sizes, tables as text.
MAX_NOTEBOOK_BYTES = 600_000
MAX_HTML_CHARS = 20_000
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def execute(nb, timeout=900):
    """Run ``nb`` in place in a fresh ``python3`` kernel whose working directory is notebooks/; a failing cell
    raises :class:`CellExecutionError`. No per-cell timing is recorded."""
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, allow_errors=False, record_timing=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
    return nb


def strip_machine(nb):
    """Drop what is specific to the run rather than the notebook: per-cell run metadata (timestamps, scroll state)
    and this checkout's absolute path inside text outputs (written as a path relative to notebooks/)."""
    root = str(NOTEBOOK_DIR.parent.resolve())
    for cell in nb.cells:
        for key in ("execution", "scrolled", "collapsed"):
            cell.metadata.pop(key, None)
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if "text" in out:
                out["text"] = out["text"].replace(root + "/notebooks/", "").replace(root + "/", "../")
    return nb


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


def _images(cell):
    return [out for out in cell.get("outputs", []) if set(out.get("data", {})) & set(IMAGE_TYPES)]


def _plots(cell):
    """Whether a code cell draws: a matplotlib figure or an IPython image display."""
    return bool(re.search(r"\bplt\.|\bdisplay\(\s*Image\(", cell.source))


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
    held = s["heldout_loss"]
    for mode in ("lora", "qlora"):
        v = held[mode]
        assert all(math.isfinite(x) and 0 < x < 10 for x in v.values()), (mode, v)
        assert v["after"] < v["before"] - 0.05, f"{mode} must lower the held-out loss of its base: {v}"
        assert abs(v["merged"] - v["after"]) < 1e-4, f"the merged {mode} folder must be the fine-tuned model: {v}"
    assert s["qlora_merged_onto_dense_logit_change"] > 1e-2, \
        f"the QLoRA adapter merged onto the dense weights must be another model: {s}"
    assert s["adapter_reload_bit_identical"]
    assert s["generations"] >= 1


SUMMARY_CHECKS = {"03_kan_exploration.ipynb": _check_kan, "04_lora_finetune.ipynb": _check_lora}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("JAXGRAD_NOTEBOOK_SIZE", "small")  # the kernel is a child process: it inherits this
    committed = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run from a clean slate: what the run prints, not what was committed
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    try:
        execute(nb)
    except CellExecutionError as err:  # the cell's source and the kernel's traceback, in the test report
        pytest.fail(f"{path.name}: {err}", pytrace=False)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)  # every cell really ran
    # what this run shows, the committed notebook shows: a cell that prints or draws has committed outputs,
    # and a cell that draws has a committed image
    for i, (ran, kept) in enumerate(zip(nb.cells, committed.cells)):
        if ran.cell_type != "code":
            continue
        assert not ran.outputs or kept.outputs, \
            f"{path.name} cell {i} prints when run but is committed without outputs (python tests/test_notebooks.py)"
        assert not _images(ran) or _images(kept), f"{path.name} cell {i} draws but its committed outputs have no image"
    summary = _summary(nb)
    if path.name in SUMMARY_CHECKS:
        assert summary is not None, f"{path.name} printed no SUMMARY line"
        assert summary["size"] == "small"
        print(f"{path.name}: {json.dumps(summary)}")
        SUMMARY_CHECKS[path.name](summary)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_committed_outputs_are_a_whole_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), \
        f"{path.name}: execution counts {counts}: commit one top-to-bottom run (python tests/test_notebooks.py)"
    assert any(c.outputs for c in code), f"{path.name} is committed without outputs"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        assert not errors, f"{path.name} cell {i} is committed with an error: {errors[0].get('ename')}"
        if _plots(cell):
            assert _images(cell), f"{path.name} cell {i} draws a plot but has no image output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_committed_outputs_are_small_and_portable(path):
    assert path.stat().st_size <= MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    raw = json.loads(path.read_text())
    for i, cell in enumerate(raw["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert not set(cell.get("metadata", {})) & {"execution", "scrolled", "collapsed"}, \
            f"{path.name} cell {i} has run metadata {sorted(cell['metadata'])}"
        for out in cell.get("outputs", []):
            html = "".join(out.get("data", {}).get("text/html", ""))
            assert len(html) <= MAX_HTML_CHARS, f"{path.name} cell {i}: {len(html)} characters of HTML"
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            found = MACHINE_PATH.search(text)
            assert not found, f"{path.name} cell {i} shows a path of the machine that ran it: {found.group(0)!r}"


def test_there_is_a_notebook():
    assert NOTEBOOKS


def test_the_kan_and_lora_notebooks_are_there():
    names = {p.name for p in NOTEBOOKS}
    assert set(SUMMARY_CHECKS) <= names, sorted(names)


def test_a_notebook_without_outputs_or_with_a_stray_path_fails_the_checks(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1])")])
    bare = tmp_path / "bare.ipynb"
    nbformat.write(nb, bare)
    with pytest.raises(AssertionError, match="execution counts"):
        test_the_committed_outputs_are_a_whole_run(bare)
    nb.cells[0].execution_count = 1
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="saved to /tmp/x/plot.png\n")]
    nbformat.write(nb, bare)
    with pytest.raises(AssertionError, match="no image output"):
        test_the_committed_outputs_are_a_whole_run(bare)
    with pytest.raises(AssertionError, match="path of the machine"):
        test_the_committed_outputs_are_small_and_portable(bare)


def main(names):
    """Execute the named notebooks (all when none) at their small size on this machine and write them back."""
    os.environ["JAXGRAD_NOTEBOOK_SIZE"] = "small"
    for path in [NOTEBOOK_DIR / n for n in names] or NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        execute(nb)
        nbformat.write(strip_machine(nb), path)
        print(f"wrote {path.name} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
