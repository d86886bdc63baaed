"""The example notebooks run top to bottom (a small configuration)."""

import os
import pathlib

import pytest


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
for module in ("equinox", "optax", "sklearn", "matplotlib", "ipykernel"):
    pytest.importorskip(module)

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["ensembles_equinox.ipynb"])
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("CHUNKVMAP_NOTEBOOK_FAST", "1")
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    # The committed copy is saved with its outputs, for readers on GitHub.
    assert any(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    ), f"{name} is not saved with its plot"
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(EXAMPLES.parent)}},
    )
    client.execute()  # raises CellExecutionError on any failing cell
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "ensemble accuracy" in text
    assert "chunked construction equals eqx.filter_vmap: True" in text
    assert os.environ["CHUNKVMAP_NOTEBOOK_FAST"] == "1"
