"""Small helpers for reading and binding jaxprs, shared by the convolution rewrite
(`_conv`) and ghost clipping's interpreters (`chunkvmap._dp.ghost`)."""

from __future__ import annotations

from collections.abc import Sequence
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


def open_jaxpr(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """A sub-jaxpr and its constants (from a ClosedJaxpr or an open Jaxpr)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def call_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """The body of a call-like equation (`jit`, `checkpoint`, ...) and its constants."""
    return open_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
