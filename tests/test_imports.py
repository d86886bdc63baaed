"""`import chunkvmap` needs only JAX; every public name is importable and documented."""

import ast
import functools
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import chunkvmap


FRAMEWORKS = ("flax", "equinox", "optax")

# One fresh interpreter for every import check (each costs an import of JAX): what
# `import chunkvmap` loads; the adapters' errors with their framework missing; and, as
# the meta check, that a framework once imported is seen.
PROBE = f"""
import sys

def loaded():
    print("loaded:", ",".join(m for m in {FRAMEWORKS!r} if m in sys.modules))

import chunkvmap
loaded()
for framework, modules in (
    ("flax", ("chunkvmap.linen", "chunkvmap.nnx")), ("equinox", ("chunkvmap.eqx",))
):
    sys.modules[framework] = None  # as if not installed
    for name in modules:
        try:
            __import__(name)
        except ImportError as e:
            print(name, "->", e)
del sys.modules["flax"], sys.modules["equinox"]
import optax
loaded()
"""


@functools.cache
def probe() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.splitlines()


def test_import_chunkvmap_loads_no_framework():
    assert probe()[0] == "loaded: "


def test_meta_the_check_can_fail():
    """The check does see a framework when one is imported."""
    assert probe()[-1] == "loaded: optax"


def test_adapters_without_their_framework_name_the_extra():
    lines = probe()[1:-1]
    assert len(lines) == 3, lines
    for name, extra, line in zip(
        ("chunkvmap.linen", "chunkvmap.nnx", "chunkvmap.eqx"),
        ("flax", "flax", "equinox"),
        lines,
    ):
        start = f"{name} -> {name} needs Flax" if extra == "flax" else f"{name} -> "
        assert line.startswith(start), line
        assert f"pip install chunkvmap[{extra}]" in line, line


@pytest.mark.parametrize("name", chunkvmap.__all__)
def test_public_names_importable_and_documented(name):
    obj = getattr(chunkvmap, name)
    doc = getattr(obj, "__doc__", None) or ""
    assert len(doc.strip()) > 20, f"chunkvmap.{name} has no docstring"


def test_version():
    assert isinstance(chunkvmap.__version__, str) and chunkvmap.__version__


# The layers of the package, lowest first: a module imports only modules of its own
# layer or below, so data flows one way (CONTRIBUTING.md, "Layout").
LAYERS = ["_core", "_transforms", "_quantities", "_adapters"]
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
    inside = "def f():\n    from .._quantities._ghost import plan\n"
    assert upward_imports(PACKAGE / "_transforms" / "_grads.py", inside) == [
        "chunkvmap._quantities._ghost",
        "chunkvmap._quantities._ghost.plan",  # a name or a module: both counted
    ]
    assert upward_imports(
        PACKAGE / "_quantities" / "ghost" / "_plan.py", "import chunkvmap.eqx"
    ) == ["chunkvmap.eqx"]


def _entry_points():
    import chunkvmap.eqx
    import chunkvmap.linen
    import chunkvmap.nnx

    found = {
        name: getattr(chunkvmap, name)
        for name in chunkvmap.__all__
        if inspect.isfunction(getattr(chunkvmap, name))
        and "batch_size" in inspect.signature(getattr(chunkvmap, name)).parameters
    }
    found["eqx.filter_batch_vmap"] = chunkvmap.eqx.filter_batch_vmap
    found["linen.batch_vmap"] = chunkvmap.linen.batch_vmap
    found["nnx.batch_vmap"] = chunkvmap.nnx.batch_vmap
    return found


def test_every_entry_point_takes_the_chunking_options_as_declared_once():
    """The chunking keywords are declared once (`_options`: each one's type in
    one TypedDict, its default in `DEFAULTS`); an entry point takes its set as
    `**options` and `takes` lists them in its signature: every one of its set, as
    a keyword with that default, documented, and no other chunking keyword."""
    from chunkvmap._core import _options

    assert set(_options.DEFAULTS) == set(_options.AllChunking.__annotations__)
    common = set(_options.Chunking.__annotations__) - {"batch_size"}
    entries = _entry_points()
    assert len(entries) >= 14, sorted(entries)
    for name, fn in entries.items():
        code = inspect.unwrap(fn).__code__
        assert code.co_flags & inspect.CO_VARKEYWORDS, name  # (**options)
        params = inspect.signature(fn).parameters
        declared = [a for a in _options.DEFAULTS if a in params]
        assert common <= set(declared), (name, common - set(declared))
        kinds = [_options.MapChunking] if name == "batch_map" else []
        kinds += [_options.Chunking, _options.VmapChunking, _options.ClipChunking]
        assert any(set(declared) == set(k.__annotations__) for k in kinds), name
        doc = inspect.getdoc(fn) or ""
        for arg in declared:
            p = params[arg]
            assert p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD), (name, arg)
            assert p.default is _options.DEFAULTS[arg], (name, arg, p.default)
            assert re.search(rf"^\s*{arg}:", doc, re.M), (name, arg, "not documented")


def test_every_entry_point_unwraps_to_its_own_code():
    """`takes` and `decorator_form` keep `__wrapped__` (as `functools.wraps`
    does): `inspect.getsource` of an entry point shows its own `def`, not the
    decorators' wrappers, and `inspect.unwrap` reaches the function defined."""
    for name, fn in _entry_points().items():
        inner = inspect.unwrap(fn)
        assert inner.__name__ == fn.__name__, name
        assert f"def {fn.__name__}(" in inspect.getsource(fn), name
        assert "__wrapped__" not in vars(inner), name


def test_an_entry_point_names_itself_for_a_keyword_it_does_not_take():
    """A misspelt or inapplicable keyword is a TypeError naming the function and
    the keyword (and the closest valid name), as Python's own would."""
    import jax.numpy as jnp

    import chunkvmap.eqx

    with pytest.raises(TypeError, match=r"batch_vmap\(\) .*'batch_sz'.*'batch_size'"):
        chunkvmap.batch_vmap(jnp.sin, batch_sz=2)
    with pytest.raises(TypeError, match=r"batch_jacfwd\(\) .*'reduction'"):
        chunkvmap.batch_jacfwd(jnp.sin, reduction=jnp.add)
    with pytest.raises(TypeError, match=r"filter_batch_vmap\(\) .*'in_axis'"):
        chunkvmap.eqx.filter_batch_vmap(in_axis=0)(jnp.sin)
    with pytest.raises(TypeError, match=r"clipped_grad\(\) .*'microbatch'"):
        chunkvmap.clipped_grad(jnp.sum, l2_clip_norm=1.0, microbatch=2)
    f = chunkvmap.batch_map(jnp.sin, jnp.ones(3), 2, progress=False)
    assert f.shape == (3,)


def test_entry_points_hide_their_wrappers_frames():
    """The frames of an entry point's wrappers (its keyword check, its decorator
    form) ask to be left out of a traceback (`__tracebackhide__`, as pytest and
    IPython read it)."""
    import traceback

    import jax.numpy as jnp

    with pytest.raises(ValueError, match="batch_size") as info:  # (built: a check)
        chunkvmap.batch_vmap(jnp.sin, batch_size=-1)
    frames = [f for f, _ in traceback.walk_tb(info.tb)]
    wrappers = [f for f in frames if f.f_code.co_name in ("checked", "accepting")]
    assert len(wrappers) == 2, [f.f_code.co_name for f in frames]
    assert all(f.f_locals.get("__tracebackhide__") is True for f in wrappers)
