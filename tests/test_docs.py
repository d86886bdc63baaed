"""The documentation: every public name documented, and the site builds strictly."""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import chunkvmap


ROOT = pathlib.Path(__file__).parents[1]
ADAPTERS = {
    "chunkvmap.eqx": ["filter_batch_vmap"],
    "chunkvmap.linen": ["batch_vmap"],
    "chunkvmap.nnx": ["batch_vmap"],
}


def public_names() -> list[str]:
    names = [f"chunkvmap.{n}" for n in chunkvmap.__all__]
    for module, members in ADAPTERS.items():
        names += [f"{module}.{m}" for m in members]
    return names


def documented() -> set[str]:
    found = set()
    for page in (ROOT / "docs").rglob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M))
    return found


def resolve(name: str):
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", public_names())
def test_every_public_name_has_an_api_entry_and_a_full_docstring(name):
    assert name in documented(), f"{name} has no `::: {name}` entry under docs/"
    doc = inspect.getdoc(resolve(name)) or ""
    assert len(doc.splitlines()) > 1, f"{name} has no docstring"
    obj = resolve(name)
    if isinstance(obj, type):  # a class: its attributes (the API renders them)
        sections = ("Attributes:", "Examples:")
    else:
        sections = ("Args:", "Returns:", "Examples:") if callable(obj) else ()
    for section in sections:
        assert section in doc, f"{name}'s docstring has no {section} section"


def test_adapter_modules_export_what_is_documented():
    for module, members in ADAPTERS.items():
        mod = importlib.import_module(module)
        public = [n for n in getattr(mod, "__all__", members)]
        assert sorted(public) == sorted(members), (module, public)


def test_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    assert mkdocs, "mkdocs is installed by `make test` (the docs extra)"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "core" / "index.html").read_text()
    assert "batch_size" in api and "chunk_reduction" in api  # rendered docstrings


def test_no_make_target_installs_system_packages(tmp_path, monkeypatch, capsys):
    """`make docs` installs nothing: without Chromium or Chrome, the browser check
    of docs/check_site.py is skipped with a message saying how to get one (the
    strict build still runs first); run on its own, the check fails."""
    recipes = [
        line
        for line in (ROOT / "Makefile").read_text().splitlines()
        if line.startswith("\t")
    ]
    installing = re.compile(
        r"\b(apt-get|apt|dnf|yum|brew|snap)\b.*\binstall\b|\bsudo\b"
    )
    assert not [line for line in recipes if installing.search(line)]
    docs = re.search(r"^docs:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert "mkdocs build --strict" in docs.group(1)
    assert "check_site.py --skip-without-browser site" in docs.group(1)

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import check_site
    finally:
        sys.path.remove(str(ROOT / "docs"))
    monkeypatch.delenv("CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no browser on it
    site = tmp_path / "site"
    site.mkdir()
    assert check_site.main(["check_site.py", "--skip-without-browser", str(site)]) == 0
    assert check_site.main(["check_site.py", str(site)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("skipped: No Chromium or Chrome found")
    assert "sudo apt-get install chromium" in out and "CHROMIUM=" in out
    browser = tmp_path / "google-chrome"
    browser.write_text("#!/bin/sh\n")
    browser.chmod(0o755)
    assert check_site.find_browser() == str(browser)
    monkeypatch.setenv("CHROMIUM", "/opt/chrome/chrome")
    assert check_site.find_browser() == "/opt/chrome/chrome"
