"""`import chunkvmap` needs only JAX; every public name is importable and documented."""

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
