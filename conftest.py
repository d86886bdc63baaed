"""Root conftest: how the suite compiles, and names for the doctests in `chunkvmap/`.

The suite's programs are small, so compiling them costs far more than running them.
They are compiled with XLA CPU's older fusion emitters (`xla_cpu_use_fusion_emitters`,
where this XLA has the flag) and without LLVM's optimisations
(`jax_disable_most_optimizations`): a fifth of the compile time. That changes how
fused loops are emitted and float rounding in the last bits, never the HLO: results
(to tolerance), compiled memory figures and errors are those users get. The
tests marked `optimized` and the doctests in `BITWISE_DOCTESTS` (a bitwise claim such
as the same random initialisation as a reference) compile with LLVM's optimisations;
XLA reads its flags once per process, so they keep the older emitters.

Compiled programs are kept between runs in JAX's persistent compilation cache, in
the virtual environment that runs the suite (`.venv/jax-cache/` for `make test`;
`.jax-cache/` at the root outside a venv, ignored by git), emptied at the start of
a run once past 1 GiB (delete it to start cold; a run that sets
`JAX_COMPILATION_CACHE_DIR` chooses its own): a second run of an unchanged test
loads its programs instead of compiling them. JAX keys each entry by the program's
HLO, the compile options and the versions of JAX and XLA, so a changed program is
compiled afresh. JAX times a program loaded from the cache as a compilation, so
`tests.helpers.CompileCounter` counts it as one.
"""

import os
import subprocess
import sys


# Starts XLA's CPU client, which parses XLA_FLAGS (and aborts on a flag it does not
# know): through jaxlib alone where it has `make_cpu_client` (a tenth of a second), else
# through JAX.
_PROBE = """
try:
    from jaxlib.xla_client import make_cpu_client
except ImportError:
    import jax
    jax.devices("cpu")
else:
    make_cpu_client()
"""


def _fast_compiles() -> None:
    # Set in the environment before JAX reads it, so that the test workers and the
    # processes tests start (examples, hosts) inherit it; checked once, by the first
    # process, as XLA aborts on a flag it does not know.
    if os.environ.get("CHUNKVMAP_TESTS_COMPILE"):
        return
    os.environ["CHUNKVMAP_TESTS_COMPILE"] = "set"
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false"
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, "XLA_FLAGS": flags.strip()},
        capture_output=True,
        timeout=300,
    )
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = flags.strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        cache = _cache_dir()
        _bound(cache, 2**30)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _cache_dir() -> str:
    # In the virtual environment that runs the suite (`make test`'s `.venv`: a warm
    # venv holds the programs of its last run), else at the root.
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return os.path.join(sys.prefix, "jax-cache")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax-cache")


def _bound(cache: str, limit: int) -> None:
    # JAX's own bound (`jax_compilation_cache_max_size`) scans the whole cache at
    # every write; the suite empties it once, at the start of a run, when it has
    # grown past `limit` bytes (each change of a program adds entries).
    if not os.path.isdir(cache):
        return
    entries = list(os.scandir(cache))
    if sum(e.stat().st_size for e in entries if e.is_file()) > limit:
        for e in entries:
            if e.is_file():
                os.remove(e.path)


_fast_compiles()

import importlib.util  # noqa: E402

import pytest  # noqa: E402


# JAX and the package are imported by the fixtures, in the processes that run tests:
# the xdist controller, which only hands out files, starts sooner without them.


# The slowest test files, slowest first (about 60 s down to 8 s each on a 2-core
# CPU): run first, so that neither of `make test`'s workers (`--dist loadfile
# --no-loadscope-reorder`: whole files, in this order) is left with a long file
# while the other has finished. Only the order matters; the others follow.
SLOWEST = [
    f"tests/test_{name}.py"
    for name in (
        "statistics curvature padding conv wherever closures projections benchmarks "
        "sharding notebooks clipping ghost demo conformance grads doc_snippets eqx "
        "hostile linen ghost_models nnx vectorize bench_clipping cache compose "
        "layouts ghost_rules multihost auto loop"
    ).split()
]


def pytest_collection_modifyitems(items):
    rank = {path: k for k, path in enumerate(SLOWEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "optimized: compile with LLVM's optimisations, as users do"
    )


# Doctests whose claim is bitwise against another program (marks cannot reach them).
BITWISE_DOCTESTS = {"chunkvmap.linen.batch_vmap"}


@pytest.fixture(autouse=True)
def _compile_as_marked(request):
    doctest = type(request.node).__name__ == "DoctestItem"
    bitwise = doctest and request.node.name in BITWISE_DOCTESTS
    if not (bitwise or request.node.get_closest_marker("optimized")):
        yield
        return
    from tests.helpers import compiled_as_users

    with compiled_as_users():
        yield


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    import jax
    import jax.numpy as jnp

    import chunkvmap

    doctest_namespace["jax"] = jax
    doctest_namespace["jnp"] = jnp
    doctest_namespace["chunkvmap"] = chunkvmap


# The adapters import their framework at module top; skip their doctests without it.
collect_ignore = []
if importlib.util.find_spec("equinox") is None:
    collect_ignore.append("chunkvmap/eqx.py")
if importlib.util.find_spec("flax") is None:
    collect_ignore += ["chunkvmap/linen.py", "chunkvmap/nnx.py"]
