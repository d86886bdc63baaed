"""Equinox adapter: `filter_batch_vmap`, a chunked drop-in for `eqx.filter_vmap`.

Equinox modules mix arrays with non-array leaves (activation functions, static
fields), which plain chunked maps cannot slice. `filter_batch_vmap` follows
`eqx.filter_vmap`'s conventions — `in_axes`/`out_axes` are pytree prefixes whose leaves
are ints, None, or callables such as `eqx.if_array(0)`; a dict keyed by parameter name;
non-array leaves pass through; non-array outputs come back unbatched — and hands the
array leaves, with one axis each, to `chunkvmap.batch_vmap`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any, Unpack, overload


try:
    import equinox as eqx
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "chunkvmap.eqx needs Equinox: install it with `pip install chunkvmap[equinox]` "
        "(or `pip install equinox`)."
    ) from e
import jax
import jax.numpy as jnp

from ._core import _axes, _cache
from ._core._axes import is_none
from ._core._options import (
    VmapChunking,
    check_callable,
    decorator_form,
    identity,
    takes,
)
from ._transforms._batch_vmap import Transform, function_name, out_paths


_NAME = "filter_batch_vmap"


class _Static:
    """A pytree node with no leaves that carries a Python value in its treedef."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and _same(self.value, other.value)

    def __hash__(self) -> int:
        return 0


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


jax.tree_util.register_pytree_node(
    _Static, lambda s: ((), s.value), lambda value, _: _Static(value)
)


def _check_spec(name: str, spec: Any) -> None:
    for leaf in jax.tree.leaves(spec, is_leaf=is_none):
        ok = leaf is None or callable(leaf)
        ok = ok or (isinstance(leaf, int) and not isinstance(leaf, bool))
        if not ok:
            raise TypeError(
                f"{_NAME} {name} must be a pytree prefix whose leaves are ints, None, "
                f"or callables such as eqx.if_array(0), but got {name}={spec!r} "
                f"containing {leaf!r} of type {type(leaf).__name__}."
            )


def _named_in_axes(fun: Callable[..., Any], in_axes: Any, args: tuple) -> Any:
    """A dict `in_axes` keyed by parameter name, as a tuple over the positional args."""
    if not isinstance(in_axes, dict):
        return in_axes
    remaining = dict(in_axes)
    names = list(inspect.signature(fun).parameters)
    axes = tuple(remaining.pop(n, eqx.if_array(0)) for n, _ in zip(names, args))
    if remaining:
        raise ValueError(
            f"{_NAME} in_axes names {sorted(remaining)}, which are not among the "
            f"parameters {names[: len(args)]} that received positional arguments."
        )
    return axes


def _resolve(tree: Any, spec: Any, what: str) -> Any:
    """Per-leaf axes (int or None) for `tree`, from a prefix whose leaves may be
    callables; an integer axis for a non-array leaf is an error."""

    def one(axis_spec, sub, path):
        def leaf_axis(p, leaf):
            axis = axis_spec(leaf) if callable(axis_spec) else axis_spec
            arraylike = eqx.is_array_like if what == "out_axes" else eqx.is_array
            if axis is not None and not arraylike(leaf):
                raise ValueError(
                    f"{_NAME} {what} gives {jax.tree_util.keystr(path + p)} (a "
                    f"{type(leaf).__name__}, not an array) the axis {axis}; only "
                    f"arrays can be mapped. Use eqx.if_array({axis}) or None for it."
                )
            return axis

        return jax.tree_util.tree_map_with_path(leaf_axis, sub)

    what_tree = "arguments" if what == "in_axes" else "output"
    prefix, leaves, subtrees = _axes.split_by_prefix(what, spec, tree, what_tree, _NAME)
    paths = [
        p for p, _ in jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_none)[0]
    ]
    resolved = [one(a, sub, p) for a, sub, p in zip(leaves, subtrees, paths)]
    return prefix.unflatten(resolved)


def _mapped_mask(axes: Any) -> Any:
    return jax.tree.map(lambda a: a is not None, axes, is_leaf=is_none)


@overload
def filter_batch_vmap(
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    axis_name: Hashable = None,
    axis_size: int | None = None,
    **options: Unpack[VmapChunking],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_batch_vmap(
    fun: Callable[..., Any],
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    axis_name: Hashable = None,
    axis_size: int | None = None,
    **options: Unpack[VmapChunking],
) -> Callable[..., Any]: ...


@decorator_form("fun")
@takes(VmapChunking)
def filter_batch_vmap(
    fun: Callable[..., Any],
    *,
    in_axes: Any = eqx.if_array(0),
    out_axes: Any = eqx.if_array(0),
    axis_name: Hashable = None,
    axis_size: int | None = None,
    **options: Unpack[VmapChunking],
) -> Any:
    """`eqx.filter_vmap`, evaluated `batch_size` examples at a time.

    Same calling conventions as `eqx.filter_vmap`: `in_axes` is a pytree prefix of the
    positional arguments (or a dict keyed by parameter name) whose leaves are ints,
    None, or callables of a leaf such as `eqx.if_array(0)`; non-array leaves are passed
    through unchanged; `out_axes` likewise for the output, and outputs whose axis
    resolves to None (non-arrays, with the default) come back unbatched. Usable as a
    decorator, with or without arguments. The chunking options are those of
    `chunkvmap.batch_vmap` (`batch_size`, `reduction`, `chunk_reduction`, `shard`,
    `mesh`, `remat`, `memory_limit`, `progress`); `reduction` and `chunk_reduction`
    see the function's output with its mapped arrays at their `out_axes`.

    Args:
      fun: the function to vectorise (positional arguments only, as in Equinox).
      in_axes: where each input is mapped (`eqx.if_array(0)` by default).
      out_axes: where each output's mapped axis goes (`eqx.if_array(0)` by default).
      axis_name: a name for collectives inside `fun` (unchunked evaluation only).
      axis_size: the mapped length when no input is mapped.
      batch_size: examples per chunk, None for a single call, or "auto".
      reduction: fold chunk summaries instead of stacking (see `batch_vmap`).
      chunk_reduction: summarises one chunk's output (see `batch_vmap`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      The vectorised function (or, without `fun`, a decorator).

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> from chunkvmap.eqx import filter_batch_vmap
      >>> keys = jax.random.split(jax.random.key(0), 7)
      >>> models = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 2, key=k))(keys)
      >>> out = filter_batch_vmap(lambda m, x: m(x), in_axes=(eqx.if_array(0), None),
      ...                         batch_size=3)(models, jnp.ones(3))
      >>> out.shape
      (7, 2)
    """
    check_callable(_NAME, "fun", fun)
    if not isinstance(in_axes, dict):
        _check_spec("in_axes", in_axes)
    else:
        _check_spec("in_axes", tuple(in_axes.values()))
    _check_spec("out_axes", out_axes)
    transform = Transform.make(
        _NAME,
        axis_name=axis_name,
        axis_size=axis_size,
        **options,
    )
    wrapper = eqx.module_update_wrapper(
        _BatchVmapWrapper(fun, in_axes, out_axes, transform, function_name(fun))
    )
    return wrapper


def _run(
    transform: Transform, fun_name: str, out_axes: Any, dyn_axes: Any
) -> Callable[[tuple, dict], Any]:
    """The chunked evaluation of `_inner` for one output spec and input layout
    (through an eager cache that `transform` keeps); messages name the user's
    function `fun_name`."""
    key = (_axes.spec_key(out_axes), _axes.spec_key(dyn_axes))
    return transform.cache_for(
        key, lambda: _call(transform, fun_name, out_axes, dyn_axes)
    )


def _call(
    transform: Transform, fun_name: str, out_axes: Any, dyn_axes: Any
) -> _cache.Call:
    """`_run`'s call: `_inner` mapped by the core."""
    options = transform.options
    core = options
    if options.reduction is not None:
        chunk_reduction = options.chunk_reduction

        def core_reduce(triple):
            return chunk_reduction(_user_output(triple))

        core = options.replace(chunk_reduction=core_reduce)
    elif options.chunk_reduction is not identity:
        core = options.replace(chunk_reduction=identity)  # applied after

    def inner(fun_parts: Any, dyn: Any, static: Any) -> Any:
        return _inner(fun_parts, dyn, static, out_axes)

    # Messages (the core's and JAX's) name the user's function.
    inner.__name__ = inner.__qualname__ = fun_name

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        in_axes = (None, dyn_axes, None)
        # Messages name the user's arguments: `args` is (fun, dynamic, static),
        # and outputs: `_inner` returns (mapped, unmapped arrays, static).
        names = ("fun", "args", "args")
        return transform.map(
            inner,
            args,
            kwargs,
            in_axes,
            _core_out_axes,
            options=core,
            arg_names=names,
            out_names=_user_out_names,
            known=known,
        )

    return call


def _core_out_axes(triple: Any) -> Any:
    """The core's `out_axes` for `_inner`'s output: each mapped array at the axis its
    `out_axes` entry resolved to (so no transpose is needed afterwards)."""
    mapped, _, static = triple
    _, axes = static.value
    flat = [a for a in jax.tree.leaves(axes, is_leaf=is_none) if a is not None]
    return (jax.tree.structure(mapped).unflatten(flat), None, None)


def _user_out_names(triple: Any) -> list[str]:
    """The user's name of each leaf of `_inner`'s output: its mapped and unmapped
    arrays are the user's output, partitioned (same structure, same paths)."""
    mapped, unmapped_arrays, _ = triple
    return out_paths(mapped) + out_paths(unmapped_arrays)


def _user_output(triple: Any) -> Any:
    mapped, unmapped_arrays, static = triple
    unmapped_static, _ = static.value
    return eqx.combine(mapped, unmapped_arrays, unmapped_static)


def _inner(fun_parts: Any, dyn: Any, static: Any, out_axes: Any) -> Any:
    """The per-example function handed to `batch_vmap`: every varying value (the
    function's own arrays and non-array parts, the mapped and unmapped array arguments,
    the non-array arguments) is an argument, so one `batch_vmap` serves every call."""
    fun_static, fun_dyn = fun_parts
    fun = eqx.combine(fun_dyn, fun_static.value)
    out = fun(*eqx.combine(dyn, static))
    out_ax = _resolve(out, out_axes, "out_axes")
    out = jax.tree.map(
        lambda leaf, a: jnp.asarray(leaf) if a is not None else leaf, out, out_ax
    )
    mapped, unmapped = eqx.partition(out, _mapped_mask(out_ax))
    unmapped_arrays, unmapped_static = eqx.partition(unmapped, eqx.is_array)
    return mapped, unmapped_arrays, _Static((unmapped_static, out_ax))


class _BatchVmapWrapper(eqx.Module):
    """The function returned by `filter_batch_vmap`: a Module (like Equinox's own
    wrapper) so that a wrapped model's arrays stay leaves of the wrapper."""

    _fun: Callable[..., Any]
    _in_axes: Any
    _out_axes: Any
    _transform: Transform = eqx.field(static=True)
    _fun_name: str = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    @property
    def __chunkvmap_auto__(self) -> Any:  # its chunk-size state, for last_batch_size
        return self._transform.auto

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise RuntimeError(
                f"keyword arguments cannot be used with functions wrapped with "
                f"{_NAME} (as with eqx.filter_vmap); got {sorted(kwargs)}."
            )
        transform = self._transform
        axes = _resolve(args, _named_in_axes(self._fun, self._in_axes, args), "in_axes")
        dynamic, static = eqx.partition(args, eqx.is_array)
        dyn_axes = jax.tree.map(
            lambda a, x: a if eqx.is_array(x) else None, axes, args, is_leaf=is_none
        )
        fun_dyn, fun_static = eqx.partition(self._fun, eqx.is_array)
        fun = _Static(fun_static)
        if transform.axis_size is None and not any(
            a is not None for a in jax.tree.leaves(dyn_axes, is_leaf=is_none)
        ):
            # Nothing is mapped: call once, as eqx.filter_vmap does, and insist that no
            # output would need a batch axis.
            triple = _inner((fun, fun_dyn), dynamic, static, self._out_axes)
            if jax.tree.leaves(triple[0]):
                raise ValueError(
                    f"{_NAME} cannot resolve the batch dimension: no input is mapped "
                    f"and axis_size is None, but some outputs have a non-None "
                    f"out_axes. Map an input or give axis_size."
                )
            return _user_output(triple)
        run = _run(transform, self._fun_name, self._out_axes, dyn_axes)
        result = run(((fun, fun_dyn), dynamic, static), {})
        options = transform.options
        if options.reduction is not None:
            return result
        out = _user_output(result)
        chunk_reduction = options.chunk_reduction
        return out if chunk_reduction is identity else chunk_reduction(out)

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)


__all__ = ["filter_batch_vmap"]
