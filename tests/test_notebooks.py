"""The example notebooks run top to bottom (a small configuration)."""

import importlib.util
import os
import pathlib
import sys

import jax
import pytest


# (the notebooks extra; the accelerator's machine has no Jupyter kernel to run them)
nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra")
nbformat = pytest.importorskip("nbformat", reason="needs the notebooks extra")


# Everything the notebooks need is installed by `make test` (the notebooks extra); a
# missing package is a failure here, never a skip.
for module in ("equinox", "flax", "optax", "sklearn", "matplotlib", "ipykernel"):
    importlib.import_module(module)

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


def test_nnx_ensembles_notebook_runs(monkeypatch):
    monkeypatch.setenv("CHUNKVMAP_NOTEBOOK_FAST", "1")
    notebook = nbformat.read(EXAMPLES / "ensembles_nnx.ipynb", as_version=4)
    saved = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    # Saved with the outputs of a full run, for readers on GitHub.
    assert any("image/png" in o.get("data", {}) for o in saved)
    assert "STEPS = 30 if FAST else 300" in notebook.cells[1].source
    assert any("300 steps" in o.get("text", "") for o in saved)
    nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(EXAMPLES.parent)}},
    ).execute()  # raises CellExecutionError on any failing cell
    text = "".join(
        o.get("text", "")
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "30 steps" in text  # the fast configuration ran
    assert "chunked construction equals nnx.vmap: True" in text
    assert "ensemble accuracy" in text


def test_flax_linen_training_example_runs(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "flax_linen_training", EXAMPLES / "flax_linen_training.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # for its dataclasses
    spec.loader.exec_module(module)
    # optax's Adam relies on standard dtype promotion (the suite sets "strict").
    with jax.numpy_dtype_promotion("standard"):
        accuracy = module.main(epochs=3)
    out = capsys.readouterr().out
    assert "chunked loss and gradients equal nn.vmap's: True" in out
    losses = [
        float(line.split()[-1]) for line in out.splitlines() if "train loss" in line
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert accuracy > 0.5
