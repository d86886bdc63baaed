"""Property test: batch_vmap equals jax.vmap for random shapes, axes and chunk sizes."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings, strategies as st

from chunkvmap import batch_vmap

from .helpers import tree_allclose


settings.register_profile(
    "chunkvmap", derandomize=True, deadline=None, database=None, max_examples=15
)
settings.load_profile("chunkvmap")


@st.composite
def cases(draw):
    n = draw(st.integers(0, 23))
    rank = draw(st.integers(1, 3))
    in_axis = draw(st.integers(-rank, rank - 1))
    other = draw(st.lists(st.integers(1, 3), min_size=rank - 1, max_size=rank - 1))
    shape = list(other)
    shape.insert(in_axis % rank, n)
    out_axis = draw(st.integers(-rank, rank - 1))
    batch = draw(st.one_of(st.none(), st.integers(1, 30)))
    reduce = draw(st.booleans()) and n > 0
    return tuple(shape), in_axis, out_axis, batch, reduce


@given(cases())
# A remainder (3 does not divide 7), stacked along a non-leading axis and folded: the
# draws above need not include one.
@example(case=((2, 7), 1, 1, 3, False))
@example(case=((7, 2), 0, 0, 3, True))
def test_batch_vmap_equals_vmap(case):
    shape, in_axis, out_axis, batch, reduce = case
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    c = jnp.float32(0.5)

    def f(v, s):
        return jnp.sin(v) * s + v.sum()

    expected = jax.jit(jax.vmap(f, (in_axis, None), out_axis))(x, c)
    if reduce:
        axis = out_axis % expected.ndim
        actual = batch_vmap(
            f,
            (in_axis, None),
            out_axis,
            batch_size=batch,
            reduction=jnp.add,
            chunk_reduction=lambda y: y.sum(axis),
        )(x, c)
        tree_allclose(actual, expected.sum(axis), rtol=1e-4, atol=1e-4)
    else:
        actual = batch_vmap(f, (in_axis, None), out_axis, batch_size=batch)(x, c)
        tree_allclose(actual, expected)
