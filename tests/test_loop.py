"""The kernel's own contract (`_loop`): accumulators that fold summaries and stack
per-example rows, leaf by leaf, over every chunk plan, under `jit` and `grad`; and
accumulators composed from leaves over a prefix tree of the outputs
(`_accumulators`), against `jax.vmap`."""

import collections
import contextlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap._core import _accumulators as acc, _loop

from .helpers import temp_bytes, tree_allclose


def _body(example, x, accumulator, remat=True, out_axes=0, batch=None):
    """The `_loop.Body` of `jax.vmap(example, out_axes=out_axes)` over the leading
    axis of `x` (`out_axes`: one axis or None for every output leaf, or a list of
    one per leaf), its accumulator prepared for chunks of `batch`."""
    one = jax.eval_shape(example, jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    flat, tree = jax.tree.flatten(one)

    axes = out_axes if isinstance(out_axes, list) else [out_axes] * len(flat)

    def chunk_fn(leaves, length):
        spec = tree.unflatten(axes)
        return jax.vmap(example, out_axes=spec)(leaves[0])

    signature = _loop.Signature(tree, flat, axes)
    if isinstance(accumulator, acc.Composed):
        accumulator = accumulator.resolve(signature, batch or x.shape[0])
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
    body = _body(_example, x, _loop.Accumulator(_mixed, _in_order))
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

    body = _body(_example, x, _loop.Accumulator(_mixed, _in_order), remat)
    got = jax.grad(lambda x: scalar(_run(body, x, batch)))(x)
    want = jax.jit(jax.grad(lambda x: scalar(_mixed_oracle(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_folding_accumulator_has_no_rows_and_returns_the_summary():
    x = jnp.arange(10.0).reshape(5, 2)
    folding = acc.compose(acc.Fold(jnp.add, lambda out: out["sum"].sum(0)))
    body = _body(_example, x, folding)
    assert body.accumulator.sums
    assert body.accumulator.summarise(jax.vmap(_example)(x))[1] == ((),)  # no rows
    np.testing.assert_allclose(_run(body, x, 2), (x**2).sum(0))


def _product(matrices):
    """The ordered product of a chunk's matrices (along axis 0)."""
    out = matrices[0]
    for k in range(1, matrices.shape[0]):
        out = out @ matrices[k]
    return out


# Leaves over a prefix tree of `_example`'s output: a sum, an ordered product (a
# fold that is not a sum) and stacked rows.
SPEC = {
    "sum": acc.Fold(jnp.add, lambda s: s.sum(0)),
    "prod": acc.Fold(jnp.matmul, _product),
    "rows": acc.Stack(),
}


def _composed_oracle(x):
    out = jax.vmap(_example)(x)
    return {**out, "sum": out["sum"].sum(0), "prod": _product(out["prod"])}


@pytest.mark.parametrize("n, batch", [(1, 1), (5, 2), (12, 4), (12, 5), (7, 20)])
def test_composed_leaves_match_vmap(n, batch):
    x = jax.random.normal(jax.random.key(n), (n, 2))
    body = _body(_example, x, acc.compose(SPEC), batch=batch)
    assert not body.accumulator.sums  # the ordered product is not a sum
    expected = _composed_oracle(x)
    tree_allclose(_run(body, x, batch), expected, rtol=1e-5, atol=1e-5)
    got = jax.jit(lambda x: _run(body, x, batch))(x)
    tree_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, batch, remat", [(12, 5, True), (7, 3, False)])
def test_composed_leaves_under_grad(n, batch, remat):
    x = jax.random.normal(jax.random.key(1), (n, 2))

    def scalar(result):
        rows, row_sums = result["rows"]
        weights = jnp.arange(1.0, n + 1)
        return (
            result["sum"].sum() + result["prod"].sum()
            + (rows.sum(1) * weights).sum() + (row_sums**2 * weights).sum()
        )  # fmt: skip

    body = _body(_example, x, acc.compose(SPEC), remat, batch=batch)
    got = jax.grad(lambda x: scalar(_run(body, x, batch)))(x)
    want = jax.jit(jax.grad(lambda x: scalar(_composed_oracle(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_axes", [1, None])
def test_stack_keeps_the_output_axes_as_vmap(out_axes):
    """A stacked leaf comes back at its output axis (1 here); an unmapped one (None)
    once, as jax.vmap gives it; both beside a sum."""
    x = jax.random.normal(jax.random.key(2), (9, 3))

    def example(x):
        return jnp.outer(x, x), x[:2] * 2.0

    if out_axes is None:  # unmapped outputs: each the same for every example
        example = lambda x: (jnp.zeros((3, 3)), jnp.ones(2))  # noqa: E731
    spec = (acc.Stack(), acc.Stack())
    body = _body(example, x, acc.compose(spec), out_axes=out_axes, batch=4)
    assert body.accumulator.sums == (out_axes is not None)  # kept: not added
    want = jax.vmap(example, out_axes=out_axes)(x)
    tree_allclose(_run(body, x, 4), want, rtol=1e-6, atol=1e-6)


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
        body = _body(example, x, _loop.Accumulator(summarise))
        return temp_bytes(lambda x: _run(body, x, 16), x)

    small, large = temp(1024), temp(16384)
    indices = 4 * (16384 - 1024) // 16
    assert large - small <= indices + 256, (small, large)


def test_row_types_follow_the_examples():
    x = jnp.ones((6, 3), jnp.bfloat16)

    def summarise(out):
        return out["sum"].sum(0), out["rows"]

    _, (rows, row_sums) = _run(_body(_example, x, _loop.Accumulator(summarise)), x, 4)
    assert rows.shape == (6, 3) and rows.dtype == jnp.bfloat16
    assert row_sums.shape == (6,) and row_sums.dtype == jnp.bfloat16


@pytest.mark.parametrize("n, batch", [(12, 5), (7, 7), (9, 2)])
def test_moments_match_the_two_pass_mean_and_variance(n, batch):
    """`Moments` over a tree of two leaves (examples along axis 1, as the
    statistics lay them out, and axis 0), beside stacked rows; a large common
    part, where a one-pass sum of squares would cancel."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(n, 3)) + 1e3, jnp.float32)

    def example(x):
        return {"a": x * 2.0, "b": x[:2] ** 2}, x.sum()

    spec = (acc.Moments(), acc.Stack())
    body = _body(example, x, acc.compose(spec), out_axes=[1, 0, 0], batch=batch)
    (count, mean, m2), sums = _run(body, x, batch)
    out, want_sums = jax.vmap(example)(np.asarray(x, np.float64))
    assert float(count) == n
    for k in ("a", "b"):
        np.testing.assert_allclose(mean[k], out[k].mean(0), rtol=1e-6)
        np.testing.assert_allclose(m2[k] / n, out[k].var(0), rtol=2e-3)
    np.testing.assert_allclose(sums, want_sums, rtol=1e-6)


def _primitives(fn, *args):
    """How many equations of each primitive `fn`'s jaxpr holds, nested ones
    included."""
    counts = collections.Counter()

    def count(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                count(sub)

    count(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


def _holds(fn, *args):
    return _primitives(fn, *args)["reduce_precision"]


@pytest.mark.parametrize(
    "n, batch, dtype, out_axis",
    [
        (12, 4, np.float32, 0),  # B divides N
        (13, 5, np.float32, 1),  # the last window, outputs along axis 1
        (7, 3, jnp.bfloat16, 0),
        (9, 4, np.float64, 0),
    ],
)
def test_a_held_loop_is_jax_vmap(monkeypatch, n, batch, dtype, out_axis):
    """On the platforms `HELD` (the TPU; here posed on the CPU) each chunk's
    floating inputs are read through `hold` and the outputs written in place: the
    same values as `jax.vmap` eagerly, jitted, under `grad` and `jvp`, to second
    order, transposed (the loop itself and its linearisation), at every float
    width, with integer inputs and Python scalars left as they are; and every
    float32 or bfloat16 chunk does pass through the hold (a mutant that skips it
    leaves the program as XLA:TPU narrows whole; float64 is read as it is)."""
    from chunkvmap import batch_vmap

    if dtype == np.float64 and not jax.config.jax_enable_x64:
        ctx = jax.enable_x64(True)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        rng = np.random.default_rng(n)
        x = jnp.asarray(rng.normal(size=(n, 6)), dtype)  # (more read than written)
        ids = jnp.asarray(rng.integers(0, 4, size=(n,)), np.int32)
        w = jnp.asarray(rng.normal(size=(6, 4)), dtype)

        def f(w, x, i, s):
            return (jnp.tanh(x @ w) * s).at[i].add(jnp.sin(x).sum())

        ref = jax.vmap(f, (None, 0, 0, None), out_axis)
        monkeypatch.setattr(_loop, "HELD", frozenset({jax.default_backend()}))
        ours = batch_vmap(f, (None, 0, 0, None), out_axis, batch_size=batch)
        tol = dict(rtol=3e-2, atol=3e-2) if dtype == jnp.bfloat16 else {}
        args = (w, x, ids, 2.0)
        tree_allclose(ours(*args), ref(*args), **tol)
        tree_allclose(jax.jit(ours)(*args), ref(*args), **tol)
        for wrt in (0, 1):
            if dtype == jnp.bfloat16:
                continue

            def total(g, wrt=wrt):
                return lambda *a: jnp.sum(jnp.sin(g(*a)))

            tree_allclose(
                jax.grad(total(ours), wrt)(*args), jax.grad(total(ref), wrt)(*args)
            )
        if dtype != jnp.bfloat16:
            t = jnp.ones_like(x)
            tree_allclose(
                jax.jvp(lambda v: ours(w, v, ids, 2.0), (x,), (t,)),
                jax.jvp(lambda v: ref(w, v, ids, 2.0), (x,), (t,)),
            )

            def hvp(g):  # forward over reverse: a custom rule dropped shows here
                grad = jax.grad(lambda v: jnp.sum(g(w, v, ids, 2.0) ** 2))
                return jax.jvp(grad, (x,), (t,))[1]

            tree_allclose(hvp(ours), hvp(ref), rtol=1e-4, atol=1e-5)

            def transposed(g):  # the linearised loop's transpose
                _, lin = jax.linearize(lambda v: g(w, v, ids, 2.0), x)
                return jax.linear_transpose(lin, x)(jnp.cos(ref(*args)))

            tree_allclose(transposed(ours), transposed(ref), rtol=1e-5, atol=1e-6)

            def linear(g):  # a loop linear in its input, transposed itself
                lin = g(lambda v, u: (v @ w) * u, (0, None), out_axis)
                return jax.linear_transpose(lambda v: lin(v, 2.0), x)(
                    jnp.cos(ref(*args))
                )

            tree_allclose(
                linear(lambda *a: batch_vmap(*a, batch_size=batch)),
                linear(jax.vmap),
                rtol=1e-5,
                atol=1e-6,
            )
        counts = _primitives(ours, *args)
        # x's chunk held where it is float32 or bfloat16 (float64 is read as it is)
        assert counts["reduce_precision"] == (dtype != np.float64)
        assert counts["dynamic_update_slice"] == 1  # the outputs written in place


def test_a_loop_holds_where_it_reads_more_than_it_writes(monkeypatch):
    """On the platforms `HELD` a stacked loop holds its chunks only where it has
    float32 or bfloat16 inputs (not integers alone), writes no more bytes than it
    reads (not per-example gradients) and has no weakly typed output; elsewhere it
    is the loop as on every other platform, without a hold."""
    from chunkvmap import batch_vmap

    monkeypatch.setattr(_loop, "HELD", frozenset({jax.default_backend()}))
    x, ids = jnp.ones((8, 5)), jnp.arange(8)
    cases = [
        (lambda v: jnp.sum(v), (x,), 1),
        (lambda v: jnp.outer(v, v), (x,), 0),  # writes 5x what it reads
        (lambda i: jnp.sin(i.astype(np.float32)), (ids,), 0),  # nothing to hold
        (lambda v: 1.0, (x,), 0),  # a weak output
    ]
    for f, args, holds in cases:
        g = batch_vmap(f, batch_size=4)
        assert _holds(g, *args) == holds
        tree_allclose(g(*args), jax.vmap(f)(*args))
