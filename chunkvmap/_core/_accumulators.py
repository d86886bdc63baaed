"""Accumulators as small leaves composed over a prefix tree of the outputs.

How the chunks' outputs combine is said per subtree of the chunk function's output,
by a prefix tree whose leaves are these accumulators:

* `Stack()`: as `jax.vmap` stacks: each mapped leaf one row per example, in example
  order, at its output axis; an unmapped leaf (the same for every example) is kept
  from the first chunk;
* `Fold(reduction, chunk_reduction)`: one summary, `chunk_reduction` of each chunk's
  outputs folded over the chunks, in order, by `reduction` leaf by leaf (a sum when
  `reduction` is one of `_loop.SUMS`: devices' summaries are then added by one
  all-reduce);
* `Moments()`: the examples' count, mean and centred sum of squares, leaf by leaf.

`compose(spec)` is the accumulator of the whole output: resolved by the core against the
chunk function's traced `Signature` before any loop is built (`Composed.resolve`),
into a `_loop.Accumulator`, so each leaf knows its subtree's structure and axes.
Clipping is `(Fold(add, scaled sum), Stack())`; the Flax adapters' outputs with a
reduction are `(Fold(reduction, chunk_reduction), Stack())`; the gradient statistics
`(Moments(), Stack(), Stack())`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _axes, _loop
from ._options import identity


@dataclasses.dataclass(frozen=True)
class _Out:
    """One output leaf of a chunk function, as the signature gives it (not a pytree
    node, so that a prefix tree can split a tree of them)."""

    aval: Any
    axis: int | None


class Leaf:
    """An accumulator of one subtree of the outputs. `resolve(outs, length)` (a tree
    of `_Out`, the subtree's structure; chunks of `length`) returns the leaf to run;
    `summarise(out)` maps the subtree of one chunk's outputs to `(summary, rows)`
    (every leaf of `rows` one row per example along axis 0; `()` for none),
    `combine` folds two summaries, `finish` gives the subtree's result."""

    sums: bool = True  # `combine` adds leaf by leaf (or has nothing to combine)
    windows: bool = False  # see `_loop.Accumulator.windows`
    pure: bool = False  # see `_loop.Accumulator.pure` (opted into by each leaf)

    def resolve(self, outs: Any, length: int) -> Leaf:
        return self

    def summarise(self, out: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def combine(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def finish(self, summary: Any, rows: Any) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Fold(Leaf):
    reduction: Callable[[Any, Any], Any] = jnp.add
    chunk_reduction: Callable[[Any], Any] = identity
    # A user's reduction, checked when resolved (messages name the transform `name`).
    name: str | None = None

    @property
    def sums(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.reduction in _loop.SUMS

    @property
    def pure(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.name is None  # a front end's own fold, not a user's reduction

    def resolve(self, outs: Any, length: int) -> Leaf:
        if self.name is not None:
            checked_summary(
                self.name, self.reduction, self.chunk_reduction, outs, [length or 1]
            )
        return self

    def summarise(self, out: Any) -> tuple[Any, Any]:
        return self.chunk_reduction(out), ()

    def combine(self, a: Any, b: Any) -> Any:
        return _loop.fold(self.reduction, a, b)

    def finish(self, summary: Any, rows: Any) -> Any:
        return summary


@dataclasses.dataclass(frozen=True)
class Stack(Leaf):
    # Set by `resolve`: the subtree's structure and each leaf's output axis.
    tree: Any = None
    axes: tuple[int | None, ...] = ()
    pure: bool = True

    @property
    def sums(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        return all(a is not None for a in self.axes)  # nothing kept to combine

    @property
    def windows(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.sums  # each example's row is its own, whichever chunk made it

    def resolve(self, outs: Any, length: int) -> Leaf:
        leaves, tree = jax.tree.flatten(outs)
        return Stack(tree, tuple(o.axis for o in leaves))

    def summarise(self, out: Any) -> tuple[Any, Any]:
        leaves = self.tree.flatten_up_to(out)
        kept = [x for x, a in zip(leaves, self.axes) if a is None]
        rows = [
            jnp.moveaxis(x, a, 0) for x, a in zip(leaves, self.axes) if a is not None
        ]
        return kept, rows

    def combine(self, a: Any, b: Any) -> Any:
        return a

    def finish(self, summary: Any, rows: Any) -> Any:
        kept, stacked = iter(summary), iter(rows)
        leaves = [
            next(kept) if a is None else jnp.moveaxis(next(stacked), 0, a)
            for a in self.axes
        ]
        return self.tree.unflatten(leaves)


@dataclasses.dataclass(frozen=True)
class Moments(Leaf):
    """The examples' count, and per leaf their mean and centred sum of squares,
    merged over the chunks by Chan et al.'s parallel update (`merge_moments`) with
    the means held shifted (`moments`); finished as `(count, mean, m2)`."""

    axes: tuple[int, ...] = ()  # set by `resolve`: each leaf's examples axis
    sums: bool = False
    pure: bool = True
    # The outputs are `(real, tree)`: `real` flags each example that counts (a
    # padded buffer's real examples), and the moments are those of `tree`'s.
    weighted: bool = False

    def resolve(self, outs: Any, length: int) -> Leaf:
        leaves = jax.tree.leaves(outs)
        if any(o.axis is None for o in leaves):
            raise AssertionError("Moments takes mapped outputs only")
        return Moments(tuple(o.axis for o in leaves), weighted=self.weighted)

    def summarise(self, out: Any) -> tuple[Any, Any]:
        real, axes = None, self.axes
        if self.weighted:
            (real, out), axes = out, axes[1:]
        leaves, tree = jax.tree.flatten(out)
        n = leaves[0].shape[axes[0]] if leaves else 0
        kind = count_dtype([x.dtype for x in leaves])
        if real is not None:
            n = jnp.sum(real, dtype=kind)
        parts = [moments(g, a, real) for g, a in zip(leaves, axes)]
        shift, mean, m2 = (tree.unflatten(list(p)) for p in zip(*parts, strict=True))
        return (jnp.asarray(n, kind), shift, mean, m2), ()

    def combine(self, a: Any, b: Any) -> Any:
        return merge_moments(a, b)

    def finish(self, summary: Any, rows: Any) -> Any:
        return unshifted(summary)


def moments(
    g: jax.Array, axis: int, real: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The moments of `g`'s examples along `axis`, as `(shift, mean, m2)`: a shift
    (the first example), the mean of the examples less the shift, and their centred
    sum of squares. Held shifted, means stay as precise as the examples' spread,
    not their size: merging two chunks subtracts their means, which a large common
    part (a mean of 1e6 beside a spread of 1, in float32) would cancel away.
    `real` (a boolean per example): only those examples count (the shift is the
    first of them; the others' values, NaN included, never enter; with none, the
    moments are zeros, which merging leaves out)."""
    if real is None:
        shift = lax.index_in_dim(g, 0, axis, keepdims=False)
        d = g - jnp.expand_dims(shift, axis)
        mean = d.mean(axis)
        d = d - jnp.expand_dims(mean, axis)
        return shift, mean, jnp.sum(jnp.real(d * jnp.conj(d)), axis).astype(g.dtype)
    shape = [1] * g.ndim
    shape[axis] = -1
    keep = real.reshape(shape)
    shift = jnp.take(g, jnp.argmax(real), axis=axis)
    d = jnp.where(keep, g - jnp.expand_dims(shift, axis), 0)
    mean = d.sum(axis) / jnp.maximum(jnp.sum(real, dtype=g.real.dtype), 1)
    d = jnp.where(keep, d - jnp.expand_dims(mean, axis), 0)
    return shift, mean, jnp.sum(jnp.real(d * jnp.conj(d)), axis).astype(g.dtype)


def count_dtype(dtypes: Sequence[Any]) -> Any:
    """The dtype moments count their examples in (their merge weights): float64
    beside double-precision values (float32 weights would round their means to
    float32 precision), else float32."""
    wide = any(jnp.finfo(d).dtype.itemsize > 4 for d in dtypes)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def merge_moments(a: Any, b: Any) -> Any:
    """Two chunks' `(count, shift, mean, m2)` (`moments`) merged, held at `a`'s
    shift: `b`'s mean is moved to it (the shifts' difference is one of two
    examples, exact when they are close, not of two large means), then
    `merge_centred`."""
    count_a, shift_a, mean_a, m2_a = a
    count_b, shift_b, mean_b, m2_b = b
    moved = jax.tree.map(lambda sa, sb, mb: (sb - sa) + mb, shift_a, shift_b, mean_b)
    count, mean, m2 = merge_centred((count_a, mean_a, m2_a), (count_b, moved, m2_b))
    return count, shift_a, mean, m2


def merge_centred(a: Any, b: Any) -> Any:
    """Two chunks' `(count, mean, m2)` at one shift merged (Chan et al.'s parallel
    update: no cancellation from subtracting large sums of squares; `a` may have no
    example yet)."""
    count_a, mean_a, m2_a = a
    count_b, mean_b, m2_b = b
    count = count_a + count_b
    share = count_b / jnp.where(count == 0, 1, count)  # (nothing merged: no change)

    def mean(ma: jax.Array, mb: jax.Array) -> jax.Array:
        return ma + (mb - ma) * share.astype(ma.dtype)

    def m2(ma: jax.Array, mb: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
        delta = mb - ma
        weight = (count_a * share).astype(ma.dtype)
        return sa + sb + delta * jnp.conj(delta) * weight

    return (
        count,
        jax.tree.map(mean, mean_a, mean_b),
        jax.tree.map(m2, mean_a, mean_b, m2_a, m2_b),
    )


def unshifted(summary: Any) -> tuple[Any, Any, Any]:
    """`(count, mean, m2)` of merged moments `(count, shift, mean, m2)`."""
    count, shift, mean, m2 = summary
    return count, jax.tree.map(jnp.add, shift, mean), m2


@dataclasses.dataclass(frozen=True, eq=False)
class Composed:
    """The accumulator of outputs of which `spec` (a tree of `Leaf`s) is a prefix,
    before the outputs are known (`compose`). `pure`: every leaf is."""

    spec: Any

    @property
    def pure(self) -> bool:
        return all(leaf.pure for leaf in _spec_leaves(self.spec)[0])

    def resolve(self, signature: _loop.Signature, length: int) -> _loop.Accumulator:
        """The `_loop.Accumulator` of a chunk function's outputs (`signature`,
        chunks of `length`): each leaf resolved against its subtree."""
        leaves, spec_tree = _spec_leaves(self.spec)
        outs = signature.out_tree.unflatten(
            [_Out(a, ax) for a, ax in zip(signature.out_avals, signature.out_axes)]
        )
        subtrees = spec_tree.flatten_up_to(outs)
        leaves = [leaf.resolve(sub, length) for leaf, sub in zip(leaves, subtrees)]

        def summarise(out: Any) -> tuple[Any, Any]:
            parts = [
                leaf.summarise(sub)
                for leaf, sub in zip(leaves, spec_tree.flatten_up_to(out))
            ]
            return tuple(s for s, _ in parts), tuple(r for _, r in parts)

        def combine(a: Sequence[Any], b: Sequence[Any]) -> Any:
            return tuple(leaf.combine(x, y) for leaf, x, y in zip(leaves, a, b))

        def finish(summaries: Sequence[Any], rows: Sequence[Any]) -> Any:
            return spec_tree.unflatten(
                [leaf.finish(s, r) for leaf, s, r in zip(leaves, summaries, rows)]
            )

        return _loop.Accumulator(
            summarise,
            None if all(leaf.sums for leaf in leaves) else combine,
            finish,
            windows=all(leaf.windows for leaf in leaves),
            pure=all(leaf.pure for leaf in leaves),
        )


def compose(spec: Any) -> Composed:
    """The accumulator of outputs of which `spec` (a tree of `Leaf`s) is a prefix,
    resolved against the chunk function's signature before the loop is built."""
    return Composed(spec)


def _spec_leaves(spec: Any) -> tuple[list[Leaf], Any]:
    return jax.tree.flatten(spec, is_leaf=lambda x: isinstance(x, Leaf))


def _same_types(a: Any, b: Any) -> bool:
    """Whether two trees of arrays have the same structure, shapes and dtypes."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        (x.shape, x.dtype) == (y.shape, y.dtype)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _aval_str(tree: Any) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def checked_summary(
    name: str,
    reduction: Callable[[Any, Any], Any],
    chunk_reduction: Callable[[Any], Any],
    outs: Any,
    lengths: Sequence[int],
) -> Any:
    """Check that `chunk_reduction` removes the mapped axis and `reduction` is a fold.

    `chunk_reduction` is evaluated abstractly on chunks of every length that will occur
    (plus one more when only one does). If its output shapes depend on the chunk length,
    it did not reduce over the mapped axis, and folding such results would be wrong (or
    silently broadcast), so this is an error. `reduction(a, a)` must return `a`'s exact
    structure, shapes and dtypes, as a fold carry must. `outs`: the outputs it
    folds, a tree of `_Out`. Returns the types of one chunk's summary.
    """
    first = _summary_type(name, chunk_reduction, outs, lengths)
    _check_fold(name, reduction, first)
    return first


def _summary_type(
    name: str, chunk_reduction: Callable[[Any], Any], outs: Any, lengths: Sequence[int]
) -> Any:
    """`checked_summary`'s first check: the types of `chunk_reduction` of a chunk,
    the same for chunks of every length in `lengths` (and one more)."""
    lengths = sorted(set(lengths))
    if len(lengths) == 1:
        lengths.append(lengths[0] + 1)
    summaries = []
    for length in lengths:
        chunk = jax.tree.map(lambda o: _axes.stacked(o.aval, o.axis, length), outs)
        summaries.append(jax.eval_shape(chunk_reduction, chunk))
    first = summaries[0]
    for length, other in zip(lengths[1:], summaries[1:]):
        if not _same_types(first, other):
            hint = (
                " chunk_reduction is the identity (the default): pass one that sums up "
                "a chunk along the mapped axis, e.g. chunk_reduction=lambda y: "
                "y.sum(0) with reduction=jnp.add, or drop reduction."
                if chunk_reduction is identity
                else " It must reduce over the mapped axis, e.g. lambda y: y.sum(0)."
            )
            raise ValueError(
                f"{name} with a reduction needs a chunk_reduction whose output does "
                f"not depend on the chunk length, but its output still has the mapped "
                f"axis: for a chunk of {lengths[0]} examples it returns "
                f"{_aval_str(first)}, for {length} examples {_aval_str(other)}.{hint}"
            )

    return first


def _check_fold(name: str, reduction: Callable[[Any, Any], Any], first: Any) -> None:
    """`checked_summary`'s second check: `reduction` of two summaries of the types
    `first` is traceable and of those types."""

    def combine(a: Any, b: Any) -> Any:
        out = _loop.fold(reduction, a, b)
        for leaf in jax.tree.leaves(out):
            if not isinstance(leaf, jax.Array):
                raise TypeError(f"it returned a value of type {type(leaf).__name__}")
        return out

    try:
        folded = jax.eval_shape(combine, first, first)
    except Exception as e:  # not traceable (np.add, max), or not array-valued
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TypeError(
            f"{name} reduction={reduction!r} must be a JAX-traceable function of two "
            f"chunk summaries returning one of the same structure (e.g. jnp.add, "
            f"jnp.maximum), but applying it to two summaries of {_aval_str(first)} "
            f"failed: {type(e).__name__}: {first_line}"
        ) from None
    if not _same_types(first, folded):
        raise ValueError(
            f"{name} reduction must combine two chunk summaries into one of the same "
            f"structure, shapes and dtypes (it is applied leaf by leaf), but on "
            f"{_aval_str(first)} it returns {_aval_str(folded)}."
        )
