"""`shard=` / `mesh=` validation.

The sharded evaluation itself (splitting the mapped axis over the devices of a 1-D mesh,
per-device chunking, the global remainder) is not built yet; until it is, `shard=True`
raises `NotImplementedError` after the arguments have been checked, and never falls back
to an unsharded evaluation silently.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import AxisType, Mesh


def check_shard_args(name: str, shard: Any, mesh: Any) -> None:
    """Validate `shard` and `mesh` for the transform called `name`."""
    if not isinstance(shard, bool):
        raise TypeError(
            f"{name} shard must be a bool, but got shard={shard!r} of type "
            f"{type(shard).__name__}."
        )
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"{name} mesh must be a jax.sharding.Mesh or None, but got "
                f"mesh={mesh!r} of type {type(mesh).__name__}."
            )
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"{name} needs a one-dimensional mesh, but got a mesh with "
                f"{len(mesh.axis_names)} axes {mesh.axis_names} (shape "
                f"{dict(mesh.shape)}). Build one with jax.make_mesh((n,), ('batch',), "
                f"axis_types=(jax.sharding.AxisType.Auto,))."
            )
        (axis_type,) = mesh.axis_types
        if axis_type != AxisType.Auto:
            raise ValueError(
                f"{name} needs a mesh whose axis has type AxisType.Auto, but axis "
                f"{mesh.axis_names[0]!r} has type {axis_type}."
            )
        if not shard:
            raise ValueError(
                f"{name} got mesh={mesh!r} with shard=False: the mesh is only used "
                f"to shard the mapped axis. Pass shard=True, or drop mesh."
            )
    if shard:
        raise NotImplementedError(
            f"{name}(shard=True) is not implemented yet: sharded chunking over a "
            f"device mesh is planned. Use shard=False (the default), or shard the "
            f"inputs yourself with jax.device_put and a NamedSharding."
        )
