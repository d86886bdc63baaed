"""Shared by the notebook build scripts: cells in, executed notebook out."""

import pathlib

import nbformat
from nbclient import NotebookClient


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook of `("md" | "code", text)` cells."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for kind, text in cells:
        new = (
            nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        )
        nb.cells.append(new(text))
    return nb


def execute_and_write(cells: list[tuple[str, str]], path: pathlib.Path) -> None:
    """Run the notebook from the repository root and save it with its outputs."""
    notebook = build(cells)
    NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.parent)}},
    ).execute()
    nbformat.write(notebook, path)
    print("wrote", path)
