"""batch_map: an already-vectorised function over chunks of the leading axis."""

import jax
import jax.numpy as jnp
import pytest

from chunkvmap import batch_map

from .helpers import TraceCounter, tree_allclose


def vec(tree):
    x, y = tree["x"], tree["y"]
    return {"sum": x.sum(axis=1) + y, "x2": x * 2.0}


@pytest.mark.parametrize("n", [1, 7, 12, 40])
@pytest.mark.parametrize("b", [1, 3, 4, 50, None])
def test_matches_unchunked_call(n, b, rng):
    xs = {
        "x": jnp.asarray(rng.normal(size=(n, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n,)), jnp.float32),
    }
    tree_allclose(batch_map(vec, xs, b), vec(xs))


@pytest.mark.parametrize("n", [1, 5])
def test_strip_dim0_hands_single_examples(n, rng):
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    shapes = []

    def per_example(v):
        shapes.append(v.shape)
        return jnp.outer(v, v)

    out = batch_map(per_example, x, 1, strip_dim0=True)
    tree_allclose(out, jax.vmap(per_example)(x))
    assert all(s == (3,) for s in shapes)


def test_strip_dim0_with_zero_examples():
    x = jnp.zeros((0, 3), jnp.float32)
    out = batch_map(lambda v: (v.sum(), v), x, 1, strip_dim0=True)
    assert out[0].shape == (0,) and out[1].shape == (0, 3)


def test_zero_examples():
    x = jnp.zeros((0, 3), jnp.float32)
    out = batch_map(lambda c: c * 2.0, x, 4)
    assert out.shape == (0, 3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.bool_, jnp.complex64])
def test_dtypes(dtype):
    x = (jnp.arange(9 * 2) % 3).reshape(9, 2).astype(dtype)
    out = batch_map(lambda c: c[:, ::-1], x, 4)
    tree_allclose(out, x[:, ::-1])
    assert out.dtype == dtype


def test_traced_once_even_with_a_remainder(rng):
    x = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)
    counted = TraceCounter(lambda c: c * 2.0)
    tree_allclose(batch_map(counted, x, 4), x * 2.0)  # 10 = 2 x 4 + 2
    assert counted.count == 1
    counted.count = 0
    batch_map(counted, x, 5, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))
    assert counted.count == 1


def test_strip_dim0_zero_examples_applies_chunk_reduction():
    out = batch_map(
        lambda e: e.sum(),
        jnp.zeros((0, 3)),
        1,
        strip_dim0=True,
        chunk_reduction=lambda y: y.shape,
    )
    assert out == (0,)


def test_functions_that_compare_equal_are_not_confused():
    """Two callables that compare equal (and hash alike) but compute different
    things (a frozen dataclass whose weights are left out of `==`) each run
    themselves: `batch_map`'s caches know a function by its identity (it once
    returned `a(xs)` for `batch_map(b, xs)`)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Scaled:
        name: str
        w: jax.Array = dataclasses.field(compare=False)

        def __call__(self, x):
            return x * self.w

    a, b = Scaled("m", jnp.float32(1.0)), Scaled("m", jnp.float32(1.3))
    assert a == b and hash(a) == hash(b)
    xs = jnp.arange(6.0).reshape(3, 2)
    tree_allclose(batch_map(a, xs, 2), a(xs))
    tree_allclose(batch_map(b, xs, 2), b(xs))
    tree_allclose(batch_map(a, xs, 2), a(xs))
