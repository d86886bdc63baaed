"""Jacobians in chunks of basis vectors: `batch_jacfwd` and `batch_jacrev`.

`fun` is linearised once (`jax.linearize` / `jax.vjp`), and the standard basis is pushed
(pulled) through the linear map `batch_size` columns (rows) at a time by the chunked
`batch_vmap` pipeline, each chunk building its own basis vectors from their indices, so
the identity matrix is never formed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _axes, _cache
from .._core._options import (
    AllChunking,
    Chunking,
    check_bool,
    check_callable,
    decorator_form,
    takes,
)
from ._batch_vmap import Transform, check_outputs, function_name
from ._grads import check_argnums, describe, resolve_argnums


def _jac_transform(
    name: str,
    fun: Any,
    argnums: Any,
    has_aux: Any,
    holomorphic: Any,
    unwrap_numpy_int: bool,
    **options: Unpack[AllChunking],
) -> Transform:
    """The transform of `batch_jacfwd` and `batch_jacrev` (its arguments checked
    now, so errors name it when it is built)."""
    check_callable(name, "fun", fun)
    check_bool(name, "has_aux", has_aux)
    check_bool(name, "holomorphic", holomorphic)
    return Transform.make(
        name, args=JacArgs.make(name, argnums, unwrap_numpy_int), **options
    )


@dataclasses.dataclass(frozen=True)
class JacArgs:
    """How a Jacobian transform's call resolves its arguments: `argnums` are
    differentiated (`single`: one bare Jacobian rather than a tuple of them)."""

    name: str
    argnums: tuple[int, ...]
    single: bool

    @classmethod
    def make(cls, name: str, argnums: Any, unwrap_numpy_int: bool) -> JacArgs:
        checked, single = check_argnums(name, "argnums", argnums)
        # Whether a NumPy integer `argnums` gives a bare Jacobian (jax.jacfwd) or a
        # 1-tuple (jax.jacrev unwraps a Python int only).
        single = single and (unwrap_numpy_int or isinstance(argnums, int))
        return cls(name, checked, single)

    def resolve(self, transform: Transform, args: tuple):
        """The differentiated arguments of a call (one, or a tuple) and a function
        of them (`_dyn_args`)."""
        del transform
        return _dyn_args(self.name, self.argnums, self.single, args)


def _basis_map(
    transform: Transform, fn: Callable[..., Any], linear: Any, n: int, out_axis: int,
    known: Any,
) -> Any:  # fmt: skip
    """`fn(linear, i)` for every basis index `i < n`, chunked; the linear map
    `linear` (holding its residuals) is closed over: the chunk's trace reads its
    residuals as it reads any closure's arrays (an eager call passes them to its
    compiled program), and its linearised program is in that trace. The chunks map
    over basis indices made here, not over the arguments: of what the call knows
    (`known`), only its mesh lays them out."""
    index = jnp.arange(n, dtype=jnp.int32)
    known = _axes.Known(mesh=known.mesh)
    return transform.map(
        lambda i: fn(linear, i), (index,), {}, 0, out_axis, known=known
    )


def _dyn_args(name: str, argnums_t: tuple[int, ...], single: bool, args: tuple):
    """The differentiated arguments (one, or a tuple) and a function of them."""
    argnums = resolve_argnums(name, "argnums", argnums_t, len(args))
    _check_differentiated(name, [(f"args[{i}]", args[i]) for i in argnums])
    dyn = args[argnums[0]] if single else tuple(args[i] for i in argnums)

    def with_dyn(fun: Callable[..., Any], kwargs: dict[str, Any]):
        def f(dyn_value: Any) -> Any:
            values = (dyn_value,) if single else dyn_value
            return fun(*_axes.combine(args, argnums, values), **kwargs)

        return f

    return dyn, with_dyn


def _check_differentiated(name: str, named_args: list[tuple[str, Any]]) -> None:
    """The differentiated arguments are arrays or pytrees of them, with at least one
    leaf (as `jax.jacfwd` / `jax.jacrev` require), else an error naming them."""
    count = 0
    for root, value in named_args:
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            count += 1
            if not isinstance(leaf, _axes.JAX_TYPES):
                raise TypeError(
                    f"{name} differentiates {root}, which must be an array or a "
                    f"pytree of arrays, but {root}{jax.tree_util.keystr(path)} is a "
                    f"value of type {type(leaf).__name__}. Pass it in an argument "
                    f"not in argnums."
                )
    if not count:
        listed = ", ".join(f"{root}={value!r}" for root, value in named_args)
        raise ValueError(
            f"{name} has nothing to differentiate: the arguments in argnums hold no "
            f"array ({listed})."
        )


def _checked(name: str, fun: Callable[..., Any], has_aux: bool, aux_is_mapped: bool):
    """`fun` with its output checked: `(output, aux)` with `has_aux` (a list pair is
    read as a tuple, as JAX does), and JAX types only in the output (and in `aux`
    when `aux_is_mapped`: `jax.jacfwd` maps it through `jax.vmap`, `jax.jacrev`
    passes it through)."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if not has_aux:
            check_outputs(name, fun, out)
            return out
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                f"{name} has_aux=True expects {function_name(fun)} to return a pair "
                f"(output, aux), but it returned {describe(out)}."
            )
        out = tuple(out)
        check_outputs(name, fun, out if aux_is_mapped else (out[0],))
        return out

    return checked


def _basis(leaves: Sequence[Any], index: jax.Array, dtypes: Sequence[Any]) -> list:
    """The `index`-th standard basis vector of the flattened `leaves` (one example)."""
    out, offset = [], 0
    for x, dtype in zip(leaves, dtypes):
        size = int(np.size(x))
        hot = jnp.arange(size, dtype=jnp.result_type(index)) == index - offset
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


@decorator_form("fun")
@takes(Chunking)
def batch_jacfwd(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    **options: Unpack[Chunking],
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

    Usable as a decorator too, with its options as keywords and without `fun`:
    `@batch_jacfwd(batch_size=8)` over a `def`.

    Args:
      fun: the function to differentiate; keyword arguments are passed through.
      argnums: the positional argument(s) to differentiate (int or sequence of ints,
        negative counts from the end).
      has_aux: `fun` returns `(output, aux)`; `aux` is returned unchanged.
      holomorphic: `fun` is holomorphic (complex inputs and outputs).
      batch_size: basis columns per chunk: a positive int, None (one `jax.vmap`), or
        `"auto"` (from `memory_limit`).
      shard: spread the basis columns over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"` (see `batch_vmap`).
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

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
    transform = _jac_transform(
        name, fun, argnums, has_aux, holomorphic, unwrap_numpy_int=True,
        **options,
    )  # fmt: skip
    checked = _checked(name, fun, has_aux, aux_is_mapped=True)

    def jacobian(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        dyn, with_dyn = transform.resolve(args)
        in_leaves, in_tree = jax.tree.flatten(dyn)
        _check_dtypes(name, "input", in_leaves, holomorphic)
        lin = jax.linearize(with_dyn(checked, kwargs), dyn, has_aux=has_aux)
        out, push = lin[0], lin[1]
        dtypes = [jnp.result_type(x) for x in in_leaves]

        def column(push: Any, index: jax.Array) -> Any:
            return push(in_tree.unflatten(_basis(in_leaves, index, dtypes)))

        n = sum(int(np.size(x)) for x in in_leaves)
        columns = _basis_map(transform, column, push, n, -1, known)

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

    return transform.public(jacobian, fun, whole=True)  # (its linearisation)


@decorator_form("fun")
@takes(Chunking)
def batch_jacrev(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """`jax.jacrev`, pulling back `batch_size` basis vectors at a time.

    Same results and pytree structure as `jax.jacrev(fun, argnums, has_aux,
    holomorphic, allow_int)`. `fun` is evaluated once under `jax.vjp`, then the
    standard basis of the outputs is pulled back through the VJP in chunks of
    `batch_size` rows with `chunkvmap.batch_vmap`, each chunk building its own
    cotangents from their indices (the identity is never formed).

    Usable as a decorator too, with its options as keywords and without `fun`:
    `@batch_jacrev(batch_size=8)` over a `def`.

    Args:
      fun: the function to differentiate; keyword arguments are passed through.
      argnums: the positional argument(s) to differentiate (int or sequence of ints,
        negative counts from the end).
      has_aux: `fun` returns `(output, aux)`; `aux` is returned unchanged.
      holomorphic: `fun` is holomorphic (complex inputs and outputs).
      allow_int: allow integer inputs; their Jacobian blocks are zeros of their
        dtype, as in `jax.jacrev`.
      batch_size: basis rows per chunk: a positive int, None (one `jax.vmap`), or
        `"auto"` (from `memory_limit`).
      shard: spread the basis rows over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"` (see `batch_vmap`).
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

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
    transform = _jac_transform(
        name, fun, argnums, has_aux, holomorphic, unwrap_numpy_int=False,
        **options,
    )  # fmt: skip
    check_bool(name, "allow_int", allow_int)
    checked = _checked(name, fun, has_aux, aux_is_mapped=False)

    def jacobian(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        dyn, with_dyn = transform.resolve(args)
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
            return with_dyn(checked, kwargs)(in_tree.unflatten(full))

        res = jax.vjp(f, diff, has_aux=has_aux)
        out, pull = res[0], res[1]
        out_leaves, out_tree = jax.tree.flatten(out)
        if not out_leaves:
            raise ValueError(
                f"{name}: the function {function_name(fun)} returned "
                f"{out!r}{' as its output (of output, aux)' * has_aux}, which holds "
                f"no array: there is no output to differentiate."
            )
        _check_dtypes(name, "output", out_leaves, holomorphic)
        dtypes = [jnp.result_type(y) for y in out_leaves]

        def row(pull: Any, index: jax.Array) -> Any:
            (cotangent,) = pull(out_tree.unflatten(_basis(out_leaves, index, dtypes)))
            return cotangent

        m = sum(int(np.size(y)) for y in out_leaves)
        rows = _basis_map(transform, row, pull, m, 0, known)
        per_output = _row_blocks(rows, out_leaves, in_leaves, ints, in_tree)
        jac = out_tree.unflatten(per_output)
        return (jac, res[2]) if has_aux else jac

    return transform.public(jacobian, fun, whole=True)  # (its linearisation)


def _row_blocks(
    rows: list, out_leaves: list, in_leaves: list, ints: list, in_tree: Any
) -> list:
    """Per output leaf, its Jacobian blocks against every input leaf (a pytree like
    the inputs'), from the stacked rows of the differentiated inputs (integer inputs:
    zeros of their dtype)."""
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
    return per_output
