"""A transform built once sees its function's closure as it is at each call, as
`jax.vmap` does: generated over every entry point x what the function closes over
x how it is called.

What the function closes over, changed between two calls (`KINDS`): a JAX array
rebound; a typed PRNG key rebound; a NumPy array changed in place or rebound; a
Python scalar (0.0, then -0.0); a host callback with a default argument; a
`custom_jvp` or `custom_vjp` rule; a `custom_vjp` (a clipped backward pass) whose
primal reads a rebound array through a nested `jax.jit`; a nested `jax.jit` closing
over a JAX array or over a NumPy array changed in place; an Equinox module, an NNX
module's weight, a linen model's variables.

How it is called (`MODES`): eagerly, and under `jax.grad`, `jax.jvp` and
`jax.vmap` with respect to a value the function closes over (the closure then
holds a tracer).

Every entry point meets every kind eagerly (where the kind can change what the
entry point computes: a custom derivative rule changes only derivatives); each
other call meets every entry point and every kind, and the custom rules meet every
entry point whose traced program holds them (those that do not differentiate).
Each case builds the transform once, then for each state of the closure compares
it with the reference on the same inputs (`jax.vmap`, `jnp.vectorize`,
`jax.jacfwd`/`jax.jacrev`, `jax.vmap(jax.grad)`), evaluated eagerly (a jitted
reference would keep JAX's own compiled constants). Eagerly, a new array compiles
nothing, and no array the closure let go of stays alive while the transform does.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import gc
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap as cv

from .helpers import CompileCounter, projected_rows, tree_allclose


N, B, CLIP = 5, 2, 1e6
X = jnp.asarray(np.linspace(-1.0, 1.5, N * 3, dtype=np.float32).reshape(N, 3))
W = jnp.asarray(np.eye(3, dtype=np.float32) + 0.1)
P0 = jnp.asarray(np.array([1.0, 0.5, -0.25], np.float32))
# What the function closes over. "p" is the value the calls under grad, jvp and vmap
# differentiate or map (a factor of every kind's function).
S: dict[str, Any] = {}
VALUES = [
    np.array([1.0, -2.0, 3.0], np.float32),
    np.array([0.5, 4.0, -1.0], np.float32),
]


# --------------------------------------------------------------------------------------
# What the function closes over


@dataclasses.dataclass
class Kind:
    """A closure that can be in state 0 or 1 (`set`), read by `fn(v)`; `arrays`:
    only arrays change (eagerly, nothing compiles again); `derivative_only`: only
    derivatives change; `forward_mode`: it can be differentiated forward."""

    fn: Callable[[Any], Any]
    set: Callable[[int], Any]  # returns the JAX arrays it replaced
    arrays: bool = True
    derivative_only: bool = False
    forward_mode: bool = True


IN_PLACE = np.zeros(3, np.float32)


def _rebind(name, make):
    def set_state(k):
        old = S.get(name)
        S[name] = make(k)
        return [a for a in jax.tree.leaves(old) if isinstance(a, jax.Array)]

    return set_state


def _jnp_array(k):
    return jnp.asarray(VALUES[k])


def _numpy_array(k):
    return VALUES[k].copy()


def _in_place(k):
    IN_PLACE[:] = VALUES[k]


def _callback(v):
    shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
    return v * jax.pure_callback(
        S["cb"], shape, jax.lax.stop_gradient(v), vmap_method="sequential"
    )


def _make_cb(k):
    return lambda x, s=(1.0, 3.0)[k]: np.asarray(x) * np.float32(s)


def _make_custom_jvp(k):
    scale = (1.0, 5.0)[k]

    @jax.custom_jvp
    def reverse(x):
        return x

    reverse.defjvp(lambda p, t: (p[0], -scale * t[0]))
    return reverse


def _make_custom_vjp(k):
    scale = (1.0, 5.0)[k]

    @jax.custom_vjp
    def reverse(x):
        return x

    reverse.defvjp(lambda x: (x, None), lambda _, g: (-scale * g,))
    return reverse


def _eqx_module(k):
    import equinox as eqx

    return eqx.nn.Linear(3, 3, key=jax.random.key(k))


class _NNX:
    module: Any = None

    @classmethod
    def set(cls, k):
        from flax import nnx

        if cls.module is None:
            cls.module = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        old = cls.module.kernel.get_value()
        cls.module.kernel.set_value(jnp.asarray(np.outer(VALUES[k], VALUES[1 - k])))
        return [old]


@ft.cache
def _dense():
    import flax.linen as nn

    return nn.Dense(3)  # made once, outside any module's method


def _linen_variables(k):
    return _dense().init(jax.random.key(k), jnp.ones(3))


def _linen_apply(v):
    return _dense().apply(S["vars"], v)


@jax.custom_vjp
def _clipped_through_jit(v):
    """A custom_vjp (a clipped backward pass) whose primal reads the closed-over
    array through a nested `jax.jit`: its constant is hoisted in an eager program."""
    return jax.jit(lambda y: y * S["a"])(v)


_clipped_through_jit.defvjp(
    lambda v: (_clipped_through_jit(v), None), lambda _, g: (jnp.clip(g, -0.1, 0.1),)
)


KINDS = {
    "jnp array": Kind(lambda v: v * S["a"], _rebind("a", _jnp_array)),
    "typed key": Kind(
        lambda v: v * jax.random.uniform(S["k"], (3,), minval=0.5),
        _rebind("k", jax.random.key),
    ),
    "custom_vjp over a nested jit": Kind(
        _clipped_through_jit, _rebind("a", _jnp_array), forward_mode=False
    ),
    "numpy in place": Kind(lambda v: v * IN_PLACE, _in_place),
    "numpy rebound": Kind(lambda v: v * S["n"], _rebind("n", _numpy_array)),
    "scalar +-0.0": Kind(
        lambda v: v * jnp.arctan2(S["s"], -1.0), _rebind("s", (0.0, -0.0).__getitem__),
        arrays=False,
    ),
    "callback default": Kind(_callback, _rebind("cb", _make_cb), arrays=False),
    "custom_jvp rule": Kind(
        lambda v: S["cj"](v), _rebind("cj", _make_custom_jvp), arrays=False,
        derivative_only=True,
    ),
    "custom_vjp rule": Kind(
        lambda v: S["cv"](v), _rebind("cv", _make_custom_vjp), arrays=False,
        derivative_only=True, forward_mode=False,
    ),
    "nested jit, jnp": Kind(
        lambda v: jax.jit(ft.partial(jnp.multiply, S["a"]))(v),
        _rebind("a", _jnp_array),
    ),
    "nested jit, numpy in place": Kind(
        lambda v: jax.jit(lambda y: y * IN_PLACE)(v), _in_place
    ),
    "eqx module": Kind(lambda v: S["m"](v), _rebind("m", _eqx_module)),
    "nnx module": Kind(lambda v: _NNX.module(v), _NNX.set),
    "linen variables": Kind(_linen_apply, _rebind("vars", _linen_variables)),
}  # fmt: skip


def user_fn(kind: Kind) -> Callable[[Any], Any]:
    """The user's per-example function: the kind's, of the example times the
    closed-over "p" (so that a derivative with respect to "p" passes through it)."""
    return lambda v: kind.fn(v * S["p"])


# --------------------------------------------------------------------------------------
# The entry points: (built once from the user's function, called; its reference)


def _loss(u):
    return lambda w, v: jnp.sum(u(v @ w))


def _grads(u):
    return jax.vmap(jax.grad(_loss(u)), (None, 0))(W, X)


def _flat(g):
    return g.reshape(g.shape[0], -1)


def _linen(u):
    import flax.linen as nn

    from chunkvmap import linen as cl

    class Apply(nn.Module):
        def __call__(self, v):
            return u(v)

    lifted = cl.batch_vmap(
        Apply, variable_axes={}, split_rngs={}, in_axes=0, batch_size=B
    )()
    return lambda: lifted.apply({}, X)


def _batch_map(u):
    fun = jax.vmap(u)  # made once, as users pass the same function
    return lambda: cv.batch_map(fun, X, batch_size=B)


@dataclasses.dataclass
class Entry:
    make: Callable[[Callable], Callable[[], Any]]  # u -> a call of the built transform
    oracle: Callable[[Callable], Any]  # u -> the reference, now
    derivative: bool = False  # computes derivatives (custom rules show)
    reverse_only: bool = False  # reverse mode inside (no custom_vjp under jvp)


def _made(transform, *args):
    return lambda u: ft.partial(transform(u), *args)


def _part(transform, part):
    """A transform's call, keeping one part of its result (an index or a field)."""
    if isinstance(part, int):
        return lambda *a: transform(*a)[part]
    return lambda *a: getattr(transform(*a), part)


def _clipped_sum(u, method):
    return cv.clipped_grad_sum(_loss(u), CLIP, batch_size=B, method=method)


def _model(u):
    return lambda w, v: u(v @ w)


def _jacobians(u):
    return jax.vmap(jax.jacrev(_model(u)), (None, 0))(W, X)


def _projections(u, method):
    return cv.per_example_grad_projections(_loss(u), dim=2, method=method, batch_size=B)


def _projected(u):
    return projected_rows(_grads(u), 2)


_CLIPPED_GRAD = Entry(
    _made(
        lambda u: cv.clipped_grad(
            _loss(u), l2_clip_norm=CLIP, keep_batch_dim=False, batch_size=B
        ),
        W, X,
    ),
    lambda u: _grads(u).sum(0), derivative=True, reverse_only=True,
)  # fmt: skip

ENTRIES = {
    "batch_vmap": Entry(
        _made(lambda u: cv.batch_vmap(u, batch_size=B), X), lambda u: jax.vmap(u)(X)
    ),
    "batch_map": Entry(_batch_map, lambda u: jax.vmap(u)(X)),
    "batch_vectorize": Entry(
        _made(lambda u: cv.batch_vectorize(u, signature="(n)->(n)", batch_size=B), X),
        lambda u: jnp.vectorize(u, signature="(n)->(n)")(X),
    ),
    "batch_jacfwd": Entry(
        _made(lambda u: cv.batch_jacfwd(u, batch_size=B), X[1]),
        lambda u: jax.jacfwd(u)(X[1]), derivative=True,
    ),
    "batch_jacrev": Entry(
        _made(lambda u: cv.batch_jacrev(u, batch_size=B), X[1]),
        lambda u: jax.jacrev(u)(X[1]), derivative=True, reverse_only=True,
    ),
    "per_example_grads": Entry(
        _made(lambda u: cv.per_example_grads(_loss(u), batch_size=B), W, X),
        _grads, derivative=True, reverse_only=True,
    ),
    "clipped_grad_sum": Entry(
        _made(lambda u: _part(_clipped_sum(u, "vmap"), 0), W, X),
        lambda u: _grads(u).sum(0), derivative=True, reverse_only=True,
    ),
    "clipped_grad_sum(ghost)": Entry(
        _made(lambda u: _part(_clipped_sum(u, "ghost"), 0), W, X),
        lambda u: _grads(u).sum(0), derivative=True, reverse_only=True,
    ),
    "clipped_grad": _CLIPPED_GRAD,
    # (the same entry, run by the TPU's NaN-safe sum in passes here on the CPU)
    "clipped_grad(in passes)": _CLIPPED_GRAD,
    "per_example_grad_norms": Entry(
        _made(lambda u: cv.per_example_grad_norms(_loss(u), batch_size=B), W, X),
        lambda u: jnp.linalg.norm(_flat(_grads(u)), axis=1),
        derivative=True, reverse_only=True,
    ),
    "per_example_grad_stats": Entry(
        _made(
            lambda u: _part(cv.per_example_grad_stats(_loss(u), batch_size=B), "mean"),
            W, X,
        ),
        lambda u: _grads(u).mean(0), derivative=True, reverse_only=True,
    ),
    "per_example_grad_gram": Entry(
        _made(lambda u: cv.per_example_grad_gram(_loss(u), batch_size=B), W, X),
        lambda u: _flat(_grads(u)) @ _flat(_grads(u)).T,
        derivative=True, reverse_only=True,
    ),
    "ggn_diagonal": Entry(  # halved squared error: the Jacobian's squares
        _made(
            lambda u: cv.ggn_diagonal(_model(u), likelihood="gaussian", batch_size=B),
            W, X,
        ),
        lambda u: jnp.sum(_jacobians(u) ** 2, (0, 1)),
        derivative=True, reverse_only=True,
    ),
    "kfac_factors": Entry(  # the output factor: sum J_u^T J_u at the product's output
        _made(
            lambda u: _part(
                cv.kfac_factors(_model(u), likelihood="gaussian", batch_size=B),
                "outputs",
            ),
            W, X,
        ),
        lambda u: jnp.einsum("nmo,nmp->op", *[jax.vmap(jax.jacrev(u))(X @ W)] * 2),
        derivative=True, reverse_only=True,
    ),
    "per_example_grad_projections": Entry(
        _made(lambda u: _projections(u, "vmap"), W, X), _projected,
        derivative=True, reverse_only=True,
    ),
    "per_example_grad_projections(ghost)": Entry(
        _made(lambda u: _projections(u, "ghost"), W, X), _projected,
        derivative=True, reverse_only=True,
    ),
    "eqx.filter_batch_vmap": Entry(
        _made(lambda u: _eqx().filter_batch_vmap(u, batch_size=B), X),
        lambda u: jax.vmap(u)(X),
    ),
    "nnx.batch_vmap": Entry(
        _made(lambda u: _nnx().batch_vmap(u, batch_size=B), X),
        lambda u: jax.vmap(u)(X),
    ),
    "linen.batch_vmap": Entry(_linen, lambda u: jax.vmap(u)(X)),
}  # fmt: skip


def _eqx():
    from chunkvmap import eqx

    return eqx


def _nnx():
    from chunkvmap import nnx

    return nnx


# --------------------------------------------------------------------------------------
# How it is called: a function of the closed-over "p"


def _at(p, call):
    S["p"] = p
    try:
        return call()
    finally:
        S["p"] = P0


def _total(p, call):
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(_at(p, call)))


MODES = {
    "eager": lambda call: _at(P0, call),
    "grad": lambda call: jax.grad(_total, argnums=0)(P0, call),
    "jvp": lambda call: jax.jvp(lambda p: _total(p, call), (P0,), (P0 + 1,)),
    "vmap": lambda call: jax.vmap(lambda p: _total(p, call))(jnp.stack([P0, 2 * P0])),
}


def valid(entry: str, kind: str, mode: str) -> bool:
    """Whether the kind of closure can change what the call computes, and the call
    exists (no custom_vjp under forward mode)."""
    e, k = ENTRIES[entry], KINDS[kind]
    forward = mode == "jvp" or entry == "batch_jacfwd"
    if not k.forward_mode and forward:
        return False
    if k.derivative_only:
        return e.derivative or mode in ("grad", "jvp")
    return True


def cases() -> list[tuple[str, str, str]]:
    """Every (entry point, kind) eagerly; under grad, jvp and vmap every entry point
    with some kind and every kind with some entry point (each picking the one met
    least so far), and the custom rules with every entry point that does not
    differentiate (where the traced program holds the rule itself)."""
    out = [(e, k, "eager") for e in ENTRIES for k in KINDS if valid(e, k, "eager")]
    for mode in ("grad", "jvp", "vmap"):
        met: dict[str, int] = {}

        def least(options, met=met):
            chosen = min(options, key=lambda o: met.get(o, 0))
            met[chosen] = met.get(chosen, 0) + 1
            return chosen

        pairs = set()
        for e in ENTRIES:
            pairs.add((e, least([k for k in KINDS if valid(e, k, mode)])))
        for k in KINDS:
            entries = [e for e in ENTRIES if valid(e, k, mode)]
            if entries and not any(pk == k for _, pk in pairs):
                pairs.add((least(entries), k))
            if KINDS[k].derivative_only:  # the rule stays in a forward program
                pairs.update((e, k) for e in entries if not ENTRIES[e].derivative)
        out += [(e, k, mode) for e, k in sorted(pairs)]
    return out


CASES = cases()


def test_the_grid_covers_every_entry_point_kind_and_call():
    eager = {(e, k) for e, k, m in CASES if m == "eager"}
    assert eager == {(e, k) for e in ENTRIES for k in KINDS if valid(e, k, "eager")}
    for mode in MODES:
        assert {e for e, _, m in CASES if m == mode} == set(ENTRIES)
        possible = {k for k in KINDS if any(valid(e, k, mode) for e in ENTRIES)}
        assert {k for _, k, m in CASES if m == mode} == possible
    # every kind under every call, but for the custom_vjps under jvp (JAX refuses)
    no_jvp = {"custom_vjp rule", "custom_vjp over a nested jit"}
    assert {k for _, k, m in CASES if m == "jvp"} == set(KINDS) - no_jvp


@pytest.mark.parametrize("entry, kind, mode", CASES)
def test_a_changed_closure_is_seen(entry, kind, mode, request):
    if entry.startswith(("eqx", "nnx", "linen")) or kind.startswith(
        ("eqx", "nnx", "linen")
    ):
        pytest.importorskip("equinox" if "eqx" in entry + kind else "flax")
    if entry == "clipped_grad_sum(ghost)":
        request.getfixturevalue("always_ghost")
    if entry == "clipped_grad(in passes)":
        request.getfixturevalue("in_passes")
    e, k = ENTRIES[entry], KINDS[kind]
    S["p"] = P0
    k.set(0)
    u = user_fn(k)
    call = e.make(u)  # built once, called in each state
    refs = []  # the arrays each state replaced: none is kept (checked once, at the end)
    try:
        for state in (0, 1):
            replaced = k.set(state)
            with CompileCounter() as compiles:
                got = MODES[mode](call)
            tree_allclose(got, MODES[mode](lambda: e.oracle(u)), rtol=2e-5, atol=2e-5)
            if mode == "eager" and state == 1 and k.arrays:
                assert compiles.count == 0, "a new array compiled a new program"
            if mode == "eager" and k.arrays:
                refs += [weakref.ref(a) for a in replaced or ()]
            del replaced
        if any(r() is not None for r in refs):  # (a cycle may hold it until then)
            gc.collect()
            assert all(r() is None for r in refs), "a replaced array is kept"
    finally:
        k.set(0)
