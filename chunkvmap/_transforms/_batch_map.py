"""`batch_map`: the front end for an already vectorised function of one pytree.

The same pipeline as `batch_vmap` without the `jax.vmap`: the leaves of `xs` are mapped
along axis 0, `fun` is traced once on a chunk to learn its outputs, and one chunk of it
is described as a `_loop.Body` for `_chunked.evaluate`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from .._core import (
    _axes,
    _cache,
    _chunked,
    _conv,
    _loop,
    _memory,
    _padding,
    _program,
)
from .._core._options import (
    ChunkOptions,
    MapChunking,
    check_bool,
    check_callable,
    identity,
    takes,
)
from ._batch_vmap import check_backend_dtypes, check_outputs


@takes(MapChunking)
def batch_map(
    fun: Callable[[Any], Any],
    xs: Any,
    /,
    batch_size: int | str | None = None,
    *,
    strip_dim0: bool = False,
    is_padding_example: Any = None,
    **options: Unpack[MapChunking],
) -> Any:
    """Apply an already-vectorised `fun` to `xs` in chunks of `batch_size`.

    `fun` receives whole chunks: a pytree like `xs` whose leaves hold `batch_size`
    consecutive examples along axis 0, and must return a pytree whose leaves have that
    same leading length. The result is `fun(xs)` evaluated piecewise, i.e. ::

        concatenate([fun(xs[i:i + batch_size]) for i in range(0, N, batch_size)])

    with the chunks written into one preallocated output. No `jax.vmap` is added, which
    makes it cheaper to compile than `batch_vmap` and free of vmap-of-control-flow and
    custom-derivative pitfalls. When `batch_size` does not divide `N`, the last chunk is
    the window of the last `batch_size` real examples (overlapping the previous chunk,
    whose results it keeps), so `fun` always sees chunks of one size and is traced
    once; `remat`, `progress` and `batch_size="auto"` / `memory_limit` work as in
    `batch_vmap`. Called eagerly, it compiles once per `fun`, options and structure and
    types of `xs` (the cache holds `fun` weakly).

    With `strip_dim0=True` (which needs `batch_size=1`) `fun` receives single examples
    (the leading axis removed) and its outputs get the axis back, as in `lax.map`.

    `reduction` / `chunk_reduction` work as in `batch_vmap`: `chunk_reduction`
    summarises one chunk's output along axis 0, `reduction` folds the summaries in
    order.

    `is_padding_example` marks `xs` as a padded buffer, as `batch_vmap`'s
    `padded=True` does: the rows of padding in `fun`'s outputs are zeros (stacked,
    and as `chunk_reduction` sees them), the real examples are evaluated first
    wherever the padding sits, and chunks of padding alone are skipped at run time,
    so one compiled program serves every number of real examples.

    Args:
      fun: a vectorised function of one pytree argument.
      xs: a pytree of arrays sharing their leading length `N`.
      batch_size: examples per chunk (positive int), None for a single call, or
        `"auto"` to choose it from `memory_limit`.
      reduction: None, or an associative binary function folding chunk summaries.
      chunk_reduction: summarises a chunk's output (with `reduction`), or
        post-processes the whole output (without it).
      strip_dim0: hand `fun` single examples; requires `batch_size=1`.
      is_padding_example: None, or a boolean (or 0/1 integer) vector with one entry
        per example, true for the padding of a padded buffer.
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"` (see `batch_vmap`).
      progress: a progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      `fun`'s outputs for all `N` examples, stacked along axis 0, or the reduced value.

    Raises:
      TypeError: for a non-callable argument, a non-integer `batch_size`, or `xs` with
        a leaf that is not an array.
      ValueError: for leaves of different leading lengths, scalar leaves, `strip_dim0`
        without `batch_size=1`, outputs without the chunk's leading axis, a
        `chunk_reduction` that keeps the mapped axis, or a reduction over zero examples.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_map
      >>> x = jnp.arange(10.0).reshape(5, 2)
      >>> batch_map(lambda c: c.sum(axis=1), x, batch_size=2)
      Array([ 1.,  5.,  9., 13., 17.], dtype=float32)
      >>> batch_map(lambda c: c.sum(axis=1), x, batch_size=2,
      ...           reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))
      Array(45., dtype=float32)
    """
    name = "batch_map"
    check_callable(name, "fun", fun)
    options = ChunkOptions.make(name, batch_size=batch_size, **options)
    check_bool(name, "strip_dim0", strip_dim0)
    if strip_dim0 and options.batch_size != 1:
        raise ValueError(
            f"{name} strip_dim0=True hands fun single examples, so it needs "
            f"{options.batch_arg}=1, but got {options.batch_str()}."
        )
    auto = _cache.auto_state_of(fun, name, options.memory_limit, options.auto)

    try:  # the cache below is keyed weakly by `fun`: its entry must not keep it
        fun_ref = weakref.ref(fun)
    except TypeError:  # not weak-referenceable: not cached either
        fun_ref = lambda: fun  # noqa: E731

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        return _map_call(fun_ref(), *args, options, strip_dim0, auto, known=known)

    placement = _cache.Placement(options.shard, options.mesh)
    run = _cache.memo(
        fun,
        (options, strip_dim0),
        lambda: _cache.EagerCache(call, placement=placement),
    )
    check_backend_dtypes(options.name, (xs,), {})
    return run((xs, is_padding_example), {})


def _map_call(
    fun: Callable[[Any], Any],
    xs: Any,
    flags: Any,
    options: ChunkOptions,
    strip_dim0: bool,
    auto: _memory.AutoBatch | None,
    *,
    known: _cache.Known,
) -> Any:
    name = options.name
    leaves, paths, treedef = _flatten_xs(name, xs)
    axes = [
        _axes.canonical_in_axis(0, x, p, transform=name, arg="xs")
        for x, p in zip(leaves, paths)
    ]
    size = _axes.mapped_size(paths, leaves, axes, None, transform=name)
    if size == 0 and options.reduction is not None:
        raise _chunked.zero_examples(name)  # before fun meets an empty chunk
    if strip_dim0:
        if size == 0 and options.reduction is None:
            return _empty(fun, leaves, treedef, options)
        fun = _strip_dim0(name, fun)
    padding = None
    if flags is not None:  # one more leaf, mapped: the padding's rows are zeros
        padding = len(leaves)
        leaves, paths = (
            [*leaves, _padding.check(name, flags, size)],
            [*paths, "is_padding_example"],
        )
        axes, fun, treedef = (
            [*axes, 0],
            _zeroing(fun),
            jax.tree.structure((treedef.unflatten([0] * padding), 0)),
        )
    key = (treedef, tuple(jax.typeof(x) for x in leaves))
    inputs = _axes.Inputs(
        leaves, paths, range(len(leaves)), size, key, known, padding=padding
    )
    lay = _chunked.layout(options, inputs, axes)
    # The first size an "auto" search measures, else the loop's chunk length.
    probe = min(size, 1) if options.auto else _chunked.chunk_length(options, size, lay)
    with _chunked.tracing(lay):
        body = _trace(fun, leaves, axes, treedef, probe, options)
    return _chunked.evaluate(body, inputs, options, auto, lay)


def _flatten_xs(name: str, xs: Any) -> tuple[list[Any], list[str], Any]:
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(xs)
    paths = ["xs" + jax.tree_util.keystr(p) for p, _ in path_leaves]
    leaves = []
    for p, (_, x) in zip(paths, path_leaves):
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{name} maps every leaf of xs over its leading axis, but {p} is not "
                f"an array: got a value of type {type(x).__name__}."
            )
        leaves.append(x if isinstance(x, jax.Array) else jnp.asarray(x))
    if not leaves:
        raise ValueError(f"{name} xs has no array leaves to map over: got xs={xs!r}.")
    return leaves, paths, treedef


def _strip_dim0(name: str, fun: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fun` of one example as a function of a chunk of one (as in `lax.map`), its
    output checked first (messages name `fun`, as does the chunk function)."""

    @_cache.wraps(fun)
    def chunk_fun(chunk: Any) -> Any:
        out = fun(jax.tree.map(lambda a: a[0], chunk))
        check_outputs(name, fun, out)
        return jax.tree.map(lambda y: jnp.expand_dims(y, 0), out)

    return chunk_fun


def _zeroing(fun: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fun` of `(xs, flags)`: its outputs' rows zeros where `flags` (a chunk of a
    padded buffer)."""

    @_cache.wraps(fun)
    def zeroed(chunk: Any) -> Any:
        xs, flags = chunk
        return _padding.zeroed(flags, fun(xs))

    return zeroed


def _empty(fun, leaves, treedef, options) -> Any:
    """`strip_dim0` with zero examples: the output types of one example, stacked 0
    times (`fun` of single examples cannot be called on an empty chunk)."""
    example = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves]

    def one(*example_leaves: Any) -> Any:
        out = fun(jax.tree.unflatten(treedef, example_leaves))
        check_outputs(options.name, fun, out)
        return out

    out = jax.eval_shape(one, *example)
    out = jax.tree.map(lambda a: _loop.zeros((0, *a.shape), a), out)
    chunk_reduction = options.chunk_reduction
    return out if chunk_reduction is identity else chunk_reduction(out)


def _trace(fun, leaves, axes, treedef, probe, options) -> _loop.Body:
    """`fun` traced once on a chunk; one chunk of it as a `_loop.Body`."""
    name = options.name
    out_box: list[Any] = []

    def fun_flat(*chunk_leaves):
        out = fun(jax.tree.unflatten(treedef, chunk_leaves))
        check_outputs(name, fun, out)
        out_leaves, out_tree = jax.tree.flatten(out)
        length = jnp.shape(chunk_leaves[0])[0]
        for p, y in zip(jax.tree_util.tree_flatten_with_path(out)[0], out_leaves):
            if jnp.ndim(y) == 0 or jnp.shape(y)[0] != length:
                raise ValueError(
                    f"{name} fun must return arrays whose leading axis is the chunk's "
                    f"{length} examples, but output out{jax.tree_util.keystr(p[0])} "
                    f"has shape {jnp.shape(y)} for a chunk of {length}."
                )
        out_box[:] = [out_tree]
        return out_leaves

    # Inlined where it is called: the arrays `fun` closes over are then constants
    # of the caller's program, which an eager call passes as arguments.
    fun_flat = jax.jit(fun_flat, inline=True)
    chunk_avals = [_axes.sized(x, 0, probe) for x in leaves]
    first, out_chunk_avals = _program.traced(fun_flat, chunk_avals)
    (out_tree,) = out_box
    out_avals = [_axes.per_example(a) for a in out_chunk_avals]
    # The loop evaluates the trace, the arrays it reads passed in (`Body.params`).
    retraced = _program.Retraced(
        _program.Trace.of(first),
        (probe, tuple(first.in_avals)),
        lambda length: fun_flat,
        lambda: out_tree,  # (`fun`'s structure does not depend on its context)
    )
    k = len(retraced.params)

    def chunk_fn(chunk_leaves: list[Any], length: int) -> Any:
        return retraced(chunk_leaves[:k], list(chunk_leaves[k:]), length)

    signature = _loop.Signature(out_tree, out_avals, [0] * len(out_avals))
    convolutions = _conv.has_convolution(first)
    return _chunked.body(
        options, None, chunk_fn, axes, signature, length=probe,
        convolutions=convolutions, traced=retraced,
    )  # fmt: skip
