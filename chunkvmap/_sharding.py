"""`shard=True`: the mapped axis split over the devices of a 1-D mesh.

Layout of one sharded evaluation of N examples on a mesh of D devices:

* the divisible prefix (N - N % D examples) is split evenly: device k gets the
  examples `[k L, (k + 1) L)` with `L = N // D`, and runs the ordinary chunked loop over
  them (its own chunks of `batch_size`, its own local remainder window);
* the global remainder (the last N % D < D examples) is evaluated once overall, by
  device 0 (a `lax.cond` on the device index), not redundantly by every device;
* stacked outputs of the prefix stay sharded along the mapped axis (no all-gather when
  D divides N); with a global remainder the assembled output is replicated;
* reduced outputs: each device folds its own chunks, then the D summaries (and the
  remainder's) are folded in device order, so non-commutative reductions still see the
  examples in order.

Only JAX's own machinery is used: `jax.shard_map` over the mesh, `lax.axis_index`, and
sharding constraints. The same code runs multi-host under `jax.distributed` (one
process per host), since a mesh over `jax.devices()` spans every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from . import _progress
from ._loop import fold, make_plan, zeros


AXIS_NAME = "chunkvmap"
_DEFAULT_MESHES: dict[tuple[Any, ...], Mesh] = {}


def default_mesh() -> Mesh:
    """A 1-D `Auto` mesh over all devices (every process's), built once."""
    devices = tuple(jax.devices())
    mesh = _DEFAULT_MESHES.get(devices)
    if mesh is None:
        mesh = Mesh(np.array(devices), (AXIS_NAME,), axis_types=(AxisType.Auto,))
        _DEFAULT_MESHES[devices] = mesh
    return mesh


def resolve_mesh(name: str, mesh: Mesh | None) -> Mesh:
    """The mesh to shard over: `mesh`, else the ambient one, else all devices.

    An ambient mesh (`jax.set_mesh`) must be the mesh used, since `shard_map` inside
    it must match it: a 1-D `Auto` ambient mesh is used when `mesh` is None; any other
    ambient mesh is an error that says what to do.
    """
    ambient = jax.sharding.get_abstract_mesh()
    if ambient.empty:
        return default_mesh() if mesh is None else mesh
    if mesh is not None:
        if mesh.abstract_mesh == ambient:
            return mesh
        raise ValueError(
            f"{name}(shard=True) was called under jax.set_mesh({ambient}), which "
            f"differs from mesh={mesh}. Call it outside jax.set_mesh, or set that "
            f"mesh as the ambient one."
        )
    concrete = jax.sharding.get_mesh()
    if (
        isinstance(concrete, Mesh)
        and len(concrete.axis_names) == 1
        and concrete.axis_types[0] == AxisType.Auto
    ):
        return concrete
    raise ValueError(
        f"{name}(shard=True) was called under jax.set_mesh({ambient}); chunkvmap "
        f"shards over a one-dimensional mesh whose axis has type AxisType.Auto. Call "
        f"it outside jax.set_mesh, or set a 1-D Auto mesh (and pass it as mesh=)."
    )


def place_inputs(
    name: str, mesh: Mesh, paths: Sequence[str], leaves: list[Any], axes: Sequence[Any]
) -> list[Any]:
    """Check (and, for concrete arrays, place) the inputs on the mesh.

    Arrays typed with an `Explicit` sharding are an error (reshard them to an Auto
    layout first). Concrete arrays committed to other devices are moved onto the mesh
    with the layout the evaluation needs; arrays already laid out on the mesh are used
    as they are. Traced inputs are placed by the enclosing `jit`.
    """
    mesh_devices = set(mesh.devices.flat)
    placed = list(leaves)
    for k, (path, x, axis) in enumerate(zip(paths, leaves, axes)):
        if not isinstance(x, jax.Array):
            continue
        abstract_mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        types = getattr(abstract_mesh, "axis_types", ())
        if any(t == AxisType.Explicit for t in types):
            raise ValueError(
                f"{name}(shard=True) got {path} with an Explicit sharding "
                f"({jax.typeof(x).str_short()}), but chunkvmap shards over an Auto "
                f"mesh. Make the input Auto-typed first: inside `with "
                f"jax.set_mesh(explicit_mesh)`, x = jax.sharding.reshard(x, P()), then "
                f"call chunkvmap outside that block (or build the input on an Auto "
                f"mesh)."
            )
        if isinstance(x, jax.core.Tracer):
            continue
        if x.sharding.device_set != mesh_devices:
            size = np.shape(x)[axis] if axis is not None else 0
            spec = _spec(axis, mesh.axis_names[0]) if size % mesh.size == 0 else P()
            placed[k] = jax.device_put(x, NamedSharding(mesh, spec))
    return placed


def _spec(axis: int | None, name: str) -> P:
    return P() if axis is None else P(*([None] * axis), name)


def evaluate(body: Any, inputs: Any, options: Any) -> Any:
    """`body` (a `_loop.Body`) over `inputs` (a `_chunked.Inputs`), split over the
    devices of the options' mesh as described in the module docstring: the flat stacked
    outputs (mapped along `body.out_axes`), or the folded summary."""
    mesh = resolve_mesh(options.name, options.mesh)
    leaves = place_inputs(options.name, mesh, inputs.paths, inputs.leaves, body.axes)
    name = mesh.axis_names[0]
    size, dyn = inputs.size, inputs.dyn
    num_devices = mesh.size
    rem = size % num_devices
    prefix = size - rem
    per_device = prefix // num_devices
    reduced = body.reduction is not None
    dyn_axes = [body.axes[i] for i in dyn]

    def local(full: list[Any], n: int, offset: Any, report: bool) -> Any:
        # Progress: only the device at mesh index 0 reports, and only its own chunks
        # (the global remainder is reported only when nothing else runs).
        plan = make_plan(n, options.batch_size, offset)
        hook = _progress.hook(
            options.reporter if report else None,
            plan.num_chunks,
            lambda: lax.axis_index(name) == 0,
        )
        return body.run(full, plan, hook)

    def stack1(tree):  # a leading axis of one, to be concatenated over devices
        return jax.tree.map(lambda y: jnp.expand_dims(y, 0), tree)

    def shard_body(values):
        # With a global remainder the inputs arrive whole (N does not split evenly, so
        # they are replicated anyway) and every device reads its examples in place
        # through the plan's offset: no per-device copy of its slice or the remainder.
        full = list(leaves)
        for i, v in zip(dyn, values):
            full[i] = v
        outs = {}
        if per_device:
            start = lax.axis_index(name) * per_device if rem else 0
            result = local(full, per_device, start, True)
            outs["local"] = stack1(result) if reduced else result
        if rem:
            shapes = jax.eval_shape(lambda: local(full, rem, prefix, False))
            result = lax.cond(
                lax.axis_index(name) == 0,
                lambda: local(full, rem, prefix, not per_device),
                lambda: jax.tree.map(lambda s: zeros(s.shape, s), shapes),
            )
            outs["rem"] = stack1(result)
        return outs

    def run(*values):
        out_specs: dict[str, Any] = {}
        if per_device:
            out_specs["local"] = (
                P(name) if reduced else [_spec(a, name) for a in body.out_axes]
            )
        if rem:
            out_specs["rem"] = P(name)
        in_specs = [P() if rem else _spec(a, name) for a in dyn_axes]
        outs = jax.shard_map(
            shard_body,
            mesh=mesh,
            in_specs=(in_specs,),
            out_specs=out_specs,
            check_vma=False,
        )(list(values))
        if reduced:
            return _fold_devices(body.reduction, outs, NamedSharding(mesh, P()))
        return _assemble(outs, body.out_axes, NamedSharding(mesh, P()))

    return jax.jit(run)(*[leaves[i] for i in dyn])


def _fold_devices(reduction: Any, outs: dict[str, Any], replicated: Any) -> Any:
    """The devices' summaries (and the global remainder's) folded in device order."""
    acc = None
    summaries = outs.get("local")
    if summaries is not None:
        acc = jax.tree.map(lambda s: s[0], summaries)
        if jax.tree.leaves(summaries)[0].shape[0] > 1:
            rest = jax.tree.map(lambda s: s[1:], summaries)
            acc, _ = lax.scan(lambda a, s: (fold(reduction, a, s), None), acc, rest)
    if "rem" in outs:
        tail = jax.tree.map(lambda s: s[0], outs["rem"])
        acc = tail if acc is None else fold(reduction, acc, tail)
    return lax.with_sharding_constraint(acc, replicated)


def _assemble(outs: dict[str, Any], out_axes: Sequence[Any], replicated: Any) -> Any:
    """The stacked outputs: the devices' shares, then the global remainder's."""
    if "rem" not in outs:
        return outs["local"]
    tail = [y[0] for y in outs["rem"]]
    if "local" not in outs:
        return lax.with_sharding_constraint(tail, replicated)
    assembled = [
        y if a is None else jnp.concatenate([y, t], axis=a)
        for y, t, a in zip(outs["local"], tail, out_axes)
    ]
    return lax.with_sharding_constraint(assembled, replicated)
