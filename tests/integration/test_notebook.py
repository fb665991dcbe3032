"""examples/train_notebook.ipynb runs top to bottom in a fresh kernel and trains.

The kernel is a process of its own that starts (and stops) its own local Ray; this test uses
no Ray of the test session's.
"""

from __future__ import annotations

import os
import re

import pytest

from tests_paths import REPO_ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = os.path.join(REPO_ROOT, "examples", "train_notebook.ipynb")
_LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", re.M)


def _stream_text(nb: object) -> str:
    """Everything the notebook's code cells printed to stdout, in order."""
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"  # type: ignore[attr-defined]
                   for out in cell.get("outputs", []) if out.get("output_type") == "stream"
                   and out.get("name") == "stdout")


def test_the_committed_notebook_has_no_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_the_notebook_trains_and_the_loss_falls() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Run in examples/ as Jupyter would; a cell that raises fails the test with its traceback.
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    text = _stream_text(nb)
    steps = [(int(s), float(loss)) for s, loss in _LOSS.findall(text)]
    assert [s for s, _ in steps] == list(range(1, 31)), text
    first, last = steps[0][1], steps[-1][1]
    assert last < first - 0.5, f"loss {first} -> {last}"
    assert text.count("validation loss") == 3, text  # the held-out windows, every 10 steps
    assert "Model-state memory per actor" in text
