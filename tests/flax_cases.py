"""What the linen and NNX adapter tests share: the inputs, the chunking grid's
binding, the summing reduction, and the threefry setting both references draw
with. Each test file keeps its own model and its framework's `vmap` as the
oracle."""

import functools as ft

import jax
import jax.numpy as jnp
import pytest


X = jnp.linspace(-1.0, 1.0, 30, dtype=jnp.float32).reshape(10, 3)
T = jnp.arange(10.0, dtype=jnp.float32)
# A reduction summing the per-example losses (the chunk's sum, then the chunks').
SUM = dict(reduction=jnp.add, chunk_reduction=lambda losses: losses.sum(0))


@pytest.fixture(autouse=True)
def classic_threefry():
    """JAX's default, partitionable threefry takes XLA several times longer to compile
    on CPU. The bits differ, but the chunked model and its reference draw the same.
    (Keys must be threefry: `rbg` keys draw differently under vmap depending on the
    batch around an example, under the framework's vmap and in chunks alike.)"""
    with jax.threefry_partitionable(False):
        yield


def chunked_by(batch_vmap):
    """`chunked(batch_size, **options)`: the adapter `batch_vmap` with the chunking
    options bound, a drop-in for the framework's `vmap`."""

    def chunked(batch_size, **options):
        return ft.partial(batch_vmap, batch_size=batch_size, **options)

    return chunked
