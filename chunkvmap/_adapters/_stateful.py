"""Stateful adapters' evaluation: outputs folded or stacked, state always stacked.

The Flax adapters (`chunkvmap.linen`, `chunkvmap.nnx`) map a pure function that returns
`(outputs, state)`: the user's outputs, and the variables and RNG counters it updated.
Outputs follow the user's `reduction`; state, which is per example, is always stacked:
with a reduction, in the same evaluation (one accumulator folds the outputs and stacks
the state). No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import _accumulators, _axes, _cache, _loop
from .._core._options import identity
from .._transforms._batch_vmap import Transform, out_paths


def stateful_map(
    transform: Transform,
    fn: Callable[..., tuple[Any, Any]],
    args: tuple,
    in_axes: Any,
    out_axes: Any,
    state_axes: Any,
    *,
    state_root: str,
) -> tuple[Any, Any]:
    """`fn(*args) -> (y, state)` mapped by `transform`; returns `(y, state)`, in one
    chunked evaluation, under the call's mesh as every entry point's (`fn`, which
    Flax's lifting makes anew at every call, is told apart by its chunk's trace):
    without a reduction both are stacked; with one, `y` is folded by it and `state`
    stacked beside it. Messages name the outputs `out...` and the state
    `state_root...` (how the user knows it)."""
    in_axes = _axes.check_axes_spec(
        "in_axes", in_axes, top_level_tuple=True, transform=transform.name
    )
    axes = (in_axes, out_axes, state_axes)

    def evaluate(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        return _evaluate(transform, state_root, fn, args, axes, known)

    return transform.cache(evaluate)(args, {})


def _evaluate(
    transform: Transform,
    state_root: str,
    fn: Callable[..., Any],
    args: tuple,
    axes: tuple,
    known: _cache.Known,
) -> tuple[Any, Any]:
    """`stateful_map`'s evaluation; `axes`: its `(in_axes, out_axes,
    state_axes)`."""
    in_axes, out_axes, state_axes = axes
    options = transform.options

    def both_paths(out: Any) -> list[str]:
        return out_paths(out[0]) + out_paths(out[1], state_root)

    if options.reduction is None:
        stacked = options.replace(reduction=None, chunk_reduction=identity)
        y, state = transform.map(
            fn, args, {}, in_axes, (out_axes, state_axes), options=stacked,
            out_names=both_paths, known=known,
        )  # fmt: skip
        chunk_reduction = options.chunk_reduction
        return (y if chunk_reduction is identity else chunk_reduction(y)), state
    accumulator = _folded_and_stacked(
        options.name, options.reduction, options.chunk_reduction
    )
    return transform.map(
        fn, args, {}, in_axes, (out_axes, state_axes),
        accumulator=accumulator, out_names=both_paths, known=known,
    )  # fmt: skip


def _folded_and_stacked(
    name: str, reduction: Callable[[Any, Any], Any], chunk_reduction: Callable
) -> _loop.Accumulator:
    """The accumulator of `(y, state)` outputs: `y` folded by the user's `reduction`
    (after `chunk_reduction`, checked as the core checks them), `state` stacked as
    `jax.vmap` stacks it (a leaf the same for every example kept once)."""
    return _accumulators.compose(
        (
            _accumulators.Fold(reduction, chunk_reduction, name=name),
            _accumulators.Stack(),
        )
    )
