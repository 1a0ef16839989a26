"""The notebooks run top to bottom in a fresh kernel, and are committed without outputs."""

import os

import pytest
from conftest import REPO

nbformat = pytest.importorskip("nbformat")  # installed by the test extra; a GPU image may lack it

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_and_they_are_stripped():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "gpt2_long_context"}
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, (
                    f"{path.name} holds outputs: python scripts/strip_notebooks.py"
                )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    # The notebooks make their working folders with tempfile: under the test's own folder
    # they go when pytest cleans up, not into the machine's /tmp run after run.
    client.execute(env=dict(os.environ, TMPDIR=str(tmp_path)))  # raises CellExecutionError on a failing cell
    assert any(tmp_path.glob("bpt-*")), "the notebook's working folder was not made under TMPDIR"
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
