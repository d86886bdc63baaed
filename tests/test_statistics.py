"""Per-example gradient statistics against `jax.vmap(jax.grad(fun))` followed by the
statistic: norms (both methods), mean / variance / sum of squares, Gram matrices;
on an MLP and the models DP is trained on (GPT-style LMs with gathered and tied
embeddings and a scanned layer stack, a convnet), over chunk plans, meshes and
dtypes, with the memory each holds."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap
from chunkvmap import (
    GradStats,
    last_batch_size,
    per_example_grad_gram,
    per_example_grad_norms,
    per_example_grad_stats,
)
from chunkvmap._quantities import _statistics

from . import test_ghost_models as models
from .helpers import (
    HostLog,
    init_mlp,
    make_mesh,
    mlp,
    program_bytes,
    projected_grads,
    temp_bytes,
    tree_allclose,
)


def mlp_loss(p, x, y):
    return jnp.sum((mlp(p, x) - y) ** 2)


def mlp_data(n, sizes=(4, 8, 3), seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = init_mlp(k[0], list(sizes))
    x = jax.random.normal(k[1], (n, sizes[0]))
    y = jax.random.normal(k[2], (n, sizes[-1]))
    return params, x, y


def oracle_grads(loss, params, *batch):
    """The N per-example gradients (leaves with a leading N), and flattened, as NumPy
    arrays (the statistics of them are then computed without compiling)."""
    in_axes = (None, *[0] * len(batch))
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=in_axes))(params, *batch)
    grads = jax.tree.map(np.asarray, grads)
    n = batch[0].shape[0]
    flat = np.concatenate([g.reshape(n, -1) for g in jax.tree.leaves(grads)], 1)
    return grads, flat


@functools.cache
def dp_case(n, seed=40):
    """The models DP is trained on (`test_ghost_models.dp_models`), a batch of `n`
    examples and its per-example gradients (computed once per file)."""
    params, loss = models.dp_models()
    data = models.dp_batch(n, seed)
    return params, loss, data, *oracle_grads(loss, params, *data)


# B > N, and ghost with a remainder (test_conformance has the remainder, by vmap, for
# every entry point; divisors and single examples are the kernel's, test_loop)
@pytest.mark.parametrize("n, batch, method", [(5, 8, "vmap"), (7, 3, "ghost")])
def test_stats_match_vmap_over_chunk_plans(n, batch, method):
    params, x, y = mlp_data(n)
    grads, flat = oracle_grads(mlp_loss, params, x, y)
    stats = per_example_grad_stats(mlp_loss, batch_size=batch, method=method)(
        params, x, y
    )
    assert isinstance(stats, GradStats) and stats.aux is None
    tree_allclose(stats.mean, jax.tree.map(lambda g: g.mean(0), grads))
    tree_allclose(
        stats.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4, atol=1e-5
    )
    tree_allclose(stats.sum_sq, jax.tree.map(lambda g: (g**2).sum(0), grads), rtol=1e-4)
    np.testing.assert_allclose(stats.sq_norms, (flat**2).sum(1), rtol=1e-5)


def test_stats_with_aux():
    params, x, y = mlp_data(7)
    grads, _ = oracle_grads(mlp_loss, params, x, y)

    def with_aux(p, x, y):
        return mlp_loss(p, x, y), {"y": y}

    stats = jax.jit(per_example_grad_stats(with_aux, has_aux=True, batch_size=3))(
        params, x, y
    )
    tree_allclose(stats.mean, jax.tree.map(lambda g: g.mean(0), grads))
    np.testing.assert_array_equal(stats.aux["y"], y)
    norms, aux = per_example_grad_norms(
        with_aux, has_aux=True, batch_size=3, method="ghost"
    )(params, x, y)
    np.testing.assert_allclose(norms**2, stats.sq_norms, rtol=1e-5)
    np.testing.assert_array_equal(aux["y"], y)


@pytest.mark.parametrize("scale", [1e4, 1e6])
def test_variance_is_exact_beside_a_large_mean(scale, always_ghost):
    """Gradients with a large common mean and spread 1, in float32: a variance from
    sums of squares (`E[g^2] - E[g]^2`) loses every digit; the statistics keep
    float32's precision (within 10x of a two-pass float32 variance, against float64)
    however they are chunked, example by example (batch_size=1, and ghost, which
    merges its examples one at a time) or all at once."""
    offsets = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    grads = np.float32(scale) + offsets  # each example's gradient, as float32 has it

    def loss(w, d):
        return jnp.sum((scale + d) @ w)  # example d's gradient: (scale + d) in each
        # column of w (a dense use: ghost moments form it from its activation)

    assert chunkvmap.ghost_report(loss, jnp.zeros((3, 2)), offsets[0]).runs == "ghost"
    expected = np.var(grads.astype(np.float64), axis=0)[:, None]
    g32 = jnp.asarray(grads)
    two_pass = jnp.mean((g32 - g32.mean(0, keepdims=True)) ** 2, axis=0)[:, None]
    bound = 10 * np.max(np.abs(np.asarray(two_pass, np.float64) - expected) / expected)
    for method in ("vmap", "ghost"):
        for batch_size in (1, 3, 7, None):
            stats = per_example_grad_stats(loss, batch_size=batch_size, method=method)(
                jnp.zeros((3, 2)), offsets
            )
            error = np.max(np.abs(np.asarray(stats.variance) - expected) / expected)
            assert error <= max(bound, 1e-6), (method, batch_size, error, bound)
            mean = grads.mean(0, dtype=np.float64)[:, None]
            np.testing.assert_allclose(stats.mean, np.broadcast_to(mean, (3, 2)))


def test_ghost_stats_where_no_leaf_has_a_ghost_rule():
    """A parameter used only through `w**2` (no ghost rule): method="ghost" runs
    the per-example path, as clipping does, and gives method="vmap"'s statistics."""

    def loss(w, x):
        return jnp.tanh(w**2 * x).sum()

    rng = np.random.default_rng(3)
    w, x = rng.normal(size=3).astype(np.float32), rng.normal(size=(5, 3))
    x = x.astype(np.float32)
    g = 2 * w * x * (1 - np.tanh(w**2 * x) ** 2)  # the per-example gradients

    @jax.jit
    def both(w, x):
        return [
            per_example_grad_stats(loss, batch_size=3, method=m)(w, x)
            for m in ("ghost", "vmap")
        ]

    with pytest.warns(chunkvmap.GhostFallbackWarning, match="runs as method='vmap'"):
        results = both(jax.device_put(w), jax.device_put(x))
    for stats in results:
        np.testing.assert_allclose(stats.mean, g.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.variance, g.var(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(stats.sum_sq, (g**2).sum(0), rtol=1e-5)
        np.testing.assert_allclose(stats.sq_norms, (g**2).sum(1), rtol=1e-5)


@pytest.mark.parametrize("call", ["eager", "jit"])
def test_ghost_stats_of_a_per_example_leaf_beside_ghost_ones(always_ghost, call):
    """A leaf used through `w**2` (per-example) beside ghost layers: the ghost
    program's moments of its formed gradients (reduced along their examples, moved
    last) equal the oracle's, N = 11 in chunks of 4 (the last window's examples
    counted once)."""

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w"] ** 2)
        return jnp.sum((jnp.tanh(h @ p["v"]) - y) ** 2)

    rng = np.random.default_rng(9)
    p = {
        "w": jnp.asarray(rng.normal(size=(6, 12)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(12, 3)), jnp.float32),
    }
    x, y = (jnp.asarray(rng.normal(size=(11, k)), jnp.float32) for k in (6, 3))
    grads, flat = oracle_grads(loss, p, x, y)
    stats = per_example_grad_stats(loss, batch_size=4, method="ghost")
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="per-example gradients"):
        got = (stats if call == "eager" else jax.jit(stats))(p, x, y)
    tree_allclose(got.mean, jax.tree.map(lambda g: g.mean(0), grads))
    tree_allclose(
        got.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(got.sq_norms, (flat**2).sum(1), rtol=1e-5)


def test_bf16_parameters_give_float32_statistics():
    params, x, y = mlp_data(6)
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)

    def loss(p, x, y):
        return mlp_loss(p, x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)).astype(
            jnp.float32
        )

    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params16, x, y)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    stats = per_example_grad_stats(loss, batch_size=4)(params16, x, y)
    ghost = per_example_grad_stats(loss, batch_size=4, method="ghost")(params16, x, y)
    for leaf in jax.tree.leaves((stats, ghost)):
        assert leaf.dtype == jnp.float32
    tree_allclose(ghost.variance, stats.variance, rtol=2e-2, atol=2e-3)
    # bfloat16 gradients (8 bits of mantissa) round differently when XLA fuses the
    # chunked program differently: equal to bfloat16's precision (two of its steps
    # at the largest entries, ~0.7: seen on a TPU)
    tree_allclose(
        stats.mean, jax.tree.map(lambda g: g.mean(0), grads), rtol=2e-2, atol=8e-3
    )
    tree_allclose(stats.sum_sq, jax.tree.map(lambda g: (g**2).sum(0), grads), rtol=2e-2)
    norms = per_example_grad_norms(loss, batch_size=4)(params16, x, y)
    np.testing.assert_allclose(norms**2, stats.sq_norms, rtol=1e-2)


def test_stats_and_norms_on_a_mesh():
    """Examples split over 8 devices (13: a global remainder) by ghost rules (moments
    and a cross-Gram; `method="vmap"` is test_conformance's), and over an Explicit
    mesh (16, sharded): the chunks' moments merge across devices as within one."""
    params, x, y = mlp_data(16)
    grads, flat = oracle_grads(mlp_loss, params, x[:13], y[:13])
    ghost = per_example_grad_stats(mlp_loss, batch_size=1, shard=True, method="ghost")
    stats = jax.jit(ghost)(params, x[:13], y[:13])
    tree_allclose(stats.mean, jax.tree.map(lambda g: g.mean(0), grads))
    tree_allclose(
        stats.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(stats.sq_norms, (flat**2).sum(1), rtol=1e-5)
    gram = per_example_grad_gram(mlp_loss, batch_size=1, shard=True, method="ghost")
    np.testing.assert_allclose(
        gram(params, x[:13], y[:13], other=(params, x[:2], y[:2])),
        flat @ flat[:2].T,
        rtol=1e-5,
        atol=1e-6,
    )

    mesh = make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    where = jax.sharding.NamedSharding(mesh, jax.P("data"))
    grads, flat = oracle_grads(mlp_loss, params, x, y)
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put(x, where), jax.device_put(y, where)
        stats = per_example_grad_stats(mlp_loss, batch_size=3)(params, xs, ys)
        ghost = per_example_grad_stats(mlp_loss, batch_size=3, method="ghost")(
            params, xs, ys
        )
        norms = per_example_grad_norms(mlp_loss, batch_size=3, method="ghost")(
            params, xs, ys
        )
    for s in (stats, ghost):
        tree_allclose(
            s.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4, atol=1e-6
        )
    np.testing.assert_allclose(ghost.sq_norms, (flat**2).sum(1), rtol=1e-5)
    np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=1e-5)
    assert norms.sharding.spec == jax.P("data")


@pytest.mark.parametrize(
    "batch, other_batch, method",
    [(3, 2, "vmap"), (8, None, "ghost"), (3, 2, "ghost")],
)
def test_gram_matches_vmap(batch, other_batch, method):
    params, x, y = mlp_data(7)
    _, flat = oracle_grads(mlp_loss, params, x, y)
    gram = per_example_grad_gram(
        mlp_loss, batch_size=batch, other_batch_size=other_batch, method=method
    )
    expected = flat @ flat.T
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(gram(params, x, y), expected, atol=1e-5 * scale)
    _, x2, y2 = mlp_data(5, seed=1)
    _, flat2 = oracle_grads(mlp_loss, params, x2, y2)
    cross = jax.jit(gram)(params, x, y, other=(params, x2, y2))
    assert cross.shape == (7, 5)
    np.testing.assert_allclose(cross, flat @ flat2.T, atol=1e-5 * scale)


def counted(loss):
    """`loss` with a host counter of its evaluations (under jax.vmap the callback
    sees the batch's examples together: it counts them)."""
    calls = HostLog()

    def fn(p, x, y):
        jax.debug.callback(lambda v: calls.extend([1] * np.size(v)), jnp.sum(x))
        return loss(p, x, y)

    return fn, calls


@pytest.mark.parametrize("n, batch", [(16, 4), (13, 3), (13, 5), (9, 8), (6, 6)])
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_gram_of_a_batch_with_itself_evaluates_about_half_of_it(n, batch, method):
    """A batch against itself: each chunk of rows (B examples from s) is dotted with
    the examples s, ..., s + min(N, N // 2 + B) - 1 (cyclically), its own among
    them, so a call evaluates chunks * (B + min(N, N // 2 + B)) gradients where
    the same batch passed as `other=` takes chunks * (B + N) (every loop's last
    chunk of a remainder is a whole window of B); the result is exactly symmetric
    and equals the oracle's (remainders, B > N / 2 and one chunk included)."""
    params, x, y = mlp_data(n)
    _, flat = oracle_grads(mlp_loss, params, x, y)
    expected = flat @ flat.T
    atol = 1e-5 * float(np.abs(expected).max())
    loss, calls = counted(mlp_loss)
    gram = per_example_grad_gram(loss, batch_size=batch, method=method)
    got = np.asarray(gram(params, x, y))

    def windows(k):  # examples evaluated by a loop over k in chunks of B
        return k if k <= batch else -(-k // batch) * batch

    chunks = -(-n // batch)
    evaluated = len(calls)
    assert evaluated == chunks * (
        windows(n) // chunks + windows(min(n, n // 2 + batch))
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol)
    np.testing.assert_array_equal(got, got.T)
    calls.clear()
    cross = gram(params, x, y, other=(params, x, y))
    assert len(calls) == chunks * (windows(n) // chunks + windows(n))
    np.testing.assert_allclose(cross, expected, rtol=1e-5, atol=atol)
    if chunks > 3:  # then the symmetric program evaluates fewer
        assert evaluated < len(calls)


@pytest.mark.runs_on_cpu(
    "XLA:CPU's figures grow with the chunk; a TPU's, tiled, need not"
)
def test_gram_evaluates_fewer_gradients_as_its_memory_grows():
    """`batch_size="auto"`: a larger `memory_limit` holds longer chunks of rows, so
    fewer chunks each dot their gradients with half of the batch."""
    params, x, y = mlp_data(48, sizes=(32, 64, 4))
    _, flat = oracle_grads(mlp_loss, params, x, y)
    expected = flat @ flat.T
    atol = 1e-5 * float(np.abs(expected).max())

    def figure(b):  # the program's memory by the figure auto compares
        return program_bytes(per_example_grad_gram(mlp_loss, batch_size=b), *data)

    data = (params, x, y)
    counts, sizes = [], []
    for b in (3, 8, 16):  # limits where chunks of b just fit
        limit = figure(b)
        loss, calls = counted(mlp_loss)
        gram = per_example_grad_gram(loss, batch_size="auto", memory_limit=limit)
        np.testing.assert_allclose(gram(params, x, y), expected, atol=atol)
        counts.append(len(calls))
        sizes.append(last_batch_size(gram))
    assert sizes == sorted(sizes) and len(set(sizes)) == 3, sizes
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == 3, counts


def _ghost_dots(loss, params, x, chunk):
    """The Gram's ghost evaluation of `loss(params, x)` for chunks of `chunk` rows:
    which leaves keep their ghost terms (`_GhostDots.ghost`)."""
    traced = _statistics.ghost.traced_loss(
        lambda key, build: build(),
        "gram",
        loss,
        (params, x),
        {},
        (0,),
        in_axes=(None, 0),
    )
    return _statistics._GhostDots(traced, chunk)


def test_ghost_gram_takes_a_layers_ghost_terms_only_where_they_cost_less(always_ghost):
    """Per pair of examples, a dense use's ghost terms cost `T^2 (d_in + d_out)`
    and its formed gradients' dot product `d_in d_out`, plus their formation shared
    by a chunk of rows (16 here): a 128 -> 128 layer keeps its ghost terms on 4
    positions and has its gradient formed on 48, where its ghost norm still pays
    (clipping's rule: under 64 positions). Both give the oracle's Gram (the ghost
    program run where it takes no layer's terms too: `always_ghost`)."""

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(128, 128)) / 11, jnp.float32)}
    for t, pays in ((4, True), (48, False)):
        x = jnp.asarray(rng.normal(size=(20, t, 128)), jnp.float32)
        dots = _ghost_dots(loss, params, x, 16)
        assert dots.traced.plan.leaves[0].rule == "ghost"
        assert dots.ghost == ([0] if pays else []), t
        _, flat = oracle_grads(loss, params, x)
        got = per_example_grad_gram(loss, batch_size=16, method="ghost")(params, x)
        expected = flat @ flat.T
        atol = 1e-5 * float(np.abs(expected).max())
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=atol)


def test_ghost_gram_shares_a_convolutions_patches_over_the_chunk():
    """A convolution's ghost terms also cost building its patches, once per
    example, shared by the chunk of rows (16 here): a 3x3 kernel over 5x5 images of
    16 channels keeps its ghost pair terms (they would not pay if building the
    patches cost a chunk's worth per pair)."""

    def loss(p, x):
        y = jax.lax.conv_general_dilated(x[None], p["k"], (1, 1), "VALID")
        return jnp.sum(jnp.tanh(y) ** 2)

    rng = np.random.default_rng(0)
    params = {"k": jnp.asarray(rng.normal(size=(16, 16, 3, 3)) / 10, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(20, 16, 5, 5)), jnp.float32)
    dots = _ghost_dots(loss, params, x, 16)
    assert dots.traced.plan.leaves[0].rule == "ghost"
    assert dots.ghost == [0]
    _, flat = oracle_grads(loss, params, x)
    got = per_example_grad_gram(loss, batch_size=16, method="ghost")(params, x)
    expected = flat @ flat.T
    atol = 1e-5 * float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=atol)


def test_gram_of_a_batch_with_itself_is_exactly_symmetric():
    """Over positions (a dense layer on 7 of them), the two chunks that reach a
    pair can round its ghost terms differently; the matrix takes one value for
    `(i, j)` and `(j, i)`."""

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(24, 40)) / 5, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(40, 6)) / 6, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(13, 7, 24)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(13, 7, 6)), jnp.float32)
    _, flat = oracle_grads(loss, params, x, y)
    expected = flat @ flat.T
    for method in ("vmap", "ghost"):
        got = np.asarray(
            per_example_grad_gram(loss, batch_size=3, method=method)(params, x, y)
        )
        np.testing.assert_array_equal(got, got.T)
        np.testing.assert_allclose(
            got, expected, rtol=1e-4, atol=1e-5 * abs(expected).max()
        )


def test_gram_of_a_batch_sharded_over_an_explicit_mesh():
    """A batch against itself on an Explicit 8-device mesh: 16 examples sharded
    over it (the rows of the matrix stay sharded; the columns' examples are
    gathered, else a row and a column would be sharded over one axis), and 13
    spread by `shard=True` (a remainder); both methods give the unsharded matrix."""
    params, x, y = mlp_data(16)
    _, flat = oracle_grads(mlp_loss, params, x, y)
    x, y = np.asarray(x), np.asarray(y)
    mesh = make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def grams(**options):
        fs = [
            per_example_grad_gram(mlp_loss, method=m, **options)
            for m in ("vmap", "ghost")
        ]
        return jax.jit(lambda *args: [f(*args) for f in fs])

    with jax.set_mesh(mesh):
        where = jax.P("data")
        even = grams(batch_size=4)(
            params, jax.device_put(x, where), jax.device_put(y, where)
        )
        uneven = grams(batch_size=3, shard=True)(
            params, jax.device_put(x[:13]), jax.device_put(y[:13])
        )
    expected = flat @ flat.T
    atol = 1e-5 * float(np.abs(expected).max())
    for g in even:
        np.testing.assert_allclose(g, expected, rtol=1e-5, atol=atol)
        assert g.sharding.spec[0] == "data"
    for g in uneven:
        np.testing.assert_allclose(g, expected[:13, :13], rtol=1e-5, atol=atol)


@pytest.mark.runs_on_cpu(
    "XLA:CPU's figures grow with the chunk; a TPU's, tiled, need not"
)
def test_gram_with_aux_and_auto():
    """`has_aux` (the rows' aux stacked) by both methods; `batch_size="auto"` with one
    size for both batches (the largest whose program fits, by XLA's estimate), and
    with the other batch's size given (the rows' size searched by the core)."""
    params, x, y = mlp_data(24, sizes=(32, 64, 4))
    _, flat = oracle_grads(mlp_loss, params, x, y)
    expected = flat @ flat.T
    atol = 1e-5 * float(np.abs(expected).max())

    def with_aux(p, x, y):
        return mlp_loss(p, x, y), {"y": y}

    for method in ("vmap", "ghost"):
        gram, aux = per_example_grad_gram(
            with_aux, has_aux=True, batch_size=5, other_batch_size=7, method=method
        )(params, x, y)
        np.testing.assert_allclose(gram, expected, atol=atol)
        np.testing.assert_array_equal(aux["y"], y)

    def figure(**kw):  # the program's memory by the figure auto compares
        return program_bytes(per_example_grad_gram(mlp_loss, **kw), params, x, y)

    # chunks of 4 fit, of 8 do not (on CPU: 73 and 145 kB of temporaries)
    limit = (figure(batch_size=4) + figure(batch_size=8)) // 2
    joint = per_example_grad_gram(mlp_loss, batch_size="auto", memory_limit=limit)
    np.testing.assert_allclose(joint(params, x, y), expected, atol=atol)
    b = last_batch_size(joint)
    assert 4 <= b < 8, b
    assert figure(batch_size=b) <= limit < figure(batch_size=b + 1)

    rows = per_example_grad_gram(
        mlp_loss, batch_size="auto", other_batch_size=2, memory_limit=limit
    )
    np.testing.assert_allclose(jax.jit(rows)(params, x, y), expected, atol=atol)
    b = last_batch_size(rows)
    rows_figure = functools.partial(figure, other_batch_size=2)
    assert rows_figure(batch_size=b + 1) > limit, b  # the largest that fits, or 1
    assert b == 1 or rows_figure(batch_size=b) <= limit, b
    if jax.default_backend() == "cpu":  # (an accelerator's figure holds the gram)
        assert 2 <= b < 24, b


def test_ghost_stats_on_the_dp_models_with_aux():
    """The LMs (gathered and tied embeddings, a scanned layer stack) and the convnet:
    one example's gradient at a time from its uses' activations and cotangents, and
    `aux` stacked per example (one chunk: the MLP's test has the remainder)."""
    params, loss, data, grads, flat = dp_case(7)

    def with_aux(params, *batch):
        return loss(params, *batch), batch[0]

    fn = per_example_grad_stats(with_aux, has_aux=True, method="ghost")
    stats = jax.jit(fn)(params, *data)
    tree_allclose(stats.mean, jax.tree.map(lambda g: g.mean(0), grads), atol=1e-5)
    tree_allclose(
        stats.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4, atol=1e-5
    )
    tree_allclose(
        stats.sum_sq, jax.tree.map(lambda g: (g**2).sum(0), grads), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(stats.sq_norms, (flat**2).sum(1), rtol=1e-4)
    np.testing.assert_array_equal(stats.aux, data[0])


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_per_leaf_norms(method):
    """`per_leaf=True`: each differentiated leaf's own per-example norm, a tree like
    the gradient's (None at an integer leaf), on an MLP and (ghost, whose rules
    give the leaves' norms) the LMs (gathered and tied embeddings, a scanned
    stack) and the convnet, eager and under jit, N uneven in chunks of 3; their
    root sum of squares is the global norm; the statistics' squared norms per
    leaf likewise. (The vmap program forms the gradients: its per-leaf norms are
    those of the formed tree on any model.)"""
    if method == "ghost":
        params, loss, data, grads, flat = dp_case(7)
    else:
        params, *data = mlp_data(7)
        loss = mlp_loss
        grads, flat = oracle_grads(loss, params, *data)
    fn = per_example_grad_norms(loss, batch_size=3, method=method, per_leaf=True)
    norms = jax.jit(fn)(params, *data)
    expected = jax.tree.map(
        lambda g: np.linalg.norm(g.reshape(g.shape[0], -1), axis=1), grads
    )
    tree_allclose(norms, expected, rtol=1e-4, atol=1e-5)
    total = np.sqrt(sum(np.asarray(n) ** 2 for n in jax.tree.leaves(norms)))
    np.testing.assert_allclose(total, np.linalg.norm(flat, axis=1), rtol=1e-4)
    stats = per_example_grad_stats(loss, batch_size=3, method=method, per_leaf=True)
    squares = stats(params, *data).sq_norms  # eager
    tree_allclose(squares, jax.tree.map(np.square, expected), rtol=2e-4, atol=1e-6)

    p, x, y = mlp_data(5)
    p = {"mlp": p, "steps": jnp.int32(3)}  # not differentiated: None

    def mlp_with_count(p, x, y):
        return mlp_loss(p["mlp"], x, y)

    got = per_example_grad_norms(
        mlp_with_count, batch_size=3, method=method, per_leaf=True
    )(p, x, y)
    assert got["steps"] is None
    mlp_grads, _ = oracle_grads(mlp_loss, p["mlp"], x, y)
    tree_allclose(
        got["mlp"],
        jax.tree.map(lambda g: np.linalg.norm(g.reshape(5, -1), axis=1), mlp_grads),
        rtol=1e-5,
    )


def test_gram_on_the_dp_models_and_a_parameter_subset():
    """The LMs and the convnet by ghost rules (dense pairs over tokens, embedding
    rows matched by token, convolution patches), a batch against another (the MLP's
    test covers a batch against itself); then the dot products of the convnet's
    output layer only (its other parameters passed unmapped, not differentiated)."""
    params, loss, data, _, flat = dp_case(7)
    *_, other, _, other_flat = dp_case(3, seed=50)
    gram = jax.jit(per_example_grad_gram(loss, batch_size=3, method="ghost"))
    cross = gram(params, *data, other=(params, *other))
    expected = flat @ other_flat.T
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(cross, expected, atol=1e-5 * scale)

    def last_layer_loss(fc, rest, tokens, img, label):
        return models.cnn_loss({**rest, "fc": fc}, img, label)

    cnn = params["cnn"]
    rest = {k: v for k, v in cnn.items() if k != "fc"}
    _, fc_flat = oracle_grads(
        lambda fc, *d: last_layer_loss(fc, rest, *d), cnn["fc"], *data
    )
    sub = per_example_grad_gram(last_layer_loss, batch_argnums=(2, 3, 4), batch_size=2)(
        cnn["fc"], rest, *data
    )
    np.testing.assert_allclose(sub, fc_flat @ fc_flat.T, rtol=1e-5, atol=1e-6)


def test_equinox_and_flax_models_as_parameters():
    """An Equinox MLP (its activation function and static fields are not
    differentiated): ghost norms and stats as from `eqx.filter_vmap(eqx.filter_grad)`;
    a linen layer's variables and an NNX layer's state: ghost moments and Gram as from
    `jax.vmap(jax.grad)`. (Ghost norms on the layers of every framework and on the DP
    models are `test_ghost_models`' clipped sums' norms: the same evaluation, which
    the norms run without the sum.)"""
    import flax.linen as nn
    from flax import nnx

    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (9, 3))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    grads = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(loss), in_axes=(None, 0)))(
        model, x
    )
    grads = jax.tree.map(np.asarray, grads)
    flat = np.concatenate([g.reshape(9, -1) for g in jax.tree.leaves(grads)], 1)
    norms = per_example_grad_norms(loss, batch_size=4, method="ghost")(model, x)
    np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=1e-5)
    stats = per_example_grad_stats(loss, batch_size=4)(model, x)
    expected = jax.tree.map(lambda g: g.var(0), grads)
    tree_allclose(
        jax.tree.leaves(stats.variance), jax.tree.leaves(expected), rtol=1e-4, atol=1e-6
    )

    dense = nn.Dense(2)
    graphdef, state = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(2)))
    for params, apply in (
        (dense.init(jax.random.key(1), x[:1]), dense.apply),
        (state, lambda s, x: nnx.merge(graphdef, s)(x)),
    ):

        def flax_loss(params, x):
            return jnp.sum(jnp.tanh(apply(params, x)) ** 2)

        grads, flat = oracle_grads(flax_loss, params, x)
        stats = per_example_grad_stats(flax_loss, batch_size=4, method="ghost")(
            params, x
        )
        assert jax.tree.structure(stats.mean) == jax.tree.structure(params)
        tree_allclose(
            stats.variance, jax.tree.map(lambda g: g.var(0), grads), atol=1e-6
        )
        gram = per_example_grad_gram(flax_loss, batch_size=4, method="ghost")(params, x)
        np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-5, atol=1e-6)


def test_memory_is_a_chunk_of_gradients_not_n():
    """Compiled temporary memory of N = 512 examples of a 784-256-10 MLP (about
    200k parameters) in chunks of 16: each statistic holds a few chunks of
    gradients, where `jax.vmap(jax.grad)` holds all N."""
    params, x, y = mlp_data(512, sizes=(784, 256, 10))
    n_params = sum(a.size for a in jax.tree.leaves(params))
    chunk = 16 * n_params * 4  # 13 MB, where N gradients are 417 MB
    for fn in (
        per_example_grad_stats(mlp_loss, batch_size=16),
        per_example_grad_norms(mlp_loss, batch_size=16),
        per_example_grad_norms(mlp_loss, batch_size=16, method="ghost"),
    ):
        assert temp_bytes(fn, params, x, y) < 4 * chunk
    # one example's gradient at a time beside the moments (each leaf's shift, mean
    # and centred sum of squares, a chunk's and the running ones): a few
    # parameter copies
    ghost_stats = per_example_grad_stats(mlp_loss, batch_size=16, method="ghost")
    assert temp_bytes(ghost_stats, params, x, y) < chunk / 2
    gram = per_example_grad_gram(mlp_loss, batch_size=16, other_batch_size=8)
    assert temp_bytes(gram, params, x, y) < 4 * chunk
    # by ghost rules: activations and cotangents only, no gradient formed
    ghost = per_example_grad_gram(
        mlp_loss, batch_size=16, other_batch_size=8, method="ghost"
    )
    assert temp_bytes(ghost, params, x, y) < chunk / 8


def test_memory_of_the_ghost_statistics_on_an_lm_scale_model():
    """`test_ghost_models.memory_case` (an 8192-row embedding, a scanned stack, a
    late convolution; 3.35 MB of parameters), N = 64 in chunks of 16: by ghost
    rules the norms, the moments and the Gram hold a few copies of the parameters,
    where a chunk of gradients is 16 copies (measured: norms 1.2, moments 5.5 (a
    shift, a mean and a centred sum of squares per leaf, a chunk's and the running
    ones), Gram 1.7; `method="vmap"` 23 for the moments and 38 for the Gram, a chunk
    of each batch)."""
    p, loss, tokens, img = models.memory_case()
    size = 4 * sum(x.size for x in jax.tree.leaves(p))
    for fn, copies in (
        (per_example_grad_norms, 2),
        (per_example_grad_stats, 6.5),
        (per_example_grad_gram, 2.5),
    ):
        temp = temp_bytes(fn(loss, batch_size=16, method="ghost"), p, tokens, img)
        assert temp < copies * size, (fn.__name__, temp / size)


def test_ghost_moments_of_an_uneven_n_in_the_memory_of_an_even_one():
    """`per_example_grad_stats(method="ghost")` on a grouped convolution (32 to 64
    channels in 4 groups, 8x8 NCHW images) in chunks of 32: N = 45 holds what N =
    64 holds, within a few bytes (the last window summarised at the chunk's length,
    the examples earlier chunks counted weighted 0; a branch at the remainder's
    length held 1.4x as much), with the moments of `jax.vmap(jax.grad)`."""
    rng = np.random.default_rng(140)
    p = {
        "k": jnp.asarray(rng.normal(size=(64, 8, 3, 3)) * 0.1, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(64, 3)) * 0.1, jnp.float32),
    }

    def loss(p, img, y):
        h = jax.lax.conv_general_dilated(
            img[None], p["k"], (1, 1), "SAME", feature_group_count=4
        )[0]
        return jnp.sum((jnp.tanh(h).mean((1, 2)) @ p["head"] - y) ** 2)

    img = jnp.asarray(rng.normal(size=(64, 32, 8, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)
    stats = per_example_grad_stats(loss, batch_size=32, method="ghost")
    got = stats(p, img[:45], y[:45])
    grads = jax.vmap(jax.grad(loss), (None, 0, 0))(p, img[:45], y[:45])
    tree_allclose(got.mean, jax.tree.map(lambda g: g.mean(0), grads))
    tree_allclose(got.variance, jax.tree.map(lambda g: g.var(0), grads), rtol=1e-4)
    uneven = temp_bytes(stats, p, img[:45], y[:45])
    assert uneven <= 1.01 * temp_bytes(stats, p, img, y), uneven  # (+ a mask)


def test_errors_name_the_function_and_argument():
    params, x, y = mlp_data(3)
    with pytest.raises(ValueError, match="per_example_grad_stats needs at least one"):
        per_example_grad_stats(mlp_loss)(params, x[:0], y[:0])
    with pytest.raises(ValueError, match="per_example_grad_norms method must be one"):
        per_example_grad_norms(mlp_loss, method="fast")
    with pytest.raises(ValueError, match="other= must hold fun's 3 positional"):
        per_example_grad_gram(mlp_loss)(params, x, y, other=(params, x))
    with pytest.raises(TypeError, match="takes fun's positional arguments and other="):
        per_example_grad_gram(mlp_loss)(params, x, y, scale=2.0)
    with pytest.raises(TypeError, match="other_batch_size must be a positive int or"):
        per_example_grad_gram(mlp_loss, batch_size="auto", other_batch_size="auto")
    with pytest.raises(ValueError, match="method='ghost' needs other= examples of"):
        per_example_grad_gram(mlp_loss, method="ghost")(
            params, x, y, other=(params, x[:, :2], y)
        )


def test_tracin_example_finds_flipped_labels_and_proponents(capsys):
    """examples/tracin.py: ghost self-influence ranks the flipped labels first (far
    above chance; the final loss's ranking is reported beside it), proponents by
    cosine influence share their test example's label and are not the mislabelled
    examples that raw dot products favour, and the scores are `sum_c lr
    <g_c(train), g_c(test)>` and its cosine form, computed from
    `jax.vmap(jax.grad)`."""
    path = pathlib.Path(__file__).parents[1] / "examples" / "tracin.py"
    spec = importlib.util.spec_from_file_location("tracin", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--epochs", "4", "--test-examples", "2"])
    assert "strongest proponents" in capsys.readouterr().out
    assert result["precision"] > 10 * result["chance"]
    assert 0 < result["loss_precision"] <= 1
    assert result["same_label"] >= 0.8
    mislabelled = result["mislabelled_proponents"]
    assert mislabelled["cosine"] <= 1 < mislabelled["raw"], mislabelled
    (x, y), (xs, ys) = result["train"], result["test"]
    expected, cosine = 0.0, 0.0
    for params in result["checkpoints"]:
        _, train_flat = oracle_grads(module.loss, params, x, y)
        _, test_flat = oracle_grads(module.loss, params, xs, ys)
        dots = 0.1 * train_flat @ test_flat.T
        expected = expected + dots
        outer = np.outer(
            np.linalg.norm(train_flat, axis=1), np.linalg.norm(test_flat, axis=1)
        )
        cosine = cosine + dots / (outer + 1e-12)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(result["scores"], expected, atol=1e-5 * scale)
    np.testing.assert_allclose(result["cosine"], cosine, atol=1e-4)
    # projected TracIn beside the exact one: the same ranking, and its sum
    # against the projected `jax.vmap(jax.grad)` rows
    assert result["spearman"] > 0.95, result["spearman"]
    for found in result["projected_precision"].values():
        assert found > 10 * result["chance"], result["projected_precision"]
    own = sum(
        0.1 * np.sum(projected_grads(module.loss, p, (x, y), dim=16) ** 2, 1)
        for p in result["checkpoints"]
    )
    np.testing.assert_allclose(result["projected"]["self"], own, rtol=1e-4)


def _conv_net(p, x, y):
    h = jax.lax.conv_general_dilated(x[None], p["k"], (1, 1), "SAME")[0]
    return jnp.sum((jnp.tanh(h).reshape(-1) @ p["head"] - y) ** 2)


def _dense_net(p, x, y):
    return jnp.sum((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize(
    "net",
    [
        "dense",
        pytest.param(
            "conv",
            marks=pytest.mark.runs_on_cpu(
                "a TPU has no float64 convolution: XLA:TPU's emulated one (8x8 "
                "images, 4 channels) did not finish in five minutes on a v5e"
            ),
        ),
    ],
)
def test_float64_statistics_keep_float64_precision(method, net, always_ghost):
    """With x64 on, float64 gradients' statistics are float64 to float64 precision
    over several chunks and with ghost (the merge weights were float32: means 1e-6
    off relatively), and a convolution's ghost rules run (their window offsets
    crashed `dynamic_slice` as int64 beside int32)."""
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        if net == "dense":
            fun, d = _dense_net, 16
            p = {"w": rng.normal(size=(d, d)), "b": rng.normal(size=d)}
            x = 3 * rng.normal(size=(11, d))
        else:
            fun = _conv_net
            p = {
                "k": 0.3 * rng.normal(size=(4, 3, 3, 3)),
                "head": rng.normal(size=(256, 2)),
            }
            x = rng.normal(size=(11, 3, 8, 8))
        p = jax.tree.map(jnp.asarray, p)
        x, y = (
            jnp.asarray(x),
            jnp.asarray(rng.normal(size=(11, 16 if net == "dense" else 2))),
        )
        g = jax.vmap(jax.grad(fun), (None, 0, 0))(p, x, y)
        mean, var = (
            jax.tree.map(lambda a: a.mean(0), g),
            jax.tree.map(lambda a: a.var(0), g),
        )
        norms = jnp.sqrt(
            sum(jnp.sum(a.reshape(11, -1) ** 2, 1) for a in jax.tree.leaves(g))
        )
        for b in (3, 11):
            stats = per_example_grad_stats(fun, batch_size=b, method=method)(p, x, y)
            tree_allclose(stats[0], mean, rtol=1e-11, atol=1e-13)
            tree_allclose(stats[1], var, rtol=1e-11, atol=1e-13)
            got = per_example_grad_norms(fun, batch_size=b, method=method)(p, x, y)
            tree_allclose(got, norms, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_the_gram_of_zero_examples_is_empty(method):
    """Zero examples (on either side) give an empty matrix, and an empty aux (it
    raised about a reduction, or divided by zero)."""
    p = {"w": jnp.ones((5, 3), jnp.float32)}

    def loss(p, x):
        return jnp.sum((x @ p["w"]) ** 2), x.sum()

    gram = per_example_grad_gram(loss, has_aux=True, method=method, batch_size=2)
    matrix, aux = gram(p, jnp.ones((0, 5)))
    assert matrix.shape == (0, 0) and aux.shape == (0,)
    matrix, aux = gram(p, jnp.ones((3, 5)), other=(p, jnp.ones((0, 5))))
    assert matrix.shape == (3, 0) and aux.shape == (3,)
    tree_allclose(matrix, jnp.zeros((3, 0), jnp.float32))


@pytest.mark.parametrize("jit", [False, True])
def test_ghost_moments_never_merge_padding_that_nothing_stands_in_for(
    monkeypatch, always_ghost, jit
):
    """Each chunk evaluates its padding on a real example's values; were that not
    so (nothing stood in), the ghost moments would still merge a padding example
    with weight 0 and its NaN gradient masked: the statistics are the real
    examples' (N = 7 real of 10, chunks of 4)."""
    from chunkvmap._core import _loop

    monkeypatch.setattr(_loop.Chunks, "stand_in", lambda self, chunk, *_: chunk)

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)

    rng = np.random.default_rng(3)
    p = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)
    pad = jnp.arange(10) >= 7
    x = jnp.where(pad[:, None], jnp.nan, x)
    f = chunkvmap.per_example_grad_stats(loss, batch_size=4, method="ghost")
    got = (jax.jit(f) if jit else f)(p, x, is_padding_example=pad)
    want = chunkvmap.per_example_grad_stats(loss)(p, x[:7])
    tree_allclose(got.mean, want.mean, rtol=1e-5, atol=1e-6)
    tree_allclose(got.variance, want.variance, rtol=1e-4, atol=1e-6)
