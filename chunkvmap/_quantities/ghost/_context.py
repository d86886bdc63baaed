"""Binding a jaxpr's equations again in the current context: shardings moved onto
the context's mesh, and the specs an Explicit mesh needs on contractions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ..._core._jaxprs import bind_params
from ..._core._loop import explicit_spec as explicit_spec


def in_context(params: dict) -> dict:
    """`params` with every `NamedSharding` moved onto the current abstract mesh.

    A jaxpr traced outside a `shard_map` carries shardings on the mesh it was traced
    under; bound again inside one (where some axes are manual), JAX rejects them. The
    same specs on the context's mesh are what tracing there would have given."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return params
    out = dict(params)
    for key, value in params.items():
        mesh = getattr(value, "mesh", None)
        if (
            isinstance(value, jax.sharding.NamedSharding)
            and mesh is not None
            and mesh != context
            and tuple(mesh.axis_names) == tuple(context.axis_names)
        ):
            out[key] = jax.sharding.NamedSharding(context, value.spec)
    return out


def bind(prim: Any, operands: Sequence[Any], params: dict) -> Any:
    """`prim.bind(*operands, **params)` with `params` as bind takes them, in context."""
    subfuns, kw = bind_params(prim, params)
    return prim.bind(*subfuns, *operands, **in_context(kw))
