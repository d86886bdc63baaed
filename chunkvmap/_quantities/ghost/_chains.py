"""Chains: the example-independent linear operations between a leaf and its use,
and where their output lies in the leaf (`LeafView`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._context import bind


class Step(enum.Enum):
    """What a chain step does: apply a primitive, multiply by a constant, or take
    the iteration's slice of a leaf a scan reads through its `xs`."""

    PRIM = enum.auto()
    SCALE = enum.auto()
    STACK = enum.auto()


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a chain: a primitive (output `index` of a multiple-result one), a
    constant `scale`, or `STACK` (the iteration's slice of a scanned leaf)."""

    kind: Step
    prim: Any = None
    params: Any = None
    index: int = 0
    scale: float = 1.0

    def apply(self, w: Any) -> Any:
        if self.kind is Step.SCALE:
            return w * jnp.asarray(self.scale, w.dtype)
        out = bind(self.prim, [w], self.params)
        return out[self.index] if self.prim.multiple_results else out


STACK = Op(Step.STACK)

# Unary primitives that pass a value through unchanged (up to dtype or layout hints);
# by name where JAX does not export the primitive.
IDENTITY = frozenset(
    {
        prims.convert_element_type_p,
        prims.copy_p,
        prims.sharding_constraint_p,
        prims.reduce_precision_p,
    }
)
IDENTITY_NAMES = frozenset({"reshard", "mesh_cast"})


def is_identity(prim: Any) -> bool:
    return prim in IDENTITY or prim.name in IDENTITY_NAMES


@dataclasses.dataclass(frozen=True)
class Axis:
    """An axis of a value made from a leaf: leaf axis `leaf` (None: a broadcast axis
    not from the leaf), of `size`."""

    leaf: int | None
    size: int


@dataclasses.dataclass(frozen=True)
class LeafView:
    """Where a chain's output comes from in its leaf.

    `axes`: the output's axes; `box[j] = (start, size, stride)`: the entries of leaf
    axis j that the output reads (axes of box size 1 may be absent from `axes`);
    `stacked`: the axes consumed by scans over the leaf (outer first); `scale`: the
    product of the chain's constant factors."""

    axes: tuple[Axis, ...]
    box: tuple[tuple[int, int, int], ...]
    stacked: tuple[Axis, ...] = ()
    scale: float = 1.0

    def present(self) -> frozenset[int]:
        return frozenset(
            a.leaf for a in (*self.axes, *self.stacked) if a.leaf is not None
        )


def _boxes_disjoint(a: tuple, b: tuple) -> bool:
    """Whether two strided ranges `(start, size, stride)` share no index."""
    (s1, n1, d1), (s2, n2, d2) = a, b
    if n1 == 0 or n2 == 0:
        return True
    if s1 + (n1 - 1) * d1 < s2 or s2 + (n2 - 1) * d2 < s1:
        return True
    if n1 * n2 <= 4096:
        return not set(range(s1, s1 + n1 * d1, d1)) & set(range(s2, s2 + n2 * d2, d2))
    return False


def layout_of(chain: Sequence[Op], shape: Sequence[int]) -> LeafView | None:
    """The layout of a chain's output in its leaf, or None when the chain mixes
    entries in a way an einsum cannot name (a reshape that merges or splits axes)."""
    axes = [Axis(j, n) for j, n in enumerate(shape)]
    box = [(0, n, 1) for n in shape]
    stacked: list[Axis] = []
    scale = 1.0
    for op in chain:
        if op.kind is Step.SCALE:
            scale *= op.scale
            continue
        if op.kind is Step.STACK:
            stacked.append(axes.pop(0))
            continue
        if is_identity(op.prim):
            continue
        moved = _MOVES.get(op.prim)
        axes = None if moved is None else moved(axes, op, box)
        if axes is None:
            return None
        # a leaf axis that left the output must be a single entry
        present = {a.leaf for a in (*axes, *stacked) if a.leaf is not None}
        for j in range(len(shape)):
            if j not in present and box[j][1] != 1:
                return None
    return LeafView(tuple(axes), tuple(box), tuple(stacked), scale)


# How each layout primitive moves a chain's axes: `move(axes, op, box)` is the new
# axes (None: entries mixed), `box` updated in place for what a slice selects.
Move = Callable[[list, Op, list], "list | None"]


def _transposed(axes: list, op: Op, box: list) -> list:
    return [axes[i] for i in op.params["permutation"]]


def _squeezed(axes: list, op: Op, box: list) -> list:
    dims = {d % len(axes) for d in op.params["dimensions"]}
    return [a for i, a in enumerate(axes) if i not in dims]


def _broadcast(axes: list, op: Op, box: list) -> list:
    shape = op.params["shape"]
    new = [Axis(None, n) for n in shape]
    for i, d in enumerate(op.params["broadcast_dimensions"]):
        if axes[i].size == shape[d]:
            new[d] = axes[i]
    return new


def _reshaped(axes: list, op: Op, box: list) -> list | None:
    p = op.params
    if p.get("dimensions") is not None:
        return None
    kept = [a for a in axes if a.size != 1]
    sizes = [n for n in p["new_sizes"] if n != 1]
    if [a.size for a in kept] != sizes:
        return None
    it = iter(kept)
    return [next(it) if n != 1 else Axis(None, 1) for n in p["new_sizes"]]


def _sliced(axes: list, op: Op, box: list) -> list:
    p = op.params
    if op.prim is lax.slice_p:
        starts, limits = p["start_indices"], p["limit_indices"]
        strides = p["strides"] or (1,) * len(axes)
    else:  # split: output `op.index`'s part
        starts = [0] * len(axes)
        limits = [a.size for a in axes]
        strides = [1] * len(axes)
        axis = p["axis"]
        starts[axis] = int(sum(p["sizes"][: op.index]))
        limits[axis] = starts[axis] + int(p["sizes"][op.index])
    new = []
    for a, s, lim, st in zip(axes, starts, limits, strides):
        size = max(0, -(-(lim - s) // st))
        if a.leaf is not None:
            b0, _, d0 = box[a.leaf]
            box[a.leaf] = (b0 + d0 * s, size, d0 * st)
        new.append(Axis(a.leaf, size))
    return new


_MOVES: dict[Any, Move] = {
    lax.transpose_p: _transposed,
    lax.squeeze_p: _squeezed,
    lax.broadcast_in_dim_p: _broadcast,
    lax.reshape_p: _reshaped,
    lax.slice_p: _sliced,
    lax.split_p: _sliced,
}
"""The unary linear primitives that move, select or broadcast a leaf's entries."""


def chain_op(eqn: Any, position: int, index: int, consts: Sequence[Any]) -> Op | None:
    """The chain step that equation `eqn` applies to its operand `position` (the leaf
    side), or None when it is not one. `consts[i]` is the concrete value of operand i
    when it is an example-independent constant (else None)."""
    prim = eqn.primitive
    if is_identity(prim) or prim in _MOVES:
        if len(eqn.invars) != 1:
            return None
        if prim is lax.convert_element_type_p and not jnp.issubdtype(
            eqn.params["new_dtype"], jnp.floating
        ):  # (a cast to complex mixes real and imaginary parts into the use)
            return None
        return Op(Step.PRIM, prim, dict(eqn.params), index)
    if prim is lax.neg_p:
        return Op(Step.SCALE, scale=-1.0)
    if prim in (lax.mul_p, lax.div_p) and len(eqn.invars) == 2:
        other = consts[1 - position]
        if other is None or np.ndim(other) != 0:
            return None
        value = float(np.asarray(other))
        if prim is lax.mul_p:
            return Op(Step.SCALE, scale=value)
        if position == 0 and value != 0:
            return Op(Step.SCALE, scale=1.0 / value)
    return None
