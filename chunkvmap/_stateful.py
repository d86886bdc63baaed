"""Stateful adapters' evaluation: outputs folded or stacked, state always stacked.

The Flax adapters (`chunkvmap.linen`, `chunkvmap.nnx`) map a pure function that returns
`(outputs, state)`: the user's outputs, and the variables and RNG counters it updated.
Outputs follow the user's `reduction`; state, which is per example, is always stacked.
No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._core import batch_vmap as _core_batch_vmap, identity


def evaluate(
    fn: Callable[..., tuple[Any, Any]],
    args: tuple,
    in_axes: Any,
    out_axes: Any,
    state_axes: Any,
    reduction: Callable[[Any, Any], Any] | None,
    chunk_reduction: Callable[[Any], Any],
    options: dict[str, Any],
) -> tuple[Any, Any]:
    """`fn(*args) -> (y, state)` mapped by the core; returns `(y, state)`.

    Without a reduction, one chunked evaluation stacks both. With one, `y` is folded
    and `state` cannot be (a fold has no room for per-example values), so when `fn`
    returns any state a second, unreduced evaluation produces it (XLA drops the parts
    of that pass that only `y` needs).
    """
    if reduction is None:
        y, state = _core_batch_vmap(
            fn, in_axes=in_axes, out_axes=(out_axes, state_axes), **options
        )(*args)
        return (y if chunk_reduction is identity else chunk_reduction(y)), state

    state_tree: list[Any] = []

    def outputs_only(*a):
        y, state = fn(*a)
        state_tree[:] = [jax.tree.structure(state)]
        return y

    def state_only(*a):
        return fn(*a)[1]

    y = _core_batch_vmap(
        outputs_only,
        in_axes=in_axes,
        out_axes=out_axes,
        reduction=reduction,
        chunk_reduction=chunk_reduction,
        **options,
    )(*args)
    (treedef,) = state_tree
    if treedef.num_leaves == 0:
        return y, treedef.unflatten([])
    # The second pass is reported by nobody: progress counts the evaluation's chunks.
    state = _core_batch_vmap(
        state_only,
        in_axes=in_axes,
        out_axes=state_axes,
        **{**options, "progress": False},
    )(*args)
    return y, state
