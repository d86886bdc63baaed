"""`import chunkvmap` needs only JAX; every public name is importable and documented."""

import ast
import pathlib
import subprocess
import sys

import pytest

import chunkvmap


FRAMEWORKS = ("flax", "equinox", "optax")

CHECK = """
import sys
import {module}
loaded = sorted(m for m in {frameworks!r} if m in sys.modules)
print(",".join(loaded))
"""


def loaded_frameworks(module: str) -> list[str]:
    code = CHECK.format(module=module, frameworks=FRAMEWORKS)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [m for m in out.stdout.strip().split(",") if m]


def test_import_chunkvmap_loads_no_framework():
    assert loaded_frameworks("chunkvmap") == []


def test_meta_the_check_can_fail():
    """The subprocess check does see a framework when one is imported."""
    assert loaded_frameworks("chunkvmap, optax") == ["optax"]


@pytest.mark.parametrize("name", chunkvmap.__all__)
def test_public_names_importable_and_documented(name):
    obj = getattr(chunkvmap, name)
    doc = getattr(obj, "__doc__", None) or ""
    assert len(doc.strip()) > 20, f"chunkvmap.{name} has no docstring"


def test_version():
    assert isinstance(chunkvmap.__version__, str) and chunkvmap.__version__


def test_flax_adapters_without_flax_name_the_extra():
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "for name in ('chunkvmap.linen', 'chunkvmap.nnx'):\n"
        "    try:\n        __import__(name)\n"
        "    except ImportError as e:\n        print(name, '->', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    for name, line in zip(("chunkvmap.linen", "chunkvmap.nnx"), lines):
        assert line.startswith(f"{name} -> {name} needs Flax"), line
        assert "pip install chunkvmap[flax]" in line, line


# The layers of the package, lowest first: a module imports only modules of its own
# layer or below, so data flows one way (CONTRIBUTING.md, "Layout").
LAYERS = ["_core", "_transforms", "_dp", "_adapters"]
PACKAGE = pathlib.Path(chunkvmap.__file__).parent


def layer(module: str) -> int:
    """The layer of `chunkvmap.<...>`: the subpackage's rank; the public modules
    (`chunkvmap`, `chunkvmap.eqx`, ...) sit on top."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if parts[1:] and parts[1] in LAYERS else len(LAYERS)


def upward_imports(path: pathlib.Path, source: str) -> list[str]:
    """The chunkvmap modules of a higher layer that `source`, the text of the module
    at `path`, imports (at its top or inside a function)."""
    here = ["chunkvmap", *path.relative_to(PACKAGE).with_suffix("").parts]
    package = here[:-1]
    if here[-1] == "__init__":
        here.pop()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("chunkvmap")}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            if module.startswith("chunkvmap"):
                # `from . import _axes` imports the module chunkvmap._core._axes
                found |= {module, *(f"{module}.{a.name}" for a in node.names)}
    name = ".".join(here)
    return sorted(m for m in found if layer(m) > layer(name))


def test_imports_go_down_the_layers_only():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20
    upward = {p.name: upward_imports(p, p.read_text()) for p in modules}
    assert {name: up for name, up in upward.items() if up} == {}


def test_meta_the_layer_check_sees_an_upward_import():
    loop = PACKAGE / "_core" / "_loop.py"
    assert upward_imports(loop, "from . import _axes") == []
    assert upward_imports(loop, "from .._transforms import _grads") == [
        "chunkvmap._transforms",
        "chunkvmap._transforms._grads",
    ]
    inside = "def f():\n    from .._dp._ghost import plan\n"
    assert upward_imports(PACKAGE / "_transforms" / "_grads.py", inside) == [
        "chunkvmap._dp._ghost",
        "chunkvmap._dp._ghost.plan",  # a name or a module: both counted
    ]
    assert upward_imports(PACKAGE / "_dp" / "_ghost.py", "import chunkvmap.eqx") == [
        "chunkvmap.eqx"
    ]
