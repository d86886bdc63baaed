"""Reductions: chunk results are folded in order, without an identity element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_map, batch_vmap

from .helpers import TraceCounter, jaxpr_eqns, tree_allclose


def f(x):
    return jnp.sin(x) + 1.5


REDUCTIONS = {
    "sum": (jnp.add, lambda y: y.sum(0)),
    "max": (jnp.maximum, lambda y: y.max(0)),
    "min": (jnp.minimum, lambda y: y.min(0)),
    "prod": (jnp.multiply, lambda y: y.prod(0)),
    "logsumexp": (jnp.logaddexp, lambda y: jax.nn.logsumexp(y, axis=0)),
}


# Every size with every chunk size (divisors, non-divisors, larger than N, None), each
# pair with one reduction, shifted from size to size (a Latin square: each reduction
# meets every size and three different chunk sizes).
REDUCTION_GRID = [
    (sorted(REDUCTIONS)[(i + j) % len(REDUCTIONS)], n, b)
    for i, n in enumerate((1, 7, 12))
    for j, b in enumerate((1, 3, 4, 20, None))
]


@pytest.mark.parametrize("name, n, b", REDUCTION_GRID)
def test_reductions_match_reducing_the_vmap_output(name, n, b):
    reduction, chunk_reduction = REDUCTIONS[name]
    x = jnp.linspace(-2.0, 2.0, n * 3, dtype=jnp.float32).reshape(n, 3)
    expected = chunk_reduction(jax.vmap(f)(x))
    actual = batch_vmap(
        f, batch_size=b, reduction=reduction, chunk_reduction=chunk_reduction
    )(x)
    tree_allclose(actual, expected, rtol=1e-5)


@pytest.mark.parametrize("n", [5, 8, 9])
@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_non_commutative_reduction_keeps_order(n, b):
    """Matrix products are associative, not commutative: the fold must keep order."""
    angles = jnp.linspace(0.1, 1.3, n, dtype=jnp.float32)

    def rotation_and_shear(t):
        return jnp.array([[jnp.cos(t), -jnp.sin(t) + t], [jnp.sin(t), jnp.cos(t)]])

    mats = jax.vmap(rotation_and_shear)(angles)

    def chain(ms):
        out = ms[0]
        for m in ms[1:]:
            out = out @ m
        return out

    def chunk_product(ms):  # ms: (chunk, 2, 2)
        return jax.lax.associative_scan(jnp.matmul, ms)[-1]

    actual = batch_vmap(
        rotation_and_shear,
        batch_size=b,
        reduction=jnp.matmul,
        chunk_reduction=chunk_product,
    )(angles)
    tree_allclose(actual, chain(list(mats)), rtol=1e-4, atol=1e-5)


def test_pytree_outputs_reduce_leaf_by_leaf():
    x = jnp.arange(14.0, dtype=jnp.float32).reshape(7, 2)

    def g(v):
        return {"s": v.sum(), "v": v * 2.0, "count": jnp.ones((), jnp.int32)}

    expected = jax.tree.map(lambda y: y.sum(0), jax.vmap(g)(x))
    actual = batch_vmap(
        g,
        batch_size=3,
        reduction=jnp.add,
        chunk_reduction=lambda y: jax.tree.map(lambda a: a.sum(0), y),
    )(x)
    tree_allclose(actual, expected)
    assert actual["count"].dtype == jnp.int32 and int(actual["count"]) == 7


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.complex64])
def test_reduction_keeps_dtype(dtype):
    x = (jnp.arange(11 * 2) % 4).reshape(11, 2).astype(dtype)
    expected = jax.vmap(lambda v: v * v)(x).sum(0)
    actual = batch_vmap(
        lambda v: v * v,
        batch_size=4,
        reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0),
    )(x)
    tree_allclose(actual, expected)
    assert actual.dtype == dtype


def test_reduction_with_out_axes_sees_chunks_in_the_requested_layout():
    x = jnp.arange(24.0, dtype=jnp.float32).reshape(6, 4)
    actual = batch_vmap(
        lambda v: v * 2.0,
        out_axes=1,
        batch_size=4,
        reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(1),
    )(x)
    tree_allclose(actual, (x * 2.0).sum(0))


def test_identity_chunk_reduction_with_reduction_is_an_error():
    x = jnp.ones((7, 2), jnp.float32)
    with pytest.raises(ValueError, match="chunk_reduction is the identity"):
        batch_vmap(f, batch_size=3, reduction=jnp.add)(x)
    # Same behaviour when the remainder has one example (where broadcasting would
    # otherwise silently succeed) and when nothing is chunked.
    with pytest.raises(ValueError, match="still has the mapped axis"):
        batch_vmap(f, batch_size=3, reduction=jnp.add)(jnp.ones((4, 2), jnp.float32))
    with pytest.raises(ValueError, match="still has the mapped axis"):
        batch_vmap(f, reduction=jnp.add)(x)


def test_chunk_reduction_that_keeps_the_mapped_axis_is_an_error():
    x = jnp.ones((8, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"for a chunk of 4 examples.*float32\[4\]"):
        batch_vmap(
            f, batch_size=4, reduction=jnp.add, chunk_reduction=lambda y: y.sum(1)
        )(x)


def test_reduction_that_changes_the_summary_is_an_error():
    x = jnp.ones((8, 3), jnp.float32)
    with pytest.raises(ValueError, match="reduction must combine two chunk summaries"):
        batch_vmap(
            f,
            batch_size=4,
            reduction=lambda a, b: jnp.stack([a, b]),
            chunk_reduction=lambda y: y.sum(0),
        )(x)


def test_reduction_over_zero_examples_is_an_error():
    x = jnp.ones((0, 3), jnp.float32)
    kwargs = dict(reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))
    with pytest.raises(ValueError, match="cannot reduce over zero examples"):
        batch_vmap(f, batch_size=2, **kwargs)(x)
    with pytest.raises(ValueError, match="cannot reduce over zero examples"):
        batch_map(lambda c: c, x, 2, **kwargs)


@pytest.mark.parametrize("b", [1, 3, 5, None])
def test_batch_map_reductions(b):
    x = jnp.linspace(-1.0, 1.0, 22, dtype=jnp.float32).reshape(11, 2)
    actual = batch_map(
        lambda c: jnp.exp(c),
        x,
        b,
        reduction=jnp.maximum,
        chunk_reduction=lambda y: y.max(0),
    )
    tree_allclose(actual, jnp.exp(x).max(0))


@pytest.mark.parametrize("n", [1000, 1003])  # without and with a remainder
def test_reduction_is_traced_once_and_nothing_of_size_n_is_stacked(n):
    """f is traced once and appears once in the program (at any depth: scan body,
    remat, cond, jit); no equation anywhere produces an (N, ...) array."""
    x = np.ones((n, 3), np.float32)
    counted = TraceCounter(f)
    fn = batch_vmap(
        counted, batch_size=10, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)
    )
    jaxpr = jax.make_jaxpr(fn)(x)
    assert counted.count == 1
    eqns = jaxpr_eqns(jaxpr)
    assert sum(e.primitive.name == "sin" for e in eqns) == 1  # f's one sin
    shapes = {tuple(v.aval.shape) for e in eqns for v in e.outvars}
    assert (10, 3) in shapes, shapes  # the walk reached the chunk inside the loop
    assert not any(n in s for s in shapes), shapes
    # The walk does see a second copy: lax.map traces f for its remainder too.
    if n % 10:
        mapped = jax.make_jaxpr(lambda x: jax.lax.map(f, x, batch_size=10))(x)
        assert sum(e.primitive.name == "sin" for e in jaxpr_eqns(mapped)) == 2
    # Traced once under jit and under grad too (remat recomputes, not retraces).
    counted = TraceCounter(f)
    fn = batch_vmap(
        counted, batch_size=10, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)
    )
    jax.make_jaxpr(jax.jit(jax.grad(lambda x: fn(x).sum())))(x)
    assert counted.count == 1


def test_reduction_with_non_array_arguments():
    x = jnp.arange(10.0, dtype=jnp.float32)

    def g(v, label, scale):
        assert label == "tag"
        return v * scale

    actual = batch_vmap(
        g,
        (0, None, None),
        batch_size=3,
        reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0),
    )(x, "tag", 2.0)
    tree_allclose(actual, (x * 2.0).sum())


def test_moments_never_read_an_example_that_does_not_count():
    """The moments of a chunk whose uncounted examples hold NaN (a padded buffer's
    padding, where nothing stands in for it) are those of the counted examples:
    the shift is the first counted example, never the first row."""
    from chunkvmap._core import _accumulators

    g = jnp.asarray([[jnp.nan, jnp.nan], [1.0, 2.0], [3.0, 5.0], [jnp.nan, 0.0]])
    real = jnp.asarray([False, True, True, False])
    shift, mean, m2 = _accumulators.moments(g, 0, real)
    tree_allclose(shift + mean, jnp.asarray([2.0, 3.5]))
    tree_allclose(m2, jnp.asarray([2.0, 4.5]))
