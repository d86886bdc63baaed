"""Root conftest: names available to the doctests in `chunkvmap/`."""

import jax
import jax.numpy as jnp
import pytest

import chunkvmap


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
