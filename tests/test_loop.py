"""The kernel's own contract (`_loop`): accumulators that fold summaries and stack
per-example rows, leaf by leaf, over every chunk plan, under `jit` and `grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap._core import _loop

from .helpers import temp_bytes, tree_allclose


def _body(example, x, accumulator, remat=True):
    """The `_loop.Body` of `jax.vmap(example)` over the leading axis of `x`."""
    one = jax.eval_shape(example, jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    flat, tree = jax.tree.flatten(one)

    def chunk_fn(leaves, length):
        return jax.tree.leaves(jax.vmap(example)(leaves[0]))

    signature = _loop.Signature(tree, flat, [0] * len(flat))
    return _loop.Body("f", chunk_fn, [0], signature, accumulator, remat=remat)


def _run(body, x, batch):
    return body.finish(body.run([x], _loop.make_plan(x.shape[0], batch)))


def _example(x):
    """Per example: a value to sum, a matrix to multiply in order, and rows."""
    c, s = jnp.cos(x[0]), jnp.sin(x[0])
    rotation = jnp.array([[c, -s], [s, c]]) * (1.0 + x[1])
    return {"sum": x**2, "prod": rotation, "rows": (x * 3.0, x.sum())}


def _mixed(out):
    """A chunk's summary (its sum, the ordered product of its matrices) and rows."""
    product = out["prod"][0]
    for k in range(1, out["prod"].shape[0]):
        product = product @ out["prod"][k]
    return (out["sum"].sum(0), product), out["rows"]


def _mixed_oracle(x):
    out = jax.vmap(_example)(x)
    return _mixed(out)


def _in_order(a, b):
    """Two summaries merged whole: sums added, products multiplied in order."""
    (sum_a, product_a), (sum_b, product_b) = a, b
    return sum_a + sum_b, product_a @ product_b


# Divisors, non-divisors (the last chunk a window over earlier examples), one chunk,
# a chunk larger than N.
@pytest.mark.parametrize("n, batch", [(1, 1), (5, 2), (12, 4), (12, 5), (7, 20)])
def test_accumulator_folds_in_order_and_stacks_rows(n, batch):
    x = jax.random.normal(jax.random.key(n), (n, 2))
    body = _body(_example, x, _loop.Accumulator(_in_order, _mixed))
    expected = _mixed_oracle(x)
    tree_allclose(_run(body, x, batch), expected, rtol=1e-5, atol=1e-5)
    tree_allclose(
        jax.jit(lambda x: _run(body, x, batch))(x), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("n, batch, remat", [(12, 5, True), (12, 4, False)])
def test_accumulator_gradients_count_each_example_once(n, batch, remat):
    """Under `grad`, the rows the last (overlapping) window does not write get no
    cotangent from it, and the summaries' cotangents reach every example once."""
    x = jax.random.normal(jax.random.key(0), (n, 2))

    def scalar(result):
        (total, product), (rows, row_sums) = result
        weights = jnp.arange(1.0, n + 1)
        return (
            total.sum() + product.sum() + (rows.sum(1) * weights).sum()
            + (row_sums**2 * weights).sum()
        )  # fmt: skip

    body = _body(_example, x, _loop.Accumulator(_in_order, _mixed), remat)
    got = jax.grad(lambda x: scalar(_run(body, x, batch)))(x)
    want = jax.jit(jax.grad(lambda x: scalar(_mixed_oracle(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_folding_accumulator_has_no_rows_and_returns_the_summary():
    x = jnp.arange(10.0).reshape(5, 2)
    folding = _loop.Accumulator.folding(jnp.add, lambda out: out["sum"].sum(0))
    body = _body(_example, x, folding)
    assert not folding.rows
    np.testing.assert_allclose(_run(body, x, 2), (x**2).sum(0))


def test_rows_cost_what_they_hold_not_n_per_chunk():
    """Rows are written in place: the compiled program's temporary memory grows with
    N only by the loop's chunk indices (4 bytes per chunk), where placing each
    chunk's rows in an N-long array summed over the chunks would add N values."""

    def example(x):
        return {"sum": x**2, "rows": jnp.tanh(x).sum()}

    def summarise(out):
        return out["sum"].sum(0), out["rows"]

    def temp(n):
        x = jnp.ones((n, 4))
        body = _body(example, x, _loop.Accumulator.adding(summarise))
        return temp_bytes(lambda x: _run(body, x, 16), x)

    small, large = temp(1024), temp(16384)
    indices = 4 * (16384 - 1024) // 16
    assert large - small <= indices + 256, (small, large)


def test_row_types_follow_the_examples():
    x = jnp.ones((6, 3), jnp.bfloat16)

    def summarise(out):
        return out["sum"].sum(0), out["rows"]

    _, (rows, row_sums) = _run(
        _body(_example, x, _loop.Accumulator.adding(summarise)), x, 4
    )
    assert rows.shape == (6, 3) and rows.dtype == jnp.bfloat16
    assert row_sums.shape == (6,) and row_sums.dtype == jnp.bfloat16
