"""Derivatives in chunks: per-example gradients, clipped sums, Jacobians.

Everything here is a thin layer over `batch_vmap`:

* `per_example_grads` is `batch_vmap(grad(fun))` with the batch arguments mapped;
* `clipped_grad_sum` clips each example's gradient inside the chunk and folds the
  chunks with a sum, so only `batch_size` gradients ever exist at once (DP-SGD);
* `batch_jacfwd` / `batch_jacrev` linearise `fun` once (`jax.linearize` / `jax.vjp`)
  and push (pull) the standard basis through the linear map `batch_size` columns (rows)
  at a time, building each chunk's basis vectors from their indices, never the whole
  identity matrix.

Parameters may be any pytree: leaves that are not floating-point arrays (integer
arrays, functions, strings, the static parts of an Equinox module) are not
differentiated and get `None` in the gradient, as with `equinox.filter_grad`.
"""

from __future__ import annotations

import functools as ft
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _axes
from ._core import _AUTO_STATES, batch_vmap, chunk_options


# --------------------------------------------------------------------------------------
# Argument numbers.


def _check_argnums(name: str, arg: str, argnums: Any) -> tuple[tuple[int, ...], bool]:
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


def _resolve_argnums(name: str, arg: str, argnums: Sequence[int], nargs: int):
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
        if not callable(fun):
            raise TypeError(f"{name} fun must be callable, but got {fun!r}.")
        self.name = name
        self.argnums, self.single = _check_argnums(name, "argnums", argnums)
        self.batch_argnums, _ = _check_argnums(name, "batch_argnums", batch_argnums)
        self.options = chunk_options(**options)

    def resolve(self, nargs: int) -> tuple[tuple[int, ...], tuple]:
        """The differentiated argument numbers and the `in_axes` of a call."""
        diff = _resolve_argnums(self.name, "argnums", self.argnums, nargs)
        mapped = _resolve_argnums(self.name, "batch_argnums", self.batch_argnums, nargs)
        return diff, tuple(0 if i in mapped else None for i in range(nargs))


def per_example_grads(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] = 1,
    batch_size: int | str | None = None,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
) -> Callable[..., Any]:
    """Per-example gradients, `batch_size` examples at a time.

    `per_example_grads(fun, argnums, batch_argnums=b)(*args, **kwargs)` equals
    `jax.vmap(jax.grad(ft.partial(fun, **kwargs), argnums), in_axes)(*args)` where
    `in_axes` maps the arguments in `batch_argnums` over their leading axis and
    broadcasts the others (keyword arguments are broadcast, not mapped):
    `fun` is the loss of a single example (e.g. `fun(params, example)`), and the result
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
        leading axis. Keyword arguments are passed to every example unchanged.
      batch_size: examples per chunk (None: one `jax.vmap`; `"auto"`: from
        `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: a one-dimensional `Auto` mesh, with `shard=True`.
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).

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
    if not isinstance(has_aux, bool):
        raise TypeError(f"{name} has_aux must be a bool, but got has_aux={has_aux!r}.")
    setup = _GradSetup(
        name,
        fun,
        argnums,
        batch_argnums,
        batch_size=batch_size,
        shard=shard,
        mesh=mesh,
        remat=remat,
        memory_limit=memory_limit,
        progress=progress,
    )
    single, options = setup.single, setup.options
    cache: dict[Any, Callable[..., Any]] = {}

    @_wraps(fun)
    def grads(*args: Any, **kwargs: Any) -> Any:
        nargs = len(args)
        diff, in_axes = setup.resolve(nargs)

        def build() -> Callable[..., Any]:
            grad_fn = _filtered_grad(_kwargs_first(fun), _shift(diff), single, has_aux)
            return batch_vmap(grad_fn, (None, *in_axes), **options)

        run = _cached(cache, (nargs, diff, tuple(sorted(kwargs))), build, grads)
        return run(kwargs, *args)

    return grads


# --------------------------------------------------------------------------------------
# Clipped per-example gradient sums (DP-SGD).


def _global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves together, accumulated in at least float32.

    Zero-safe under differentiation too: the square root is only taken of positive
    values, so a zero gradient gives norm 0 and finite derivatives.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    # float32, or float64 when a leaf has double precision (real or complex).
    wide = any(jnp.finfo(x.dtype).dtype.itemsize > 4 for x in leaves)
    acc = jnp.float64 if wide else jnp.float32
    total = sum(jnp.sum(jnp.square(jnp.abs(x).astype(acc))) for x in leaves)
    positive = total > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, total, 1)), 0)


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
    batch_argnums: int | Sequence[int] = 1,
    batch_size: int | str | None = None,
    return_norms: bool = False,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
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
      batch_argnums: the argument(s) holding the examples along their leading axis.
        Keyword arguments are passed to every example unchanged.
      batch_size: examples per chunk (None: one `jax.vmap`; `"auto"`: from
        `memory_limit`).
      return_norms: also return the `N` unclipped per-example gradient norms.
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: a one-dimensional `Auto` mesh, with `shard=True`.
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).

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
    if not isinstance(return_norms, bool):
        raise TypeError(
            f"{name} return_norms must be a bool, but got "
            f"return_norms={return_norms!r}."
        )
    setup = _GradSetup(
        name,
        fun,
        argnums,
        batch_argnums,
        batch_size=batch_size,
        shard=shard,
        mesh=mesh,
        remat=remat,
        memory_limit=memory_limit,
        progress=progress,
    )
    single, options = setup.single, setup.options
    cache: dict[Any, Callable[..., Any]] = {}

    @_wraps(fun)
    def clipped(*args: Any, **kwargs: Any) -> Any:
        nargs = len(args)
        diff, in_axes = setup.resolve(nargs)
        size = _axes.mapped_size(
            *_mapped_leaves(name, args, in_axes), None, transform=name
        )
        grad_fn = _filtered_grad(_kwargs_first(fun), _shift(diff), single, False)
        count = jnp.asarray(size, jnp.int32)
        if size == 0:  # the empty sum: zeros (a Poisson-sampled lot may be empty)
            total = _zero_grads(grad_fn, kwargs, args, in_axes)
            if return_norms:
                return total, count, jnp.zeros(0, jnp.float32)
            return total, count

        def build() -> Callable[..., Any]:
            def example(kw: Any, *inputs: Any) -> Any:
                *example_args, index = inputs
                grads, norm = _clip(grad_fn(kw, *example_args), l2_clip_norm)
                return grads, norm, index

            def summarise(chunk: Any) -> Any:
                grads, norms, index = chunk
                total = jax.tree.map(lambda g: g.sum(0), grads)
                if not return_norms:
                    return total
                # The chunk's norms at their examples' positions: an N-vector of
                # scalars per chunk (O(N) work per chunk, negligible next to the
                # chunk's B x params gradients unless N exceeds B x params).
                return total, jnp.zeros(size, norms.dtype).at[index].set(norms)

            return batch_vmap(
                example,
                (None, *in_axes, 0),
                reduction=jnp.add,
                chunk_reduction=summarise,
                **options,
            )

        key = (nargs, diff, tuple(sorted(kwargs)), size if return_norms else None)
        run = _cached(cache, key, build, clipped)
        out = run(kwargs, *args, jnp.arange(size, dtype=jnp.int32))
        if return_norms:
            total, norms = out
            return total, count, norms
        return out, count

    return clipped


def _zero_grads(grad_fn: Callable[..., Any], kwargs: dict, args: tuple, in_axes):
    """Zero gradients (None where not differentiated) for one abstract example."""
    mapped = [i for i, a in enumerate(in_axes) if a is not None]

    def one_example(*examples: Any) -> Any:
        full = list(args)
        for i, e in zip(mapped, examples):
            full[i] = e
        return grad_fn(kwargs, *full)

    avals = [
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), args[i])
        for i in mapped
    ]
    shapes = jax.eval_shape(one_example, *avals)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _shift(argnums: tuple[int, ...]) -> tuple[int, ...]:
    """Argument numbers of `_kwargs_first(fun)`: one further right."""
    return tuple(i + 1 for i in argnums)


def _kwargs_first(fun: Callable[..., Any]) -> Callable[..., Any]:
    """`fun` taking its keyword arguments as a dict in front of the positional ones,
    so that they travel to every example as one unmapped argument."""

    def call(kwargs: dict[str, Any], *args: Any) -> Any:
        return fun(*args, **kwargs)

    return call


def _cached(cache: dict, key: Any, build: Callable[[], Any], owner: Any) -> Any:
    """The chunked function for `key`, built once, so that `batch_size="auto"`
    measures once per argument shapes and `last_batch_size(owner)` sees its choice."""
    if key not in cache:
        cache[key] = build()
    run = cache[key]
    state = _AUTO_STATES.get(run)
    if state is not None:
        _AUTO_STATES[owner] = state
    return run


def _wraps(fun: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """`functools.wraps` without copying `fun.__dict__` (a Module's fields)."""
    return ft.wraps(fun, updated=())


def _mapped_leaves(
    name: str, args: tuple, in_axes: tuple
) -> tuple[list[str], list, list]:
    """Key paths, leaves and axes of the mapped arguments (for the size check)."""
    paths, leaves, axes = [], [], []
    for i, (arg, axis) in enumerate(zip(args, in_axes)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            paths.append(f"args[{i}]" + jax.tree_util.keystr(path))
            leaves.append(leaf)
            axes.append(
                _axes.canonical_in_axis(
                    axis, leaf, paths[-1], transform=name, arg="batch_argnums"
                )
            )
    return paths, leaves, axes


# --------------------------------------------------------------------------------------
# Jacobians in chunks of basis vectors.


def _jac_setup(
    name: str, argnums: Any, has_aux: Any, holomorphic: Any, batch_size: Any
) -> tuple[tuple[int, ...], bool]:
    argnums_t, single = _check_argnums(name, "argnums", argnums)
    for arg, value in (("has_aux", has_aux), ("holomorphic", holomorphic)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} {arg} must be a bool, but got {arg}={value!r}.")
    _axes.check_positive_int("batch_size", batch_size, transform=name)
    return argnums_t, single


def _dyn_args(name: str, argnums_t: tuple[int, ...], single: bool, args: tuple):
    """The differentiated arguments (one, or a tuple) and a function of them."""
    argnums = _resolve_argnums(name, "argnums", argnums_t, len(args))
    dyn = args[argnums[0]] if single else tuple(args[i] for i in argnums)

    def with_dyn(fun: Callable[..., Any], kwargs: dict[str, Any]):
        def f(dyn_value: Any) -> Any:
            new = list(args)
            values = (dyn_value,) if single else dyn_value
            for i, v in zip(argnums, values):
                new[i] = v
            return fun(*new, **kwargs)

        return f

    return dyn, with_dyn


def _basis(leaves: Sequence[Any], index: jax.Array, dtypes: Sequence[Any]) -> list:
    """The `index`-th standard basis vector of the flattened `leaves` (one example)."""
    out, offset = [], 0
    for x, dtype in zip(leaves, dtypes):
        size = int(np.size(x))
        hot = jnp.arange(size) == index - offset
        out.append(hot.astype(dtype).reshape(np.shape(x)))
        offset += size
    return out


def _split(column: jax.Array, axis: int, leaves: Sequence[Any], outer: tuple) -> list:
    """Cut the basis axis of `column` into one block per leaf, shaped `outer + leaf`."""
    blocks, offset = [], 0
    for x in leaves:
        size = int(np.size(x))
        block = jax.lax.slice_in_dim(column, offset, offset + size, axis=axis)
        blocks.append(block.reshape(*outer, *np.shape(x)))
        offset += size
    return blocks


def _check_dtypes(name: str, what: str, leaves: Sequence[Any], holomorphic: bool):
    for x in leaves:
        dtype = jnp.result_type(x)
        if holomorphic:
            if not jnp.issubdtype(dtype, jnp.complexfloating):
                raise TypeError(
                    f"{name} with holomorphic=True requires complex-valued {what}s, "
                    f"but got {dtype.name}."
                )
        elif not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{name} requires real-valued {what}s (a floating dtype), but got "
                f"{dtype.name}. For holomorphic differentiation pass holomorphic=True; "
                f"for other complex or integer {what}s use jax.jvp / jax.vjp directly."
            )


def batch_jacfwd(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    *,
    batch_size: int | None = None,
) -> Callable[..., Any]:
    """`jax.jacfwd`, pushing `batch_size` basis vectors at a time.

    Same results and pytree structure as `jax.jacfwd(fun, argnums, has_aux,
    holomorphic)`: for each output leaf, a pytree like the differentiated argument(s)
    whose leaves have shape `output.shape + input.shape`. `fun` is linearised once
    (`jax.linearize`: one evaluation of `fun`), then the standard basis of the inputs is
    pushed through the linear map in chunks of `batch_size` columns with
    `chunkvmap.batch_vmap`; each chunk builds its own basis vectors from their indices,
    so the `n x n` identity is never formed and the working memory is that of
    `batch_size` tangents (plus the Jacobian itself). `batch_size=None` is one
    `jax.vmap` over all columns, like `jax.jacfwd`.

    Args:
      fun: the function to differentiate; keyword arguments are passed through.
      argnums: the positional argument(s) to differentiate (int or sequence of ints,
        negative counts from the end).
      has_aux: `fun` returns `(output, aux)`; `aux` is returned unchanged.
      holomorphic: `fun` is holomorphic (complex inputs and outputs).
      batch_size: basis columns per chunk, a positive int or None.

    Returns:
      A function with `fun`'s signature returning the Jacobian (and `aux`).

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_jacfwd
      >>> batch_jacfwd(lambda x: x ** 2, batch_size=2)(jnp.arange(3.0))
      Array([[0., 0., 0.],
             [0., 2., 0.],
             [0., 0., 4.]], dtype=float32)
    """
    name = "batch_jacfwd"
    if not callable(fun):
        raise TypeError(f"{name} fun must be callable, but got {fun!r}.")
    argnums_t, single = _jac_setup(name, argnums, has_aux, holomorphic, batch_size)

    @ft.wraps(fun)
    def jacobian(*args: Any, **kwargs: Any) -> Any:
        dyn, with_dyn = _dyn_args(name, argnums_t, single, args)
        in_leaves, in_tree = jax.tree.flatten(dyn)
        _check_dtypes(name, "input", in_leaves, holomorphic)
        lin = jax.linearize(with_dyn(fun, kwargs), dyn, has_aux=has_aux)
        out, push = lin[0], lin[1]
        dtypes = [jnp.result_type(x) for x in in_leaves]

        def column(index: jax.Array) -> Any:
            return push(in_tree.unflatten(_basis(in_leaves, index, dtypes)))

        n = sum(int(np.size(x)) for x in in_leaves)
        columns = batch_vmap(column, out_axes=-1, batch_size=batch_size)(
            jnp.arange(n, dtype=jnp.int32)
        )

        def block(c: jax.Array, y: Any) -> Any:
            if not jnp.issubdtype(jnp.result_type(y), jnp.inexact):
                # An integer output has no tangent: zeros of its dtype, as jax.jacfwd.
                return in_tree.unflatten(
                    [
                        jnp.zeros((*np.shape(y), *np.shape(x)), y.dtype)
                        for x in in_leaves
                    ]
                )
            return in_tree.unflatten(_split(c, -1, in_leaves, np.shape(y)))

        jac = jax.tree.map(block, columns, out)
        return (jac, lin[2]) if has_aux else jac

    return jacobian


def batch_jacrev(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    batch_size: int | None = None,
) -> Callable[..., Any]:
    """`jax.jacrev`, pulling back `batch_size` basis vectors at a time.

    Same results and pytree structure as `jax.jacrev(fun, argnums, has_aux,
    holomorphic, allow_int)`. `fun` is evaluated once under `jax.vjp`, then the
    standard basis of the outputs is pulled back through the VJP in chunks of
    `batch_size` rows with `chunkvmap.batch_vmap`, each chunk building its own
    cotangents from their indices (the identity is never formed).

    Args:
      fun: the function to differentiate; keyword arguments are passed through.
      argnums: the positional argument(s) to differentiate (int or sequence of ints,
        negative counts from the end).
      has_aux: `fun` returns `(output, aux)`; `aux` is returned unchanged.
      holomorphic: `fun` is holomorphic (complex inputs and outputs).
      allow_int: allow integer inputs; their Jacobian blocks are zeros of their
        dtype, as in `jax.jacrev`.
      batch_size: basis rows per chunk, a positive int or None.

    Returns:
      A function with `fun`'s signature returning the Jacobian (and `aux`).

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_jacrev
      >>> batch_jacrev(lambda x: jnp.cumsum(x), batch_size=2)(jnp.ones(3))
      Array([[1., 0., 0.],
             [1., 1., 0.],
             [1., 1., 1.]], dtype=float32)
    """
    name = "batch_jacrev"
    if not callable(fun):
        raise TypeError(f"{name} fun must be callable, but got {fun!r}.")
    argnums_t, single = _jac_setup(name, argnums, has_aux, holomorphic, batch_size)
    if not isinstance(allow_int, bool):
        raise TypeError(
            f"{name} allow_int must be a bool, but got allow_int={allow_int!r}."
        )

    @ft.wraps(fun)
    def jacobian(*args: Any, **kwargs: Any) -> Any:
        dyn, with_dyn = _dyn_args(name, argnums_t, single, args)
        in_leaves, in_tree = jax.tree.flatten(dyn)
        ints = [
            allow_int and jnp.issubdtype(jnp.result_type(x), jnp.integer)
            for x in in_leaves
        ]
        _check_dtypes(
            name, "input", [x for x, i in zip(in_leaves, ints) if not i], holomorphic
        )
        # Differentiate the floating leaves only; integer ones are held fixed.
        diff = [x for x, i in zip(in_leaves, ints) if not i]

        def f(diff_leaves: list[Any]) -> Any:
            it = iter(diff_leaves)
            full = [x if i else next(it) for x, i in zip(in_leaves, ints)]
            return with_dyn(fun, kwargs)(in_tree.unflatten(full))

        res = jax.vjp(f, diff, has_aux=has_aux)
        out, pull = res[0], res[1]
        out_leaves, out_tree = jax.tree.flatten(out)
        _check_dtypes(name, "output", out_leaves, holomorphic)
        dtypes = [jnp.result_type(y) for y in out_leaves]

        def row(index: jax.Array) -> Any:
            (cotangent,) = pull(out_tree.unflatten(_basis(out_leaves, index, dtypes)))
            return cotangent

        m = sum(int(np.size(y)) for y in out_leaves)
        rows = batch_vmap(row, batch_size=batch_size)(jnp.arange(m, dtype=jnp.int32))
        per_output = []
        for k, y in enumerate(out_leaves):
            lo = sum(int(np.size(z)) for z in out_leaves[:k])
            it = iter(rows)
            blocks = []
            for x, i in zip(in_leaves, ints):
                shape = (*np.shape(y), *np.shape(x))
                if i:
                    blocks.append(jnp.zeros(shape, jnp.result_type(x)))
                    continue
                block = jax.lax.slice_in_dim(next(it), lo, lo + int(np.size(y)))
                blocks.append(block.reshape(shape))
            per_output.append(in_tree.unflatten(blocks))
        jac = out_tree.unflatten(per_output)
        return (jac, res[2]) if has_aux else jac

    return jacobian
