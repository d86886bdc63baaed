"""One conformance suite for every public transform and adapter.

Each entry point is a `Case` in `CASES`: it knows how to build the chunkvmap call for
given chunking options, the plain JAX / framework call it must agree with (its oracle),
and the arguments for `N` examples (for the Jacobians `N` is the number of basis
vectors: the input size for `batch_jacfwd`, the output size for `batch_jacrev`). Every
check below is one test parametrized over all cases (as optax tests its variants with
one shared suite):

(a) values against the oracle, with and without a remainder;
(b) that it really chunks: XLA's compiled temporary memory stays flat as `N` grows 16x
    while the oracle's grows, and `progress` reports ceil(N / B) chunks;
(c) the shared options: `chunk_size`, `batch_size="auto"`, `remat`, `shard`;
(d) error messages name the function the user called and the argument they used;
(e) a second eager call with new arrays of the same types does not retrace.

Inputs are built with NumPy (`np.random.default_rng`), so new shapes cost no eager
compilation; memory checks compile abstract (`jax.ShapeDtypeStruct`) arguments.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import chunkvmap
import chunkvmap.eqx
import chunkvmap.linen
import chunkvmap.nnx

from .helpers import CompileCounter, clipped_sum, make_mesh, temp_bytes, tree_allclose


D, H, K = 8, 256, 4  # input features, hidden width (the per-example work), outputs
B = 4  # the chunk size of every check
N_VALUES = (12, 13)  # without and with a remainder
N_OPTIONS = 13  # the option checks: with a remainder
N_SHARD = 43  # 8 devices x 5 examples (a chunk and a remainder window each) + 3
N_SMALL, N_LARGE = 64, 1024  # the memory check: N grows 16x at fixed B
CLIP = 11.0  # clipped_grad_sum's norm: the gradients' norms are 5 to 19, so some
# examples are clipped and some are not

_rng = np.random.default_rng(0)
W1 = (_rng.standard_normal((H, D)) / math.sqrt(D)).astype(np.float32)
W2 = (_rng.standard_normal((K, H)) / math.sqrt(H)).astype(np.float32)
# Constants the single-example functions close over (a device_put, no compilation).
W1_J, W2_J = jnp.asarray(W1), jnp.asarray(W2)
MESH = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def to_jax(tree):
    return jax.device_put(tree)  # a transfer (jnp.asarray would compile per shape)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def counted(f):
    """`f`, counting its Python calls (JAX traces) in `.count`."""

    @ft.wraps(f)
    def wrapper(*args, **kwargs):
        wrapper.count += 1
        return f(*args, **kwargs)

    wrapper.count = 0
    return wrapper


# --------------------------------------------------------------------------------------
# The user functions: one hidden layer of width H per example, so that per-example
# intermediates (an H-vector out of a matmul, which XLA materialises) dominate memory.


def mlp(params, x):
    w1, w2 = params
    return w2 @ jnp.tanh(w1 @ x)


def mlp_chunk(xs):
    """`mlp` of a whole chunk (batch_map's `fun` is already vectorised)."""
    return jnp.tanh(xs @ W1_J.T) @ W2_J.T


def loss(w, x):
    """A per-example loss with a small parameter `w` (D,) and a width-H hidden layer,
    so per-example gradients are small and the work per example is not."""
    return jnp.sum(jnp.tanh(W1_J @ (w * x)))


def jac_fwd_f(x, w1):
    """R^n -> R^K; the Jacobian in x has n columns (the basis vectors to push)."""
    return W2_J @ jnp.tanh(w1 @ x)


def jac_rev_f(x, w2):
    """R^D -> R^m; the Jacobian in x has m rows (the basis vectors to pull back)."""
    return w2 @ jnp.tanh(W1_J @ x)


class EqxNet(eqx.Module):
    w1: jax.Array
    w2: jax.Array
    act: Callable = jnp.tanh  # a non-array leaf, passed through by the filters

    def __call__(self, x):
        return self.w2 @ self.act(self.w1 @ x)


LINEN_TRACES = [0]  # calls of LinenNet.__call__ (a Module class cannot be wrapped)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        LINEN_TRACES[0] += 1
        return nn.Dense(K, use_bias=False)(nn.tanh(nn.Dense(H, use_bias=False)(x)))


class NnxNet(nnx.Module):
    def __init__(self, w1, w2):
        self.w1 = nnx.Param(w1)
        self.w2 = nnx.Param(w2)

    def __call__(self, x):
        return self.w2 @ jnp.tanh(self.w1 @ x)


def apply_model(model, x):
    return model(x)


def clipped_sum_oracle(loss_fn):
    """Per-example gradients by vmap(grad), each scaled by min(1, C / ||g||), summed."""

    def ref(w, xs):
        total = clipped_sum(loss_fn, CLIP, (w, xs))[0]
        return total, jnp.asarray(xs.shape[0], jnp.int32)

    return ref


def _grads(loss_fn, w, xs):
    return jax.vmap(jax.grad(loss_fn), (None, 0))(w, xs)


def norms_oracle(loss_fn):
    return lambda w, xs: jnp.linalg.norm(_grads(loss_fn, w, xs), axis=1)


def stats_oracle(loss_fn):
    def ref(w, xs):
        g = _grads(loss_fn, w, xs)
        sq = (g**2).sum(0), (g**2).sum(1)
        return chunkvmap.GradStats(g.mean(0), g.var(0), *sq, None)

    return ref


def gram_oracle(loss_fn):
    def ref(w, xs):
        g = _grads(loss_fn, w, xs)
        return g @ g.T

    return ref


LINEN_AXES = dict(variable_axes={"params": None}, split_rngs={"params": False})


def _linen_args(n, rng):
    """The variables of `LinenNet` (kernels are (in, out)), and the examples."""
    # Submodules are numbered as they are built: the outer Dense(K) first.
    variables = {"params": {"Dense_0": {"kernel": W2.T}, "Dense_1": {"kernel": W1.T}}}
    return variables, normal(rng, n, D)


# --------------------------------------------------------------------------------------
# The cases.


@dataclasses.dataclass(frozen=True)
class Case:
    """One public entry point.

    `make(user, **options)` builds the chunkvmap call from the user function `user`
    (normally `self.user`) and returns `(run, handle)`: `run(*args)` evaluates it,
    `handle` is what `chunkvmap.last_batch_size` takes. `oracle(user)` is the plain
    reference with the same signature as `run`; `args(n, rng)` are NumPy arguments for
    `n` examples.
    """

    id: str
    name: str  # the public name that error messages start with
    user: Callable[..., Any]
    make: Callable[..., tuple[Callable[..., Any], Any]]
    oracle: Callable[[Callable[..., Any]], Callable[..., Any]]
    args: Callable[[int, np.random.Generator], tuple]
    basis: bool = False  # N counts basis vectors of length N (the Jacobians)
    block: bool = False  # the Gram: rows of dot products with half of the batch

    def counted_user(self) -> tuple[Callable[..., Any], Callable[[], int]]:
        """The user function and a function returning how often it was traced."""
        if self.user is LinenNet:
            return LinenNet, lambda: LINEN_TRACES[0]
        user = counted(self.user)
        return user, lambda: user.count


def _same(transform):
    """`make` for a transform whose result is the function to call."""

    def make(user, **options):
        fn = transform(user, **options)
        return fn, fn

    return make


def _batch_map(user, **options):
    return (lambda xs: chunkvmap.batch_map(user, xs, **options)), user


def _eqx(user, **options):
    fn = chunkvmap.eqx.filter_batch_vmap(user, in_axes=(None, 0), **options)
    return (lambda params, xs: fn(EqxNet(*params), xs)), fn


def _eqx_oracle(user):
    fn = eqx.filter_vmap(user, in_axes=(None, 0))
    return lambda params, xs: fn(EqxNet(*params), xs)


def _linen(user, **options):
    model = chunkvmap.linen.batch_vmap(user, **LINEN_AXES, **options)
    return model().apply, model


def _linen_oracle(user):
    return nn.vmap(user, **LINEN_AXES)().apply


def _nnx(user, **options):
    fn = chunkvmap.nnx.batch_vmap(user, in_axes=(None, 0), **options)
    return (lambda params, xs: fn(NnxNet(*params), xs)), fn


def _nnx_oracle(user):
    fn = nnx.vmap(user, in_axes=(None, 0))
    return lambda params, xs: fn(NnxNet(*params), xs)


def _mlp_args(n, rng):
    return (W1, W2), normal(rng, n, D)


def _jac_fwd_args(n, rng):
    return normal(rng, n), normal(rng, H, n) / np.float32(math.sqrt(n))


def _jac_rev_args(n, rng):
    return normal(rng, D), normal(rng, n, H) / np.float32(math.sqrt(H))


VECTORIZE = dict(excluded={0}, signature="(d)->(k)")

CASES = [
    Case(
        "batch_vmap",
        "batch_vmap",
        mlp,
        _same(lambda f, **o: chunkvmap.batch_vmap(f, (None, 0), **o)),
        lambda f: jax.vmap(f, (None, 0)),
        _mlp_args,
    ),
    Case(
        "batch_map",
        "batch_map",
        mlp_chunk,
        _batch_map,
        lambda fun: fun,
        lambda n, rng: (normal(rng, n, D),),
    ),
    Case(
        "per_example_grads",
        "per_example_grads",
        loss,
        _same(chunkvmap.per_example_grads),
        lambda f: jax.vmap(jax.grad(f), (None, 0)),
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
    ),
    Case(
        "clipped_grad_sum",
        "clipped_grad_sum",
        loss,
        _same(lambda f, **o: chunkvmap.clipped_grad_sum(f, CLIP, **o)),
        clipped_sum_oracle,
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
    ),
    Case(
        "clipped_grad",
        "clipped_grad",
        loss,
        _same(
            lambda f, **o: chunkvmap.clipped_grad(
                f, l2_clip_norm=CLIP, keep_batch_dim=False, **o
            )
        ),
        lambda f: lambda w, xs: clipped_sum_oracle(f)(w, xs)[0],
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
    ),
    Case(
        "per_example_grad_norms",
        "per_example_grad_norms",
        loss,
        _same(chunkvmap.per_example_grad_norms),
        norms_oracle,
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
    ),
    Case(
        "per_example_grad_stats",
        "per_example_grad_stats",
        loss,
        _same(chunkvmap.per_example_grad_stats),
        stats_oracle,
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
    ),
    Case(
        "per_example_grad_gram",
        "per_example_grad_gram",
        loss,
        _same(chunkvmap.per_example_grad_gram),
        gram_oracle,
        lambda n, rng: (normal(rng, D), normal(rng, n, D)),
        block=True,
    ),
    Case(
        "batch_jacfwd",
        "batch_jacfwd",
        jac_fwd_f,
        _same(chunkvmap.batch_jacfwd),
        jax.jacfwd,
        _jac_fwd_args,
        basis=True,
    ),
    Case(
        "batch_jacrev",
        "batch_jacrev",
        jac_rev_f,
        _same(chunkvmap.batch_jacrev),
        jax.jacrev,
        _jac_rev_args,
        basis=True,
    ),
    Case(
        "batch_vectorize",
        "batch_vectorize",
        mlp,
        _same(lambda f, **o: chunkvmap.batch_vectorize(f, **VECTORIZE, **o)),
        lambda f: jnp.vectorize(f, **VECTORIZE),
        _mlp_args,
    ),
    Case(
        "eqx",
        "filter_batch_vmap",
        apply_model,
        _eqx,
        _eqx_oracle,
        _mlp_args,
    ),
    Case(
        "linen",
        "chunkvmap.linen.batch_vmap",
        LinenNet,
        _linen,
        _linen_oracle,
        _linen_args,
    ),
    Case(
        "nnx",
        "chunkvmap.nnx.batch_vmap",
        apply_model,
        _nnx,
        _nnx_oracle,
        _mlp_args,
    ),
]
ALL = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
FLAX_IDS = ("linen", "nnx")


def inputs(case: Case, n: int, seed: int = 0) -> tuple:
    return to_jax(case.args(n, np.random.default_rng(seed)))


@ft.cache
def expected(case_id: str, n: int):
    """The oracle's values for the standard inputs of `n` examples (computed once)."""
    case = next(c for c in CASES if c.id == case_id)
    return jax.jit(case.oracle(case.user))(*inputs(case, n))


def chunked(case: Case, n: int, **options):
    run, _ = case.make(case.user, **options)
    return run(*inputs(case, n))


# --------------------------------------------------------------------------------------
# (a) Values.


def close_to_oracle(case, out, n: int) -> None:
    """`out` equals the oracle's value for `n` examples. A Gram matrix's entries are
    dot products of whole gradients, summed in another order than the oracle's:
    float32's rounding there reaches a few 1e-5 of the largest entry."""
    gram = case.id == "per_example_grad_gram"  # entries up to ~150
    tree_allclose(
        out,
        expected(case.id, n),
        rtol=1e-4 if gram else 1e-5,
        atol=1e-4 if gram else 1e-6,
    )


@ft.cache
def eager_session(case_id: str, n: int):
    """The transform with `batch_size=B` and a counted user function, called eagerly
    on the standard inputs of `n` examples and again on new arrays of the same types:
    the first output, the trace counts before and after the first call, and the
    compilations made by the second. Shared by (a) and (e), so that each compiles
    once."""
    case = next(c for c in CASES if c.id == case_id)
    user, traces = case.counted_user()
    run, _ = case.make(user, batch_size=B)
    before = traces()
    out = run(*inputs(case, n))
    first = traces()
    with CompileCounter() as compiles:
        run(*inputs(case, n, seed=1))
    return out, (before, first, compiles.count)


@ALL
@pytest.mark.parametrize("n", N_VALUES)
def test_values_match_the_oracle(case, n):
    out, _ = eager_session(case.id, n)
    close_to_oracle(case, out, n)


# --------------------------------------------------------------------------------------
# (b) It really chunks.


@ALL
def test_temp_memory_is_flat_in_n(case):
    """XLA's compiled temporary memory at fixed B stays flat as N grows 16x.

    The control: the oracle evaluates all N examples at once and holds N hidden
    activations (4 * H bytes each), so its temporaries grow by at least half of that,
    2 * H * (N_LARGE - N_SMALL) ~ 480 KiB (1 to 5 MiB measured). The chunked program
    may only grow by what the chunking itself legitimately sizes by N (the output is
    not a temporary): the scan's int32 chunk indices (4 / B bytes per example, 960
    bytes measured for every case), allowed 4 bytes per example; and for the Jacobians,
    whose basis vectors have length N, one chunk of B basis vectors plus one more
    length-N vector, 4 * (B + 1) bytes per example (20160 bytes measured in all, and
    (B + 1) * 4 * (N_LARGE - N_SMALL) for B = 2, 4, 8 alike); for the Gram of a batch
    with itself, each example's row of dot products with the half of the batch its
    chunk reaches (min(N, N // 2 + B) float32 values and an int32 start, held until
    the symmetric matrix is read from them: 2,108,160 bytes of the growth), plus 4 * B
    bytes per example. Each slack beyond those rows is at most 1/20 of the control's
    growth.
    """
    run, _ = case.make(case.user, batch_size=B)
    oracle = case.oracle(case.user)
    rng = np.random.default_rng(0)
    small, large = abstract(case.args(N_SMALL, rng)), abstract(case.args(N_LARGE, rng))
    sizes = {
        "chunked": (temp_bytes(run, *small), temp_bytes(run, *large)),
        "oracle": (temp_bytes(oracle, *small), temp_bytes(oracle, *large)),
    }
    growth = {k: large - small for k, (small, large) in sizes.items()}
    dn = N_LARGE - N_SMALL
    assert growth["oracle"] >= 2 * H * dn, sizes
    slack = 4 * dn + (4 * (B + 1) * dn if case.basis else 0)
    if case.block:
        rows = [n * (min(n, n // 2 + B) + 1) for n in (N_SMALL, N_LARGE)]
        slack += 4 * B * dn + 4 * (rows[1] - rows[0])
    assert growth["chunked"] <= slack, sizes


@ALL
def test_progress_reports_every_chunk(case):
    calls = []
    out = chunked(
        case,
        N_OPTIONS,
        batch_size=B,
        progress=lambda done, total: calls.append((done, total)),
    )
    jax.block_until_ready(out)
    jax.effects_barrier()
    total = -(-N_OPTIONS // B)
    assert calls == [(done, total) for done in range(1, total + 1)]


# --------------------------------------------------------------------------------------
# (c) The shared options, each against the oracle.


@ALL
def test_chunk_size_is_an_alias(case):
    close_to_oracle(case, chunked(case, N_OPTIONS, chunk_size=B), N_OPTIONS)
    with pytest.raises(TypeError, match="both batch_size=4 and its alias chunk_size=4"):
        case.make(case.user, batch_size=B, chunk_size=B)[0](*inputs(case, N_OPTIONS))


@ALL
def test_auto_batch_size(case, caplog):
    # The budget fits all 13 examples (at most 30 KiB of temporaries), so the search
    # stops after two probes: compiling probes is what this check costs.
    run, handle = case.make(case.user, batch_size="auto", memory_limit="64KiB")
    with caplog.at_level(logging.INFO, logger="chunkvmap"):
        out = run(*inputs(case, N_OPTIONS))
    close_to_oracle(case, out, N_OPTIONS)
    # The chunkvmap logger reports the choice of this very transform, by its name.
    choices = [
        int(m.group(1))
        for r in caplog.records
        if r.name == "chunkvmap"
        and (
            m := re.match(
                rf"{re.escape(case.name)} batch_size='auto': chose (\d+) of "
                rf"{N_OPTIONS} examples",
                r.getMessage(),
            )
        )
    ]
    assert len(choices) == 1, caplog.text
    (chosen,) = choices
    assert 1 <= chosen <= N_OPTIONS
    assert chunkvmap.last_batch_size() == chosen
    assert chunkvmap.last_batch_size(handle) == chosen


@ALL
@pytest.mark.parametrize(
    "remat", [False, jax.checkpoint_policies.dots_saveable], ids=["off", "policy"]
)
def test_remat_options_keep_values(case, remat):
    out = chunked(case, N_OPTIONS, batch_size=B, remat=remat)
    close_to_oracle(case, out, N_OPTIONS)


@ALL
def test_shard_keeps_values(case):
    out = chunked(case, N_SHARD, batch_size=B, shard=True, mesh=MESH)
    close_to_oracle(case, out, N_SHARD)


# --------------------------------------------------------------------------------------
# (d) Errors name the function the user called and the argument they used.


@ALL
@pytest.mark.parametrize("arg", ["batch_size", "chunk_size"])
def test_invalid_batch_size_names_function_and_argument(case, arg):
    with pytest.raises(ValueError) as info:
        chunked(case, N_OPTIONS, **{arg: 0})
    message = str(info.value)
    assert message.startswith(f"{case.name} {arg} must be a positive int"), message


@ALL
def test_invalid_progress_names_function_and_argument(case):
    with pytest.raises(TypeError) as info:
        chunked(case, N_OPTIONS, batch_size=B, progress=3)
    message = str(info.value)
    assert message.startswith(f"{case.name} progress must be"), message
    assert "progress=3" in message, message


# --------------------------------------------------------------------------------------
# (e) No retrace on the second eager call.


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id not in FLAX_IDS], ids=lambda c: c.id
)
def test_second_eager_call_does_not_recompile(case):
    _, (before, first, compiles) = eager_session(case.id, N_OPTIONS)
    assert first > before  # the first call traces the user's function
    # The second, with new arrays of the same types, traces it again (an eager call
    # sees the function as it is now, as jax.vmap does) but compiles nothing.
    assert compiles == 0


# The Flax adapters are left out of the check above: called eagerly, `Module.apply`
# and an `nnx` transform re-run Flax's own Python on every call (module setup, lifting,
# graph splitting and merging), and that Python calls the user's method again; nothing
# is cached across eager calls, by `nn.vmap` / `nnx.vmap` either. This test shows the
# reference retraces too.
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in FLAX_IDS], ids=lambda c: c.id
)
def test_flax_oracles_retrace_on_every_eager_call(case):
    user, traces = case.counted_user()
    oracle = case.oracle(user)
    oracle(*inputs(case, N_OPTIONS))
    first = traces()
    oracle(*inputs(case, N_OPTIONS, seed=1))
    assert traces() > first


# --------------------------------------------------------------------------------------
# (f) Every transform of a function is also a decorator with its options alone.


def _loss(w, x):
    return jnp.sum(jnp.tanh(x * w))


DECORATED = {
    # name: (options, the function it decorates, its arguments)
    "batch_vmap": ({}, jnp.sin, (np.linspace(0, 1, 7, dtype=np.float32),)),
    "per_example_grads": ({}, _loss, (np.ones(3, np.float32), normal(_rng, 7, 3))),
    "clipped_grad_sum": (
        {"l2_clip_norm": 0.5},
        _loss,
        (np.ones(3, np.float32), normal(_rng, 7, 3)),
    ),
    "clipped_grad": (
        {"l2_clip_norm": 0.5, "keep_batch_dim": False},
        _loss,
        (np.ones(3, np.float32), normal(_rng, 7, 3)),
    ),
    **{
        name: ({}, _loss, (np.ones(3, np.float32), normal(_rng, 7, 3)))
        for name in (
            "per_example_grad_norms",
            "per_example_grad_stats",
            "per_example_grad_gram",
        )
    },
    "batch_jacfwd": ({}, jnp.sin, (np.linspace(0, 1, 7, dtype=np.float32),)),
    "batch_jacrev": ({}, jnp.sin, (np.linspace(0, 1, 7, dtype=np.float32),)),
    "batch_vectorize": (
        {"signature": "(n)->()"},
        jnp.sum,
        (normal(_rng, 7, 3),),
    ),
}


@pytest.mark.parametrize("name", sorted(DECORATED))
def test_decorator_form(name):
    transform = getattr(chunkvmap, name)
    options, fun, args = DECORATED[name]
    decorator = transform(**options, batch_size=3)
    decorated = decorator(fun)
    tree_allclose(decorated(*args), transform(fun, **options, batch_size=3)(*args))
    assert decorated.__name__ == fun.__name__
    assert chunkvmap.last_batch_size(decorated) == 3
    with pytest.raises(TypeError, match=f"{name} .*must be a callable"):
        transform(3, **options)
