"""Flax NNX adapter: `batch_vmap`, a chunked drop-in for `nnx.vmap`.

`nnx.vmap` turns the graph nodes among its arguments (Modules, `nnx.Rngs`, Variables)
into pure pytrees of state with one axis per substate (`nnx.StateAxes` picks them by
filter), runs `jax.vmap` on the pure function, and merges the state that comes out
back into the caller's objects. This module does the same translation with
`chunkvmap.batch_vmap` in place of `jax.vmap`:

1. outside, `flax.nnx.to_tree` splits every graph node argument into its
   graph definition and state, grouped by the filters of `nnx.StateAxes`;
2. the core evaluates the pure function chunk by chunk; inside, the objects are
   rebuilt, `f` runs, and the state of the argument objects is split again;
3. outside, `flax.nnx.from_tree` merges the state that came back into the
   caller's objects, so RNG counters, BatchNorm statistics and `nnx.Variable` writes
   made inside propagate exactly as with `nnx.vmap`.

Only state that `f` changed crosses the chunk loop: the parameters of a shared model
are read in place and never copied through it.
"""

from __future__ import annotations

import functools as ft
import inspect
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, Unpack, overload


try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "chunkvmap.nnx needs Flax: install it with `pip install chunkvmap[flax]` "
        "(or `pip install flax`)."
    ) from e
import jax

from ._adapters._flax import clear_non_graph_nodes, is_graph_node
from ._adapters._stateful import stateful_map
from ._core import _axes, _cache, _memory
from ._core._options import VmapChunking, check_callable, decorator_form, takes
from ._transforms._batch_vmap import Transform, check_outputs


F = TypeVar("F", bound=Callable[..., Any])

_NAME = "chunkvmap.nnx.batch_vmap"
_TAG = "chunkvmap.nnx.batch_vmap"  # the NNX update context of this transform
_MISSING = object()


# --------------------------------------------------------------------------------------
# Axis specs: ints and None as in jax.vmap, plus nnx.StateAxes for graph nodes.


def _is_spec_leaf(x: Any) -> bool:
    return _axes.is_none(x) or isinstance(x, nnx.StateAxes)


def _check_spec(name: str, spec: Any) -> Any:
    if name == "in_axes" and isinstance(spec, list):  # as jax.vmap
        spec = tuple(spec)
    if name == "in_axes" and not (
        _axes.is_axis(spec) or isinstance(spec, (tuple, nnx.StateAxes))
    ):
        raise TypeError(
            f"{_NAME} in_axes must be an int, None, nnx.StateAxes, or a tuple with "
            f"one entry per positional argument, but got in_axes={spec!r} of type "
            f"{type(spec).__name__}."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[
        0
    ]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, nnx.StateAxes):
            bad = [a for a in leaf.axes if not _axes.is_axis(a)]
            if bad:
                raise TypeError(
                    f"{_NAME} {where} is {leaf!r}: its axes must be ints or None, "
                    f"but it contains {bad[0]!r} (nnx.Carry is for nnx.scan)."
                )
        elif not _axes.is_axis(leaf):
            raise TypeError(
                f"{_NAME} {name} must be an int, None, nnx.StateAxes, or a pytree "
                f"prefix of those, but {where} is {leaf!r} of type "
                f"{type(leaf).__name__}."
            )
    return spec


def _jax_axes(spec: Any) -> Any:
    """The spec with every `StateAxes` as the prefix of the `NodeStates` it covers."""
    return jax.tree.map(
        lambda x: (
            nnx.NodeStates.from_prefixes(x.axes, metadata=x)
            if isinstance(x, nnx.StateAxes)
            else x
        ),
        spec,
        is_leaf=_is_spec_leaf,
    )


def _split(ctx: Any, path: Any, prefix: Any, x: Any) -> Any:
    """Split a graph node into its state, one substate per filter of `prefix`."""
    if isinstance(prefix, nnx.StateAxes):
        return nnx.NodeStates.from_split(
            *ctx.split(x, *prefix.filters), metadata=prefix
        )
    return nnx.NodeStates.from_split(*ctx.split(x), metadata=prefix)


# --------------------------------------------------------------------------------------
# State that f did not change is not returned through the chunk loop.


class _Unchanged:
    """Marks, in the returned state, a leaf that is the argument's own leaf."""


jax.tree_util.register_pytree_node(
    _Unchanged, lambda _: ((), None), lambda _, __: _Unchanged()
)


def _is_unchanged(x: Any) -> bool:
    return isinstance(x, _Unchanged)


def _by_path(tree: Any) -> dict[Any, Any]:
    return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


def _drop_unchanged(state_out: Any, state_in: Any) -> Any:
    """Replace every leaf of `state_out` that is `state_in`'s leaf at the same path
    (a Variable `f` did not write) by a marker."""
    inputs = _by_path(state_in)
    return jax.tree_util.tree_map_with_path(
        lambda p, leaf: _Unchanged() if inputs.get(p, _MISSING) is leaf else leaf,
        state_out,
    )


def _fill_unchanged(state_out: Any, state_in: Any) -> Any:
    inputs = _by_path(state_in)
    return jax.tree_util.tree_map_with_path(
        lambda p, leaf: inputs[p] if _is_unchanged(leaf) else leaf,
        state_out,
        is_leaf=_is_unchanged,
    )


# --------------------------------------------------------------------------------------
# Call-time checks: keyword arguments, reduced outputs.


def _resolve_kwargs(f: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """Keyword arguments bound to their positions, as `nnx.vmap` does."""
    if not kwargs:
        return args
    try:
        bound = inspect.signature(f).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{_NAME}: keyword arguments {sorted(kwargs)} could not be bound to "
            f"parameters of {getattr(f, '__name__', f)!r}: {e}"
        ) from None
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(
            f"{_NAME} maps keyword arguments through the positions of their "
            f"parameters (as nnx.vmap), but {sorted(bound.kwargs)} are keyword-only "
            f"or collected by **kwargs; pass them positionally or bind them with "
            f"functools.partial."
        )
    return bound.args


def _check_prefix(arg: str, spec: Any, tree: Any, what: str) -> None:
    """`spec` (`in_axes` / `out_axes`) a prefix of `tree`, checked before NNX matches
    them (its error names neither this transform nor the argument)."""
    if _is_spec_leaf(spec):
        return
    if arg == "in_axes":
        _axes.check_arity(_NAME, spec, tree)
    _axes.split_by_prefix(arg, spec, tree, what, transform=_NAME)


def _check_no_graph_nodes(out: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: isinstance(x, nnx.NodeStates)
    )[0]:
        if isinstance(leaf, nnx.NodeStates):
            raise ValueError(
                f"{_NAME} with a reduction folds f's outputs, which must then be "
                f"arrays, but f returned a graph node (a Module, Rngs or Variable) at "
                f"out{jax.tree_util.keystr(path)}. Return arrays, or drop reduction."
            )


# --------------------------------------------------------------------------------------
# batch_vmap


@overload
def batch_vmap(
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_size: int | None = None,
    axis_name: Hashable | None = None,
    **options: Unpack[VmapChunking],
) -> Callable[[F], F]: ...


@overload
def batch_vmap(
    f: F,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_size: int | None = None,
    axis_name: Hashable | None = None,
    **options: Unpack[VmapChunking],
) -> F: ...


@decorator_form("f")
@takes(VmapChunking)
def batch_vmap(
    f: Callable[..., Any],
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_size: int | None = None,
    axis_name: Hashable | None = None,
    **options: Unpack[VmapChunking],
) -> Any:
    """`nnx.vmap`, evaluated `batch_size` examples at a time.

    Same calling conventions as `nnx.vmap` (in its default graph mode): `in_axes` and
    `out_axes` are ints, None, or pytree prefixes of the arguments / outputs, and graph
    nodes (Modules, `nnx.Rngs`, Variables) may be passed as arguments, mapped with an
    int, shared with None, or split by filter with `nnx.StateAxes` (e.g. parameters
    per ensemble member, RNG streams per example). Keyword arguments are bound to
    their parameters' positions and take those positions' axes, as in `nnx.vmap`.
    Usable as a decorator, with or without arguments.

    `f` runs on chunks of `batch_size` examples: a `jax.vmap` inside a `lax.scan`, so
    activation memory scales with `batch_size`, not with `N` (see
    `chunkvmap.batch_vmap` for the remainder, `remat` and `batch_size="auto"`). State
    updates made inside `f` (RNG counters, BatchNorm statistics, `nnx.Variable`
    writes) are merged back into the caller's objects as `nnx.vmap` merges them.
    Random keys are read from the state passed in (split beforehand with
    `nnx.split_rngs`, as for `nnx.vmap`), so draws do not depend on `batch_size`
    (with threefry keys, JAX's default: `rbg` keys draw differently in batches of
    different sizes, under `nnx.vmap` too).

    With `reduction`, `f`'s outputs (which must then be arrays) are folded chunk by
    chunk instead of stacked, e.g. a loss summed over the batch
    (`reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)`). If `f` also changes
    state, the new state is stacked per example beside them, in the same pass.

    Args:
      f: the function to vectorise; graph nodes among its arguments are handled as
        by `nnx.vmap`. Not a bound method of a Module (pass the Module as an
        argument instead).
      in_axes: an int, None, `nnx.StateAxes`, or a tuple with one entry per
        positional argument (pytree prefixes of those).
      out_axes: where the mapped axis goes in each output; `nnx.StateAxes` for
        graph nodes that `f` returns.
      axis_size: the mapped length, needed when no argument is mapped (e.g. creating
        an ensemble from split RNGs only is fine; from nothing mapped is not).
      axis_name: a name for collectives over the mapped axis (unchunked evaluation
        only, as in `chunkvmap.batch_vmap`).
      batch_size: examples per chunk: a positive int, None for one `jax.vmap` call,
        or `"auto"` to choose it from `memory_limit`.
      reduction: None (stack the outputs), or an associative binary function folding
        chunk summaries leaf by leaf (e.g. `jnp.add`).
      chunk_reduction: summarises one chunk's outputs along the mapped axis (with
        `reduction`), or post-processes the whole output (without it).
      shard: spread the examples over the devices of `mesh` first (see
        `chunkvmap.batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk for reverse mode (True, False or a
        `jax.checkpoint` policy).
      memory_limit: the budget for `batch_size="auto"`, e.g. `"1GiB"`.
      progress: a host progress bar over the chunks (see `chunkvmap.batch_vmap`);
        False by default.
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      The vectorised function (or, without `f`, a decorator).

    Raises:
      TypeError: for malformed `in_axes`/`out_axes` or chunking options, a bound
        method, or keyword arguments that have no position.
      ValueError: (when called) for mapped inputs of different lengths, specs that
        do not match the arguments, or graph nodes among the outputs of a reduced
        `f`.

    Examples:
      An ensemble of 7 linear layers created with split RNGs, applied 3 members at a
      time:

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from chunkvmap.nnx import batch_vmap
      >>> @nnx.split_rngs(splits=7)
      ... @batch_vmap(in_axes=(0,), batch_size=3)
      ... def create(rngs):
      ...     return nnx.Linear(4, 2, rngs=rngs)
      >>> ensemble = create(nnx.Rngs(0))
      >>> ensemble.kernel.shape
      (7, 4, 2)
      >>> forward = batch_vmap(lambda m, x: m(x), in_axes=(0, None), batch_size=3)
      >>> forward(ensemble, jnp.ones(4)).shape
      (7, 2)

      A shared model over a batch, with a summed loss:

      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
      >>> loss = batch_vmap(lambda m, x: (m(x) ** 2).sum(), in_axes=(None, 0),
      ...                   batch_size=4, reduction=jnp.add,
      ...                   chunk_reduction=lambda l: l.sum(0))
      >>> loss(model, jnp.ones((10, 3))).shape
      ()
    """
    check_callable(_NAME, "f", f)
    if inspect.ismethod(f) and is_graph_node(f.__self__):
        raise TypeError(
            f"{_NAME} does not take bound methods of graph nodes (as nnx.vmap): got "
            f"{f.__qualname__} bound to a {type(f.__self__).__name__}. Pass the "
            f"object as an argument: batch_vmap(lambda m, x: m.method(x), ...)."
        )
    in_axes = _check_spec("in_axes", in_axes)
    out_axes = _check_spec("out_axes", out_axes)
    transform = Transform.make(
        _NAME, axis_name=axis_name, axis_size=axis_size, **options
    )
    return _transform(f, in_axes, out_axes, transform)


def _transform(
    f: Callable[..., Any], in_axes: Any, out_axes: Any, transform: Transform
):
    """The batched `f`: graph nodes in the arguments split to pure trees (as
    `nnx.vmap` does), the pure function mapped by the core, state merged back."""
    reduction = transform.options.reduction
    jax_in_axes, jax_out_axes = _jax_axes(in_axes), _jax_axes(out_axes)

    @_cache.wraps(f)  # messages (the core's and JAX's) name the user's function
    def per_example(*pure_args: Any) -> tuple[Any, Any]:
        args = nnx.from_tree(pure_args, ctxtag=_TAG, is_inner=True)
        out = f(*args)
        _check_prefix("out_axes", out_axes, out, "function's output")
        args_out = clear_non_graph_nodes(args)
        pure_args_out, pure_out = nnx.to_tree(
            (args_out, out),
            prefix=(in_axes, out_axes),
            split_fn=_split,
            ctxtag=_TAG,
        )
        check_outputs(_NAME, f, pure_out)
        if reduction is not None:
            _check_no_graph_nodes(pure_out)
        return pure_out, _drop_unchanged(pure_args_out, pure_args)

    @ft.wraps(f)
    @nnx.update_context(_TAG)
    def batched(*args: Any, **kwargs: Any) -> Any:
        args = _resolve_kwargs(f, args, kwargs)
        _check_prefix("in_axes", in_axes, args, "positional arguments")
        pure_args = nnx.to_tree(args, prefix=in_axes, split_fn=_split, ctxtag=_TAG)
        pure_out, pure_args_out = stateful_map(
            transform, per_example, pure_args, jax_in_axes, jax_out_axes,
            jax_in_axes, state_root="args",
        )  # fmt: skip
        pure_args_out = _fill_unchanged(pure_args_out, pure_args)
        _, out = nnx.from_tree((pure_args_out, pure_out), ctxtag=_TAG, is_inner=False)
        return out

    return _memory.attach(batched, transform.auto)


__all__ = ["batch_vmap"]
