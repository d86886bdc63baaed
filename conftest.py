"""Root conftest: how the suite compiles, and names for the doctests in `chunkvmap/`.

The suite's programs are small, so compiling them costs far more than running them:
they are compiled without LLVM's optimisations (`jax_disable_most_optimizations`),
which takes about a third of the time. That changes float rounding in the last bits
only, never the HLO: results to tolerance, compiled memory figures and errors are those
users get. The doctests, and the tests marked `optimized` (a bitwise claim such as the
same random initialisation as a reference, or printed output compared with the docs),
compile as users do.
"""

import os


# Set before JAX reads it; subprocesses started by tests (examples, hosts) inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import chunkvmap  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "optimized: compile with XLA's default optimisations, as users do"
    )


@pytest.fixture(autouse=True)
def _compile_as_marked(request):
    # The caches are cleared on both sides: a program compiled one way is never
    # reused by a test that asked for the other.
    doctest = type(request.node).__name__ == "DoctestItem"
    if not (doctest or request.node.get_closest_marker("optimized")):
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["jax"] = jax
    doctest_namespace["jnp"] = jnp
    doctest_namespace["chunkvmap"] = chunkvmap


# The adapters import their framework at module top; skip their doctests without it.
collect_ignore = []
try:
    import equinox  # noqa: F401
except ImportError:
    collect_ignore.append("chunkvmap/eqx.py")
try:
    import flax  # noqa: F401
except ImportError:
    collect_ignore += ["chunkvmap/linen.py", "chunkvmap/nnx.py"]
