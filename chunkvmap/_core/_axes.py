"""Axis normalisation: `in_axes` / `out_axes` specs to and from per-leaf axes.

Everything here is about turning a user's axis specification (an int, `None`, or a
pytree prefix, exactly as `jax.vmap` accepts it) into one canonical, non-negative axis
(or `None`) per array leaf, and about reading the mapped size off those leaves. Nothing
here slices, loops or evaluates the user's function.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


AxisSpec = Any  # int | None | pytree prefix of ints and Nones

# The leaves every module tells apart, in one place: arrays (JAX's and NumPy's), and
# the values JAX takes as arrays (those and Python numbers).
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
JAX_TYPES = (*ARRAY_TYPES, bool, int, float, complex)


def is_array(x: Any) -> bool:
    """A JAX or NumPy array (or NumPy scalar): not a Python number."""
    return isinstance(x, ARRAY_TYPES)


def is_inexact_array(x: Any) -> bool:
    """A floating-point or complex array: what gradients are taken of (Python
    floats, such as a module's hyperparameters, are constants, as in
    `equinox.is_inexact_array`)."""
    return is_array(x) and bool(jnp.issubdtype(x.dtype, jnp.inexact))


def is_arraylike(x: Any) -> bool:
    """A value JAX takes as an array: an array or a Python number."""
    return isinstance(x, JAX_TYPES)


def combine(leaves: Sequence[Any], positions: Sequence[int], values: Any) -> list[Any]:
    """A new list of `leaves` with `values` put at `positions`, in order (the
    dynamic leaves of a flattened call put back among its static ones, where they
    were taken as `[leaves[i] for i in positions]`); values past the positions'
    count are left out."""
    full = list(leaves)
    for i, v in zip(positions, values):
        full[i] = v
    return full


def is_none(x: Any) -> bool:
    """None is a leaf of an axis spec (not mapped), not an empty subtree."""
    return x is None


def spec_key(spec: Any) -> tuple[Any, tuple]:
    """An axis spec (a pytree of ints and None) as a hashable key: its structure
    and its leaves, None included."""
    return jax.tree.structure(spec, is_leaf=is_none), tuple(
        jax.tree.leaves(spec, is_leaf=is_none)
    )


def is_axis(x: Any) -> bool:
    """An axis of an axis spec: a Python int (not a bool) or None. NumPy integers are
    not axes, as in `jax.vmap` (and `nn.vmap`, `nnx.vmap`, `eqx.filter_vmap`)."""
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _numpy_hint(x: Any) -> str:
    """A hint for a NumPy integer where an axis is expected (it looks like one)."""
    return " (use int(...): NumPy integers are not axes)" * isinstance(x, np.integer)


def check_axes_spec(
    name: str, spec: AxisSpec, *, top_level_tuple: bool, transform: str = "batch_vmap"
) -> AxisSpec:
    """Static checks of an axis spec, done when `batch_vmap` is called.

    Mirrors `jax.vmap`: for `in_axes` (`top_level_tuple=True`) a list at the top level
    is read as a tuple, and the spec must be an int, None, or a tuple (one entry per
    positional argument); every leaf is an int or None.
    """
    if top_level_tuple and isinstance(spec, list):
        spec = tuple(spec)
    if top_level_tuple and not (is_axis(spec) or isinstance(spec, tuple)):
        raise TypeError(
            f"{transform} {name} must be an int, None, or a tuple of entries "
            f"corresponding to the positional arguments passed to the function, "
            f"but got {name}={spec!r} of type {type(spec).__name__}"
            f"{_numpy_hint(spec)}."
        )
    leaves = jax.tree.leaves(spec, is_leaf=is_none)
    bad = [leaf for leaf in leaves if not is_axis(leaf)]
    if bad:
        raise TypeError(
            f"{transform} {name} must be an int, None, or a pytree prefix whose "
            f"leaves are ints or None, but got {name}={spec!r} containing "
            + ", ".join(f"{b!r} ({type(b).__name__}){_numpy_hint(b)}" for b in bad)
            + "."
        )
    return jax.tree.map(lambda a: None if a is None else int(a), spec, is_leaf=is_none)


def check_arity(
    transform: str,
    in_axes: AxisSpec,
    args: tuple,
    called: str = "the function was called",
) -> None:
    """A tuple `in_axes` has one entry per positional argument, else a ValueError
    (`called` says what was called, as the user knows it)."""
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        raise ValueError(
            f"{transform} in_axes must have one entry per positional argument, but "
            f"in_axes={in_axes!r} has {len(in_axes)} entries and {called} with "
            f"{len(args)} positional argument(s)."
        )


def split_by_prefix(
    name: str, spec: AxisSpec, tree: Any, what: str, transform: str = "batch_vmap"
) -> tuple[Any, list[Any], list[Any]]:
    """The prefix `spec`'s treedef, its leaves (None included) and, for each, the
    subtree of `tree` it covers; a structure mismatch is an error naming `name`.

    A None in `spec` is a leaf (an axis: not mapped); a None in `tree` is an empty
    subtree with no leaves, as everywhere in JAX.
    """
    prefix = jax.tree.structure(spec, is_leaf=is_none)
    try:
        subtrees = prefix.flatten_up_to(tree)
    except ValueError as e:
        raise ValueError(
            f"{transform} {name} must be a pytree prefix of the {what}, but the "
            f"structures do not match.\n  {name} = {spec!r}\n  {what} structure = "
            f"{jax.tree.structure(tree)}\nJAX reported: {e}"
        ) from None
    return prefix, jax.tree.leaves(spec, is_leaf=is_none), subtrees


def broadcast_axes(
    name: str, spec: AxisSpec, tree: Any, what: str, transform: str = "batch_vmap"
) -> list[Any]:
    """One axis (int or None) per leaf of `tree`, from the prefix `spec`."""
    _, axes, subtrees = split_by_prefix(name, spec, tree, what, transform)
    return [a for a, sub in zip(axes, subtrees) for _ in jax.tree.leaves(sub)]


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def canonical_in_axis(
    axis: int | None,
    leaf: Any,
    path: str,
    transform: str = "batch_vmap",
    arg: str = "in_axes",
) -> int | None:
    """Make a mapped input axis non-negative and check it is in range."""
    if axis is None:
        return None
    unmap = _how_to_unmap(path, arg)
    if not is_arraylike(leaf):
        raise TypeError(
            f"{transform} {arg} maps {path} along axis {axis}, but it is not an "
            f"array: got a value of type {type(leaf).__name__}. To share it with "
            f"every example, {unmap}; else pass an array."
        )
    ndim = len(shape_of(leaf))
    if not ndim:
        raise ValueError(
            f"{transform} {arg} maps {path} along axis {axis}, but it is a scalar "
            f"(shape ()): {unmap}, or add a mapped axis."
        )
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{transform} {arg} maps {path} along axis {axis}, which is out of range "
            f"for its shape {shape_of(leaf)} (rank {ndim}: valid axes are "
            f"{-ndim}..{ndim - 1})."
        )
    return axis % ndim


def _how_to_unmap(path: str, arg: str) -> str:
    """How a value at `path` is passed unmapped, by the option `arg` that maps it,
    for messages."""
    return {
        "in_axes": (
            "pass it positionally with in_axes=None at its position, or bind it "
            "with functools.partial (keyword arguments are always mapped over axis "
            "0, as in jax.vmap)"
            if path.startswith("kwargs")
            else "give it in_axes=None"
        ),
        "batch_argnums": (
            "pass it positionally, outside batch_argnums (keyword arguments are "
            "always mapped)"
            if path.startswith("kwargs")
            else "leave its argument out of batch_argnums"
        ),
    }.get(arg, "pass it unmapped")


def canonical_out_axis(
    axis: int | None, rank: int, path: str, transform: str = "batch_vmap"
) -> int | None:
    """Make an output axis non-negative for an output of per-example rank `rank`."""
    if axis is None:
        return None
    if not -(rank + 1) <= axis <= rank:
        raise ValueError(
            f"{transform} out_axes={axis} is out of range for output {path}: each "
            f"example's output has rank {rank}, so the mapped output has rank "
            f"{rank + 1} and valid axes are {-(rank + 1)}..{rank}."
        )
    return axis % (rank + 1)


def mapped_size(
    paths: Sequence[str],
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    axis_size: int | None,
    transform: str = "batch_vmap",
    hint: str = "",
) -> int:
    """The common length of every mapped axis (or `axis_size`), else a clear error
    (with `hint` after its first sentence)."""
    sizes = [
        (p, shape_of(x)[a], a, shape_of(x))
        for p, x, a in zip(paths, leaves, axes)
        if a is not None
    ]
    if not sizes:
        if axis_size is None:
            raise ValueError(
                f"{transform} must have at least one non-None value in in_axes, or be "
                "given axis_size: got no mapped argument and axis_size=None."
            )
        return axis_size
    distinct = {s for _, s, _, _ in sizes}
    if axis_size is not None:
        distinct.add(axis_size)
    if len(distinct) > 1:
        lines = "\n".join(
            f"  {p} of shape {shape} has size {s} along axis {a}"
            for p, s, a, shape in sizes
        )
        extra = f"\n  axis_size={axis_size}" if axis_size is not None else ""
        hint = f" ({hint})" if hint else ""
        raise ValueError(
            f"{transform} got inconsistent sizes for the mapped axis{hint}; every "
            f"mapped argument must have the same size along its mapped axis:\n"
            f"{lines}{extra}"
        )
    return sizes[0][1]


def check_positive_int(
    name: str,
    value: Any,
    *,
    allow_none: bool = True,
    allow_zero: bool = False,
    transform: str = "batch_vmap",
) -> int | None:
    """`value` as a positive int (or None), else a TypeError / ValueError naming it."""
    if value is None and allow_none:
        return None
    kind = "a non-negative int" if allow_zero else "a positive int"
    expected = kind + (" or None" if allow_none else "")
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        index = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{transform} {name} must be {expected}, but got {name}={value!r} of "
            f"type {type(value).__name__}."
        ) from None
    if index < 0 or (index == 0 and not allow_zero):
        raise ValueError(
            f"{transform} {name} must be {expected}, but got {name}={index}."
        )
    return index


def sized(x: Any, axis: int | None, length: int) -> jax.ShapeDtypeStruct:
    """The plain type (no sharding) of `x` (an array or a type) with its mapped axis
    `axis` of size `length` (None: `x`'s own shape)."""
    aval = jax.typeof(x) if isinstance(x, jax.Array) else x
    shape = list(aval.shape)
    if axis is not None:
        shape[axis] = length
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype, weak_type=weak)


def stacked(aval: Any, axis: int | None, length: int) -> jax.ShapeDtypeStruct:
    """The type of `length` values of per-example type `aval` stacked along `axis`
    (None: unmapped, `aval` itself)."""
    shape = tuple(aval.shape)
    if axis is not None:
        shape = (*shape[:axis], length, *shape[axis:])
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=weak)


def unmapped(aval: Any, axis: int | None) -> jax.ShapeDtypeStruct:
    """The type of one example of `aval` mapped along `axis` (None: `aval`)."""
    if axis is None:
        return aval
    shape = tuple(aval.shape[:axis]) + tuple(aval.shape[axis + 1 :])
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=weak)


def per_example(aval: Any) -> jax.ShapeDtypeStruct:
    """The type of one example of `aval`, stacked along its leading axis."""
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(aval.shape[1:], aval.dtype, weak_type=weak)


class Known:
    """What a call knows before it looks at its inputs: the mesh its placement
    resolved (`mesh`: `_mesh.resolve`'s, None where the caller holds one or none is
    needed), and the concrete shardings of an eager call's array arguments, told
    by the tracers that stand for them in the call's trace (where a tracer's type
    shows only Explicit mesh axes, so that a layout visible on the concrete arrays
    stays visible inside). Each sharding is held with its tracer, and found by the
    tracer's identity; none for a call under an outer `jax.jit`, where the types
    say all there is to see."""

    def __init__(self, pairs: Sequence[tuple[Any, Any]] = (), mesh: Any = None):
        self._entries = {id(t): (t, s) for t, s in pairs if s is not None}
        self.mesh = mesh

    def sharding_of(self, x: Any) -> Any:
        """The concrete sharding of the argument `x` stands for, or None."""
        entry = self._entries.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None


NOTHING_KNOWN = Known()


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The flat inputs of one call: `leaves` (each mapped along its canonical axis),
    their key paths as the user wrote them (`paths`), which leaves are arrays to trace
    (`dyn`, every mapped leaf among them), the mapped length `size`, and a hashable
    `key` of the call's types (for the `"auto"` choice); `known`: the concrete
    shardings of an eager call's arguments (`Known`); `padding`: the leaf marking
    padding examples, if any."""

    leaves: list[Any]
    paths: Sequence[str]
    dyn: Sequence[int]
    size: int
    key: Any
    known: Known = NOTHING_KNOWN
    # The leaf (an index into `leaves`) that marks each example as padding (a
    # boolean vector along axis 0), where the examples are a padded buffer; None:
    # every example is real.
    padding: int | None = None
