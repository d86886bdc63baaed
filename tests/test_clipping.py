"""`chunkvmap.clipped_grad` against its oracle, `jax_privacy.clipping.clipped_grad`.

jax-privacy evaluates any batch without microbatches, and microbatches of a size that
divides the batch; chunkvmap takes any chunk size (a divisor, a non-divisor, one larger
than the batch, "auto"). Every option jax-privacy has is compared on the same inputs:
the gradient sum, the per-example values, norms and aux, and the sensitivity.
"""

from __future__ import annotations

import functools as ft
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax_privacy import clipping as jp

import chunkvmap
from chunkvmap import clipped_grad, clipped_grad_sum, identity

from .helpers import make_mesh, temp_bytes, tree_allclose


D_IN, D_OUT = 3, 2


class Oracle:
    """`jax_privacy.clipping.clipped_grad(fun, **opts)`, run under the settings it
    needs (this suite makes warnings errors and dtype promotion strict; jax-privacy
    calls the deprecated `optax.global_norm` and adds booleans to floats)."""

    def __init__(self, fun, **opts):
        self.clipped = jp.clipped_grad(fun, **opts)

    def __call__(self, *args, **kwargs):
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore", DeprecationWarning)
            out = jax.jit(self.clipped)(*args, **kwargs)  # one compile, not per op
        if self.clipped.has_aux:  # the same fields, in chunkvmap's namedtuple type
            grads, aux = out
            assert aux._fields == chunkvmap.AuxiliaryOutput._fields
            out = (grads, chunkvmap.AuxiliaryOutput(*aux))
        return out

    def __getattr__(self, name):
        return getattr(self.clipped, name)


@ft.partial(jax.jit, static_argnums=0)
def params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w": jax.random.normal(k1, (D_IN, D_OUT)),
        "b": 0.1 * jax.random.normal(k2, (D_OUT,)),
    }


@ft.partial(jax.jit, static_argnums=(0, 1))  # one program, not one per op
def batch(n, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = 2.0 * jax.random.normal(kx, (n, D_IN))
    y = jax.random.normal(ky, (n, D_OUT))
    return x, y


def loss(p, xy):
    """A loss for a batch of examples (of one, with keep_batch_dim) or one example."""
    x, y = xy
    bias = jnp.broadcast_to(p["b"], (*x.shape[:-1], D_OUT))
    pred = jnp.tanh(x @ p["w"] + bias)
    return 0.5 * jnp.sum((pred - y) ** 2)


def loss_aux(p, xy):
    x, _ = xy
    value = loss(p, xy)
    # aux keeps the batch axis of size 1 (jax-privacy squeezes it) and has a scalar
    return value, {"pred": x @ p["w"], "scale": jnp.sum(x)}


def loss_xy(p, x, y):  # examples in two arguments
    return loss(p, (x, y))


def loss_two_params(w, b, xy):
    return loss({"w": w, "b": b}, xy)


def loss_key(p, xy, key):  # a PRNG key per example (dropout-like noise)
    x, y = xy
    noise = jax.random.normal(key, x.shape)
    return loss(p, (x + 0.1 * noise, y))


def double_leaves(g):
    return jax.tree.map(lambda x: 2.0 * x, g)


# (name, fun, kwargs of both clipped_grad, how to build the arguments)
CASES = [
    ("plain", loss, {}),
    ("no_batch_dim", loss, {"keep_batch_dim": False}),
    ("rescale", loss, {"l2_clip_norm": 0.3, "rescale_to_unit_norm": True}),
    ("normalize", loss, {"normalize_by": 4.0}),
    ("values_norms", loss, {"return_values": True, "return_grad_norms": True}),
    ("aux", loss_aux, {"has_aux": True, "return_grad_norms": True}),
    ("aux_no_batch_dim", loss_aux, {"has_aux": True, "keep_batch_dim": False}),
    ("transform", loss, {"pre_clipping_transform": double_leaves}),
    ("zero_clip", loss, {"l2_clip_norm": 0.0, "return_values": True}),
    ("inf_clip_rescale", loss, {"l2_clip_norm": jnp.inf, "rescale_to_unit_norm": True}),
    ("two_args", loss_xy, {"batch_argnums": (1, 2)}),
    ("argnums", loss_two_params, {"argnums": (0, 1), "batch_argnums": 2}),
    ("prng", loss_key, {"prng_argnum": 2, "return_values": True}),
    ("bfloat16", loss, {"dtype": jnp.bfloat16}),
]


def call_args(fun, n, seed=1):
    p = params()
    x, y = batch(n, seed)
    if fun is loss_xy:
        return (p, x, y)
    if fun is loss_two_params:
        return (p["w"], p["b"], (x, y))
    if fun is loss_key:
        return (p, (x, y), jax.random.key(7))
    return (p, (x, y))


def both(fun, opts, **ours):
    opts = {"l2_clip_norm": 1.0, **opts}
    return Oracle(fun, **opts), clipped_grad(fun, **opts, **ours)


def rtol(opts):
    # sums of 12 float32 terms in another order: a few ulps of the largest term
    return 2e-2 if opts.get("dtype") == jnp.bfloat16 else 1e-4


@pytest.mark.parametrize(
    "case,size",
    [(case, (4, 5, 16)[i % 3]) for i, case in enumerate(CASES)],
    ids=[f"{case[0]}-{(4, 5, 16)[i % 3]}" for i, case in enumerate(CASES)],
)
def test_matches_jax_privacy(case, size):
    """Every option, N = 12, against jax-privacy over the whole batch; chunkvmap with
    chunks of 4 (a divisor), 5 (not a divisor) or 16 (more than N), in turn."""
    _, fun, opts = case
    args = call_args(fun, 12)
    theirs, ours = both(fun, opts, microbatch_size=size)
    tree_allclose(ours(*args), theirs(*args), rtol=rtol(opts), atol=1e-5)
    assert ours.l2_norm_bound == theirs.l2_norm_bound
    assert ours.has_aux == theirs.has_aux


def test_unbatched_oracle_is_microbatched_oracle():
    """jax-privacy's microbatches (every K-th example) and chunkvmap's contiguous
    chunks give the same sum."""
    args = call_args(loss, 12)
    theirs = Oracle(loss, l2_clip_norm=0.5, microbatch_size=4)
    ours = clipped_grad(loss, l2_clip_norm=0.5, microbatch_size=4)
    tree_allclose(ours(*args), theirs(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,size", [(7, 3), (2, 4), (13, 13), (1, None)])
def test_any_batch_size(n, size):
    """N that jax-privacy's microbatching cannot take (prime, smaller than the
    microbatch): compared with jax-privacy over the whole batch at once."""
    opts = {"return_values": True, "return_grad_norms": True, "l2_clip_norm": 0.4}
    args = call_args(loss, n)
    expected = Oracle(loss, **opts)(*args)
    tree_allclose(
        clipped_grad(loss, **opts, microbatch_size=size)(*args), expected, rtol=1e-5
    )
    if size is not None and n % size:  # what jax-privacy refuses
        with pytest.raises((TypeError, ValueError), match="divide"):
            Oracle(loss, **opts, microbatch_size=size)(*args)


def test_zero_examples():
    """An empty (Poisson-sampled) batch: zero sum, empty per-example outputs."""
    g = clipped_grad(
        loss_aux,
        has_aux=True,
        l2_clip_norm=1.0,
        return_values=True,
        return_grad_norms=True,
        microbatch_size=4,
    )
    total, aux = g(*call_args(loss_aux, 0))
    tree_allclose(total, jax.tree.map(jnp.zeros_like, params()))
    assert aux.values.shape == aux.grad_norms.shape == (0,)
    assert aux.aux["pred"].shape == (0, D_OUT) and aux.aux["scale"].shape == (0,)


@pytest.mark.parametrize("size", [None, 3])
def test_padding_examples(size):
    """`is_padding_example` zeroes those examples' contributions, as in jax-privacy
    (whose microbatches must divide N; chunkvmap's need not). Their per-example
    outputs (here the norms) are zeros: chunks of padding alone are never
    evaluated."""
    args = call_args(loss, 12)
    pad = jnp.array([False] * 9 + [True] * 3).at[4].set(True)
    opts = {"l2_clip_norm": 0.5, "return_grad_norms": True}
    expected = Oracle(loss, **opts, microbatch_size=4)(*args, is_padding_example=pad)
    actual = clipped_grad(loss, **opts, microbatch_size=size)(
        *args, is_padding_example=pad
    )
    tree_allclose(actual[0], expected[0], rtol=1e-4, atol=1e-5)
    norms = np.asarray(actual[1].grad_norms)
    np.testing.assert_allclose(norms[~pad], expected[1].grad_norms[~pad], rtol=1e-4)
    np.testing.assert_array_equal(norms[pad], 0.0)
    # the same as leaving the padded examples out
    real = ~np.asarray(pad)
    short = (args[0], jax.tree.map(lambda a: a[real], args[1]))
    tree_allclose(
        actual[0], clipped_grad(loss, l2_clip_norm=0.5)(*short), rtol=1e-4, atol=1e-5
    )


def _squares(tree):
    return sum(jnp.sum(t**2) for t in jax.tree.leaves(tree))


def _partly_finite_loss(p, x):
    # `_nan_safe_loss` in p["w"]; p["v"]'s gradient finite wherever x[1:] is
    return _nan_safe_loss(p["w"], x) + jnp.sum(jnp.tanh(x[1:] @ p["v"]))


# The NaN-safe sum in passes (`in_passes`: the TPU's program, run here on the CPU),
# one case per row of a rotation over what a user varies: which examples are
# non-finite (none; one; one whose finite entries overflow its squared norm; NaN
# padding; a whole chunk; every example), how the call is made (eagerly, jitted,
# the gradient of a function of the sum), the dtype, and where the examples live
# (no mesh; `shard=True`; placed on an Explicit mesh; that mesh entered).
PASS_CASES = ("finite", "nan", "overflow", "padding", "chunk", "every")
PASS_CALLS = ("eager", "jit", "grad")
PASS_HOLDS = ("none", "shard=True", "placed", "set_mesh")
PASS_GRID = [
    (PASS_CASES[k % 6], PASS_CALLS[k % 3], ("float32", "float64")[k // 6 % 2],
     PASS_HOLDS[k % 4])
    for k in range(12)
]  # fmt: skip


@pytest.mark.parametrize("case, call, dtype, hold", PASS_GRID)
def test_nan_safe_sum_in_passes_matches_the_oracle(case, call, dtype, hold, in_passes):
    """The NaN-safe clipped sum of formed gradients taken in passes (norms, then the
    finite examples' sum as `grad sum_i c_i L_i`, then the non-finite ones formed
    apart) equals the oracle, and so do its norms and values: N = 13 in chunks of 4
    (16 over a mesh of 8 devices, in chunks of 1). A non-finite example's gradient
    is non-finite in one leaf and finite in the other (which its clipped sum
    keeps)."""
    from .helpers import clip_and_sum

    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(7)
        mesh = make_mesh((8,), ("d",), (jax.sharding.AxisType.Explicit,))
        n = 13 if hold in ("none", "shard=True") else 16
        w = {
            "w": jnp.asarray(rng.normal(size=(3, 2)), dtype),
            "v": jnp.asarray(rng.normal(size=(3, 2)), dtype),
        }
        x = rng.normal(size=(n, 4)).astype(dtype)
        x[:, 0] = np.abs(x[:, 0]) + 0.5
        pad = np.arange(n) >= n - 3 if case == "padding" else None
        bad = {"nan": [6], "padding": [n - 2], "chunk": [4, 5, 6, 7]}.get(case, [])
        x[bad, 0] = 0.0  # (log 0: infinite and NaN gradient entries)
        if case == "overflow":
            x[6, 0] = np.finfo(dtype).max
        if case == "every":
            x[:, 0] = 0.0
        x = x0 = jnp.asarray(x)
        opts = dict(l2_clip_norm=0.7, keep_batch_dim=False, return_grad_norms=True,
                    return_values=True)  # fmt: skip
        opts.update(batch_size=4) if hold == "none" else opts.update(batch_size=1)
        if hold == "shard=True":
            opts.update(shard=True)
        elif hold != "none":
            opts.update(shard="d", mesh=mesh)
        cg = clipped_grad(_partly_finite_loss, **opts)
        flags = None if pad is None else jnp.asarray(pad)
        if hold in ("placed", "set_mesh"):
            put = lambda a: jax.device_put(  # noqa: E731
                a, jax.sharding.NamedSharding(mesh, jax.P("d"))
            )
            x = put(x)
            flags = None if flags is None else put(flags)

        def ours(w):
            return cg(w, x) if flags is None else cg(w, x, is_padding_example=flags)

        def oracle(w):
            grads = jax.vmap(jax.grad(_partly_finite_loss), (None, 0))(w, x0)
            total, _ = clip_and_sum(grads, 0.7, finite_only=True, pad=pad)
            norms = clip_and_sum(grads, 0.7)[1]  # (as they are: NaN where not finite)
            values = jax.vmap(_partly_finite_loss, (None, 0))(w, x0)
            if pad is not None:
                norms, values = (
                    jnp.where(jnp.asarray(pad), 0, v) for v in (norms, values)
                )
            return total, norms, values

        def run(f):
            if hold == "set_mesh":
                with jax.set_mesh(mesh):
                    return f()
            return f()

        tol = 1e-12 if dtype == "float64" else 1e-5
        if call == "grad":  # of a function of the sum (finite where the sum is)
            got = run(lambda: jax.jit(jax.grad(lambda w: _squares(ours(w)[0])))(w))
            expected = jax.grad(lambda w: _squares(oracle(w)[0]))(w)
            tree_allclose(got, expected, rtol=100 * tol, atol=100 * tol)
            return
        total, aux = run(lambda: (jax.jit(ours) if call == "jit" else ours)(w))
        expected, norms, values = oracle(w)
        assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(total))
        tree_allclose(total, expected, rtol=tol, atol=tol)
        np.testing.assert_allclose(aux.grad_norms, norms, rtol=tol)
        np.testing.assert_allclose(aux.values, values, rtol=tol)


def test_nan_safe_sum_in_passes_of_a_model_holding_a_function(in_passes):
    """An Equinox MLP passed whole (holding its activation), one example infinite:
    the sum in passes, eager and under `eqx.filter_jit`, equals the oracle."""
    import equinox as eqx

    from .helpers import clip_and_sum

    k = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.gelu, key=k[0])
    x = jax.random.normal(k[1], (11, 4)).at[3, 1].set(jnp.inf)
    y = jax.random.normal(k[2], (11, 2))

    def mse(m, x, y):
        return jnp.sum((m(x) - y) ** 2)

    params, static = eqx.partition(model, eqx.is_array)
    grads = jax.vmap(
        jax.grad(lambda p, x, y: mse(eqx.combine(p, static), x, y)), (None, 0, 0)
    )(params, x, y)
    expected, _ = clip_and_sum(grads, 1.0, finite_only=True)
    cg = clipped_grad(
        mse, l2_clip_norm=1.0, batch_argnums=(1, 2), keep_batch_dim=False,
        batch_size=4,
    )  # fmt: skip
    for got in (cg(model, x, y), eqx.filter_jit(cg)(model, x, y)):
        tree_allclose(eqx.filter(got, eqx.is_array), expected, rtol=1e-5, atol=1e-6)


def test_nan_safe():
    """A NaN example: nan_safe zeroes its non-finite entries (the sum stays finite,
    its reported norm is NaN); without nan_safe the sum is NaN, as in jax-privacy."""
    p, (x, y) = call_args(loss, 8)
    x = x.at[3, 0].set(jnp.nan)
    for nan_safe in (True, False):
        opts = {"l2_clip_norm": 0.5, "return_grad_norms": True, "nan_safe": nan_safe}
        expected = Oracle(loss, **opts)(p, (x, y))
        actual = clipped_grad(loss, **opts, microbatch_size=3)(p, (x, y))
        tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)
        assert bool(jnp.isnan(actual[1].grad_norms[3]))
        finite = all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(actual[0]))
        assert finite == nan_safe


@pytest.mark.parametrize(
    "relation",
    list(dp_accounting.NeighboringRelation)[:3] + ["replace_one"],
    ids=str,
)
@pytest.mark.parametrize("rescale", [False, True])
def test_sensitivity(relation, rescale):
    opts = {"l2_clip_norm": 0.7, "rescale_to_unit_norm": rescale, "normalize_by": 2.0}
    theirs, ours = both(loss, opts)
    enum = (
        dp_accounting.NeighboringRelation.REPLACE_ONE
        if isinstance(relation, str)
        else relation
    )
    assert ours.sensitivity(relation) == theirs.sensitivity(enum)
    assert ours.sensitivity() == theirs.sensitivity()
    assert ours.l2_norm_bound == theirs.l2_norm_bound


def test_traced_clip_norm_under_jit():
    args = call_args(loss, 10)

    @jax.jit
    def step(clip, p, xy):
        return clipped_grad(loss, l2_clip_norm=clip, microbatch_size=4)(p, xy)

    expected = Oracle(loss, l2_clip_norm=0.3)(*args)
    tree_allclose(step(jnp.float32(0.3), *args), expected, rtol=1e-4, atol=1e-5)
    # a negative traced clip norm counts as 0 (jax-privacy's rule)
    zero = step(jnp.float32(-1.0), *args)
    assert all(not jnp.any(v) for v in jax.tree.leaves(zero))


def test_auto_and_aliases():
    args = call_args(loss, 40)
    expected = Oracle(loss, l2_clip_norm=0.5)(*args)
    g = clipped_grad(loss, l2_clip_norm=0.5, batch_size="auto", memory_limit="64KiB")
    tree_allclose(g(*args), expected, rtol=1e-4, atol=1e-5)
    assert 1 <= chunkvmap.last_batch_size(g) <= 40
    g = clipped_grad(loss, l2_clip_norm=0.5, chunk_size=7)  # microbatch_size's alias
    tree_allclose(g(*args), expected, rtol=1e-4, atol=1e-5)
    assert chunkvmap.last_batch_size(g) == 7
    with pytest.raises(TypeError, match="chunk_size=3 and its alias microbatch_size=4"):
        clipped_grad(loss, l2_clip_norm=0.5, microbatch_size=4, chunk_size=3)


def test_explicit_mesh_and_spmd_axis_name():
    """Examples laid out over an Explicit data axis: chunked per device."""
    mesh = make_mesh((4,), ("data",), (jax.sharding.AxisType.Explicit,))
    p, (x, y) = call_args(loss, 16)
    expected = Oracle(loss, l2_clip_norm=0.5, return_grad_norms=True)(p, (x, y))
    data = jax.sharding.NamedSharding(mesh, jax.P("data"))
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put((x, y), data)
        g = clipped_grad(
            loss, l2_clip_norm=0.5, return_grad_norms=True, microbatch_size=3
        )
        tree_allclose(jax.jit(g)(p, (xs, ys)), expected, rtol=1e-4, atol=1e-5)
    mesh = make_mesh((4,), ("data",), (jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        g = clipped_grad(
            loss,
            l2_clip_norm=0.5,
            spmd_axis_name="data",
            microbatch_size=8,
            return_grad_norms=True,
        )
        tree_allclose(jax.jit(g)(p, (x, y)), expected, rtol=1e-4, atol=1e-5)


def test_clipped_grad_sum_is_the_compact_form():
    """clipped_grad_sum = clipped_grad with single examples, mapped-by-default
    arguments, no NaN-safety, and the count."""
    p, x, y = call_args(loss_xy, 9)
    total, count, norms = chunkvmap.clipped_grad_sum(
        loss_xy, 0.5, batch_size=4, return_norms=True
    )(p, x, y)
    expected = Oracle(
        loss_xy,
        l2_clip_norm=0.5,
        batch_argnums=(1, 2),
        keep_batch_dim=False,
        nan_safe=False,
        return_grad_norms=True,
    )(p, x, y)
    tree_allclose(
        (total, norms), (expected[0], expected[1].grad_norms), rtol=1e-4, atol=1e-5
    )
    assert int(count) == 9


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"l2_clip_norm": -1.0}, ValueError, "non-negative"),
        ({"l2_clip_norm": "1"}, TypeError, "l2_clip_norm"),
        ({"l2_clip_norm": 1.0, "normalize_by": 0.0}, ValueError, "normalize_by"),
        ({"l2_clip_norm": 1.0, "dtype": jnp.int32}, TypeError, "dtype"),
        ({"l2_clip_norm": 1.0, "nan_safe": "yes"}, TypeError, "nan_safe"),
        ({"l2_clip_norm": 1.0, "prng_argnum": 1.5}, TypeError, "prng_argnum"),
        ({"l2_clip_norm": 1.0, "pre_clipping_transform": 3}, TypeError, "transform"),
        ({"l2_clip_norm": 1.0, "microbatch_size": 0}, ValueError, "microbatch_size"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        clipped_grad(loss, **kwargs)
    assert "clipped_grad" in str(info.value)


def test_bad_calls():
    args = call_args(loss, 6)
    with pytest.raises(ValueError, match="overlap"):  # seen before any call
        clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=0)
    for make in (  # negative argnums: seen at the call
        lambda: clipped_grad(loss, l2_clip_norm=1.0, argnums=-1, batch_argnums=1),
        lambda: clipped_grad_sum(loss, 1.0, argnums=1, batch_argnums=(1,)),
        lambda: clipped_grad_sum(loss, 1.0, argnums=-1, batch_argnums=1),
    ):
        with pytest.raises(ValueError, match=r"overlap on argument\(s\) \[1\]"):
            make()(*args)
    # jax-privacy's key phrases, inside chunkvmap's sentences
    with pytest.raises(ValueError, match="Batch Argnums must not be empty"):
        clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=())
    with pytest.raises(ValueError, match="Batch axis must have the same size"):
        clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=(1, 2))(
            jnp.zeros(3), jnp.zeros((10, 3)), jnp.zeros(5)
        )
    with pytest.raises(ValueError, match=r"is_padding_example .* shape \(6,\)"):
        clipped_grad(loss, l2_clip_norm=1.0)(*args, is_padding_example=jnp.ones(5))
    with pytest.raises(ValueError, match="prng_argnum=1 is also in batch_argnums"):
        clipped_grad(loss, l2_clip_norm=1.0, prng_argnum=1)(*args)
    p, x, y = call_args(loss_xy, 6)
    with pytest.raises(ValueError, match="clipped_grad"):
        clipped_grad(loss_xy, l2_clip_norm=1.0, batch_argnums=(1, 2))(p, x, y[:5])


def mlp_loss(p, xy):
    x, y = xy
    h = jax.nn.relu(x @ p["w1"])
    return jnp.sum((h @ p["w2"] - y) ** 2)


def test_memory_is_flat_in_the_batch():
    """XLA's compiled temp bytes at chunks of 64: flat from N = 256 to 4096 (within
    5 %), where jax-privacy's microbatched sum at the same size grows with N."""
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (32, 128)), "w2": jax.random.normal(k2, (128, 8))}

    def temp(fn, n):
        xy = (jnp.ones((n, 32)), jnp.ones((n, 8)))
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore", DeprecationWarning)
            return temp_bytes(fn, p, xy)

    ours = clipped_grad(mlp_loss, l2_clip_norm=1.0, microbatch_size=64)
    theirs = jp.clipped_grad(mlp_loss, l2_clip_norm=1.0, microbatch_size=64)
    small, large = temp(ours, 256), temp(ours, 4096)
    assert large <= 1.05 * small, (small, large)
    their_small, their_large = temp(theirs, 256), temp(theirs, 4096)
    assert their_large > 1.2 * their_small, (their_small, their_large)
    assert large < their_large


def test_equinox_linen_and_nnx_parameters():
    """Models as parameters: an Equinox module (only its float arrays are
    differentiated, None elsewhere), linen variables and NNX state, against jax-privacy
    on the same float parameters."""
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    x, y = batch(10)
    model = eqx.nn.MLP(D_IN, D_OUT, 8, depth=1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def eqx_loss(m, xy):
        return jnp.sum((jax.vmap(m)(xy[0]) - xy[1]) ** 2)

    expected = Oracle(
        lambda p, xy: eqx_loss(eqx.combine(p, static), xy), l2_clip_norm=0.5
    )(params, (x, y))
    actual = clipped_grad(eqx_loss, l2_clip_norm=0.5, microbatch_size=3)(model, (x, y))
    tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)

    dense = nn.Dense(D_OUT)
    variables = dense.init(jax.random.key(1), x[:1])

    def linen_loss(v, xy):
        return jnp.sum((dense.apply(v, xy[0]) - xy[1]) ** 2)

    tree_allclose(
        clipped_grad(linen_loss, l2_clip_norm=0.5, microbatch_size=4)(
            variables, (x, y)
        ),
        Oracle(linen_loss, l2_clip_norm=0.5)(variables, (x, y)),
        rtol=1e-4,
        atol=1e-5,
    )

    graphdef, state = nnx.split(nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(2)))

    def nnx_loss(s, xy):
        return jnp.sum((nnx.merge(graphdef, s)(xy[0]) - xy[1]) ** 2)

    tree_allclose(
        clipped_grad(nnx_loss, l2_clip_norm=0.5, microbatch_size=4)(state, (x, y)),
        Oracle(nnx_loss, l2_clip_norm=0.5)(state, (x, y)),
        rtol=1e-4,
        atol=1e-5,
    )


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_option_combinations_match_jax_privacy(data):
    """Random combinations of jax-privacy's options, jax-privacy microbatched (chunks
    of 4 dividing N = 8) against chunkvmap at any chunk size."""
    draw = data.draw
    has_aux = draw(st.booleans())
    opts = {
        "has_aux": has_aux,
        "l2_clip_norm": draw(st.sampled_from([0.0, 0.05, 0.5, 3.0, jnp.inf])),
        "rescale_to_unit_norm": draw(st.booleans()),
        "normalize_by": draw(st.sampled_from([1.0, 3.0])),
        "keep_batch_dim": draw(st.booleans()),
        "return_values": draw(st.booleans()),
        "return_grad_norms": draw(st.booleans()),
        "nan_safe": draw(st.booleans()),
        "pre_clipping_transform": draw(st.sampled_from([identity, double_leaves])),
    }
    fun = loss_aux if has_aux else loss
    args = call_args(fun, 8, seed=draw(st.integers(0, 3)))
    expected = Oracle(fun, **opts, microbatch_size=4)(*args)
    size = draw(st.sampled_from([None, 1, 3, 4, 8, 11]))
    tree_allclose(
        clipped_grad(fun, **opts, microbatch_size=size)(*args),
        expected,
        rtol=1e-4,
        atol=1e-5,
    )


def test_python_float_parameters_and_clip_norm_zero():
    """`clipped_grad` differentiates Python float leaves of the parameters, as
    `jax.grad` and jax-privacy do (and so does `clipped_grad_sum`); `l2_clip_norm=0`
    gives zero sums and inf unclipped ones, in both clipping functions."""

    def fun(params, data, key):
        out = params["w"] * data + params["b"]
        return jnp.mean(out + jax.random.normal(key, out.shape))

    params, data, key = (
        {"w": 2.5, "b": 1.0},
        jnp.array([10.0, 20.0, 30.0]),
        jax.random.key(0),
    )
    expected = Oracle(fun, l2_clip_norm=1.0, prng_argnum=2)(params, data, key)
    for method in ("vmap", "ghost"):
        with warnings.catch_warnings():  # (scalar products: no ghost norm to take)
            warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
            got = clipped_grad(fun, l2_clip_norm=1.0, prng_argnum=2, method=method)(
                params, data, key
            )
        assert jax.tree.structure(got) == jax.tree.structure(params)
        tree_allclose(got, expected, rtol=1e-6)
    # differentiated here too: each example's gradient (x_i, 1), clipped to norm 1
    total, _ = clipped_grad_sum(lambda p, x: fun(p, x, key), 1.0, batch_argnums=1)(
        params, data
    )
    x = np.array([10.0, 20.0, 30.0])
    scale = 1 / np.sqrt(x**2 + 1)
    tree_allclose(total, {"w": np.sum(x * scale), "b": np.sum(scale)}, rtol=1e-6)
    p, xy = call_args(loss, 6)
    for clip, check in ((0.0, lambda g: not np.any(g)), (jnp.inf, None)):
        theirs = Oracle(loss, l2_clip_norm=clip)(p, xy)
        for method in ("vmap", "ghost"):
            total, count = clipped_grad_sum(loss, clip, method=method)(p, xy)
            ours = clipped_grad(loss, l2_clip_norm=clip, method=method)(p, xy)
            tree_allclose(total, theirs, rtol=1e-5, atol=1e-6)
            tree_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
            if check is not None:
                assert all(check(g) for g in jax.tree.leaves(total))


def _nan_safe_loss(w, x):
    # log|x_0|: an example with x_0 = 0 has infinite and NaN gradient entries; one
    # with a huge x_0 has finite entries whose squares overflow
    return jnp.sum(jnp.tanh(x[1:] @ w) * jnp.log(jnp.abs(x[0])))


@pytest.mark.parametrize(
    "case, call, dtype",
    [
        ("finite", "eager", "float32"),
        ("nan", "jit", "float32"),
        ("finite", "grad", "float64"),
        ("overflow", "eager", "float32"),
        ("padding", "grad", "float32"),
        ("nan", "jit", "float64"),
    ],
)
def test_nan_safe_sum_matches_the_oracle(case, call, dtype):
    """A NaN-safe clipped sum (every example's non-finite entries zeroed before its
    norm) equals the oracle: all finite, an example with NaN and infinite entries,
    one whose finite entries overflow its squared norm, NaN padding; eager, jitted
    and differentiated (where the gradient of the sum is finite), N = 11 in chunks
    of 4, float32 and float64."""
    from .helpers import clip_and_sum

    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(5)
        w = jnp.asarray(rng.normal(size=(3, 2)), dtype)
        x = rng.normal(size=(11, 4)).astype(dtype)
        x[:, 0] = np.abs(x[:, 0]) + 0.5
        pad = None
        if case == "nan":
            x[6, 0] = 0.0
        elif case == "overflow":
            x[6, 0] = np.finfo(dtype).max
        elif case == "padding":
            pad = np.arange(11) >= 8
            x[9, 0] = 0.0  # a padding example's NaN gradient
        x = jnp.asarray(x)
        opts = dict(l2_clip_norm=0.7, keep_batch_dim=False, batch_size=4)
        cg = clipped_grad(_nan_safe_loss, **opts)

        def ours(w):
            if pad is None:
                return cg(w, x)
            return cg(w, x, is_padding_example=jnp.asarray(pad))

        def oracle(w):  # over the real examples alone
            real = x if pad is None else x[~pad]
            grads = jax.vmap(jax.grad(_nan_safe_loss), (None, 0))(w, real)
            return clip_and_sum(grads, 0.7, finite_only=True)[0]

        if call == "grad":  # of a function of the sum
            ours_, oracle_ = (
                jax.grad(lambda w, f=f: jnp.sum(f(w) ** 2)) for f in (ours, oracle)
            )
            got, expected = jax.jit(ours_)(w), oracle_(w)
        else:
            got = (jax.jit(ours) if call == "jit" else ours)(w)
            expected = oracle(w)
        assert bool(jnp.all(jnp.isfinite(got)))
        tol = 1e-12 if dtype == "float64" else 1e-5
        tree_allclose(got, expected, rtol=tol, atol=tol)
