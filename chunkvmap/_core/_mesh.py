"""The mesh a call runs under, however the caller holds it.

Every entry point's call goes through `run_under` before anything is traced. It
resolves the call's mesh once, in this order:

1. a mesh the caller has entered (`jax.set_mesh`, or an abstract mesh under
   `jax.sharding.use_abstract_mesh` inside `jit`): the call already runs under it
   (staged in one `jax.jit` under an eager transform when it has Explicit axes);
2. the `mesh=` argument;
3. the mesh the inputs are placed on: a concrete array's `NamedSharding`, or the
   mesh in a traced input's sharding type;
4. for `shard=True` with none of these, a 1-D mesh over all devices.

and runs the whole evaluation under it:

* a mesh whose axes are all `Auto` needs no context (its layout is not in the
  types, and the evaluation's `shard_map` names the mesh): the array arguments that
  live on other devices are moved onto it (replicated), and the call runs as it is;
* outside any trace, under `jax.set_mesh(mesh)`, with the array arguments that live
  on other devices moved onto the mesh (replicated) first, so the compiled program
  has one device assignment, the mesh's;
* under a trace (inside the caller's `jax.jit`, `jax.grad`, `jax.vmap`, where
  `jax.set_mesh` cannot be entered), inside one `jax.jit` under the mesh's abstract
  mesh, each array argument put on the concrete mesh (when there is one) so that the
  program's devices are the mesh's even when the caller's arrays are not on it. No
  operation runs eagerly under an abstract mesh alone.

What `jax.vmap` runs without a context mesh, the call then runs too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from . import _axes, _sharding


Run = Callable[[tuple, dict, Any], Any]  # (args, kwargs, the resolved mesh)


def resolve(shard: Any, mesh: Mesh | None, leaves: list[Any]) -> Any:
    """The mesh to enter for a call (a `Mesh`, an `AbstractMesh` when only a traced
    input's type names it), or None when the caller holds one or none is needed.

    A mesh the caller does not hold and the inputs are not placed on (`mesh=` over
    unplaced inputs, `shard=True` alone) is entered with `Auto` axes: its sharding
    types never reach outputs that the caller, outside any mesh, could not use (they
    get `jax.vmap`'s types for the caller's inputs)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return None
    placed = typed = None
    for x in leaves:
        if not isinstance(x, jax.Array):
            continue
        if isinstance(x, jax.core.Tracer):
            sharding = jax.typeof(x).sharding
            mesh_of = getattr(sharding, "mesh", None)
            if typed is None and mesh_of is not None and not mesh_of.empty:
                typed = mesh_of
        elif placed is None:
            sharding = x.sharding
            if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
                placed = sharding.mesh
    if mesh is not None:
        held = placed == mesh or typed == mesh.abstract_mesh
        return mesh if held else _sharding.all_auto(mesh)
    if placed is not None:
        return placed
    if typed is not None:
        return typed
    if shard is True:
        return _sharding.default_mesh()
    return None


def _explicit(mesh: Any) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def run_under(shard: Any, mesh: Mesh | None, run: Run, args: tuple, kwargs: dict):
    """`run(args, kwargs, resolved)` under the call's mesh (see the module
    docstring), `resolved` the mesh `resolve` chose (None: the caller's, or
    none)."""
    flat, tree = jax.tree.flatten((args, kwargs))
    target = resolve(shard, mesh, flat)
    if target is None:
        held = jax.sharding.get_abstract_mesh()
        traced = any(isinstance(x, jax.core.Tracer) for x in flat)
        if held.empty or not held.explicit_axes or not traced:
            return run(args, kwargs, None)
        # Under an eager transform (`jax.grad`, `jax.vmap` outside `jit`) JAX runs
        # the evaluation op by op, and its eager transposes lose sharding types that
        # its staged ones keep (a reshard's cotangent stays sharded, and the pad
        # that transposes a slice of it then fails): staged, the call runs as under
        # `jax.jit`. (Under an outer `jit` the stage is a nested jit, which XLA
        # inlines; an inlined stage would be transposed op by op again.)
        return _staged(held, None, run, flat, tree)
    if isinstance(target, Mesh) and not _explicit(target):
        # Auto axes are not in the types: the evaluation names the mesh itself (a
        # `shard_map` over it), under any context; arrays elsewhere are moved.
        args, kwargs = tree.unflatten([_moved(x, target) for x in flat])
        return run(args, kwargs, target)
    if isinstance(target, Mesh):
        try:
            context = jax.set_mesh(target)
        except ValueError:  # under a trace: jax.set_mesh is for eager code only
            context = None
        if context is not None:
            with context:
                args, kwargs = tree.unflatten([_moved(x, target) for x in flat])
                return run(args, kwargs, target)
    return _staged(target, target, run, flat, tree)


def _moved(x: Any, mesh: Mesh) -> Any:
    """A concrete array committed to other devices than `mesh`'s, replicated onto
    it (an uncommitted one goes where the program runs, as with `jax.jit`)."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    if not x.committed or x.sharding.device_set == set(mesh.devices.flat):
        return x
    return jax.device_put(x, NamedSharding(mesh, P()))


def _staged(
    mesh: Mesh | AbstractMesh, resolved: Any, run: Run, flat: list[Any], tree: Any
) -> Any:
    """`run` inside one `jax.jit` under `mesh`'s abstract mesh, its array arguments
    put on `mesh` when it is concrete (`resolved`: as `run_under`'s)."""
    dyn = [i for i, x in enumerate(flat) if isinstance(x, jax.Array)]
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh

    def staged(*values: Any) -> Any:
        with jax.sharding.use_abstract_mesh(abstract):
            if isinstance(mesh, Mesh):
                values = [_put(v, mesh) for v in values]
            args, kwargs = tree.unflatten(_axes.combine(flat, dyn, values))
            return run(args, kwargs, resolved)

    return jax.jit(staged)(*[flat[i] for i in dyn])


def _put(x: Any, mesh: Mesh) -> Any:
    """`x` on the concrete `mesh`, replicated, unless its type already places it
    there (then the devices are its own)."""
    if getattr(jax.typeof(x).sharding, "mesh", None) == mesh.abstract_mesh:
        return x
    return jax.device_put(x, NamedSharding(mesh, P()))
