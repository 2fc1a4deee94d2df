"""Every notebook under notebooks/ runs top to bottom in a real Jupyter kernel (nbclient, the venv's ``python3``
kernel), and is stored without outputs (run results belong to whoever runs it, not to git)."""

import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# the two notebooks predate nbformat 4.5's cell ids; nbformat adds them in memory and warns
pytestmark = pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")

NOTEBOOK_DIR = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=900, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except CellExecutionError as err:  # the cell's source and the kernel's traceback, in the test report
        pytest.fail(f"{path.name}: {err}", pytrace=False)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)  # every cell really ran


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
