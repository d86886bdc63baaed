"""Per-example gradients in chunks: `per_example_grads` and `clipped_grad_sum`.

Both are the `batch_vmap` pipeline (`_batch_vmap.vmap_call`) over the gradient of one
example: `per_example_grads` stacks the gradients; `clipped_grad_sum` clips each
example's gradient inside its chunk and folds the chunks with a sum, so only
`batch_size` gradients ever exist at once (DP-SGD).

Parameters may be any pytree: leaves that are not floating-point arrays (integer
arrays, functions, strings, the static parts of an Equinox module) are not
differentiated and get `None` in the gradient, as with `equinox.filter_grad`.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _axes
from ._batch_vmap import Mapper
from ._options import ChunkOptions, check_bool, check_callable


# --------------------------------------------------------------------------------------
# Argument numbers.


def check_argnums(name: str, arg: str, argnums: Any) -> tuple[tuple[int, ...], bool]:
    """`argnums` as a tuple of ints, and whether it was a single int."""
    single = not isinstance(argnums, (tuple, list))
    values = (argnums,) if single else tuple(argnums)
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(
                f"{name} {arg} must be an int or a sequence of ints, but got "
                f"{arg}={argnums!r}."
            )
    if not values:
        raise ValueError(f"{name} {arg} must not be empty, but got {arg}={argnums!r}.")
    return tuple(operator.index(v) for v in values), single


def resolve_argnums(name: str, arg: str, argnums: Sequence[int], nargs: int):
    """Non-negative argument numbers, checked against the call's `nargs`."""
    resolved = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"{name} {arg}={a} is out of range for a call with {nargs} positional "
                f"argument(s): expected -{nargs} <= {arg} < {nargs}."
            )
        resolved.append(a % nargs)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"{name} {arg}={tuple(argnums)} repeats an argument.")
    return tuple(resolved)


# --------------------------------------------------------------------------------------
# Gradients of single examples, with non-differentiable leaves filtered out.


def _differentiable(x: Any) -> bool:
    """Floating-point arrays only (`equinox.is_inexact_array`): Python floats, such
    as a module's hyperparameters, are constants."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return False


def _filtered_grad(
    fun: Callable[..., Any], argnums: tuple[int, ...], single: bool, has_aux: bool
) -> Callable[..., Any]:
    """`jax.grad(fun, argnums, has_aux)` w.r.t. the floating-point leaves only.

    `argnums` are non-negative here. The gradient has the structure of the
    differentiated arguments, with None at every leaf that is not differentiated.
    """

    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        parts = []
        for i in argnums:
            leaves, treedef = jax.tree.flatten(args[i])
            mask = [_differentiable(x) for x in leaves]
            parts.append((leaves, treedef, mask))
        diff = [[x for x, m in zip(lv, mask) if m] for lv, _, mask in parts]

        def inner(diff: list[list[Any]]) -> Any:
            new_args = list(args)
            for i, (leaves, treedef, mask), values in zip(argnums, parts, diff):
                it = iter(values)
                full = [next(it) if m else x for x, m in zip(leaves, mask)]
                new_args[i] = jax.tree.unflatten(treedef, full)
            return fun(*new_args, **kwargs)

        out = jax.grad(inner, has_aux=has_aux)(diff)
        grads, aux = out if has_aux else (out, None)
        trees = []
        for (leaves, treedef, mask), g in zip(parts, grads):
            it = iter(g)
            trees.append(
                jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])
            )
        result = trees[0] if single else tuple(trees)
        return (result, aux) if has_aux else result

    return grad_fn


class _GradSetup:
    """The checked arguments shared by `per_example_grads` and `clipped_grad_sum`."""

    def __init__(
        self, name: str, fun: Any, argnums: Any, batch_argnums: Any, **options: Any
    ):
        check_callable(name, "fun", fun)
        self.name = name
        self.argnums, self.single = check_argnums(name, "argnums", argnums)
        self.warned = False
        self.batch_argnums = (
            None
            if batch_argnums is None
            else check_argnums(name, "batch_argnums", batch_argnums)[0]
        )
        self.mapper = Mapper(ChunkOptions.make(name, **options))

    def resolve(self, args: tuple) -> tuple[tuple[int, ...], tuple]:
        """The differentiated argument numbers and the `in_axes` of a call."""
        nargs = len(args)
        diff = resolve_argnums(self.name, "argnums", self.argnums, nargs)
        for i in diff:  # a bare non-float array: an error, as with jax.grad
            x = args[i]
            if isinstance(x, (jax.Array, np.ndarray, np.generic, int)):
                dtype = jnp.result_type(x)
                if not jnp.issubdtype(dtype, jnp.inexact):
                    raise TypeError(
                        f"{self.name} differentiates args[{i}] (argnums), which "
                        f"has dtype {dtype.name}: like jax.grad it needs real- or "
                        f"complex-valued inputs. Pass a float array, or leave "
                        f"args[{i}] out of argnums. (Inside a pytree argument, "
                        f"non-float leaves are simply not differentiated.)"
                    )
        if self.batch_argnums is None:  # every argument not differentiated
            mapped = tuple(i for i in range(nargs) if i not in diff)
        else:
            mapped = resolve_argnums(
                self.name, "batch_argnums", self.batch_argnums, nargs
            )
            self._warn_if_ambiguous(args, diff, mapped)
        return diff, tuple(0 if i in mapped else None for i in range(nargs))

    def _warn_if_ambiguous(self, args: tuple, diff: tuple, mapped: tuple) -> None:
        """Warn (once per transform) when an argument left out of `batch_argnums`
        looks like one value per example: a leading axis of the examples' size."""
        if self.warned:
            return
        sizes = {
            np.shape(x)[0]
            for i in mapped
            for x in jax.tree.leaves(args[i])
            if np.ndim(x) > 0
        }
        if len(sizes) != 1 or (n := sizes.pop()) <= 1:
            return
        shared = [
            i
            for i, a in enumerate(args)
            if i not in mapped
            and i not in diff
            and any(np.ndim(x) > 0 and np.shape(x)[0] == n for x in jax.tree.leaves(a))
        ]
        if shared:
            self.warned = True
            suggest = tuple(sorted({*mapped, *shared}))
            warnings.warn(
                f"{self.name} passes {', '.join(f'args[{i}]' for i in shared)} "
                f"whole to every example (it is not in batch_argnums="
                f"{self.batch_argnums!r}), but its leading axis has the size of the "
                f"examples' axis, {n}. If it holds one value per example, map it: "
                f"batch_argnums={suggest} (or leave batch_argnums out: every argument "
                f"that is not differentiated is then mapped). Warned once.",
                stacklevel=4,
            )

    def map(self, fn: Any, args: tuple, kwargs: dict, in_axes: tuple, **options: Any):
        """`fn(*args, **kwargs)` mapped over `in_axes` (keyword arguments over their
        leading axis, as in `jax.vmap`), with the transform's options (changed by
        `options`)."""
        opts = self.mapper.options.replace(**options) if options else None
        return self.mapper(fn, args, kwargs, in_axes, 0, opts)


def per_example_grads(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    batch_size: int | str | None = None,
    shard: bool | str | tuple[str, ...] = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
    chunk_size: int | str | None = None,
) -> Callable[..., Any]:
    """Per-example gradients, `batch_size` examples at a time.

    `per_example_grads(fun, argnums, batch_argnums=b)(*args, **kwargs)` equals
    `jax.vmap(jax.grad(fun, argnums), in_axes)(*args, **kwargs)` where `in_axes` maps
    the arguments in `batch_argnums` over their leading axis and broadcasts the
    others. By default (`batch_argnums=None`) every positional argument that is not
    differentiated is mapped: `loss(params, x, y)` gets one `(x, y)` pair per
    example. Keyword arguments are mapped over their leading axis, as `jax.vmap`
    maps them (pass values shared by every example positionally, outside
    `batch_argnums`). `fun` is the loss of a single example, and the result
    holds one gradient per example along a new leading axis. The examples are
    evaluated in chunks of `batch_size` (see `chunkvmap.batch_vmap`), so the working
    memory is that of `batch_size` gradients plus the `N` stacked results.

    Only floating-point arrays are differentiated; any other leaf of a differentiated
    argument (integer arrays, Python floats such as hyperparameters, functions, an
    Equinox module's static parts) gets None in the gradient, as with
    `equinox.filter_grad`, so Equinox modules and Flax variable dicts work as
    parameters directly.

    Args:
      fun: the per-example function; it must return a scalar (or `(scalar, aux)` with
        `has_aux`).
      argnums: which positional argument(s) to differentiate: an int or a sequence of
        ints (negative counts from the end).
      has_aux: `fun` returns `(loss, aux)`; the per-example `aux` is returned too.
      batch_argnums: which positional argument(s) hold the examples along their
        leading axis; the others are passed to every example unchanged. None (the
        default): every positional argument not in `argnums`.
      batch_size: examples per chunk (None: one `jax.vmap`; `"auto"`: from
        `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      A function of `fun`'s arguments returning the stacked per-example gradients
      (with the structure of the argument, or a tuple of them for a sequence
      `argnums`), and with `has_aux` a pair `(grads, aux)`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grads
      >>> def loss(w, x):
      ...     return 0.5 * jnp.sum((w * x) ** 2)
      >>> x = jnp.arange(6.0).reshape(3, 2)
      >>> per_example_grads(loss, batch_size=2)(jnp.ones(2), x)
      Array([[ 0.,  1.],
             [ 4.,  9.],
             [16., 25.]], dtype=float32)
    """
    name = "per_example_grads"
    check_bool(name, "has_aux", has_aux)
    setup = _GradSetup(
        name,
        fun,
        argnums,
        batch_argnums,
        batch_size=batch_size,
        chunk_size=chunk_size,
        shard=shard,
        mesh=mesh,
        remat=remat,
        memory_limit=memory_limit,
        progress=progress,
    )

    def call(args: tuple, kwargs: dict) -> Any:
        diff, in_axes = setup.resolve(args)
        grad_fn = _filtered_grad(fun, diff, setup.single, has_aux)
        return setup.map(grad_fn, args, kwargs, in_axes)

    return setup.mapper.transform(call, fun)


# --------------------------------------------------------------------------------------
# Clipped per-example gradient sums (DP-SGD).


def _global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves together, accumulated in at least float32.

    Zero-safe under differentiation too: the square root is only taken of positive
    values, so a zero gradient gives norm 0 and finite derivatives. A gradient with a
    NaN has a NaN norm.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    # float32, or float64 when a leaf has double precision (real or complex).
    wide = any(jnp.finfo(x.dtype).dtype.itemsize > 4 for x in leaves)
    acc = jnp.float64 if wide else jnp.float32
    total = sum(jnp.sum(jnp.square(jnp.abs(x).astype(acc))) for x in leaves)
    positive = total > 0
    norm = jnp.where(positive, jnp.sqrt(jnp.where(positive, total, 1)), 0)
    # A NaN gradient has a NaN norm (so it is never summed unclipped as if its norm
    # were 0): the clipped sum is then NaN, as the unchunked reference gives.
    return jnp.where(jnp.isnan(total), total, norm)


def _clip(tree: Any, l2_clip_norm: Any) -> tuple[Any, jax.Array]:
    """`tree` scaled to global norm at most `l2_clip_norm`, and its original norm."""
    norm = _global_norm(tree)
    clip = jnp.asarray(l2_clip_norm, norm.dtype)
    scale = clip / jnp.maximum(norm, clip)  # 1 when norm <= clip; no 0/0 at norm 0
    return jax.tree.map(lambda x: x * scale.astype(x.dtype), tree), norm


def _check_clip_norm(name: str, value: Any) -> None:
    try:
        number = float(np.asarray(value))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return  # a traced clip norm (e.g. a schedule): allowed, and not checkable
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} l2_clip_norm must be a positive number, but got "
            f"l2_clip_norm={value!r} of type {type(value).__name__}."
        ) from None
    if np.ndim(value) != 0 or not number > 0 or not np.isfinite(number):
        raise ValueError(
            f"{name} l2_clip_norm must be a positive, finite scalar, but got "
            f"l2_clip_norm={value!r}."
        )


def clipped_grad_sum(
    fun: Callable[..., Any],
    l2_clip_norm: Any,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    batch_size: int | str | None = None,
    return_norms: bool = False,
    shard: bool | str | tuple[str, ...] = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
    chunk_size: int | str | None = None,
) -> Callable[..., Any]:
    """The sum of per-example gradients, each clipped to L2 norm `l2_clip_norm`.

    This is the aggregation step of DP-SGD: for every example `i` the gradient `g_i` of
    `fun` is scaled by `min(1, l2_clip_norm / ||g_i||)` (the global L2 norm over all
    leaves of the differentiated arguments), and the clipped gradients are summed. It
    runs chunk by chunk: each chunk of `batch_size` examples computes, clips and sums
    its gradients, and the chunk sums are added up, so peak memory is
    O(`batch_size` x parameters), never O(N x parameters) as with
    `optax.contrib.differentially_private_aggregate` on stacked gradients. Unlike
    `optax.microbatching.micro_grad`, `N` need not be divisible by `batch_size`.

    Zero gradients are safe (their norm is 0 and they are left unscaled, with no 0/0),
    the sum keeps each parameter's dtype (norms are accumulated in at least float32),
    and, as in `per_example_grads`, only floating-point arrays are differentiated
    (other leaves get None), so Equinox modules and Flax variables work as
    parameters. Zero examples give zero sums and a count of 0 (a Poisson-sampled lot
    may be empty).

    Args:
      fun: the per-example loss, `fun(params, example, ...)` returning a scalar.
      l2_clip_norm: the clipping norm, a positive scalar (it may be traced).
      argnums: the argument(s) to differentiate (int or sequence of ints).
      batch_argnums: the argument(s) holding the examples along their leading axis;
        the others are passed to every example unchanged. None (the default): every
        positional argument not in `argnums`. Keyword arguments are mapped over
        their leading axis, as in `jax.vmap`.
      batch_size: examples per chunk (None: one `jax.vmap`; `"auto"`: from
        `memory_limit`).
      return_norms: also return the `N` unclipped per-example gradient norms.
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      A function of `fun`'s arguments returning `(grad_sum, count)` — the clipped sum
      (structured like the differentiated argument(s)) and the number of examples as an
      int32 scalar — or `(grad_sum, count, norms)` with `return_norms`, where `norms`
      has shape `(N,)`. For the DP-SGD update add Gaussian noise of standard deviation
      `noise_multiplier * l2_clip_norm` to `grad_sum` and divide by the lot size: the
      fixed lot size (`count`) with fixed-size lots, the *expected* lot size with
      Poisson sampling. A traced `l2_clip_norm` cannot be checked here; it must be
      positive.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import clipped_grad_sum
      >>> def loss(w, x):
      ...     return jnp.dot(w, x)  # the gradient of example x is x itself
      >>> x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])  # norms 5, 0.5, 0
      >>> total, count, norms = clipped_grad_sum(loss, 1.0, batch_size=2,
      ...                                        return_norms=True)(jnp.ones(2), x)
      >>> total, count, norms
      (Array([0.90000004, 1.2       ], dtype=float32), Array(3, dtype=int32),
       Array([5. , 0.5, 0. ], dtype=float32))
    """
    name = "clipped_grad_sum"
    _check_clip_norm(name, l2_clip_norm)
    check_bool(name, "return_norms", return_norms)
    setup = _GradSetup(
        name,
        fun,
        argnums,
        batch_argnums,
        batch_size=batch_size,
        chunk_size=chunk_size,
        shard=shard,
        mesh=mesh,
        remat=remat,
        memory_limit=memory_limit,
        progress=progress,
    )

    def call(args: tuple, kwargs: dict) -> Any:
        diff, in_axes = setup.resolve(args)
        size = _axes.mapped_size(
            *_mapped_leaves(name, args, in_axes, kwargs), None, transform=name
        )
        grad_fn = _filtered_grad(fun, diff, setup.single, False)
        count = jnp.asarray(size, jnp.int32)
        if size == 0:  # the empty sum: zeros (a Poisson-sampled lot may be empty)
            total = _zero_grads(grad_fn, kwargs, args, in_axes)
            if return_norms:
                return total, count, jnp.zeros(0, jnp.float32)
            return total, count

        def example(*inputs: Any, **kw: Any) -> Any:
            *example_args, index = inputs
            grads, norm = _clip(grad_fn(*example_args, **kw), l2_clip_norm)
            return grads, norm, index

        def summarise(chunk: Any) -> Any:
            grads, norms, index = chunk
            total = jax.tree.map(lambda g: g.sum(0), grads)
            if not return_norms:
                return total
            # The chunk's norms at their examples' positions: an N-vector of scalars
            # per chunk (O(N) work per chunk, negligible next to the chunk's
            # B x params gradients unless N exceeds B x params).
            return total, jnp.zeros(size, norms.dtype).at[index].set(norms)

        index = jnp.arange(size, dtype=jnp.int32)
        out = setup.map(
            example,
            (*args, index),
            kwargs,
            (*in_axes, 0),
            reduction=jnp.add,
            chunk_reduction=summarise,
        )
        if return_norms:
            total, norms = out
            return total, count, norms
        return out, count

    return setup.mapper.transform(call, fun)


def _zero_grads(grad_fn: Callable[..., Any], kwargs: dict, args: tuple, in_axes):
    """Zero gradients (None where not differentiated) for one abstract example."""
    mapped = [i for i, a in enumerate(in_axes) if a is not None]

    def one_example(examples: list, kw: dict) -> Any:
        full = list(args)
        for i, e in zip(mapped, examples):
            full[i] = e
        return grad_fn(*full, **kw)

    def example(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x))

    avals = [jax.tree.map(example, args[i]) for i in mapped]
    shapes = jax.eval_shape(one_example, avals, jax.tree.map(example, kwargs))
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _mapped_leaves(
    name: str, args: tuple, in_axes: tuple, kwargs: dict
) -> tuple[list[str], list, list]:
    """Key paths, leaves and axes of the mapped arguments (for the size check)."""
    paths, leaves, axes = [], [], []
    named = [(f"args[{i}]", a, x) for i, (a, x) in enumerate(zip(args, in_axes))]
    named += [(f"kwargs[{k!r}]", v, 0) for k, v in kwargs.items()]
    for root, arg, axis in named:
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            paths.append(root + jax.tree_util.keystr(path))
            leaves.append(leaf)
            axes.append(
                _axes.canonical_in_axis(
                    axis, leaf, paths[-1], transform=name, arg="batch_argnums"
                )
            )
    return paths, leaves, axes
