"""`batch_vectorize`: `jnp.vectorize` whose loop is evaluated in chunks.

The pieces, in the order a call runs them:

* the static configuration, checked when `batch_vectorize` is called: `excluded`, the
  gufunc `signature` (parsed by `_parse_signature` into core dimension names) and
  `batch_size`;
* the split of a call's arguments into vectorised ones (positional arguments not in
  `excluded`, then keyword arguments not in `excluded`, in call order) and fixed ones
  (excluded arguments, and `None` passed for an argument without core dimensions);
* the shape analysis (`_analyse`): each vectorised argument is `jnp.asarray`-ed, split
  into loop dimensions and core dimensions, core sizes are checked against each other
  and the loop shapes are broadcast to the loop shape `L` (with JAX's rank-promotion
  check);
* the evaluation, without materialising any broadcast copy of an input:

  - `batch_size` None (or at least the number of examples): one nested `jax.vmap` per
    non-trivial loop dimension, each mapping only the arguments that vary along it
    (`_nested`), the same strategy as `jnp.vectorize`;
  - otherwise the `N = prod(L)` examples are flattened and evaluated by `batch_vmap`
    in chunks (`_chunked`, inside one `jax.jit`, so reshapes are free). An argument
    that already has the full loop shape is reshaped to `(N, *core)` and mapped; one
    whose loop dimensions are all 1 is passed unmapped; any other (broadcast along
    some dimensions only) is passed unmapped whole, and each example reads its own
    element at an index computed from the flat example index, so a chunk gathers
    `batch_size` elements, never `N`.

Outputs come back as `(N, *core_out)` (or `(*nontrivial loop dims, *core_out)`) and are
reshaped to `(*L, *core_out)`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar, Unpack

import jax
import jax.numpy as jnp
from jax import lax

from .._core import _cache
from .._core._options import (
    Chunking,
    ChunkOptions,
    check_callable,
    decorator_form,
    takes,
)
from ._batch_vmap import Transform, check_outputs


F = TypeVar("F", bound=Callable[..., Any])
CoreDims = tuple[str, ...]

_NAME = "batch_vectorize"
_DIM_NAME = re.compile(r"\w+")


# --------------------------------------------------------------------------------------
# Static configuration: signature and excluded.


@dataclasses.dataclass(frozen=True)
class _Signature:
    text: str
    inputs: tuple[CoreDims, ...]
    outputs: tuple[CoreDims, ...]


def _parse_signature(signature: Any) -> _Signature | None:
    """The core dimension names of a gufunc signature such as `"(m,n),(n)->(m)"`.

    Whitespace is ignored. Each side is a non-empty, comma-separated list of
    parenthesised (possibly empty) lists of dimension names (letters, digits, `_`).
    """
    if signature is None:
        return None
    if not isinstance(signature, str):
        raise TypeError(
            f"{_NAME} signature must be a str such as '(m,n),(n)->(m)' or None, but "
            f"got signature={signature!r} of type {type(signature).__name__}."
        )
    text = "".join(signature.split())
    inputs, arrow, outputs = text.partition("->")
    try:
        if not arrow:
            raise _SignatureError("it has no '->' between inputs and outputs")
        parsed = _Signature(
            signature,
            _parse_argument_list(inputs, "inputs"),
            _parse_argument_list(outputs, "outputs"),
        )
    except _SignatureError as e:
        raise ValueError(
            f"{_NAME} got an invalid gufunc signature={signature!r}: {e}. Expected "
            f"comma-separated core dimensions in parentheses on both sides of '->', "
            f"e.g. '(m,n),(n)->(m)', '()->()' or '(n)->(n),()'."
        ) from None
    return parsed


class _SignatureError(Exception):
    pass


def _parse_argument_list(text: str, side: str) -> tuple[CoreDims, ...]:
    arguments: list[CoreDims] = []
    pos = 0
    while True:
        if pos >= len(text) or text[pos] != "(":
            found = repr(text[pos]) if pos < len(text) else "the end"
            raise _SignatureError(
                f"the {side} {text!r} need '(' at position {pos}, found {found}"
            )
        close = text.find(")", pos)
        if close < 0:
            raise _SignatureError(f"the {side} {text!r} have an unclosed '('")
        body = text[pos + 1 : close]
        names = tuple(body.split(",")) if body else ()
        for name in names:
            if not _DIM_NAME.fullmatch(name):
                raise _SignatureError(
                    f"the {side} {text!r} have an invalid dimension name {name!r}"
                )
        arguments.append(names)
        pos = close + 1
        if pos == len(text):
            return tuple(arguments)
        if text[pos] != ",":
            raise _SignatureError(
                f"the {side} {text!r} need ',' or the end at position {pos}, found "
                f"{text[pos]!r}"
            )
        pos += 1


def _check_excluded(excluded: Any) -> frozenset[int | str]:
    if isinstance(excluded, (str, bytes)):
        raise TypeError(
            f"{_NAME} excluded must be a collection of argument positions (int) and "
            f"keyword names (str), but got the bare string excluded={excluded!r}: "
            f"did you mean excluded={{{excluded!r}}}?"
        )
    try:
        items = list(excluded)
    except TypeError:
        raise TypeError(
            f"{_NAME} excluded must be a collection of argument positions (int) and "
            f"keyword names (str), but got excluded={excluded!r} of type "
            f"{type(excluded).__name__}."
        ) from None
    bad = [e for e in items if isinstance(e, bool) or not isinstance(e, (int, str))]
    if bad:
        raise TypeError(
            f"{_NAME} excluded can only hold argument positions (int) and keyword "
            f"names (str), but excluded={excluded!r} contains "
            + ", ".join(f"{b!r} ({type(b).__name__})" for b in bad)
            + "."
        )
    negative = [e for e in items if isinstance(e, int) and e < 0]
    if negative:
        raise ValueError(
            f"{_NAME} excluded positions must be non-negative, but excluded="
            f"{excluded!r} contains {', '.join(map(str, negative))}."
        )
    return frozenset(items)


# --------------------------------------------------------------------------------------
# One call: which arguments are vectorised, and their loop and core shapes.


@dataclasses.dataclass(frozen=True)
class _Call:
    """The vectorised arguments of one call, and how to rebuild `pyfunc`'s call."""

    names: list[str]  # "args[1]", "kwargs['y']": for error messages
    keys: list[int | str]  # position or keyword of each vectorised argument
    arrays: list[Any]
    core: list[CoreDims]
    fixed: dict[int | str, Any]  # excluded arguments and None arguments
    num_args: int
    kwarg_names: list[str]
    shown: Any = frozenset()  # `excluded` as the user passed it (for messages)

    def where(self, sig: Any) -> str:
        """`jnp.vectorize`'s words for this function, for its messages."""
        text = sig and sig.text
        return (
            f"on vectorized function with excluded={self.shown!r} and "
            f"signature={text!r}"
        )

    def rebuild(self, values: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        """`pyfunc`'s positional and keyword arguments for one example's `values`."""
        full = dict(self.fixed)
        full.update(zip(self.keys, values))
        return [full[i] for i in range(self.num_args)], {
            k: full[k] for k in self.kwarg_names
        }


def _split(
    excluded: frozenset[int | str],
    sig: _Signature | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shown: Any = frozenset(),
) -> _Call:
    """The call's vectorised arguments (as arrays, with their names, keys and core
    dimensions) apart from its excluded ones (and Nones)."""
    names: list[str] = []
    keys: list[int | str] = []
    values: list[Any] = []
    fixed: dict[int | str, Any] = {}
    given = [(i, f"args[{i}]", x) for i, x in enumerate(args)]
    given += [(k, f"kwargs[{k!r}]", x) for k, x in kwargs.items()]
    for key, name, x in given:
        if key in excluded:
            fixed[key] = x
        else:
            names.append(name)
            keys.append(key)
            values.append(x)
    core = _core_dims(sig, names, values, excluded, shown)
    none_at = {i for i, (x, d) in enumerate(zip(values, core)) if x is None and d}
    call_names, call_keys, arrays, call_core = [], [], [], []
    for name, key, x, dims in zip(names, keys, values, core):
        if x is None:  # None is passed through, as an excluded argument
            if dims:
                raise ValueError(
                    f"Cannot pass None at locations {none_at} with signature="
                    f"{sig and sig.text!r}. "
                    f"{_NAME} got None for {name}, whose core dimensions in "
                    f"signature={sig and sig.text!r} are {dims}: None can only be "
                    f"passed for an argument with core dimensions '()'."
                )
            fixed[key] = None
            continue
        arrays.append(_as_array(name, x))
        call_names.append(name)
        call_keys.append(key)
        call_core.append(dims)
    return _Call(
        call_names, call_keys, arrays, call_core, fixed, len(args), list(kwargs),
        shown,
    )  # fmt: skip


def _core_dims(
    sig: _Signature | None, names: list, values: list, excluded: Any, shown: Any
) -> list[CoreDims]:
    """Each vectorised argument's core dimensions, checked against the number of
    the signature's inputs."""
    if sig is None:
        return [()] * len(values)
    if len(sig.inputs) != len(values):
        listed = ", ".join(names) or "none"
        raise TypeError(
            f"wrong number of positional arguments: expected {len(sig.inputs)}, got "
            f"{len(values)} on vectorized function with excluded="
            f"{shown!r} and signature={sig.text!r}. "
            f"{_NAME} with signature={sig.text!r} expects {len(sig.inputs)} vectorised "
            f"argument(s), but got {len(values)} ({listed}; excluded="
            f"{set(excluded) or '{}'}). Keyword arguments not in excluded are "
            f"vectorised too, after the positional ones."
        )
    return list(sig.inputs)


def _as_array(name: str, x: Any) -> jax.Array:
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"{_NAME} vectorises {name}, so it must be convertible with "
            f"jnp.asarray, but got a value of type {type(x).__name__}: "
            f"{str(e).rstrip('.')}. "
            f"Pass non-array arguments through excluded."
        ) from None


def _shape_list(call: _Call) -> str:
    return ", ".join(f"{n} {tuple(a.shape)}" for n, a in zip(call.names, call.arrays))


def _analyse(call: _Call, sig: _Signature | None):
    """The broadcast loop shape, each argument's loop shape, and the core sizes."""
    sizes: dict[str, tuple[int, str]] = {}
    loops: list[tuple[int, ...]] = []
    for name, x, dims in zip(call.names, call.arrays, call.core):
        if x.ndim < len(dims):
            raise ValueError(
                f"input with shape {tuple(x.shape)} does not have enough dimensions "
                f"for all core dimensions {dims} {call.where(sig)}. "
                f"{_NAME} {name} has shape {tuple(x.shape)}, which has too few "
                f"dimensions for its core dimensions {dims} in signature="
                f"{sig and sig.text!r}: expected at least {len(dims)} dimension(s)."
            )
        loop_ndim = x.ndim - len(dims)
        loops.append(tuple(x.shape[:loop_ndim]))
        for dim, size in zip(dims, x.shape[loop_ndim:]):
            where = f"{name} (shape {tuple(x.shape)})"
            _record_size(sizes, dim, size, where, sig, call)
    loop_shape = _broadcast(call, loops)
    _check_rank_promotion(call, loops, sig)
    return loop_shape, loops, {d: s for d, (s, _) in sizes.items()}


def _record_size(sizes, dim: str, size: int, where: str, sig, call) -> None:
    if dim not in sizes:
        sizes[dim] = (size, where)
    elif sizes[dim][0] != size:
        first, first_where = sizes[dim]
        raise ValueError(
            f"inconsistent size for core dimension {dim!r}: {size} vs {first} "
            f"{call.where(sig)}. "
            f"{_NAME} core dimension {dim!r} of signature={sig.text!r} has "
            f"inconsistent sizes: {first} in {first_where}, but {size} in {where}. "
            f"Core dimensions are not broadcast; they must match exactly."
        )


def _broadcast(call: _Call, loops: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(s) for s in loops), default=0)
    padded = [(1,) * (ndim - len(s)) + s for s in loops]
    shape = []
    for d in range(ndim):
        sizes = {s[d] for s in padded} - {1}
        if len(sizes) > 1:
            listed = ", ".join(f"{n} {s}" for n, s in zip(call.names, loops))
            raise ValueError(
                f"Incompatible shapes for broadcasting: shapes={list(loops)}. "
                f"{_NAME} cannot broadcast the loop (non-core) dimensions of its "
                f"vectorised arguments: loop dimension {d - ndim} has sizes "
                f"{sorted(sizes)}. Loop shapes: {listed}."
            )
        shape.append(sizes.pop() if sizes else 1)
    return tuple(shape)


def _check_rank_promotion(call: _Call, loops, sig: _Signature | None) -> None:
    """Mirror `jnp.vectorize`: arguments (other than 0-d ones) whose loop ranks
    differ need rank promotion, which `jax_numpy_rank_promotion` may forbid."""
    mode = jax.config.jax_numpy_rank_promotion  # pyright: ignore[reportAttributeAccessIssue]
    if mode == "allow":
        return
    ranks = {len(s) for x, s in zip(call.arrays, loops) if x.ndim != 0}
    if len(ranks) <= 1:
        return
    loop_shapes = ", ".join(f"{n} {s}" for n, s in zip(call.names, loops))
    shapes = [tuple(x.shape) for x in call.arrays]
    msg = (
        f"operands with shapes {shapes} require rank promotion for jnp.vectorize "
        f"function with signature {sig and sig.text!r}. "
        f"{_NAME} arguments with loop (non-core) dimensions of different ranks need "
        f"rank promotion (signature={sig and sig.text!r}; shapes: "
        f"{_shape_list(call)}; loop shapes: {loop_shapes}). Add the leading size-1 "
        f"dimensions explicitly, or set jax_numpy_rank_promotion to 'allow' (e.g. "
        f"`with jax.numpy_rank_promotion('allow'):`); see "
        f"https://docs.jax.dev/en/latest/rank_promotion_warning.html."
    )
    if mode == "raise":
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=4)


def _checked(
    pyfunc: Callable[..., Any],
    call: _Call,
    sig: _Signature | None,
    sizes: dict[str, int],
) -> Callable[..., Any]:
    """One example: `pyfunc` on the vectorised `values`, outputs checked (JAX types,
    as every entry point checks them, and against the signature). Named like
    `pyfunc`, as is every function wrapping it, so that messages name it."""

    @_cache.wraps(pyfunc)
    def example(*values: Any) -> Any:
        f_args, f_kwargs = call.rebuild(values)
        out = pyfunc(*f_args, **f_kwargs)
        check_outputs(_NAME, pyfunc, out)
        if sig is not None:
            _check_outputs(out, sig, sizes, call)
        return out

    return example


def _describe(out: Any) -> str:
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"a single array of shape {tuple(out.shape)} per example"
    return f"a value of type {type(out).__name__}"


def _check_outputs(out: Any, sig: _Signature, sizes: dict[str, int], call) -> None:
    expected = len(sig.outputs)
    if expected > 1 and not isinstance(out, tuple):
        raise TypeError(
            f"{_NAME} signature={sig.text!r} has {expected} outputs, so the function "
            f"must return a tuple of {expected} arrays, but it returned "
            f"{_describe(out)}."
        )
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != expected:
        raise TypeError(
            f"{_NAME} signature={sig.text!r} has {expected} output(s), but the "
            f"function returned a tuple of {len(outs)}."
        )
    seen = {d: (s, "the inputs") for d, s in sizes.items()}
    for k, (y, dims) in enumerate(zip(outs, sig.outputs)):
        shape = tuple(jnp.shape(y))
        where = f"output {k} (shape {shape} per example)"
        if len(shape) != len(dims):
            raise ValueError(
                f"output shape {shape} does not match core dimensions {dims} "
                f"{call.where(sig)}. "
                f"{_NAME} {where} does not match its core dimensions {dims} in "
                f"signature={sig.text!r}: expected {len(dims)} dimension(s) per "
                f"example, got {len(shape)}."
            )
        for dim, size in zip(dims, shape):
            _record_size(seen, dim, size, where, sig, call)


# --------------------------------------------------------------------------------------
# Evaluation.


def _reshape_outputs(out: Any, loop_shape: tuple[int, ...], lead: int) -> Any:
    """Each output leaf `(*lead dims, *core)` as `(*loop_shape, *core)`."""
    return jax.tree.map(
        lambda y: jnp.reshape(y, (*loop_shape, *jnp.shape(y)[lead:])), out
    )


def _nested(example, call: _Call, loops, loop_shape: tuple[int, ...]) -> Any:
    """One `jax.vmap` per non-trivial loop dimension, mapping only the arguments that
    vary along it: no input is broadcast, and size-1 dimensions are never mapped."""
    ndim = len(loop_shape)
    padded = [(1,) * (ndim - len(s)) + s for s in loops]
    squeezed = [
        jnp.reshape(x, tuple(n for n in s if n != 1) + x.shape[len(s) :])
        for x, s in zip(call.arrays, loops)
    ]
    fn = example
    mapped_dims = 0
    for d in reversed(range(ndim)):  # innermost first: the outer vmap is dimension 0
        in_axes = tuple(None if s[d] == 1 else 0 for s in padded)
        if all(a is None for a in in_axes):
            continue
        fn = jax.vmap(fn, in_axes=in_axes)
        mapped_dims += 1
    out = fn(*squeezed)
    if not loop_shape:
        return out
    return _reshape_outputs(out, loop_shape, mapped_dims)


def _chunked(
    example,
    arrays: list[Any],
    loops,
    loop_shape: tuple[int, ...],
    transform: Transform,
    known: _cache.Known,
) -> Any:
    """The `N = prod(L)` examples in chunks through the `batch_vmap` pipeline
    (`known`: the concrete shardings of an eager call's arguments).

    Full-shape arguments are mapped as `(N, *core)`; arguments with only size-1 loop
    dimensions are unmapped; partially broadcast arguments are unmapped whole and read
    per example at the flat position of the example's multi-index, with the broadcast
    dimensions clamped to 0 (so a chunk gathers `batch_size` elements of them).
    The reshapes are free under `jax.jit` (the eager cache's, or the caller's).
    """
    ndim, size = len(loop_shape), math.prod(loop_shape)
    leaves: list[Any] = []
    in_axes: list[int | None] = []
    # For each argument: None (use the value as is) or its row-major strides over the
    # loop dimensions (0 where it is broadcast), to read example k's element.
    strides: list[tuple[int, ...] | None] = []
    for x, s in zip(arrays, loops):
        core = x.shape[len(s) :]
        count = math.prod(s)
        if count == size:
            leaves.append(jnp.reshape(x, (size, *core)))
            in_axes.append(0)
            strides.append(None)
        elif count == 1:
            leaves.append(jnp.reshape(x, core))
            in_axes.append(None)
            strides.append(None)
        else:
            padded = (1,) * (ndim - len(s)) + s
            leaves.append(jnp.reshape(x, (count, *core)))
            in_axes.append(None)
            strides.append(_strides(padded))
    partial = any(st is not None for st in strides)
    if partial:
        leaves.append(jnp.arange(size, dtype=_index_dtype(size)))
        in_axes.append(0)
    loop_strides = _strides(loop_shape)

    @_cache.wraps(example)
    def one(*values: Any) -> Any:
        if partial:
            k, values = values[-1], values[:-1]
        per_example = []
        for v, st in zip(values, strides):
            if st is not None:
                # The flat position of example k in this argument: its coordinate
                # along every loop dimension it does not broadcast, times its stride.
                j = sum(
                    lax.rem(lax.div(k, loop_strides[d]), loop_shape[d]) * st[d]
                    for d in range(ndim)
                    if st[d]
                )
                v = lax.dynamic_index_in_dim(v, j, axis=0, keepdims=False)
            per_example.append(v)
        return example(*per_example)

    out = transform.map(one, tuple(leaves), {}, tuple(in_axes), 0, known=known)
    return _reshape_outputs(out, loop_shape, 1)


def _index_dtype(size: int) -> Any:
    if size <= jnp.iinfo(jnp.int32).max:
        return jnp.int32
    if not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]
        raise ValueError(
            f"{_NAME} needs 64-bit indices for {size} examples with a partially "
            f"broadcast argument: enable jax_enable_x64, or broadcast it explicitly."
        )
    return jnp.int64


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape`, 0 along size-1 dimensions."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(0 if n == 1 else step)
        step *= n
    return tuple(reversed(strides))


# --------------------------------------------------------------------------------------
# batch_vectorize


@decorator_form("pyfunc")
@takes(Chunking)
def batch_vectorize(
    pyfunc: F,
    *,
    excluded: Collection[int | str] = frozenset(),
    signature: str | None = None,
    **options: Unpack[Chunking],
) -> F:
    """`jnp.vectorize` whose loop is evaluated `batch_size` examples at a time.

    `batch_vectorize(f, excluded=e, signature=s, batch_size=B)(*args)` gives the same
    result as `jnp.vectorize(f, excluded=e, signature=s)(*args)`: the vectorised
    arguments are broadcast against each other over their loop (non-core) dimensions,
    NumPy-style, to a loop shape `L`, and `f` is applied to every one of the
    `N = prod(L)` examples. With `B` None (or `B >= N`) this is one nested `jax.vmap`,
    as in `jnp.vectorize`. Otherwise the examples are flattened and evaluated by
    `chunkvmap.batch_vmap` in chunks of `B` (see there for the remainder, `remat` and
    where to put `grad`), so the working memory of `f` scales with `B`, not `N`::

        out[l] = f(*(x[broadcast index of l] for x in args))   for l in ndindex(L)

    No broadcast copy of an input is ever made: an argument with the full loop shape
    is reshaped to `(N, *core)` and sliced per chunk; one whose loop dimensions are all
    1 is shared by every example; any other one (broadcast along some loop dimensions)
    stays whole, and each example reads its element at an index computed from the flat
    example index, so a chunk gathers only `B` elements of it (this costs one `(N,)`
    int32 array of example indices, 4 bytes per example). For instance, an
    outer-product style call `g(a[:, None, :], b[None, :, :])` with
    `signature="(k),(k)->()"` never builds the `(n, n, k)` broadcast of either input.
    Outputs have shape `(*L, *core_out)`.

    Semantics, as in `jnp.vectorize`: without `signature`, `f` receives 0-d arrays and
    may return any pytree (each leaf gets the loop dimensions in front); with one, `f`
    receives arrays with the signature's core dimensions (which must match exactly:
    size-1 core dimensions are not broadcast) and must return one array per output
    (a tuple when there are several), whose core dimensions are checked; a name that
    only appears in the outputs takes its size from `f`. Vectorised arguments are
    converted with `jnp.asarray`; passing `None` for an argument without core
    dimensions passes it through unchanged. Loop dimensions of different ranks
    follow `jax_numpy_rank_promotion` ('allow', 'warn' or 'raise'), counting every
    argument except 0-d ones.

    Keyword arguments not in `excluded` are vectorised like positional arguments (as
    in `np.vectorize`; with a signature they are matched, in call order, to the
    signature's inputs after the positional ones). `jnp.vectorize` (JAX 0.10) drops
    them silently instead.

    Usable as a decorator too, with its options as keywords and without `pyfunc`:
    `@batch_vectorize(signature="(n)->()", batch_size=8)` over a `def`.

    Args:
      pyfunc: the function to vectorise.
      excluded: positions (int) and keyword names (str) of arguments passed to
        `pyfunc` unchanged, not vectorised.
      signature: an optional generalized-ufunc signature such as `"(m,n),(n)->(m)"`
        (whitespace ignored); None means scalar inputs and outputs of any shape.
      batch_size: examples per chunk: a positive int, None for a single vmap, or
        `"auto"` (from `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"` (see `batch_vmap`).
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      The vectorised function. It traces `pyfunc` on single examples and returns its
      outputs with the loop shape `L` in front.

    Raises:
      TypeError: (at once) for a non-callable `pyfunc`, an `excluded` that is not a
        collection of ints and strings, a `signature` that is not a str, a
        non-integer `batch_size`; (when called) for a number of vectorised arguments
        other than the signature's inputs, an argument `jnp.asarray` rejects, or
        outputs that are not a tuple of the signature's length.
      ValueError: (at once) for a malformed signature, a negative excluded position,
        a non-positive `batch_size`; (when called) for an argument with fewer
        dimensions than its core dimensions, inconsistent core dimension sizes,
        loop shapes that do not broadcast, rank promotion when
        `jax_numpy_rank_promotion='raise'`, or outputs whose core dimensions do not
        match the signature.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_vectorize
      >>> add = batch_vectorize(lambda x, y: x + y, batch_size=2)
      >>> add(jnp.arange(3.0)[:, None], jnp.ones((1, 2)))
      Array([[1., 1.],
             [2., 2.],
             [3., 3.]], dtype=float32)
      >>> dot = batch_vectorize(jnp.dot, signature="(k),(k)->()", batch_size=3)
      >>> a, b = jnp.ones((4, 2)), jnp.ones((5, 2))
      >>> dot(a[:, None, :], b[None, :, :]).shape
      (4, 5)
      >>> stats = batch_vectorize(lambda x: (x - x.mean(), x.mean()),
      ...                         signature="(n)->(n),()", batch_size=1)
      >>> stats(jnp.array([[1.0, 3.0], [2.0, 2.0]]))[1]
      Array([2., 2.], dtype=float32)
    """
    check_callable(_NAME, "pyfunc", pyfunc)
    shown, excluded = excluded, _check_excluded(excluded)
    sig = _parse_signature(signature)
    options = ChunkOptions.make(_NAME, **options)
    transform = Transform(options)

    def vectorized(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        call = _split(excluded, sig, args, kwargs, shown)
        loop_shape, loops, sizes = _analyse(call, sig)
        example = _checked(pyfunc, call, sig, sizes)
        size = math.prod(loop_shape)
        if options.plain or (
            isinstance(options.batch_size, int)
            and options.batch_size >= size
            and options.reporter is None
            and not options.shard
        ):
            return _nested(example, call, loops, loop_shape)
        return _chunked(example, call.arrays, loops, loop_shape, transform, known)

    return transform.public(vectorized, pyfunc)  # pyright: ignore[reportReturnType]
