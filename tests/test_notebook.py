"""notebooks/experiments.ipynb executes headless (smallest settings, embedded model)."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "experiments.ipynb"


@pytest.mark.slow
def test_notebook_runs(monkeypatch):
    monkeypatch.setenv("NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    outputs = "".join(
        o.get("text", "") + "".join(o.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    )
    assert "| `seed_stand` |" in outputs  # the benchmark table
    assert "[(1, " in outputs  # acceptance length against trajectories
