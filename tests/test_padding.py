"""Poisson lots in one program: a padded buffer (`is_padding_example=`) costs what its
real examples cost, with values equal to the program for exactly those examples.

Chunks that hold only padding are skipped at run time (the real examples are
evaluated first, wherever the padding sits), so one compiled program serves every lot
size up to the buffer's capacity; the padding's per-example outputs are zeros.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from chunkvmap import (
    batch_map,
    batch_vmap,
    clipped_grad,
    clipped_grad_sum,
    per_example_grad_norms,
    per_example_grad_stats,
)

from .helpers import clipped_sum, make_mesh, tree_allclose


C, B = 40, 8


def loss(p, x, y):
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean((h @ p["v"] - y) ** 2)


def _data(rng):
    p = {
        "w": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=7), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(7, 2)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(C, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(C, 2)), jnp.float32)
    return p, x, y


class Counted:
    """`fn`, counting the examples it evaluates (a host callback per example, on
    its second argument): `count(call)` runs `call` and returns how many."""

    def __init__(self, fn):
        self.fn, self.evaluated = fn, []

    def __call__(self, *args):
        jax.debug.callback(lambda _: self.evaluated.append(1), args[1])
        return self.fn(*args)

    def count(self, call):
        self.evaluated.clear()
        jax.block_until_ready(call())
        jax.effects_barrier()
        return len(self.evaluated)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_one_program_serves_twenty_lot_sizes(method, rng, always_ghost):
    """20 lot sizes from 0 to the capacity (half with the padding shuffled through
    the buffer), one jitted program: the clipped sum and the real examples' norms
    equal the oracle's (`jax.vmap(jax.grad)` of the whole buffer, the padding left
    out of the sum) and, for three of the lots, the program compiled for exactly
    the real examples; the padding's norms are zeros (an empty lot's sum too)."""
    p, x, y = _data(rng)
    grad = clipped_grad(
        loss, l2_clip_norm=0.5, batch_argnums=(1, 2), batch_size=B, method=method,
        return_grad_norms=True, keep_batch_dim=False,
    )  # fmt: skip
    padded = jax.jit(lambda p, x, y, m: grad(p, x, y, is_padding_example=m))
    sizes = [0, 1, 2, 5, 7, 8, 9, 11, 15, 16, 17, 20, 23, 24, 25, 31, 32, 33, 39, 40]
    for k, n in enumerate(sizes):
        pad = np.arange(C) >= n
        if k % 2:
            pad = rng.permutation(pad)
        total, aux = padded(p, x, y, jnp.asarray(pad))
        norms, real = np.asarray(aux.grad_norms), np.nonzero(~pad)[0]
        np.testing.assert_array_equal(norms[pad], 0.0)
        expected, expected_norms = clipped_sum(loss, 0.5, (p, x, y), pad=pad)
        tree_allclose(total, expected, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(norms[real], expected_norms[real], rtol=2e-5)
        if n in (9, 23, 40):  # the program for exactly the real examples
            exact_total, exact_aux = grad(p, x[real], y[real])
            tree_allclose(total, exact_total, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(norms[real], exact_aux.grad_norms, rtol=2e-5)
    assert padded._cache_size() == 1


# The passes over the examples of a clipped sum, and how often each evaluates an
# example (a pass differentiated by `jax.grad` is traced twice: its callbacks twice).
# `method="vmap"` with `nan_safe` on the TPU (`in_passes`) takes the norms, then the
# sum as one backward pass (and a third, of the non-finite examples alone: none
# here); elsewhere one pass.
PASSES = {
    ("vmap", True, False): 1,
    ("vmap", True, True): 1 + 2,
    ("vmap", False, True): 1,
    ("ghost", True, False): 1,
}


@pytest.mark.parametrize("method, nan_safe, passes", list(PASSES))
@pytest.mark.parametrize("where", ["end", "shuffled"])
def test_chunks_of_padding_alone_are_not_evaluated(
    method, nan_safe, passes, where, rng, always_ghost, request
):
    """9 real examples of 40 in chunks of 8: two chunks are evaluated (16 examples,
    the last partly padding) by each pass, not five, wherever the padding sits."""
    if passes:
        request.getfixturevalue("in_passes")
    p, x, y = _data(rng)
    counted = Counted(loss)

    grad = clipped_grad(
        counted,
        l2_clip_norm=0.5,
        batch_argnums=(1, 2),
        batch_size=B,
        method=method,
        nan_safe=nan_safe,
        keep_batch_dim=False,
    )
    pad = np.arange(C) >= 9
    if where == "shuffled":
        pad = rng.permutation(pad)
    count = counted.count(lambda: grad(p, x, y, is_padding_example=jnp.asarray(pad)))
    assert count == 16 * PASSES[method, nan_safe, passes]


MESH = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))


def _on_mesh(hold, fn):
    """`fn` called as a user holding the mesh `hold` would call it: "shard=True"
    (an `Auto` mesh over the 8 devices, under `jit`: one `shard_map`), "placed"
    (the examples placed on an `Explicit` mesh, eagerly), "set_mesh" (that mesh
    entered, the examples placed, under `jit`)."""

    def call(*args):
        *args, pad = args
        if hold == "shard=True":
            return jax.jit(fn)(*args, pad)
        spec = P("d") if len(pad) % 8 == 0 else P()  # (else replicated: even only)
        place = lambda x: jax.device_put(x, NamedSharding(MESH, spec))  # noqa: E731
        examples = [args[0], *map(place, args[1:]), place(jnp.asarray(pad))]
        if hold == "placed":
            return fn(*examples)
        with jax.set_mesh(MESH):
            return jax.jit(fn)(*examples)

    return call


def _mesh_entries():
    """Each entry point that takes a padded buffer: `(build(**options), oracle)`,
    `build` a function of `(params, *examples, flags)`, the oracle of the real
    examples' `(params, x, y, flags)`."""
    clip = dict(l2_clip_norm=0.5, batch_argnums=(1, 2), keep_batch_dim=False)

    def clipped(method):
        def build(**o):
            g = clipped_grad(loss, **clip, method=method, return_grad_norms=True, **o)

            def run(p, x, y, m):
                total, aux = g(p, x, y, is_padding_example=m)
                return total, aux.grad_norms

            return run

        def oracle(p, x, y, pad):
            total, norms = clipped_sum(loss, 0.5, (p, x, y), pad=pad)
            return total, np.where(pad, 0.0, norms)

        return build, oracle

    def stacked(**o):
        f = batch_vmap(
            _net, (None, 0), batch_size=o.pop("batch_size"), padded=True, **o
        )
        return lambda p, x, y, m: f(p["w"], x, is_padding_example=m)

    def mapped(**o):
        return lambda p, x, y, m: batch_map(
            lambda v: jnp.tanh(v @ p["w"]), x, o.pop("batch_size"),
            is_padding_example=m, **o,
        )  # fmt: skip

    def net_rows(p, x, y, pad):
        return jnp.where(jnp.asarray(~pad)[:, None], jnp.tanh(x @ p["w"]), 0.0)

    def stats(**o):
        f = per_example_grad_stats(loss, **o)
        return lambda p, x, y, m: f(p, x, y, is_padding_example=m)[:3]

    def stats_oracle(p, x, y, pad):
        real = np.nonzero(~pad)[0]
        g = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x[real], y[real])
        return tuple(
            jax.tree.map(r, g)
            for r in (lambda g: g.mean(0), lambda g: g.var(0), lambda g: (g**2).sum(0))
        )

    return {
        "clipped_grad(vmap)": clipped("vmap"),
        "clipped_grad(ghost)": clipped("ghost"),
        "batch_vmap(padded=True)": (stacked, net_rows),
        "batch_map(is_padding_example=)": (mapped, net_rows),
        "per_example_grad_stats": (stats, stats_oracle),
    }


MESH_ENTRIES = list(_mesh_entries())
HOLDS = ("shard=True", "placed", "set_mesh")
# Every entry point with one way of holding the mesh, every way with several, and
# the two layouts (Auto's shard_map, Explicit's shares) with the padding at the end
# and shuffled.
MESH_CASES = [
    (e, HOLDS[k % 3], ("end", "shuffled")[k % 2]) for k, e in enumerate(MESH_ENTRIES)
] + [
    ("clipped_grad(ghost)", "placed", "end"),
    ("batch_vmap(padded=True)", "shard=True", "shuffled"),
]


@pytest.mark.parametrize("entry, hold, where", MESH_CASES)
def test_a_padded_buffer_split_over_a_mesh(entry, hold, where, rng, always_ghost):
    """Split over 8 devices, with N uneven (37: a global remainder of 5), a padded
    buffer gives the values of the real examples alone (the padding's per-example
    outputs zeros). With 64 examples, every device skips its own chunks of padding
    alone (the progress reporter counts the chunks run: under `shard=True`, the
    first device's; over Explicit axes, the chunks of the shares together, skipped
    where every share's is padding alone)."""
    build, oracle = _mesh_entries()[entry]
    p, x, y = _data(rng)
    x, y = jnp.concatenate([x, x[:24]]), jnp.concatenate([y, y[:24]])  # 64
    # (the examples' axis named: replicated examples do not show it)
    shard = {"shard": True} if hold == "shard=True" else {"shard": "d", "mesh": MESH}
    for n, size in ((20, 37), (3, 64)):
        pad = np.arange(size) >= n
        if where == "shuffled":
            pad = rng.permutation(pad)
        chunks = []
        fn = build(batch_size=2, progress=lambda i, t: chunks.append(i), **shard)
        got = _on_mesh(hold, fn)(p, x[:size], y[:size], pad)
        tree_allclose(got, oracle(p, x[:size], y[:size], pad), rtol=2e-5, atol=1e-6)
    # 64 over 8 devices: 8 each, in 4 chunks of 2. The first device holds 3 real
    # examples at the end (2 chunks); shuffled, no device holds more than
    # `most` real ones. (`shard=True` spreads over the devices of the default
    # device's platform: on an accelerator's machine this test runs on its CPU,
    # the module holding a mesh of CPU devices, and spreads over those.)
    jax.effects_barrier()
    platform = jnp.zeros(()).devices().pop().platform
    d = len(jax.devices(platform)) if hold == "shard=True" else MESH.size
    each = size // d
    most = max(np.sum(~pad[k * each : (k + 1) * each]) for k in range(d))
    first = np.sum(~pad[:each])
    expected = -(-(first if hold == "shard=True" else most) // 2)
    assert len(chunks) == expected < 4, (chunks, pad)


def _net(w, v):
    return jnp.tanh(v @ w)


def test_batch_vmap_folds_a_padded_buffer_in_one_program(rng):
    """`batch_vmap(padded=True)` with a reduction: one jitted program for lots of
    every size (padding at the end or shuffled), equal to `jax.vmap` over the real
    examples alone, under `jax.grad` too; chunks of padding alone are skipped."""
    w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(C, 5)), jnp.float32)
    folded = batch_vmap(
        _net, (None, 0), batch_size=B, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    run = jax.jit(lambda w, x, m: folded(w, x, is_padding_example=m))
    grad = jax.jit(jax.grad(lambda w, x, m: run(w, x, m).sum()))
    for k, n in enumerate([1, 8, 13, 29, 40]):
        pad = np.arange(C) >= n
        if k % 2:
            pad = rng.permutation(pad)
        real = x[np.nonzero(~pad)[0]]
        np.testing.assert_allclose(
            run(w, x, pad), jax.vmap(_net, (None, 0))(w, real).sum(0), rtol=1e-5
        )
        expected = jax.grad(lambda w: jax.vmap(_net, (None, 0))(w, real).sum())(w)
        np.testing.assert_allclose(grad(w, x, pad), expected, rtol=1e-5, atol=1e-6)
    assert run._cache_size() == 1 and grad._cache_size() == 1
    counted = Counted(_net)
    sums = batch_vmap(
        counted, (None, 0), batch_size=B, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    flags = rng.permutation(np.arange(C) >= 9)
    assert counted.count(lambda: sums(w, x, is_padding_example=flags)) == 16


@pytest.mark.parametrize("out_axes", [0, 1])
def test_batch_vmap_stacks_a_padded_buffer_with_zeros_for_the_padding(out_axes, rng):
    """`batch_vmap(padded=True)` without a reduction: the outputs are `jax.vmap`'s
    with the padding's rows zeros, at either output axis and with N uneven in the
    chunks, from one program under `jit` and under `grad` (the padding gets no
    gradient); chunks of padding alone are not evaluated."""
    w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(C - 3, 5)), jnp.float32)  # 37: 5 chunks of 8
    counted = Counted(_net)

    stacked = batch_vmap(counted, (None, 0), out_axes, batch_size=B, padded=True)
    run = jax.jit(lambda w, x, m: stacked(w, x, is_padding_example=m))
    grad = jax.jit(jax.grad(lambda w, x, m: (run(w, x, m) ** 2).sum(), (0, 1)))
    for k, n in enumerate([0, 1, 9, 30, 37]):
        pad = np.arange(C - 3) >= n
        if k % 2:
            pad = rng.permutation(pad)
        keep = jnp.asarray(~pad)[:, None]
        expected = jnp.where(keep, jax.vmap(_net, (None, 0))(w, x), 0.0)
        got = run(w, x, pad)
        np.testing.assert_allclose(got, jnp.moveaxis(expected, 0, out_axes), rtol=1e-6)
        oracle = jax.grad(
            lambda w, x: (jnp.where(keep, jax.vmap(_net, (None, 0))(w, x), 0.0) ** 2)
            .sum(), (0, 1)
        )(w, x)  # fmt: skip
        tree_allclose(grad(w, x, pad), oracle, rtol=1e-5, atol=1e-6)
    assert run._cache_size() == 1 and grad._cache_size() == 1
    assert (
        counted.count(lambda: run(w, x, rng.permutation(np.arange(C - 3) >= 9))) == 16
    )


@pytest.mark.parametrize("strip_dim0", [False, True])
def test_batch_map_takes_a_padded_buffer(strip_dim0, rng):
    """`batch_map(is_padding_example=)`: stacked, the padding's rows are zeros;
    with a reduction, the sum over the real examples; one program for every lot
    under `jit`, exact under `grad`, and chunks of padding alone not evaluated
    (`strip_dim0=True`: chunks of one example)."""
    w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(C - 3, 5)), jnp.float32)
    fun = Counted(lambda w, v: jnp.tanh(v @ w))

    batch = 1 if strip_dim0 else B

    def run(w, x, m, **reduce):
        return batch_map(
            lambda v: fun(w, v), x, batch, strip_dim0=strip_dim0,
            is_padding_example=m, **reduce,
        )  # fmt: skip

    def total(w, x, m):
        return run(w, x, m, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))

    stacked, summed = jax.jit(run), jax.jit(total)
    grad = jax.jit(jax.grad(lambda w, x, m: total(w, x, m).sum()))
    for k, n in enumerate([0, 3, 9, 37]):
        pad = np.arange(C - 3) >= n
        if k % 2:
            pad = rng.permutation(pad)
        keep = jnp.asarray(~pad)[:, None]
        rows = jnp.tanh(x @ w)
        np.testing.assert_allclose(
            stacked(w, x, pad), jnp.where(keep, rows, 0.0), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            summed(w, x, pad), jnp.where(keep, rows, 0.0).sum(0), rtol=1e-5, atol=1e-6
        )
        expected = jax.grad(lambda w: jnp.where(keep, jnp.tanh(x @ w), 0.0).sum())(w)
        np.testing.assert_allclose(grad(w, x, pad), expected, rtol=1e-5, atol=1e-6)
    assert stacked._cache_size() == summed._cache_size() == grad._cache_size() == 1
    flags = rng.permutation(np.arange(C - 3) >= 9)
    assert fun.count(lambda: stacked(w, x, flags)) == (9 if strip_dim0 else 2)


def test_padded_calls_check_their_flags():
    f = batch_vmap(
        _net, (None, 0), batch_size=2, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    w, x = jnp.ones((5, 3)), jnp.ones((6, 5))
    with pytest.raises(TypeError, match="is_padding_example=, a boolean .* but got "
                       "nothing"):  # fmt: skip
        f(w, x)
    with pytest.raises(TypeError, match="is_padding_example: an array of shape"):
        f(w, x, is_padding_example=jnp.zeros(6))
    with pytest.raises(ValueError, match="is_padding_example"):
        f(w, x, is_padding_example=jnp.zeros(4, bool))
    ints = f(w, x, is_padding_example=jnp.array([0, 0, 1, 0, 1, 1]))  # as jax-privacy
    np.testing.assert_allclose(ints, 3 * _net(w, x[0]), rtol=1e-6)
    with pytest.raises(
        ValueError,
        match=r"batch_map is_padding_example must be a "
        r"boolean vector .* shape \(6,\), but got shape \(5,\)",
    ):
        batch_map(jnp.tanh, x, 2, is_padding_example=np.zeros(5, bool))
    with pytest.raises(ValueError, match="dtype float32"):
        batch_map(jnp.tanh, x, 2, is_padding_example=np.zeros(6, np.float32))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_clipped_grad_sum_counts_the_real_examples(method, rng, always_ghost):
    """`clipped_grad_sum` takes `is_padding_example=` too: one program for every
    lot, the sum over the real examples, and their count."""
    p, x, y = _data(rng)
    sums = clipped_grad_sum(loss, 0.5, batch_size=B, method=method)
    run = jax.jit(lambda p, x, y, m: sums(p, x, y, is_padding_example=m))
    for n in (0, 9, 31):
        pad = rng.permutation(np.arange(C) >= n)
        total, count = run(p, x, y, pad)
        assert int(count) == n
        tree_allclose(total, clipped_sum(loss, 0.5, (p, x, y), pad=pad)[0], atol=1e-6)
    assert run._cache_size() == 1


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("per_leaf", [False, True])
def test_per_example_grad_norms_of_a_padded_buffer(method, per_leaf, rng, always_ghost):
    """`per_example_grad_norms` takes `is_padding_example=`: the real examples'
    norms equal the exact-size program's (`jax.vmap(jax.grad)`), the padding's are
    zeros, one program serves every lot, and chunks of padding alone are skipped."""
    p, x, y = _data(rng)
    counted = Counted(loss)

    norms = per_example_grad_norms(
        counted, batch_size=B, method=method, per_leaf=per_leaf
    )
    run = jax.jit(lambda p, x, y, m: norms(p, x, y, is_padding_example=m))
    for n in (0, 9, 31):
        pad = rng.permutation(np.arange(C) >= n)
        real = np.nonzero(~pad)[0]
        grads = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x[real], y[real])
        leaf = lambda g: jnp.sqrt((g**2).sum(range(1, g.ndim)))  # noqa: E731
        each = jax.tree.map(leaf, grads)
        if not per_leaf:
            each = jnp.sqrt(sum(v**2 for v in jax.tree.leaves(each)))
        got = run(p, x, y, pad)
        tree_allclose(jax.tree.map(lambda g: g[real], got), each, rtol=2e-5)
        for g in jax.tree.leaves(got):
            np.testing.assert_array_equal(np.asarray(g)[pad], 0.0)
    assert run._cache_size() == 1
    assert counted.count(lambda: run(p, x, y, rng.permutation(np.arange(C) >= 9))) == 16


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_gradient_statistics_of_a_padded_buffer(method, rng, always_ghost):
    """`per_example_grad_stats` takes `is_padding_example=`: the mean, variance and
    sum of squares of the real examples' gradients (the oracle: `jax.vmap(jax.grad)`
    of them alone), even with NaN inputs in the padding; their squared norms, the
    padding's zeros; one program for every lot, N uneven in the chunks, and chunks
    of padding alone skipped. A lot with no real example has a NaN mean."""
    p, x, y = _data(rng)
    x = x[:37].at[-1].set(jnp.nan)  # 37 in chunks of 8, the last example NaN
    y = y[:37]
    counted = Counted(loss)

    stats = per_example_grad_stats(counted, batch_size=B, method=method)
    run = jax.jit(lambda p, x, y, m: stats(p, x, y, is_padding_example=m))
    every = jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))(p, x, y)  # (one program)
    for n in (1, 9, 30, 36):
        pad = np.concatenate([rng.permutation(np.arange(36) >= n), [True]])
        real = np.nonzero(~pad)[0]
        grads = jax.tree.map(lambda g: g[real], every)
        got = run(p, x, y, pad)
        tol = dict(rtol=2e-4, atol=1e-6)
        tree_allclose(got.mean, jax.tree.map(lambda g: g.mean(0), grads), **tol)
        tree_allclose(got.variance, jax.tree.map(lambda g: g.var(0), grads), **tol)
        tree_allclose(got.sum_sq, jax.tree.map(lambda g: (g**2).sum(0), grads), **tol)
        sq = sum((g.reshape(len(real), -1) ** 2).sum(1) for g in jax.tree.leaves(grads))
        np.testing.assert_allclose(np.asarray(got.sq_norms)[real], sq, rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(got.sq_norms)[pad], 0.0)
    empty = run(p, x, y, np.ones(37, bool))
    assert all(np.isnan(m).all() for m in jax.tree.leaves(empty.mean))
    # one chunk of all the examples (nothing reordered), the first one padding
    whole = per_example_grad_stats(loss, batch_size=None, method=method)
    pad = np.arange(37) % 3 == 0
    real = np.nonzero(~pad)[0]
    grads = jax.tree.map(lambda g: g[real], every)
    got = whole(p, x[::-1], y[::-1], is_padding_example=pad)  # the NaN first
    tree_allclose(got.mean, jax.tree.map(lambda g: g.mean(0), grads), rtol=2e-4)
    assert run._cache_size() == 1
    assert counted.count(lambda: run(p, x, y, np.arange(37) >= 9)) == 16


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_the_padded_clipped_sum_under_grad(method, rng, always_ghost):
    """Differentiated (a function of the clipped sum, as a meta-learning step
    would), the padded program is one program for every lot, equal to the
    exact-size program's derivative."""
    p, x, y = _data(rng)
    sums = clipped_grad_sum(loss, 0.5, batch_size=B, method=method)

    def objective(p, x, y, **flags):
        total, _ = sums(p, x, y, **flags)
        return sum(jnp.sum(jnp.tanh(g)) for g in jax.tree.leaves(total))

    padded = jax.jit(
        jax.grad(lambda p, x, y, m: objective(p, x, y, is_padding_example=m))
    )
    for n in (9, 31):
        pad = rng.permutation(np.arange(C) >= n)
        real = np.nonzero(~pad)[0]
        expected = jax.grad(objective)(p, x[real], y[real])
        tree_allclose(padded(p, x, y, pad), expected, rtol=1e-4, atol=1e-6)
    assert padded._cache_size() == 1


def _nonfinite_at_padding(p, x, y):
    """A loss whose value and gradient are non-finite at zero inputs (a log and a
    normalisation), and at NaN ones."""
    u = x / jnp.linalg.norm(x)
    return loss(p, u, y) + jnp.log(jnp.sum(x**2))


def _padding_under_grad_entries():
    f = _nonfinite_at_padding

    def stacked(b, shard):
        run = batch_vmap(f, in_axes=(None, 0, 0), batch_size=b, padded=True, **shard)
        return lambda p, x, y, m: jnp.sum(run(p, x, y, is_padding_example=m))

    def mapped(b, shard):
        def run(p, x, y, m):
            out = batch_map(
                lambda xy: jax.vmap(f, (None, 0, 0))(p, *xy), (x, y), b,
                is_padding_example=m, **shard,
            )  # fmt: skip
            return jnp.sum(out)

        return run

    def clipped(method):
        def build(b, shard):
            sums = clipped_grad_sum(f, 0.5, batch_size=b, method=method, **shard)

            def run(p, x, y, m):
                total, _ = sums(p, x, y, is_padding_example=m)
                return sum(jnp.sum(jnp.tanh(g)) for g in jax.tree.leaves(total))

            return run

        return build

    def norms(method):
        def build(b, shard):
            fn = per_example_grad_norms(f, batch_size=b, method=method, **shard)
            return lambda p, x, y, m: jnp.sum(fn(p, x, y, is_padding_example=m))

        return build

    return {
        "batch_vmap(padded=True)": stacked,
        "batch_map(is_padding_example=)": mapped,
        "clipped_grad_sum(vmap)": clipped("vmap"),
        "clipped_grad_sum(ghost)": clipped("ghost"),
        "per_example_grad_norms(vmap)": norms("vmap"),
        "per_example_grad_norms(ghost)": norms("ghost"),
    }


PADDING_UNDER_GRAD = _padding_under_grad_entries()


# The layouts of test_padding_never_reaches_a_derivative: chunks of 3 (the padding
# inside a chunk of real ones), 10 (one chunk), 16 (a window wider than the buffer),
# and split over 8 devices; each entry takes two with one fill and the other two
# with the other.
_UNDER_GRAD_LAYOUTS = ((3, {}), (16, {}), (10, {}), (2, {"shard": True}))
_UNDER_GRAD_CASES = [
    (entry, fill, _UNDER_GRAD_LAYOUTS[2 * ((k + f) % 2) : 2 * ((k + f) % 2) + 2])
    for k, entry in enumerate(PADDING_UNDER_GRAD)
    for f, fill in enumerate(["nan", "zeros"])
]


@pytest.mark.parametrize(
    "entry, fill, layouts", _UNDER_GRAD_CASES,
    ids=[f"{fill}-{entry}" for entry, fill, _ in _UNDER_GRAD_CASES],
)  # fmt: skip
def test_padding_never_reaches_a_derivative(entry, fill, layouts, rng, always_ghost):
    """A padded buffer whose padding is non-finite for the loss (NaN, or zeros
    under a log and a normalisation) differentiates as the real examples alone do,
    eagerly and jitted: N=10 with 4 real examples, in chunks of 3 (the padding
    inside a chunk of real ones), 10 (one chunk) and 16 (a window wider than the
    buffer), and split over 8 devices (`_UNDER_GRAD_LAYOUTS`, every layout with
    every entry). Masking the padding's outputs alone left every weight's gradient
    NaN."""
    p, x, y = _data(rng)
    x, y = x[:10], y[:10]
    pad = np.array([0, 1, 1, 0, 1, 0, 1, 1, 0, 1], bool)
    filled = np.asarray(x).copy()
    filled[pad] = np.nan if fill == "nan" else 0.0
    real = np.nonzero(~pad)[0]
    for b, shard in layouts:
        run = PADDING_UNDER_GRAD[entry](b, shard)
        oracle = PADDING_UNDER_GRAD[entry](None, {})
        expected = jax.grad(oracle)(p, x[real], y[real], np.zeros(len(real), bool))
        got = jax.grad(run)(p, jnp.asarray(filled), y, pad)
        tree_allclose(got, expected, rtol=1e-4, atol=1e-6)
        got = jax.jit(jax.grad(run))(p, jnp.asarray(filled), y, pad)
        tree_allclose(got, expected, rtol=1e-4, atol=1e-6)


def _scanned_stack(p, x, y):
    """Layers run by `lax.scan` over a stacked weight: ghost clipping takes their
    norms in a first pass and the clipped sum in a second."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])
    return jnp.sum((h @ p["head"] - y) ** 2)


@pytest.mark.parametrize("case", ["empty lot", "every example non-finite"])
def test_two_pass_ghost_sums_nothing_to_zero(case, rng):
    """Where no example counts, the second pass has no example to stand in for
    the others (it took example 0, itself padding or non-finite): the sum is zero,
    as documented (it was NaN), eagerly and jitted."""
    d = 64
    p = {
        "w": jnp.asarray(rng.normal(size=(4, d, d)) * 0.1, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(d, 2)), jnp.float32),
    }
    x = jnp.full((6, d), jnp.nan, jnp.float32)  # an unfilled buffer
    y = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
    from chunkvmap import ghost_report

    assert ghost_report(_scanned_stack, p, x[0], y[0]).runs == "ghost"
    if case == "empty lot":
        sums = clipped_grad_sum(_scanned_stack, 1.0, batch_size=4, method="ghost")
        run = lambda p, x, y: sums(p, x, y, is_padding_example=np.ones(6, bool))[0]  # noqa: E731
    else:
        run = clipped_grad(
            _scanned_stack, l2_clip_norm=1.0, batch_argnums=(1, 2), method="ghost",
            keep_batch_dim=False,
        )  # fmt: skip
    for fn in (run, jax.jit(run)):
        tree_allclose(fn(p, x, y), jax.tree.map(jnp.zeros_like, p))


@pytest.mark.parametrize("entry", list(PADDING_UNDER_GRAD)[:5])
@pytest.mark.parametrize("b", [1, 2])
def test_a_share_of_padding_alone_never_reaches_a_derivative(
    entry, b, rng, always_ghost
):
    """Over an Explicit mesh of 8 devices, a device whose share of the buffer is
    all padding (NaN) still evaluates it beside the others' real examples: a real
    example of another share stands in (its own padding stood in, and the
    gradient was NaN in every weight)."""
    p, x, y = _data(rng)
    x, y = x[:16], y[:16]
    pad = np.zeros(16, bool)
    pad[[2, 3, 9]] = True  # the second device's share (examples 2, 3) all padding
    filled = np.asarray(x).copy()
    filled[pad] = np.nan
    real = np.nonzero(~pad)[0]
    oracle = PADDING_UNDER_GRAD[entry](None, {})
    expected = jax.grad(oracle)(p, x[real], y[real], np.zeros(len(real), bool))
    place = lambda a: jax.device_put(a, NamedSharding(MESH, P("d")))  # noqa: E731
    run = PADDING_UNDER_GRAD[entry](b, {})
    with jax.set_mesh(MESH):
        got = jax.grad(run)(p, place(jnp.asarray(filled)), place(y), pad)
    tree_allclose(got, expected, rtol=1e-4, atol=1e-6)
