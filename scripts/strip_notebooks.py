"""Removes the outputs and execution counts of notebooks (all of notebooks/ by default), so
git holds only their sources; tests/test_notebooks.py checks it.

    python scripts/strip_notebooks.py [notebook.ipynb ...]
"""

import sys
from pathlib import Path

import nbformat


def strip(path: Path) -> bool:
    notebook = nbformat.read(path, as_version=4)
    changed = False
    for cell in notebook.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
        if cell.metadata.pop("execution", None) is not None:
            changed = True
    if changed:
        nbformat.write(notebook, path)
    return changed


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        (Path(__file__).parents[1] / "notebooks").glob("*.ipynb")
    )
    for path in paths:
        print(f"{path}: {'stripped' if strip(path) else 'already clean'}")
