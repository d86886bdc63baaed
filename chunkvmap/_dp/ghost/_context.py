"""Binding a jaxpr's equations again in the current context: shardings moved onto
the context's mesh, and the specs an Explicit mesh needs on contractions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ..._core._jaxprs import bind_params


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


def explicit_spec(spec: Any = ()) -> Any:
    """`spec` (a PartitionSpec or its entries) where the current mesh has Explicit
    axes (a contraction over sharded axes must then say its output's sharding),
    else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return None
    names = set(mesh.explicit_axes)

    def keep(entry: Any) -> Any:  # axes manual here are not the output's to name
        parts = entry if isinstance(entry, tuple) else (entry,)
        parts = tuple(a for a in parts if a in names)
        return parts[0] if len(parts) == 1 else (parts or None)

    return jax.P(*(keep(e) for e in spec))


def bind(prim: Any, operands: Sequence[Any], params: dict) -> Any:
    """`prim.bind(*operands, **params)` with `params` as bind takes them, in context."""
    subfuns, kw = bind_params(prim, params)
    return prim.bind(*subfuns, *operands, **in_context(kw))
