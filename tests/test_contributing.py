"""CONTRIBUTING.md fits one screen and stays true to the tree.

Its Layout list has one item per module of `chunkvmap/`, each starting with the
module's path in backticks. The rule: every `.py` file under `chunkvmap/` is a module,
except the `__init__.py` of a subpackage (`chunkvmap/__init__.py`, the public names,
is one); an item whose path ends in `/` stands for a whole package, every module under
it, whose files are then not listed themselves. Each module is covered by exactly one
item. Every script, module and make target its code blocks run exists.
"""

from __future__ import annotations

import glob
import importlib.util
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "CONTRIBUTING.md"
PACKAGE = "chunkvmap"
MAX_LINES = 80

ITEM = re.compile(r"^- `([^`]+)`")
PYTHON = re.compile(r"\bpython\S*\s+(?:-m\s+([\w.]+)|(\S+\.py)\b)")
PY_PATH = re.compile(r"[\w.*-]*/[\w./*-]*\.py\b")
MAKE = re.compile(r"\bmake\s+([\w-]+)")


def section(text: str, title: str) -> list[str]:
    """The lines of the `## title` section (up to the next `## ` heading)."""
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("## ")),
        len(lines),
    )
    return lines[start:end]


def layout_items(text: str) -> list[str]:
    """The backticked paths that start the Layout list's items. A list item of that
    section that does not start with a backticked path fails the test."""
    items = []
    for line in section(text, "Layout"):
        if line.startswith("- "):
            match = ITEM.match(line)
            assert match, f"a Layout item must start with a `path`: {line!r}"
            items.append(match.group(1))
    return items


def modules(root: pathlib.Path = ROOT) -> list[str]:
    """Every module of the package by the rule above, as a path from the root."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name == "__init__.py" and rel != f"{PACKAGE}/__init__.py":
            continue
        found.append(rel)
    return found


def covering(module: str, items: list[str]) -> list[str]:
    """The items that cover `module`: itself, or a package item above it."""
    return [
        item
        for item in items
        if item == module or (item.endswith("/") and module.startswith(item))
    ]


def coverage_errors(items: list[str], mods: list[str], root: pathlib.Path) -> list[str]:
    errors = []
    for item in items:
        if not item.startswith(f"{PACKAGE}/"):
            errors.append(f"{item}: not a path in {PACKAGE}/")
        elif item.endswith("/"):
            if not (root / item / "__init__.py").is_file():
                errors.append(f"{item}: no such package")
        elif not (root / item).is_file():
            errors.append(f"{item}: no such file")
        elif item not in mods:
            errors.append(f"{item}: not a module by the rule (a subpackage __init__)")
    for item in set(items):
        if items.count(item) > 1:
            errors.append(f"{item}: listed {items.count(item)} times")
    for module in mods:
        by = covering(module, items)
        if len(by) != 1:
            errors.append(f"{module}: covered by {len(by)} items {by}")
    return errors


def code_blocks(text: str) -> list[str]:
    """The lines inside fenced code blocks."""
    inside, lines = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def runnable(module: str) -> bool:
    """Whether `python -m module` finds it: a module of this repository (by its file,
    without importing it), or an installed top-level module (`pytest`)."""
    top = module.split(".")[0]
    if (ROOT / top).exists() or (ROOT / f"{top}.py").exists():
        base = ROOT / module.replace(".", "/")
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    return "." not in module and importlib.util.find_spec(module) is not None


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {
        name
        for m in re.finditer(r"^([\w.-][\w. -]*):(?!=)", makefile, re.M)
        for name in m.group(1).split()
    }


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def test_fits_one_screen(text):
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines, at most {MAX_LINES}"


def test_layout_lists_every_module_once(text):
    items = layout_items(text)
    assert coverage_errors(items, modules(), ROOT) == []


def test_scripts_and_targets_in_code_blocks_exist(text):
    lines = code_blocks(text)
    assert lines, "CONTRIBUTING.md shows its commands in a code block"
    missing = []
    targets = make_targets()
    for line in lines:
        for module, script in PYTHON.findall(line):
            if module and not runnable(module):
                missing.append(f"python -m {module}")
            elif script and not (ROOT / script).is_file():
                missing.append(script)
        for path in PY_PATH.findall(line):
            if not glob.glob(str(ROOT / path)):
                missing.append(path)
        for target in MAKE.findall(line):
            if target not in targets:
                missing.append(f"make {target}")
    assert missing == []


# The checks themselves: they must see what they are there to catch.


def test_meta_a_missing_or_doubled_module_is_seen(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub" / "inner").mkdir(parents=True)
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py",
                "sub/inner/__init__.py", "sub/inner/c.py"):  # fmt: skip
        (pkg / rel).write_text("")
    mods = modules(tmp_path)
    assert mods == [f"{PACKAGE}/__init__.py", f"{PACKAGE}/a.py",
                    f"{PACKAGE}/sub/b.py", f"{PACKAGE}/sub/inner/c.py"]  # fmt: skip
    good = [f"{PACKAGE}/__init__.py", f"{PACKAGE}/a.py", f"{PACKAGE}/sub/b.py",
            f"{PACKAGE}/sub/inner/"]  # fmt: skip
    assert coverage_errors(good, mods, tmp_path) == []
    assert coverage_errors(good[1:], mods, tmp_path)  # __init__.py missing
    assert coverage_errors(good + [f"{PACKAGE}/sub/inner/c.py"], mods, tmp_path)
    assert coverage_errors(good + [f"{PACKAGE}/gone.py"], mods, tmp_path)
    assert coverage_errors(good + [f"{PACKAGE}/sub/__init__.py"], mods, tmp_path)


def test_meta_the_parsers_read_the_document(text):
    doc = "## Layout\n\n- `x/a.py`: A.\n- `x/b/`: B.\n\n## Next\n\n- `x/c.py`: C.\n"
    assert layout_items(doc) == ["x/a.py", "x/b/"]
    with pytest.raises(AssertionError):
        layout_items("## Layout\n\n- no path here\n")
    assert len(layout_items(text)) >= 20
    assert PYTHON.findall(".venv/bin/python dev/x.py --all") == [("", "dev/x.py")]
    assert PYTHON.findall("python -m chunkvmap.demo") == [("chunkvmap.demo", "")]
    assert {"test", "demo", "bench", "docs"} <= make_targets()
    assert runnable("chunkvmap.demo") and runnable("pytest")
    assert not runnable("chunkvmap.gone") and not runnable("chunkvmap._core")


def test_every_mutant_edits_one_place_of_the_source():
    """`dev/mutants.py`'s edits still name the library's code: each mutant's string
    occurs exactly once in its file (a refactor that moves it must move the mutant)."""
    spec = importlib.util.spec_from_file_location(
        "mutants", ROOT / "dev" / "mutants.py"
    )
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    counts = {
        name: (ROOT / path).read_text().count(old)
        for name, ((path, old, _), _files) in mutants.MUTANTS.items()
    }
    assert {name: n for name, n in counts.items() if n != 1} == {}


def _dev(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_function_of_the_library_is_longer_than_sixty_lines_of_code():
    assert [
        (n, where) for n, where in _dev("function_lengths").lengths() if n > 60
    ] == []


def test_no_function_of_the_core_path_is_longer_than_forty_lines_of_code():
    """The core path (`_core`, and `batch_vmap`'s front end every entry point
    reuses) reads one room at a time."""
    core = ("chunkvmap/_core/", "chunkvmap/_transforms/_batch_vmap.py")
    long = [
        (n, where)
        for n, where in _dev("function_lengths").lengths()
        if n > 40 and where.startswith(core)
    ]
    assert long == []


def test_no_function_of_the_library_takes_more_than_six_positional_parameters():
    """Beyond six, parameters are keyword-only (or a value that holds them), so
    that a call site names what it passes."""
    rows = _dev("positional").positional()
    assert rows and [(n, where) for n, where in rows if n > 6] == []
