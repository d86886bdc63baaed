"""Small helpers for reading and binding jaxprs, shared by the convolution rewrite
(`_conv`) and ghost clipping's interpreters (`chunkvmap._quantities.ghost`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jcore


def bind_params(prim: Any, params: dict) -> tuple[Sequence[Any], dict]:
    """A jaxpr equation's `params` as `prim.bind` takes them: `(subfuns, params)`
    (sub-jaxprs of call primitives become functions)."""
    bound = prim.get_bind_params(params)
    # (older JAX returns (subfuns, params), newer the params)
    return ((), bound) if isinstance(bound, dict) else bound


def sub_jaxprs(value: Any) -> list[Any]:
    """The jaxprs (open or closed) in an equation parameter's `value`."""
    if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]
    return []


def rebuilt(value: tuple | list, items: Sequence[Any]) -> tuple | list:
    """A tuple or list parameter (a namedtuple too, such as
    `custom_linear_solve`'s jaxprs) of the same type, holding `items`."""
    if hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*items)
    return type(value)(items)


def open_jaxpr(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """A sub-jaxpr and its constants (from a ClosedJaxpr or an open Jaxpr)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def call_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """The body of a call-like equation (`jit`, `checkpoint`, ...) and its constants."""
    return open_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))


def bind(eqn: Any, ins: Sequence[Any], params: dict | None = None) -> list[Any]:
    """`eqn`'s primitive bound to `ins` (with `params` in place of its own, when
    given), its outputs as a list."""
    subfuns, kw = bind_params(eqn.primitive, eqn.params if params is None else params)
    outs = eqn.primitive.bind(*subfuns, *ins, **kw)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    equation: Callable[[Any, list[Any]], list[Any]] = bind,
) -> list[Any]:
    """`jaxpr` evaluated on `args` as `jax.core.eval_jaxpr` does, each equation by
    `equation(eqn, ins)` (by default, its primitive bound), in the context it was
    traced in (its mesh)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
        with ctx if ctx is not None else contextlib.nullcontext():
            outs = equation(eqn, ins)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
