"""Every entry point, however the caller holds the mesh (8 simulated devices).

The matrix crosses five dimensions:

* how the mesh is held: `mesh=` only, inputs placed with `jax.device_put` only,
  `jax.set_mesh` only, none at all (`shard=True`: all devices), and the mixes
  `mesh=` + placed and `jax.set_mesh` + placed;
* the mesh: Explicit (8,), Auto (8,), and Explicit (4, 2) with a "model" axis that
  the weights are sharded over;
* the call: eager, `jax.jit`, `jax.grad`, `jax.jit(jax.grad)`, `jax.vmap` of it;
* N: divisible by the devices (16), uneven (13), fewer than the devices (3), 1;
* what the function holds (`HOLDINGS`): nothing more; a typed PRNG key (a fixed
  dropout mask); a scalar that the caller's `jax.jit` traces (the transform built
  inside the jitted step); a weight shared by every layer of a scanned stack
  (`broadcast_to` fed to `lax.scan`); float64 throughout (x64 on); a padded
  buffer (every third example padding, NaN-filled: the entry points that take
  `is_padding_example=`; their references compute the real examples alone);
* the entry point: every public transform and the three adapters.

Every pair of values of any two dimensions appears in some case (a greedy pairwise
covering, deterministic), and every entry point meets every way of holding a mesh.
Each case is checked against the same computation by `jax.vmap` on unsharded
inputs, and for stacked `batch_vmap` outputs the sharding against `jax.vmap`'s on
the same inputs. Where `jax.vmap` itself refuses the call (eager `jax.grad` of an
output typed over an Explicit mesh with no mesh entered: JAX cannot place the
cotangent's seed), chunkvmap may refuse it too, with the same error. The docs'
sharding page shows `table()`; a test keeps it in step.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import chunkvmap as cv

from .helpers import clipped_sum, make_mesh, mesh_devices, projected_rows


pytestmark = pytest.mark.skipif(
    len(mesh_devices(8)) < 8, reason="needs 8 devices (jax_num_cpu_devices=8)"
)

ENTRIES = (
    "batch_vmap",
    "batch_vmap(reduction)",
    "batch_map",
    "batch_vectorize",
    "per_example_grads",
    "clipped_grad_sum",
    "clipped_grad_sum(ghost)",
    "clipped_grad",
    "per_example_grad_norms",
    "per_example_grad_stats",
    "per_example_grad_gram",
    "ggn_diagonal",
    "kfac_factors",
    "per_example_grad_projections",
    "per_example_grad_projections(ghost)",
    "eqx.filter_batch_vmap",
    "linen.batch_vmap",
    "nnx.batch_vmap",
)
HOLDS = ("mesh=", "placed", "set_mesh", "none", "mesh= + placed", "set_mesh + placed")
KINDS = ("explicit", "auto", "2d")
MODES = ("eager", "jit", "grad", "jit(grad)", "vmap")
SIZES = (16, 13, 3, 1)
HOLDINGS = ("plain", "typed key", "traced scalar", "shared stack", "float64", "padded")
# The entry points that take a padded buffer (`is_padding_example=`): with "padded",
# every third example is padding, filled with NaN.
PADDED = {
    "batch_vmap", "batch_map", "clipped_grad_sum", "clipped_grad_sum(ghost)",
    "per_example_grad_norms", "per_example_grad_stats",
}  # fmt: skip
DIMS = (ENTRIES, HOLDS, KINDS, MODES, SIZES, HOLDINGS)


def _pairwise() -> list[tuple]:
    """A deterministic set of cases covering every pair of values of any two
    dimensions: one case per (entry point, way of holding the mesh), each other
    dimension's value chosen to cover the most pairs not yet covered (ties: the
    value used least so far), then cases for any pair left."""
    todo = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(DIMS)), 2)
        for a in DIMS[i]
        for b in DIMS[j]
    }
    used: dict[tuple[int, object], int] = {}
    cases = []

    def complete(partial: dict[int, object]) -> tuple:
        for d in range(len(DIMS)):
            if d in partial:
                continue

            def gain(v, d=d):
                new = sum(_pair(d, v, e, partial[e]) in todo for e in partial)
                return (new, -used.get((d, v), 0))

            partial[d] = max(DIMS[d], key=gain)
        case = tuple(partial[d] for d in range(len(DIMS)))
        for d, v in enumerate(case):
            used[(d, v)] = used.get((d, v), 0) + 1
        for i, j in itertools.combinations(range(len(DIMS)), 2):
            todo.discard((i, case[i], j, case[j]))
        return case

    for entry, hold in itertools.product(ENTRIES, HOLDS):
        cases.append(complete({0: entry, 1: hold}))
    while todo:
        i, a, j, b = min(todo, key=repr)
        cases.append(complete({i: a, j: b}))
    return cases


def _pair(d: int, v: object, e: int, w: object) -> tuple:
    return (d, v, e, w) if d < e else (e, w, d, v)


CASES = _pairwise()


def table() -> str:
    """The entry points x ways of holding a mesh, with the calls each is tested in
    (markdown; docs/sharding.md shows it)."""
    modes: dict[tuple[str, str], set[str]] = {}
    for entry, hold, _, mode, *_ in CASES:
        modes.setdefault((entry, hold), set()).add(mode)
    lines = [
        "| entry point | "
        + " | ".join(f"`{h}`" if "=" in h else h for h in HOLDS)
        + " |",
        "|---" * (len(HOLDS) + 1) + "|",
    ]
    for entry in ENTRIES:
        cells = [
            ", ".join(m for m in MODES if m in modes.get((entry, h), ())) for h in HOLDS
        ]
        lines.append(f"| `{entry}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mesh_of(kind: str):
    if kind == "2d":
        return make_mesh((4, 2), ("data", "model"))
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return make_mesh((8,), ("data",), axis_types=(axis_type,))


def mesh_args(hold: str, kind: str, mesh) -> dict:
    """The chunking options a user holding the mesh this way passes."""
    if hold == "none":
        return {"shard": True}
    names = "data" if kind == "2d" else True
    if "mesh=" in hold:
        return {"shard": names, "mesh": mesh}
    if kind == "auto":  # an Auto mesh's layout is not in the types: name its axis
        return {"shard": "data"}
    return {}


_KEY = jax.random.key(11)


def model(holding: str = "plain", s=1.25):
    """`f(w, x)`: one example's output, holding what `holding` names (`s`: the
    scalar, traced by the caller's `jax.jit` for "traced scalar")."""

    def f(w, x):
        if holding == "typed key":  # a fixed dropout mask
            keep = jax.random.bernoulli(jax.random.fold_in(_KEY, 1), 0.7, (8,))
            return jnp.where(keep, jnp.tanh(x @ w), 0.0)
        if holding == "traced scalar":
            return jnp.tanh(x @ (s * w))
        if holding == "shared stack":  # every layer reads the same weight
            layers = jnp.broadcast_to(w, (2, *w.shape))
            step = lambda c, v: (c * jnp.tanh(x @ v), None)  # noqa: E731
            return jax.lax.scan(step, jnp.tanh(x @ w), layers)[0]
        return jnp.tanh(x @ w)

    return f


def loss_of(f):
    return lambda w, x: jnp.sum(f(w, x) ** 2)


f, loss = model(), loss_of(model())


def entry_point(entry: str, opts: dict, holding: str = "plain", s=1.25):
    """`(chunked, reference)`: functions of `(w, x)` computing the same thing, the
    first with `entry` and `opts`, the second with `jax.vmap`; the function holds
    what `holding` names."""
    f = model(holding, s)
    loss = loss_of(f)

    def _grads(w, x):
        return jax.vmap(jax.grad(loss), (None, 0))(w, x)

    b = dict(batch_size=2, **opts)
    if entry == "batch_vmap":
        return cv.batch_vmap(f, (None, 0), **b), jax.vmap(f, (None, 0))
    if entry == "batch_vmap(reduction)":
        chunked = cv.batch_vmap(
            f, (None, 0), reduction=jnp.add, chunk_reduction=lambda y: y.sum(0), **b
        )
        return chunked, lambda w, x: jax.vmap(f, (None, 0))(w, x).sum(0)
    if entry == "batch_map":
        return (
            lambda w, x: cv.batch_map(lambda xs: jax.vmap(f, (None, 0))(w, xs), x, **b),
            jax.vmap(f, (None, 0)),
        )
    if entry == "batch_vectorize":
        vec = cv.batch_vectorize(f, signature="(i,j),(i)->(j)", **b)
        return (lambda w, x: vec(w[None], x)), jax.vmap(f, (None, 0))
    if entry == "per_example_grads":
        return cv.per_example_grads(loss, **b), _grads
    if entry in ("clipped_grad_sum", "clipped_grad_sum(ghost)"):
        method = "ghost" if "ghost" in entry else "vmap"
        summed = cv.clipped_grad_sum(loss, 1.0, method=method, **b)
        return (
            lambda w, x: summed(w, x)[0],
            lambda w, x: clipped_sum(loss, 1.0, (w, x))[0],
        )
    if entry == "clipped_grad":
        clipped = cv.clipped_grad(
            lambda w, xs: jnp.sum(jax.vmap(loss, (None, 0))(w, xs)),
            l2_clip_norm=1.0,
            batch_argnums=1,
            **b,
        )
        return clipped, lambda w, x: clipped_sum(loss, 1.0, (w, x))[0]
    if entry == "per_example_grad_norms":
        return (
            cv.per_example_grad_norms(loss, **b),
            lambda w, x: jnp.sqrt(jnp.sum(_grads(w, x) ** 2, axis=(1, 2))),
        )
    if entry == "per_example_grad_stats":
        stats = cv.per_example_grad_stats(loss, **b)
        return (
            lambda w, x: stats(w, x).mean,
            lambda w, x: _grads(w, x).mean(0),
        )
    if entry == "per_example_grad_gram":
        g = lambda w, x: _grads(w, x).reshape(x.shape[0], -1)  # noqa: E731
        return (
            cv.per_example_grad_gram(loss, **b),
            lambda w, x: g(w, x) @ g(w, x).T,
        )
    if entry == "ggn_diagonal":  # halved squared error: the Jacobian's squares
        return (
            cv.ggn_diagonal(f, likelihood="gaussian", **b),
            lambda w, x: jnp.sum(jax.vmap(jax.jacfwd(f), (None, 0))(w, x) ** 2, (0, 1)),
        )
    if entry == "kfac_factors":  # sum x x^T, and sum diag(f'(x w)^2)
        kfac = cv.kfac_factors(f, likelihood="gaussian", **b)

        def factors(w, x):
            k = kfac(w, x)
            return (k.inputs, k.outputs) if isinstance(k, cv.Kronecker) else k

        def oracle(w, x):
            if holding in ("traced scalar", "shared stack"):  # w's diagonal
                jac = jax.vmap(jax.jacfwd(f), (None, 0))(w, x)
                return jnp.sum(jac**2, (0, 1))
            slope = jax.vmap(jax.grad(lambda z: jnp.sum(f_of_pre(z))))(x @ w)
            return jax.vmap(jnp.outer)(x, x).sum(0), jnp.diag(jnp.sum(slope**2, 0))

        def f_of_pre(z):  # f as a function of x @ w
            if holding == "typed key":
                keep = jax.random.bernoulli(jax.random.fold_in(_KEY, 1), 0.7, (8,))
                return jnp.where(keep, jnp.tanh(z), 0.0)
            return jnp.tanh(z)

        return factors, oracle
    if entry.startswith("per_example_grad_projections"):
        method = "ghost" if "ghost" in entry else "vmap"
        project = cv.per_example_grad_projections(loss, dim=4, method=method, **b)
        return project, lambda w, x: projected_rows(_grads(w, x), 4)
    if entry == "eqx.filter_batch_vmap":
        from chunkvmap.eqx import filter_batch_vmap

        return filter_batch_vmap(f, in_axes=(None, 0), **b), jax.vmap(f, (None, 0))
    if entry == "linen.batch_vmap":
        import flax.linen as nn

        from chunkvmap import linen as cl

        dense = cl.batch_vmap(
            nn.Dense,
            variable_axes={"params": None},
            split_rngs={"params": False},
            in_axes=0,
            **b,
        )(8, use_bias=False)
        return (
            lambda w, x: dense.apply({"params": {"kernel": w}}, x[:, None, :])[:, 0],
            lambda w, x: x @ w,
        )
    if entry == "nnx.batch_vmap":
        from chunkvmap import nnx as cn

        return cn.batch_vmap(f, in_axes=(None, 0), **b), jax.vmap(f, (None, 0))
    raise AssertionError(entry)


def inputs(n: int, hold: str, mesh, kind: str, dtype=np.float32):
    rng = np.random.default_rng(n)
    w = (rng.normal(size=(6, 8)) / 3).astype(dtype)
    x = rng.normal(size=(n, 6)).astype(dtype)
    if "placed" not in hold:
        return jax.device_put(w), jax.device_put(x)
    data = "data" if n % mesh.shape["data"] == 0 else None
    model = "model" if kind == "2d" else None
    return (
        jax.device_put(w, NamedSharding(mesh, P(None, model))),
        jax.device_put(x, NamedSharding(mesh, P(data))),
    )


def called(fn, mode: str):
    """`fn(w, x)` as `mode` calls it."""

    def total(w, x):
        return sum(jnp.sum(y) for y in jax.tree.leaves(fn(w, x)))

    if mode == "eager":
        return fn
    if mode == "jit":
        return jax.jit(fn)
    if mode == "grad":  # with respect to the weights and the mapped examples
        return jax.grad(total, (0, 1))
    if mode == "jit(grad)":
        return jax.jit(jax.grad(total, (0, 1)))
    return lambda w, x: jax.vmap(fn, (None, 0))(w, jnp.stack([x, 0.5 * x]))


def _padding(n: int) -> np.ndarray:
    return np.arange(n) % 3 == 1


def padded_entry(entry: str, opts: dict):
    """`(chunked, reference)` of `entry` over a padded buffer (`_padding`): the
    chunked one takes the NaN-filled buffer and its flags; the reference, the
    same buffer, computes on the real examples alone (a padding row's stacked
    outputs zeros), its NaN never read (`where`, so that its derivatives are the
    real examples' too)."""
    b = dict(batch_size=2, **opts)

    def clean(x):
        pad = _padding(x.shape[0])
        return jnp.where(pad[:, None], jnp.ones((), x.dtype), x), pad

    def rows(values, pad):
        shape = (-1,) + (1,) * (values.ndim - 1)
        return jnp.where(pad.reshape(shape), jnp.zeros((), values.dtype), values)

    def filled(x):
        return jnp.where(_padding(x.shape[0])[:, None], jnp.nan, x)

    grads = lambda w, x: jax.vmap(jax.grad(loss), (None, 0))(w, x)  # noqa: E731
    if entry == "batch_vmap":
        run = cv.batch_vmap(f, (None, 0), padded=True, **b)
        chunked = lambda w, x: run(w, filled(x), is_padding_example=_padding(len(x)))  # noqa: E731
        return chunked, lambda w, x: rows(
            jax.vmap(f, (None, 0))(w, clean(x)[0]), clean(x)[1]
        )
    if entry == "batch_map":

        def chunked(w, x):
            fn = lambda xs: jax.vmap(f, (None, 0))(w, xs)  # noqa: E731
            return cv.batch_map(fn, filled(x), is_padding_example=_padding(len(x)), **b)

        return chunked, lambda w, x: rows(
            jax.vmap(f, (None, 0))(w, clean(x)[0]), clean(x)[1]
        )
    if entry.startswith("clipped_grad_sum"):
        method = "ghost" if "ghost" in entry else "vmap"
        summed = cv.clipped_grad_sum(loss, 1.0, method=method, **b)

        def reference(w, x):
            x, pad = clean(x)
            return clipped_sum(loss, 1.0, (w, x[~pad]))[0]

        return (
            lambda w, x: summed(w, filled(x), is_padding_example=_padding(len(x)))[0],
            reference,
        )
    if entry == "per_example_grad_norms":
        norms = cv.per_example_grad_norms(loss, **b)

        def reference(w, x):
            x, pad = clean(x)
            return rows(jnp.sqrt(jnp.sum(grads(w, x) ** 2, axis=(1, 2))), pad)

        return (
            lambda w, x: norms(w, filled(x), is_padding_example=_padding(len(x))),
            reference,
        )
    stats = cv.per_example_grad_stats(loss, **b)  # the mean over the real examples

    def reference(w, x):
        x, pad = clean(x)
        return grads(w, x[~pad]).mean(0)

    return (
        lambda w, x: stats(w, filled(x), is_padding_example=_padding(len(x))).mean,
        reference,
    )


def _run(entry: str, opts: dict, holding: str, mode: str, which: int):
    """`called(...)` of the chunked (`which=0`) or reference (1) computation, as a
    function of `(w, x)`; for "traced scalar", inside a `jax.jit` that traces the
    scalar and builds the transform there."""
    if holding == "padded" and entry in PADDED:
        return called(padded_entry(entry, opts)[which], mode)
    if holding != "traced scalar":
        return called(entry_point(entry, opts, holding)[which], mode)

    def step(w, x, s):
        return called(entry_point(entry, opts, holding, s)[which], mode)(w, x)

    return lambda w, x: jax.jit(step)(w, x, jnp.asarray(1.25, w.dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_entry_point_wherever_the_mesh_is_held(case, opts=None):
    """`opts`: chunking options in place of those `mesh_args` gives."""
    entry, hold, kind, mode, n, *rest = case
    holding = rest[0] if rest else "plain"
    with jax.enable_x64(holding == "float64"), warnings.catch_warnings():
        # (a weight every layer shares, or a traced scale, is per-example there)
        warnings.simplefilter("ignore", cv.GhostFallbackWarning)
        _check_case(entry, hold, kind, mode, n, holding, opts)


def _check_case(entry, hold, kind, mode, n, holding, opts) -> None:
    mesh = mesh_of(kind)
    opts = mesh_args(hold, kind, mesh) if opts is None else opts
    dtype = np.float64 if holding == "float64" else np.float32
    w, x = inputs(n, hold, mesh, kind, dtype)
    held = jax.set_mesh(mesh) if "set_mesh" in hold else contextlib.nullcontext()
    plain_w, plain_x = jax.device_get((w, x))
    want = jax.jit(_run(entry, opts, holding, mode, 1))(plain_w, plain_x)
    with held:
        try:
            got = _run(entry, opts, holding, mode, 0)(w, x)
        except Exception as error:  # only where jax.vmap refuses it too
            with pytest.raises(type(error)):
                _run(entry, opts, holding, mode, 1)(w, x)
            return
    assert {y.dtype for y in jax.tree.leaves(got)} == {
        y.dtype for y in jax.tree.leaves(want)
    }
    got_flat, want_flat = (
        np.concatenate([np.ravel(y) for y in jax.tree.leaves(t)]) for t in (got, want)
    )
    scale = max(1.0, float(np.max(np.abs(want_flat), initial=0.0)))
    np.testing.assert_allclose(got_flat, want_flat, rtol=2e-5, atol=2e-6 * scale)
    if entry == "batch_vmap" and mode in ("eager", "jit") and "placed" in hold:
        with held:
            ref = _run(entry, opts, holding, mode, 1)(w, x)
        assert got.sharding.spec == ref.sharding.spec, (got.sharding, ref.sharding)


def test_the_matrix_covers_every_pair_and_every_holding():
    assert {(e, h) for e, h, *_ in CASES} == set(itertools.product(ENTRIES, HOLDS))
    for i, j in itertools.combinations(range(len(DIMS)), 2):
        seen = {(c[i], c[j]) for c in CASES}
        assert seen == set(itertools.product(DIMS[i], DIMS[j])), (i, j)


def test_the_sharding_page_shows_the_matrix():
    page = (Path(__file__).parents[1] / "docs" / "sharding.md").read_text()
    assert table() in page, "docs/sharding.md: paste tests/test_wherever.table()"


# Beyond the pairwise sample: `jax.vmap` of a chunked call on inputs placed on an
# Explicit mesh with no mesh entered, which jax.vmap itself runs (the call must not
# run eagerly under an abstract mesh alone).
@pytest.mark.parametrize("kind", ["explicit", "2d"])
@pytest.mark.parametrize("hold, n", [("placed", 16), ("mesh= + placed", 13)])
@pytest.mark.parametrize("entry", ["batch_vmap", "clipped_grad_sum"])
def test_vmap_of_a_call_on_placed_inputs(entry, hold, n, kind):
    test_every_entry_point_wherever_the_mesh_is_held((entry, hold, kind, "vmap", n))


# Beyond the pairwise sample: the examples sharded by `shard=` (True, or the axis
# named) under a mesh entered by `jax.set_mesh`, inputs not placed, the call
# differentiated eagerly with respect to the examples, N uneven (JAX's eager
# transposes lost the sharding types that its staged ones keep, and the split of the
# examples failed to transpose).
@pytest.mark.parametrize(
    "entry, kind",
    [(e, "explicit" if i % 2 else "2d") for i, e in enumerate(ENTRIES)],
)
def test_eager_grad_of_a_call_sharded_under_set_mesh(entry, kind):
    opts = {"shard": True if kind == "explicit" else "data"}
    case = (entry, "set_mesh", kind, "grad", 13)
    test_every_entry_point_wherever_the_mesh_is_held(case, opts)


@pytest.mark.parametrize("n", [12, 13, 3])
def test_the_seed_call_with_a_mesh_passed(n):
    """`batch_vmap(f, shard=True, mesh=make_mesh(...))` with no mesh entered, on a
    plain (replicated) batch of 12, 13 or 3 examples over 4 devices: eagerly, under
    jax.jit and under jax.grad."""
    mesh = make_mesh((4,), ("x",), devices=mesh_devices(4))
    f = cv.batch_vmap(jnp.sin, batch_size=2, shard=True, mesh=mesh)
    x = jax.device_put(np.linspace(0.0, 1.0, n, dtype=np.float32))
    want = np.sin(np.asarray(x))
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
    grad = jax.grad(lambda v: jnp.sum(f(v)))(x)
    np.testing.assert_allclose(grad, np.cos(np.asarray(x)), rtol=1e-6)


def test_an_unmapped_argument_sharded_over_the_examples_axis_without_set_mesh():
    """in_axes=(0, None), both arguments placed over the mesh axis the examples are
    split over, shard=True, no mesh entered: eager, jit and grad."""
    mesh = make_mesh((4,), ("x",), devices=mesh_devices(4))
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 3)).astype(np.float32)
    b = rng.normal(size=(8, 3)).astype(np.float32)
    sa, sb = (jax.device_put(v, NamedSharding(mesh, P("x"))) for v in (a, b))
    fn = cv.batch_vmap(
        lambda u, v: u * v.sum(), in_axes=(0, None), batch_size=2, shard=True
    )
    for out in (fn(sa, sb), jax.jit(fn)(sa, sb)):
        np.testing.assert_allclose(out, a * b.sum(), rtol=1e-5)
    grad = jax.jit(jax.grad(lambda u, v: jnp.sum(fn(u, v)), argnums=1))(sa, sb)
    np.testing.assert_allclose(grad, np.full_like(b, a.sum()), rtol=1e-5)


# Beyond the pairwise sample, calls that crashed: the projections' matrices made
# while the call is traced under an Auto mesh entered with `jax.set_mesh` (the
# devices' shares) or under `jax.jit` of inputs placed on an Explicit mesh with no
# mesh entered; the curvature's output cotangents and `sum x x^T` of a model whose
# weights are sharded over "model".
@pytest.mark.parametrize(
    "case",
    [
        ("per_example_grad_projections", "set_mesh", "auto", "eager", 13),
        ("per_example_grad_projections", "placed", "explicit", "jit", 16),
        ("per_example_grad_projections(ghost)", "placed", "explicit", "jit", 16),
        ("ggn_diagonal", "set_mesh + placed", "2d", "jit", 13),
        ("kfac_factors", "set_mesh + placed", "2d", "eager", 16),
    ],
    ids=lambda c: "-".join(map(str, c)),
)
def test_calls_made_under_a_mesh(case):
    test_every_entry_point_wherever_the_mesh_is_held(case)
