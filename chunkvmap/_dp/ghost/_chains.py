"""Chains: the example-independent linear operations between a leaf and its use,
and where their output lies in the leaf (`Layout`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._context import bind


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a chain: a primitive (output `index` of a multiple-result one), a
    constant `scale`, or `stack` (the iteration's slice of a scanned leaf)."""

    kind: str  # "prim" | "scale" | "stack"
    prim: Any = None
    params: Any = None
    index: int = 0
    scale: float = 1.0

    def apply(self, w: Any) -> Any:
        if self.kind == "scale":
            return w * jnp.asarray(self.scale, w.dtype)
        out = bind(self.prim, [w], self.params)
        return out[self.index] if self.prim.multiple_results else out


# Unary primitives that pass a value through unchanged (up to dtype or layout hints).
IDENTITY = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "reduce_precision",
    }
)
# Unary linear primitives that move, select or broadcast entries.
LAYOUT = frozenset(
    {"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice"}
)
MULTI = frozenset({"split"})


@dataclasses.dataclass(frozen=True)
class Axis:
    """An axis of a value made from a leaf: leaf axis `leaf` (None: a broadcast axis
    not from the leaf), of `size`."""

    leaf: int | None
    size: int


@dataclasses.dataclass(frozen=True)
class Layout:
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


def layout_of(chain: Sequence[Op], shape: Sequence[int]) -> Layout | None:
    """The layout of a chain's output in its leaf, or None when the chain mixes
    entries in a way an einsum cannot name (a reshape that merges or splits axes)."""
    axes = [Axis(j, n) for j, n in enumerate(shape)]
    box = [(0, n, 1) for n in shape]
    stacked: list[Axis] = []
    scale = 1.0
    for op in chain:
        if op.kind == "scale":
            scale *= op.scale
            continue
        if op.kind == "stack":
            stacked.append(axes.pop(0))
            continue
        name, p = op.prim.name, op.params
        if name in IDENTITY:
            continue
        if name == "transpose":
            axes = [axes[i] for i in p["permutation"]]
        elif name == "squeeze":
            dims = {d % len(axes) for d in p["dimensions"]}
            axes = [a for i, a in enumerate(axes) if i not in dims]
        elif name == "expand_dims":
            for d in sorted(p["dimensions"]):
                axes.insert(d, Axis(None, 1))
        elif name == "broadcast_in_dim":
            new = [Axis(None, n) for n in p["shape"]]
            for i, d in enumerate(p["broadcast_dimensions"]):
                if axes[i].size == p["shape"][d]:
                    new[d] = axes[i]
            axes = new
        elif name == "reshape":
            if p.get("dimensions") is not None:
                return None
            kept = [a for a in axes if a.size != 1]
            sizes = [n for n in p["new_sizes"] if n != 1]
            if [a.size for a in kept] != sizes:
                return None
            it = iter(kept)
            axes = [next(it) if n != 1 else Axis(None, 1) for n in p["new_sizes"]]
        elif name in ("slice", "split"):
            if name == "slice":
                starts, limits = p["start_indices"], p["limit_indices"]
                strides = p["strides"] or (1,) * len(axes)
            else:
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
            axes = new
        else:
            return None
        # a leaf axis that left the output must be a single entry
        present = {a.leaf for a in (*axes, *stacked) if a.leaf is not None}
        for j in range(len(shape)):
            if j not in present and box[j][1] != 1:
                return None
    return Layout(tuple(axes), tuple(box), tuple(stacked), scale)


def chain_op(eqn: Any, position: int, index: int, consts: Sequence[Any]) -> Op | None:
    """The chain step that equation `eqn` applies to its operand `position` (the leaf
    side), or None when it is not one. `consts[i]` is the concrete value of operand i
    when it is an example-independent constant (else None)."""
    name = eqn.primitive.name
    if name in IDENTITY or name in LAYOUT or name in MULTI:
        if len(eqn.invars) != 1:
            return None
        if name == "convert_element_type" and not jnp.issubdtype(
            eqn.params["new_dtype"], jnp.floating
        ):  # (a cast to complex mixes real and imaginary parts into the use)
            return None
        return Op("prim", eqn.primitive, dict(eqn.params), index)
    if name == "neg":
        return Op("scale", scale=-1.0)
    if name in ("mul", "div") and len(eqn.invars) == 2:
        other = consts[1 - position]
        if other is None or np.ndim(other) != 0:
            return None
        value = float(np.asarray(other))
        if name == "mul":
            return Op("scale", scale=value)
        if position == 0 and value != 0:
            return Op("scale", scale=1.0 / value)
    return None
