"""Chunking that follows the data's sharding: who evaluates which examples.

A call is *laid out* over some axes of a mesh (`Layout`) when the examples are split
over them, either because the inputs say so or because the caller asks:

* visible layouts: a mapped input whose mapped dimension is sharded over mesh axes,
  seen in its type (`Explicit` axes, e.g. `jax.make_mesh`'s default, eager or under
  `jit`) or on a concrete array (any axis type, eager calls; the eager cache hands
  the concrete shardings of its arguments down with the call, `Inputs.known`);
* requested layouts: `shard=True` (the one axis of a 1-D mesh), `shard="data"` or
  `shard=("a", "b")`, over `mesh=`, the ambient `jax.set_mesh` mesh or the mesh the
  inputs are on (or, for `shard=True` without any, one 1-D mesh over all devices).
  This is how `Auto` meshes under `jit`, whose layout is not in the types, are
  chunked per device.

One laid-out evaluation of N examples over D devices (the product of the layout's axis
sizes) splits the divisible prefix (N - N % D examples) evenly: device k gets the
examples `[k L, (k + 1) L)` with `L = N // D` (where the inputs already are) and runs
the chunked loop over them (its own chunks of `batch_size`, its own remainder window).
Mapped inputs are never gathered; stacked outputs stay sharded along the mapped axis,
with the layout `jax.vmap` gives them; the mesh's other axes (model parallelism) are
left alone, so parameters sharded over them stay sharded. How:

* `Explicit` axes (`_split_evaluation`): no manual axes. Each mapped axis is split as
  `(D, L)`, the layout's axes on D (a reshape that moves no data), and every chunk reads
  `batch_size` examples of each share and evaluates them together, vmapped over the
  shares (`Body.run_shares`); sharding-in-types places each device's work on its own
  examples and gathers nothing. The last N % D examples (the inputs are then
  replicated: an Explicit sharding is even) run on every device after the split part.
* `Auto` axes (with `shard=`, under `jit`): a `jax.shard_map` that is manual over the
  layout's axes only. The global remainder is evaluated once, by the first device (a
  `lax.cond` on the device index); the inputs then arrive whole.
* Either way, with a remainder a stacked output is replicated, as `jax.vmap`'s is for
  replicated inputs. Reduced outputs: each device folds its own chunks; the D
  summaries (and the remainder's) are gathered (one summary per device) and folded in
  device order, so non-commutative reductions still see the examples in order. A sum
  (`jnp.add`, `lax.add`, `operator.add`) is combined by one all-reduce instead.
* Unmapped inputs may be sharded any way; over the layout's axes they are gathered
  (each device needs all of them).

The same code runs multi-host under `jax.distributed` (one process per host), since a
mesh over `jax.devices()` spans every process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from . import _axes, _memory, _progress
from ._axes import Inputs, Known
from ._loop import (
    Accumulator,
    Body,
    example_at,
    make_plan,
    share_length,
    spec_entries,
    window,
    zeros,
)
from ._options import shard_axes


AXIS_NAME = "chunkvmap"


def default_mesh() -> Mesh:
    """A 1-D `Auto` mesh over all devices (every process's) of the default device's
    platform (`jax.default_device`, else the default backend's: a call made on the
    CPU of an accelerator's machine spans the CPU devices). (Meshes are values:
    equal ones are equal, and compiled programs are shared between them.)"""
    devices = np.array(jax.devices(_memory.default_platform()))
    return Mesh(devices, (AXIS_NAME,), axis_types=(AxisType.Auto,))


def _visible_sharding(x: Any, known: Known) -> NamedSharding | None:
    """The sharding of `x` as this call can see it (None when it cannot): its own, its
    type's, or for a tracer of an eager call's argument the concrete sharding of that
    argument (`known`)."""
    if isinstance(x, jax.core.Tracer):
        sharding = known.sharding_of(x)
        if sharding is None:
            sharding = jax.typeof(x).sharding
    elif isinstance(x, jax.Array):
        sharding = x.sharding
    else:
        return None
    return sharding if isinstance(sharding, NamedSharding) else None


def _dim_axes(spec: Any, dim: int) -> tuple[str, ...]:
    """The mesh axes that dimension `dim` of a `PartitionSpec` is sharded over."""
    entry = spec[dim] if dim < len(spec) else None
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The examples split over `axes` of `mesh` (a `Mesh` or `AbstractMesh`)."""

    mesh: Any
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        """D: the number of shares."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def explicit(self) -> bool:
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
        return any(types[a] == AxisType.Explicit for a in self.axes)

    def spec(self, axis: int | None) -> P:
        """The in/out spec of a leaf mapped along `axis` (None: not mapped)."""
        if axis is None:
            return P()
        entry = self.axes[0] if len(self.axes) == 1 else self.axes
        return P(*([None] * axis), entry)


def layout(
    name: str,
    shard: Any,
    mesh: Any,
    paths: Sequence[str],
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    *,
    known: Known,
) -> Layout | None:
    """The call's layout: requested by `shard`, else visible on the mapped inputs
    (`known`: see `_visible_sharding`)."""
    if shard is not False:
        return _requested(name, shard, mesh, known)
    found: dict[tuple[Any, ...], list[str]] = {}
    for path, x, axis in zip(paths, leaves, axes):
        sharding = None if axis is None else _visible_sharding(x, known)
        if sharding is None or sharding.mesh.size == 1:
            continue
        data = _dim_axes(sharding.spec, axis)
        if data:
            found.setdefault((sharding.mesh, data), []).append(path)
    if not found:
        return None
    if len(found) > 1:
        lines = "\n".join(
            f"  {', '.join(ps)}: over {data} of a mesh {dict(m.shape)}"
            for (m, data), ps in found.items()
        )
        raise ValueError(
            f"{name} got mapped inputs whose mapped axis is sharded differently, so "
            f"it cannot follow their layout:\n{lines}\nReshard them to one layout "
            f"(e.g. jax.sharding.reshard(x, P('data'))) before the call."
        )
    ((mesh, data),) = found
    return Layout(mesh, data)


def _requested(name: str, shard: Any, mesh: Any, known: Known) -> Layout:
    """The layout `shard=` asks for, over the mesh the call runs under: the one it
    holds or entered, else the one its placement resolved (`Known.mesh`: `mesh=`,
    with Auto axes where the caller does not hold it, the mesh the inputs are
    placed on, or all devices)."""
    ambient = jax.sharding.get_abstract_mesh()
    if ambient.empty:
        if known.mesh is None:
            raise ValueError(
                f"{name} got shard={shard!r}, which names mesh axes, but no mesh: "
                f"pass mesh=, or call it under jax.set_mesh(mesh). (shard=True alone "
                f"spreads the examples over all devices.)"
            )
        mesh = known.mesh
    elif mesh is None:
        mesh = ambient
    elif all_auto(mesh).abstract_mesh == ambient:
        # The mesh entered for the call with Auto axes (the caller does not hold it:
        # `_mesh.resolve`).
        mesh = all_auto(mesh)
    elif mesh.abstract_mesh != ambient:
        raise ValueError(
            f"{name}(shard={shard!r}) was called under jax.set_mesh({ambient}), which "
            f"differs from mesh={mesh}. Call it outside jax.set_mesh, pass no mesh "
            f"(the ambient one is used), or set that mesh as the ambient one."
        )
    return Layout(mesh, shard_axes(name, shard, mesh))


def all_auto(mesh: Mesh) -> Mesh:
    """`mesh` with every axis `Auto`."""
    types = (AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) == types:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def evaluate(
    body: Body, inputs: Inputs, lay: Layout, batch: int | None, reporter: Any
) -> Any:
    """`body` over `inputs`, split over `lay` as described in the module docstring,
    chunks of `batch` per device, progress reported to `reporter` (None: none): the
    flat stacked outputs (mapped along `body.out_axes`), or the accumulated
    `(summary, rows)`."""
    if lay.explicit:
        return _typed(body, inputs, lay, batch, reporter)
    manual = _Manual(body, inputs, lay, batch, reporter)
    in_specs = [P() if manual.rem else lay.spec(body.axes[i]) for i in inputs.dyn]
    out_specs = _out_specs(body, lay, manual.per_device, manual.rem)

    def run(*values):
        outs = jax.shard_map(
            manual.shard_body, mesh=lay.mesh, in_specs=(in_specs,),
            out_specs=out_specs, axis_names=set(lay.axes), check_vma=False,
        )(list(values))  # fmt: skip
        if body.accumulator is not None:
            summary, rows = outs
            return summary, _assemble_rows(rows, lay)
        return _assemble(outs, body.out_axes, lay)

    return jax.jit(run)(*[manual.leaves[i] for i in inputs.dyn])


class _Manual:
    """`evaluate` over manual (`Auto`) mesh axes: what each device runs inside
    `shard_map` (`shard_body`), its share of the N - N % D examples and, on the
    first device, the global remainder (in chunks of the shares' length: one
    trace)."""

    def __init__(self, body, inputs, lay, batch, reporter) -> None:
        self.body, self.inputs, self.lay, self.reporter = body, inputs, lay, reporter
        size, num_devices = inputs.size, lay.size
        self.rem = size % num_devices
        self.prefix = size - self.rem
        self.per_device = self.prefix // num_devices
        self.leaves = _prepare(
            body.name, lay, inputs.paths, inputs.leaves, body.axes, self.rem
        )
        self.batch = batch

    def local(self, full: list[Any], n: int, offset: Any, report: bool) -> Any:
        """This device's `n` examples from `offset` of the leaves `full`.
        Progress: only the first device of the layout reports, and only its own
        chunks (the global remainder is reported only when nothing else runs)."""
        inputs, axes = self.inputs, self.lay.axes
        length = share_length(inputs.size, self.lay.size, self.batch)
        plan = window(n, length, offset)
        if inputs.padding is not None:  # this device's padding
            flags = full[inputs.padding]
            first = offset + min(0, n - plan.batch)  # (a wide window's start)
            mine = lax.dynamic_slice_in_dim(flags, first, max(n, plan.batch))
            plan = plan.padded(mine, inputs.padding)
        hook = _progress.hook(
            self.reporter if report else None,
            plan.num_chunks,
            lambda: lax.axis_index(axes) == 0,
        )
        return self.body.run(full, plan, hook)

    def shard_body(self, values: list[Any]) -> Any:
        """One device's outputs. With a global remainder the inputs arrive whole (N
        does not split evenly, so they are replicated anyway) and every device
        reads its examples in place through the plan's offset: no per-device copy
        of its slice or the remainder."""
        axes, rem, per_device = self.lay.axes, self.rem, self.per_device
        full = _axes.combine(self.leaves, self.inputs.dyn, values)
        outs = {}
        if per_device:
            start = lax.axis_index(axes) * per_device if rem else 0
            outs["local"] = self.local(full, per_device, start, True)
        if rem:
            outs["rem"] = self.remainder(full)
        if self.body.accumulator is not None:  # every device folds all summaries
            summaries = {k: v[0] for k, v in outs.items()}
            rows = {k: v[1] for k, v in outs.items()}
            return _fold_devices(self.body.accumulator, summaries, axes), rows
        return outs

    def remainder(self, full: list[Any]) -> Any:
        """The global remainder's outputs, run on the layout's first device (zeros
        elsewhere), with a leading axis of one."""
        rem, prefix, per_device = self.rem, self.prefix, self.per_device
        shapes = jax.eval_shape(lambda: self.local(full, rem, prefix, False))
        out = lax.cond(
            lax.axis_index(self.lay.axes) == 0,
            lambda: self.local(full, rem, prefix, not per_device),
            lambda: jax.tree.map(lambda s: zeros(s.shape, s), shapes),
        )
        return jax.tree.map(lambda y: jnp.expand_dims(y, 0), out)


def _shares_plan(plan, inputs, head, split, axes) -> Any:
    """The shares' plan over a padded buffer (each share's padding skipped where
    every share's is; the first real example of the whole head, `head` before it
    is `split`, stands in for the padding of all); else `plan`."""
    if inputs.padding is None:
        return plan
    first = jnp.argmin(head[inputs.padding])
    rows = [None if a is None else example_at(x, first, a) for x, a in zip(head, axes)]
    return plan.padded(split[inputs.padding], inputs.padding, rows)


def _out_specs(body: Body, lay: Layout, per_device: int, rem: int) -> Any:
    """`evaluate`'s output specs: stacked outputs (and an accumulator's rows, along
    axis 0) come back split over the layout; the global remainder's, from the first
    device."""
    reduced = body.accumulator is not None
    stacked_specs: Any = {}
    if per_device:
        stacked_specs["local"] = (
            lay.spec(0) if reduced else [lay.spec(a) for a in body.out_axes]
        )
    if rem:
        stacked_specs["rem"] = P(lay.axes)
    return (P(), stacked_specs) if reduced else stacked_specs


def _typed(
    body: Body, inputs: Inputs, lay: Layout, batch: int | None, reporter: Any
) -> Any:
    """See `_split_evaluation`; under the layout's mesh as the context mesh (the
    shares' sharding types name its axes)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return _split_evaluation(body, inputs, lay, batch, reporter)
    with jax.sharding.use_abstract_mesh(getattr(lay.mesh, "abstract_mesh", lay.mesh)):
        return _split_evaluation(body, inputs, lay, batch, reporter)


def _split_evaluation(
    body: Body, inputs: Inputs, lay: Layout, batch: int | None, reporter: Any
) -> Any:
    """`evaluate` over Explicit mesh axes, with no manual axes: sharding-in-types
    places the work.

    Each mapped input's axis of N examples is split as `(D, N / D)` (the devices'
    shares, the layout's axes on the leading factor: a reshape that moves no data),
    and every chunk reads `batch` examples of each share and evaluates them together,
    vmapped over the shares (`Body.run_shares`): every device runs its own chunks,
    the model's other mesh axes keep the shardings in the types (nothing is gathered
    at a boundary), and stacked outputs (an accumulator's rows) are reshaped back to
    N along their mapped axis. Summaries are the D devices' folded in device order
    (a sum: one reduction over the sharded axis). When N is not a multiple of D (the
    inputs are then replicated: an Explicit sharding is even), the last N % D
    examples run on every device after the split part, and a stacked output is
    replicated, as `jax.vmap`'s is for replicated inputs."""
    size, num_devices = inputs.size, lay.size
    rem, share = size % num_devices, size // num_devices
    pieces = {}
    if share:
        pieces["head"] = _split_head(body, inputs, lay, batch, reporter)
    if rem:
        # the remainder in chunks of the shares' length (`window`): one trace
        length = share_length(size, num_devices, batch)
        reporting = reporter if not share else None
        pieces["tail"] = _typed_remainder(body, inputs, lay, length, reporting)
    if len(pieces) == 1:
        return next(iter(pieces.values()))
    return _joined(body, lay, pieces["head"], pieces["tail"])


def _split_head(
    body: Body, inputs: Inputs, lay: Layout, batch: int | None, reporter: Any
) -> Any:
    """`_split_evaluation`'s first N - N % D examples, split into the D devices'
    shares and run together (`Body.run_shares`): the stacked outputs merged back
    along their axes, or the accumulator's folded summary and merged rows."""
    axes, accumulator = body.axes, body.accumulator
    rem = inputs.size % lay.size
    prefix, share = inputs.size - rem, inputs.size // lay.size
    head = [
        x if a is None or not rem else lax.slice_in_dim(x, 0, prefix, axis=a)
        for x, a in zip(inputs.leaves, axes)
    ]
    head = _prepare(body.name, lay, inputs.paths, head, axes, 0)
    split_head = [_split(x, a, lay) for x, a in zip(head, axes)]
    plan = _shares_plan(make_plan(share, batch), inputs, head, split_head, axes)
    split = body.run_shares(split_head, plan, _progress.hook(reporter, plan.num_chunks))
    if accumulator is not None:
        summaries, rows = split
        return (
            _fold_shares(accumulator, summaries, lay),
            jax.tree.map(lambda y: _merge(y, 0, lay), rows),
        )
    return [y if a is None else _merge(y, a, lay) for y, a in zip(split, body.out_axes)]


def _joined(body: Body, lay: Layout, head: Any, tail: Any) -> Any:
    """The split head's result and the remainder's, in example order: summaries
    merged and rows concatenated, or the stacked outputs concatenated along their
    axes (replicated over the layout, as `jax.vmap`'s output for such inputs)."""
    if body.accumulator is not None:
        (head_summary, head_rows), (tail_summary, tail_rows) = head, tail
        rows = jax.tree.map(
            lambda h, t: jnp.concatenate([_without(h, lay), t], axis=0),
            head_rows,
            tail_rows,
        )
        return body.accumulator.merge(head_summary, tail_summary), rows
    return [
        t if a is None else jnp.concatenate([_without(h, lay), t], axis=a)
        for h, t, a in zip(head, tail, body.out_axes)
    ]


def _without(y: Any, lay: Layout) -> Any:
    """`y` replicated over the layout's axes (its other shardings kept)."""
    typed = P(*spec_entries(y))
    entries = [
        [a for a in _dim_axes(typed, d) if a not in lay.axes] for d in range(np.ndim(y))
    ]
    spec = P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])
    if spec == _normalized(typed, np.ndim(y)):
        return y
    return jax.sharding.reshard(y, NamedSharding(jax.typeof(y).sharding.mesh, spec))


def chunk_type(
    name: str, lay: Layout | None, path: str, x: Any, axis: int | None, length: int
) -> jax.ShapeDtypeStruct:
    """The type of a leaf's chunk of `length` examples as the loop gives it to the
    chunk function: its plain type, but over Explicit axes, where types carry
    shardings, a mapped leaf's as each share's chunk has it (`_prepare`d, the
    shares vmapped away: its other dimensions keep their shardings, the examples'
    axis has none), and an unmapped leaf sharded over the mesh as `_prepare` lays
    it out (off the layout's axes), so that the chunk is traced at the types the
    loop runs."""
    plain = _axes.sized(x, axis, length)
    if lay is None or not lay.explicit or not isinstance(x, jax.Array):
        return plain
    typed = jax.typeof(x).sharding
    current = typed.spec if isinstance(typed, NamedSharding) else P()
    if axis is None:  # as `_prepare` lays it out: off the layout's axes
        if not isinstance(typed, NamedSharding) or not any(current):
            return plain
        spec = _respec(name, path, current, np.ndim(x), None, lay.axes)
        mesh = getattr(lay.mesh, "abstract_mesh", lay.mesh)
        return jax.ShapeDtypeStruct(
            plain.shape, plain.dtype, weak_type=plain.weak_type,
            sharding=NamedSharding(mesh, spec),
        )  # fmt: skip
    spec = list(_respec(name, path, current, np.ndim(x), axis, lay.axes))
    spec += [None] * (np.ndim(x) - len(spec))
    spec[axis] = None
    mesh = getattr(lay.mesh, "abstract_mesh", lay.mesh)
    return jax.ShapeDtypeStruct(
        plain.shape, plain.dtype, weak_type=plain.weak_type,
        sharding=NamedSharding(mesh, P(*spec)),
    )  # fmt: skip


def _split(x: Any, axis: int | None, lay: Layout) -> Any:
    """A mapped leaf's axis of N examples as `(D, N / D)`, sharded over the layout's
    axes on D (its other dimensions keep their shardings)."""
    if axis is None or not isinstance(x, jax.Array):
        return x
    shape = list(x.shape)
    spec = spec_entries(x)
    shape[axis : axis + 1] = [lay.size, shape[axis] // lay.size]
    spec[axis : axis + 1] = [_entry(lay.axes), None]
    return jnp.reshape(x, shape, out_sharding=NamedSharding(lay.mesh, P(*spec)))


def _merge(y: Any, axis: int, lay: Layout) -> Any:
    """A stacked output's `(D, N / D)` back to N examples along `axis`, sharded over
    the layout's axes (the leading factor: no data moves)."""
    shape = list(y.shape)
    spec = spec_entries(y)
    shape[axis : axis + 2] = [shape[axis] * shape[axis + 1]]
    spec[axis : axis + 2] = [_entry(lay.axes)]
    return jnp.reshape(y, shape, out_sharding=NamedSharding(lay.mesh, P(*spec)))


def _entry(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else axes


def _typed_remainder(
    body: Body, inputs: Inputs, lay: Layout, length: int, reporter: Any
) -> Any:
    """`_split_evaluation`'s last N % D examples, on every device, in chunks of
    `length` (a window of it where fewer: `window`)."""
    size, axes = inputs.size, body.axes
    rem = size % lay.size
    lo = size - max(rem, length)
    tail = [
        x if a is None else lax.slice_in_dim(x, lo, size, axis=a)
        for x, a in zip(inputs.leaves, axes)
    ]
    tail = _prepare(body.name, lay, inputs.paths, tail, axes, rem)
    plan = window(rem, length, size - rem - lo)
    return body.run(tail, plan, _progress.hook(reporter, plan.num_chunks))


def _fold_shares(accumulator: Accumulator, summaries: Any, lay: Layout) -> Any:
    """The D devices' summaries (leading axis) folded in device order; a sum is one
    reduction over the sharded axis."""
    if accumulator.sums:
        return jax.tree.map(lambda s: jnp.sum(s, axis=0), summaries)
    # the D summaries gathered (their shardings over other axes kept)
    summaries = jax.tree.map(lambda s: _without(s, lay), summaries)
    acc = jax.tree.map(lambda s: s[0], summaries)
    if lay.size > 1:
        rest = jax.tree.map(lambda s: s[1:], summaries)
        acc, _ = lax.scan(lambda a, s: (accumulator.merge(a, s), None), acc, rest)
    return acc


def unlaid(lay: Layout, leaves: Sequence[Any]) -> list[Any]:
    """Explicit-typed `leaves` with the layout's axes dropped from their types."""
    return [_without(x, lay) if isinstance(x, jax.Array) else x for x in leaves]


def laid_result(lay: Layout, body: Body, result: Any) -> Any:
    """`body.run`'s result with its stacked outputs (or its accumulator's rows)
    sharded over the layout's axes along their mapped axes."""
    if body.accumulator is None:
        return laid(lay, result, body.out_axes)
    summary, rows = result
    flat, tree = jax.tree.flatten(rows)
    return summary, tree.unflatten(laid(lay, flat, [0] * len(flat)))


def laid(lay: Layout, outs: Sequence[Any], out_axes: Sequence[Any]) -> list[Any]:
    """Stacked outputs sharded over the layout's axes along their mapped axes."""
    placed = []
    for y, axis in zip(outs, out_axes):
        if axis is not None:
            entries = spec_entries(y)
            entries[axis] = _entry(lay.axes)
            y = jax.sharding.reshard(y, NamedSharding(lay.mesh, P(*entries)))
        placed.append(y)
    return placed


def _prepare(
    name: str,
    lay: Layout,
    paths: Sequence[str],
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    rem: int,
) -> list[Any]:
    """The inputs, laid out for the evaluation's `shard_map`.

    Explicit-typed inputs are resharded where their type differs from what the
    evaluation needs over the layout's axes (a mapped input not yet split over them is
    sliced, an unmapped one sharded over them is gathered); their other axes are kept.
    Concrete inputs on other devices than a concrete mesh are moved onto it. Anything
    else is left to `shard_map` (and the enclosing `jit`).
    """
    mesh_devices = set(lay.mesh.devices.flat) if isinstance(lay.mesh, Mesh) else None
    placed = list(leaves)
    for k, (path, x, axis) in enumerate(zip(paths, leaves, axes)):
        if not isinstance(x, jax.Array):
            continue
        want = None if rem else axis
        if lay.explicit:
            typed = jax.typeof(x).sharding
            current = typed.spec if isinstance(typed, NamedSharding) else P()
            spec = _respec(name, path, current, np.ndim(x), want, lay.axes)
            # (a mapped leaf typed without a mesh is typed on it: its chunks then
            # have the types of the shares' chunks, `chunk_type`)
            unplaced = axis is not None and getattr(typed, "mesh", None) is not None
            unplaced = unplaced and typed.mesh.empty
            if spec != _normalized(current, np.ndim(x)) or unplaced:
                placed[k] = jax.sharding.reshard(x, NamedSharding(lay.mesh, spec))
        elif mesh_devices is not None and not isinstance(x, jax.core.Tracer):
            if x.sharding.device_set != mesh_devices:
                placed[k] = jax.device_put(x, NamedSharding(lay.mesh, lay.spec(want)))
    return placed


def _normalized(spec: Any, ndim: int) -> P:
    entries = [_dim_axes(spec, d) for d in range(ndim)]
    return P(*[None if not e else e[0] if len(e) == 1 else e for e in entries])


def _respec(
    name: str, path: str, spec: Any, ndim: int, axis: int | None, data: tuple
) -> P:
    """`spec` with the layout's axes `data` moved to dimension `axis` (or removed)."""
    entries = [[a for a in _dim_axes(spec, d) if a not in data] for d in range(ndim)]
    if axis is not None:
        if entries[axis]:
            raise ValueError(
                f"{name} maps {path} along its axis {axis}, which is sharded over "
                f"{tuple(entries[axis])} besides the axes {data} the examples are "
                f"split over: reshard it so that its mapped axis is split over "
                f"{data} only."
            )
        entries[axis] = list(data)
    return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def _fold_devices(accumulator: Accumulator, outs: dict[str, Any], axes: tuple) -> Any:
    """Inside the `shard_map`: the devices' summaries (and the global remainder's,
    computed by the first device) gathered and folded in device order.

    Summaries typed with a sharding over other Explicit axes are replicated before
    the gather (they are one summary per device) and get their type back after."""
    if accumulator.sums:  # a sum: one all-reduce, no gather of D summaries
        total = [lax.psum(outs[k], axes) for k in ("local", "rem") if k in outs]
        if "rem" in outs:  # zeros on every device but the first
            total[-1] = jax.tree.map(lambda s: s[0], total[-1])
        return total[0] if len(total) == 1 else jax.tree.map(jnp.add, *total)
    specs = jax.tree.map(_typed_spec, outs.get("local", outs.get("rem")))
    outs = jax.tree.map(_replicated, outs)
    acc = None
    if "local" in outs:
        summaries = lax.all_gather(outs["local"], axes)
        acc = jax.tree.map(lambda s: s[0], summaries)
        if jax.tree.leaves(summaries)[0].shape[0] > 1:
            rest = jax.tree.map(lambda s: s[1:], summaries)
            acc, _ = lax.scan(lambda a, s: (accumulator.merge(a, s), None), acc, rest)
    if "rem" in outs:
        tail = jax.tree.map(lambda s: s[0, 0], lax.all_gather(outs["rem"], axes))
        acc = tail if acc is None else accumulator.merge(acc, tail)
    return jax.tree.map(
        lambda y, spec: y if spec is None else jax.sharding.reshard(y, spec), acc, specs
    )


def _typed_spec(y: Any) -> Any:
    sharding = jax.typeof(y).sharding
    return sharding.spec if any(getattr(sharding, "spec", ())) else None


def _replicated(y: Any) -> Any:
    if _typed_spec(y) is None:
        return y
    return jax.sharding.reshard(y, NamedSharding(jax.typeof(y).sharding.mesh, P()))


def _assemble_rows(rows: dict[str, Any], lay: Layout) -> Any:
    """An accumulator's rows (a tree per piece, as `_assemble`'s pieces) stacked."""
    tree = jax.tree.structure(rows.get("local", rows.get("rem")))
    flat = {k: jax.tree.leaves(v) for k, v in rows.items()}
    return tree.unflatten(_assemble(flat, [0] * tree.num_leaves, lay))


def _assemble(outs: dict[str, Any], out_axes: Sequence[Any], lay: Layout) -> Any:
    """The stacked outputs: the devices' shares, then the global remainder's."""
    if "rem" not in outs:
        return outs["local"]
    tail = [y[0] for y in outs["rem"]]
    assembled = tail
    if "local" in outs:
        assembled = [
            y if a is None else jnp.concatenate([y, t], axis=a)
            for y, t, a in zip(outs["local"], tail, out_axes)
        ]
    if not isinstance(lay.mesh, Mesh):  # only an abstract mesh: left to the compiler
        return assembled
    return lax.with_sharding_constraint(assembled, NamedSharding(lay.mesh, P()))
