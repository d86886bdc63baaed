"""Every higher-order primitive evaluated as JAX evaluates it: generated over the
primitive x how the result is called x whether its body reads a hoisted constant.

An eager call compiles the chunk's trace with the arrays it reads as arguments,
the constants of nested `jax.jit`s too (`chunkvmap._core._program`): the
equations holding them are bound again with those constants as operands. That
evaluation must be JAX's own: the same values, derivative rules (a `custom_vjp`
that clips its cotangent, a straight-through `custom_jvp`), batching (a
`while_loop` whose stopping test differs per example) and errors (reverse mode
through a `while_loop`, forward mode through a `custom_vjp`).

The primitives (`PRIMITIVES`): custom_jvp, custom_vjp, while, scan, cond, switch,
remat (with a policy) and a nested jit. The calls (`CALLS`): eagerly, under
`jax.jit`, `jax.grad` and `jax.jvp` of the result, and under `jax.vmap`. The
constant: the body reads an array through a nested `jax.jit` closing over it
(hoisted), or through the function's own closure (not hoisted). The reference is
`jax.vmap` of the same function, called the same way; N=5 in chunks of 2.

Differentiated twice (`SECOND`: forward over reverse, reverse over reverse), each
primitive is generated again over the loop's `remat` settings: a loop that saves
residuals must keep the rules its forward pass holds (JAX's scan hoists residuals
out of its loop by a pass that drops custom JVP rules).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap as cv

from .helpers import tree_allclose


N, B = 5, 2
X = jnp.asarray(np.linspace(-1.3, 1.7, N * 3, dtype=np.float32).reshape(N, 3))
T = jnp.asarray(np.linspace(0.5, -0.5, N * 3, dtype=np.float32).reshape(N, 3))
W = jnp.asarray(np.array([1.5, -0.5, 2.0], np.float32))
M = jnp.asarray(
    np.array([[1.0, 0.5, 0.0], [-0.5, 1.0, 0.25], [0.0, 2.0, 1.0]], np.float32)
)


def _reader(hoisted: bool) -> Callable[[jax.Array], jax.Array]:
    """`x * W`: through a nested jit closing over W (its constant is hoisted), or
    through the function's own closure."""
    if hoisted:
        return jax.jit(lambda x: x * W)
    return lambda x: x * W


def _custom_jvp(read):
    @jax.custom_jvp
    def rounded(x):
        return jnp.round(read(x))

    # straight through, with a tangent that depends on the primal (so that every
    # order of the rule differs from the primal's own derivatives)
    rounded.defjvp(lambda p, t: (rounded(p[0]), (jnp.sin(p[0]) + 3.0) * t[0]))
    return lambda x: jnp.sum(jnp.dot(rounded(x), M) ** 2)


def _custom_vjp(read):
    @jax.custom_vjp
    def clipped(x):
        return read(x)

    clipped.defvjp(lambda x: (read(x), None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))
    return lambda x: jnp.sum(clipped(x) ** 2)


def _while(read):
    def f(x):  # a stopping test that differs per example
        def body(c):
            return c[0] + jnp.abs(read(x)).sum() + 0.25, c[1] + 1

        return jax.lax.while_loop(lambda c: c[0] < 4.0, body, (x.sum(), 0))[1]

    return f


def _scan(read):
    def f(x):
        def step(c, xi):
            c = jnp.sin(c + read(xi * c)).sum() + c
            return c, c * xi

        c, ys = jax.lax.scan(step, jnp.float32(0.5), x)
        return c + ys.sum()

    return f


def _cond(read):
    return lambda x: jax.lax.cond(
        x.sum() > 0, lambda x: jnp.sin(read(x)).sum(), lambda x: (x**2).sum(), x
    )


def _switch(read):
    def f(x):
        index = jnp.clip(jnp.floor(x[0] + 1.5), 0, 2).astype(jnp.int32)
        branches = [
            lambda x: jnp.sin(read(x)).sum(),
            lambda x: (read(x) ** 2).sum(),
            lambda x: x.sum() * 3.0,
        ]
        return jax.lax.switch(index, branches, x)

    return f


def _remat(read):
    policy = jax.checkpoint_policies.nothing_saveable
    body = jax.checkpoint(lambda x: jnp.tanh(read(x)) * x, policy=policy)
    return lambda x: jnp.sum(body(x) ** 2)


def _jit(read):
    return jax.jit(lambda x: jnp.sum(jnp.cos(read(x)) * x))


PRIMITIVES = {
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "while": _while,
    "scan": _scan,
    "cond": _cond,
    "switch": _switch,
    "remat": _remat,
    "jit": _jit,
}


def _summed(mapped):
    return lambda x: jnp.sum(mapped(x).astype(jnp.float32))


CALLS: dict[str, Callable[[Callable], object]] = {
    "eager": lambda m: m(X),
    "jit": lambda m: jax.jit(m)(X),
    "grad": lambda m: jax.grad(_summed(m))(X),
    "jvp": lambda m: jax.jvp(m, (X,), (T,)),
    "vmap": lambda m: jax.vmap(m)(jnp.stack([X, -X])),
}


def _outcome(call: Callable[[], object]) -> tuple[str, object]:
    try:
        return "value", call()
    except Exception as e:  # noqa: BLE001 (both sides must fail alike)
        return "error", type(e)


def _check(ours: Callable[[], object], reference: Callable[[], object]) -> None:
    expected, got = _outcome(reference), _outcome(ours)
    assert got[0] == expected[0], (got, expected)
    if expected[0] == "error":
        assert issubclass(got[1], expected[1]), (got, expected)  # pyright: ignore
    else:
        tree_allclose(got[1], expected[1], rtol=1e-5, atol=1e-5)


GRID = list(itertools.product(PRIMITIVES, CALLS, [True, False]))


def test_the_grid_is_the_whole_product():
    assert len(GRID) == 8 * 5 * 2
    assert {p for p, _, _ in GRID} == set(PRIMITIVES)


@pytest.mark.parametrize("primitive, call, hoisted", GRID)
def test_batch_vmap_evaluates_as_jax_does(primitive, call, hoisted):
    f = PRIMITIVES[primitive](_reader(hoisted))
    ours = cv.batch_vmap(f, batch_size=B)
    _check(lambda: CALLS[call](ours), lambda: CALLS[call](jax.vmap(f)))


# batch_map takes an already vectorised function: eagerly and under grad, each
# primitive reading a hoisted constant.
@pytest.mark.parametrize("primitive", PRIMITIVES)
@pytest.mark.parametrize("call", ["eager", "grad"])
def test_batch_map_evaluates_as_jax_does(primitive, call):
    f = jax.vmap(PRIMITIVES[primitive](_reader(True)))
    ours = lambda xs: cv.batch_map(f, xs, batch_size=B)  # noqa: E731
    _check(lambda: CALLS[call](ours), lambda: CALLS[call](f))


SECOND: dict[str, Callable[[Callable], object]] = {
    "jvp of grad": lambda m: jax.jvp(jax.grad(_summed(m)), (X,), (T,)),
    "grad of grad": lambda m: jax.grad(lambda x: jnp.vdot(jax.grad(_summed(m))(x), T))(
        X
    ),
}
REMATS = {
    "remat": True,
    "saved": False,
    "dots saved": jax.checkpoint_policies.dots_saveable,
}


# The straight-through rule at every call and setting; the other primitives (that
# the nesting breaks none of them) in a loop that saves everything, under one call.
SECOND_GRID = [("custom_jvp", c, r) for c in SECOND for r in REMATS] + [
    (p, "grad of grad", "saved") for p in PRIMITIVES if p != "custom_jvp"
]


@pytest.mark.parametrize("primitive, call, remat", SECOND_GRID)
def test_second_derivatives_are_jaxs_whatever_the_loop_saves(primitive, call, remat):
    """A straight-through rule's second derivative through a loop that saves its
    residuals was 0 (`remat=False`, or a policy saving the product after the
    rule), where `jax.vmap`'s is the rule's."""
    f = PRIMITIVES[primitive](_reader(primitive == "jit"))
    ours = cv.batch_vmap(f, batch_size=B, remat=REMATS[remat])
    _check(lambda: SECOND[call](ours), lambda: SECOND[call](jax.vmap(f)))


# Each loop the chunks can take: `B` dividing `N` (the scan over the reshaped
# input), a remainder window, a reduction, and devices' shares of the examples.
LAYOUTS = {
    "even": (6, {}),
    "remainder": (5, {}),
    "reduced": (5, {"reduction": jnp.add, "chunk_reduction": lambda y: y.sum(0)}),
    "sharded": (32, {"shard": True}),  # two chunks on each of 8 devices
}


@pytest.mark.parametrize(
    "layout, remat",
    [(layout, "saved") for layout in LAYOUTS] + [("remainder", "dots saved")],
)
def test_every_loop_keeps_the_rule_at_second_order(layout, remat):
    """Forward over reverse through each loop layout that saves residuals."""
    n, kw = LAYOUTS[layout]
    x = jnp.asarray(np.linspace(-1.3, 1.7, n * 3, dtype=np.float32).reshape(n, 3))
    f = PRIMITIVES["custom_jvp"](_reader(False))
    ours = cv.batch_vmap(f, batch_size=B, remat=REMATS[remat], **kw)

    def hvp(m):
        grad = jax.grad(lambda v: jnp.sum(jnp.sin(m(v))))
        return jax.jvp(grad, (x,), (jnp.cos(x),))[1]

    reference = jax.vmap(f)
    if "reduction" in kw:  # the examples' sum
        reference = lambda v: jax.vmap(f)(v).sum(0)  # noqa: E731
    tree_allclose(hvp(ours), hvp(reference), rtol=1e-5, atol=1e-5)


HIGHER = {
    "third": lambda g: jax.grad(lambda x: jnp.vdot(g(x), T)),
    "fourth": lambda g: (
        lambda x: jax.jvp(jax.grad(lambda x: jnp.vdot(g(x), T)), (x,), (T,))[1]
    ),
}


@pytest.mark.parametrize(
    "order, remat", [("third", "saved"), ("fourth", "saved"), ("fourth", "remat")]
)
def test_the_rule_holds_to_the_fourth_order(order, remat):
    """Each reverse-mode pass takes one checkpoint of the loop's nest apart: with
    `RULE_ORDERS` of them, three gradients and a tangent still use the rule."""
    assert cv._core._loop.RULE_ORDERS >= 4
    f = PRIMITIVES["custom_jvp"](_reader(False))
    ours = cv.batch_vmap(f, batch_size=B, remat=REMATS[remat])

    def derivative(m):
        g = jax.grad(lambda x: jnp.sum(m(x)))
        second = jax.grad(lambda x: jnp.vdot(g(x), T))
        return HIGHER[order](second)(X)

    expected = derivative(jax.vmap(f))
    tree_allclose(derivative(ours), expected, rtol=1e-4, atol=1e-4)


def test_per_example_gradients_differentiated_twice_keep_the_rule():
    """The same through an entry point: a Hessian-vector product (forward over
    reverse) of a function of `per_example_grads(..., remat=False)`, whose loop
    is then differentiated twice."""
    f = PRIMITIVES["custom_jvp"](_reader(False))

    def loss(w, x):
        return f(x * w)

    def hvp(per_example):
        total = lambda w: jnp.sum(jnp.sin(per_example(w, X)))  # noqa: E731
        return jax.jvp(jax.grad(total), (W,), (W[::-1],))

    ours = cv.per_example_grads(loss, batch_argnums=1, batch_size=B, remat=False)
    expected = hvp(jax.vmap(jax.grad(loss), (None, 0)))
    assert float(jnp.abs(expected[1]).max()) > 1.0  # the rule's, at third order
    tree_allclose(hvp(ours), expected, rtol=1e-5, atol=1e-5)


def test_a_clipping_rule_is_kept_under_grad():
    """The case that was wrong: `jax.grad` through a chunked `custom_vjp` whose
    primal calls a nested jit differentiated the primal (error 36 here)."""
    f = PRIMITIVES["custom_vjp"](_reader(True))
    got = jax.grad(_summed(cv.batch_vmap(f, batch_size=B)))(X)
    assert float(jnp.abs(got).max()) <= 0.1 + 1e-7  # the rule's clip
    tree_allclose(got, jax.grad(_summed(jax.vmap(f)))(X))
