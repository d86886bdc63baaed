"""The eager cache: compiled once per call structure, bounded, never keeping user
functions alive."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_map, batch_vmap
from chunkvmap._core import _cache

from .helpers import TraceCounter


def test_batch_map_compiles_once_and_converts_numpy_inputs():
    fun = TraceCounter(lambda c: jnp.sin(c) * 2)
    x = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    first = batch_map(fun, x, batch_size=4)
    traced = fun.count
    second = batch_map(fun, x + 1, batch_size=4)  # NumPy again: same program
    assert fun.count == traced
    np.testing.assert_allclose(first, np.sin(x) * 2, rtol=1e-6)
    np.testing.assert_allclose(second, np.sin(x + 1) * 2, rtol=1e-6)
    batch_map(fun, x[:5], batch_size=4)  # a new shape is a new program
    assert fun.count > traced


def test_batch_map_cache_does_not_keep_fun_alive():
    def fun(c):
        return c + 1

    ref = weakref.ref(fun)
    batch_map(fun, jnp.ones((5, 2)), batch_size=2)
    del fun
    gc.collect()
    assert ref() is None


def test_filter_batch_vmap_cache_does_not_keep_its_options_alive():
    eqx_adapter = pytest.importorskip("chunkvmap.eqx")

    def reduction(a, b):
        return a + b

    ref = weakref.ref(reduction)
    f = eqx_adapter.filter_batch_vmap(
        jnp.sin, batch_size=2, reduction=reduction, chunk_reduction=lambda y: y.sum(0)
    )
    np.testing.assert_allclose(f(jnp.ones(5)), 5 * np.sin(1.0), rtol=1e-6)
    del f, reduction
    gc.collect()
    assert ref() is None


def test_the_cache_is_bounded_and_forgets_the_least_recently_used():
    fun = TraceCounter(lambda x, k: x * k)
    f = batch_vmap(fun, in_axes=(0, None), batch_size=2)
    x = jnp.ones(3)
    for k in range(_cache.MAX_ENTRIES + 1):  # a static Python int: one entry each
        f(x, k)
    count = fun.count
    f(x, _cache.MAX_ENTRIES)  # the most recent: still cached
    f(x, 1)  # used least recently but one: still cached
    assert fun.count == count
    f(x, 0)  # the least recently used was evicted: traced again
    assert fun.count > count


def test_tracers_go_straight_through():
    fun = TraceCounter(jnp.cos)
    f = batch_vmap(fun, batch_size=2)
    g = jax.jit(f)
    np.testing.assert_allclose(g(jnp.ones(5)), np.cos(np.ones(5)), rtol=1e-6)
    np.testing.assert_allclose(f(jnp.ones(5)), np.cos(np.ones(5)), rtol=1e-6)
