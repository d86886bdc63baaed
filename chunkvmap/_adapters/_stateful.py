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

from .._core import _axes, _cache
from .._core._options import ChunkOptions, identity
from .._transforms._batch_vmap import Mapper, out_paths


class StatefulMap:
    """An adapter's validated chunking (made when the adapter is built, so errors
    name it then), mapping functions that return `(outputs, state)`; messages name
    the outputs `out...` and the state `state_root...` (how the user knows it)."""

    def __init__(
        self,
        name: str,
        *,
        axis_name: Any,
        axis_size: Any,
        state_root: str = "state",
        **options: Any,
    ):
        self.mapper = Mapper(ChunkOptions.make(name, **options), axis_name, axis_size)
        self.state_root = state_root

    @property
    def axis_size(self) -> int | None:
        return self.mapper.axis_size

    def __call__(
        self,
        fn: Callable[..., tuple[Any, Any]],
        args: tuple,
        in_axes: Any,
        out_axes: Any,
        state_axes: Any,
    ) -> tuple[Any, Any]:
        """`fn(*args) -> (y, state)` mapped by the core; returns `(y, state)`.

        Without a reduction, one chunked evaluation stacks both. With one, `y` is
        folded and `state` cannot be (a fold has no room for per-example values), so
        when `fn` returns any state a second, unreduced evaluation produces it (XLA
        drops the parts of that pass that only `y` needs).
        """
        mapper = self.mapper
        options = mapper.options
        in_axes = _axes.check_axes_spec(
            "in_axes", in_axes, top_level_tuple=True, transform=options.name
        )
        stacked = options.replace(reduction=None, chunk_reduction=identity)

        def state_paths(state: Any) -> list[str]:
            return out_paths(state, self.state_root)

        def both_paths(out: Any) -> list[str]:
            return out_paths(out[0]) + state_paths(out[1])

        def run(f, out_spec, opts, names):
            return mapper(f, args, {}, in_axes, out_spec, opts, out_names=names)

        if options.reduction is None:
            y, state = run(fn, (out_axes, state_axes), stacked, both_paths)
            chunk_reduction = options.chunk_reduction
            return (y if chunk_reduction is identity else chunk_reduction(y)), state

        state_tree: list[Any] = []

        @_cache.wraps(fn)  # messages name the user's function, as `fn` does
        def outputs_only(*a):
            y, state = fn(*a)
            state_tree[:] = [jax.tree.structure(state)]
            return y

        y = run(outputs_only, out_axes, options, out_paths)
        (treedef,) = state_tree
        if treedef.num_leaves == 0:
            return y, treedef.unflatten([])
        # The second pass is reported by nobody: progress counts the evaluation's
        # chunks.
        quiet = stacked.replace(progress=False, reporter=None)
        state_only = _cache.wraps(fn)(lambda *a: fn(*a)[1])
        state = run(state_only, state_axes, quiet, state_paths)
        return y, state
