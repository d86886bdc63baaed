"""`batch_vmap` and `batch_map`: a `jax.vmap` evaluated in chunks.

The pieces are kept apart on purpose:

* axis normalisation (`_axes.py`): in/out axis specs to one canonical axis per leaf;
* the chunk plan (`_Plan`): how many full chunks, how large the remainder;
* slicing (`_take`): a chunk is a `dynamic_slice` of the original input along its own
  mapped axis, so inputs are never transposed, reshaped or copied;
* the loop (`_stacked`, `_reduced`): a `lax.scan` over chunk indices;
* the remainder: evaluated once more as a smaller chunk;
* output assembly: stacked outputs are written with `dynamic_update_slice` into one
  preallocated buffer per output leaf, at the requested output axis (no concatenation,
  no transpose, no second output-sized buffer); reduced outputs are folded in a carry.

The user's function is wrapped in `jax.jit` once per call, so that abstract evaluation
(to learn the output structure), the scan body and the remainder all reuse a single
trace of it: JAX caches the traced function by the per-example argument types.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _axes, _memory, _progress, _sharding
from ._sharding import check_shard_args


F = TypeVar("F", bound=Callable[..., Any])


def identity(x: Any) -> Any:
    """The default `chunk_reduction`: returns its argument unchanged.

    Without a `reduction` it leaves the stacked output as it is; with one it is an error
    (it does not remove the mapped axis), so a summarising `chunk_reduction` must be
    given. Compared by identity, so `chunk_reduction=chunkvmap.identity` is the same as
    leaving it out.

    Args:
      x: any pytree.

    Returns:
      `x` itself.

    Examples:
      >>> from chunkvmap import identity
      >>> identity((1, 2))
      (1, 2)
    """
    return x


# --------------------------------------------------------------------------------------
# The chunk plan, slicing and the loop.


@dataclasses.dataclass(frozen=True)
class _Plan:
    size: int  # N, the mapped length
    batch: int  # B, 1 <= B <= N (or B = N = 0)
    # Where the N examples start in the leaves' mapped axes (may be traced): a device
    # of a sharded evaluation reads its examples in place from whole inputs.
    offset: Any = 0

    @property
    def num_chunks(self) -> int:
        """Loop iterations: ceil(N / B)."""
        return -(-self.size // self.batch) if self.batch else 0

    @property
    def rem(self) -> int:
        return self.size % self.batch if self.batch else 0

    @property
    def single(self) -> bool:
        """Whether everything is one vmap call (no loop)."""
        return self.batch >= self.size

    def start(self, i: Any) -> Any:
        """First example of chunk `i`; the last chunk is the window `[N - B, N)`."""
        if self.rem == 0:
            return i * self.batch
        return jnp.minimum(i * self.batch, self.size - self.batch)

    def chunk(self, leaves: Sequence[Any], axes: Sequence[int | None], i: Any):
        """The inputs of chunk `i` (read at `offset + start(i)`)."""
        return _take(leaves, axes, self.offset + self.start(i), self.batch)

    def whole(self, leaves: Sequence[Any], axes: Sequence[int | None]) -> list[Any]:
        """The leaves restricted to the plan's N examples (one chunk, no loop)."""
        if isinstance(self.offset, int) and self.offset == 0:
            return list(leaves)
        return _take(leaves, axes, self.offset, self.size)


def _make_plan(size: int, batch_size: Any, offset: Any = 0) -> _Plan:
    if batch_size is None or batch_size >= size:
        return _Plan(size, size, offset)
    return _Plan(size, batch_size, offset)


def _take(leaves: Sequence[Any], axes: Sequence[int | None], start: Any, length: int):
    """The chunk `[start, start + length)` of each mapped leaf (`start` traced)."""
    return [
        x if a is None else lax.dynamic_slice_in_dim(x, start, length, axis=a)
        for x, a in zip(leaves, axes)
    ]


def zeros(shape: Sequence[int], aval: Any) -> Any:
    """Zeros of `shape` with `aval`'s dtype, weakly typed when `aval` is."""
    if getattr(aval, "weak_type", False):
        # A Python scalar keeps the weak type (weak types have the default width).
        return lax.full(shape, np.zeros((), aval.dtype).item())
    return lax.full(shape, 0, aval.dtype)


def _drop_leading(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape[1:], aval.dtype, weak_type=aval.weak_type)


def _static_key(leaves: Sequence[Any], dyn: Sequence[int]) -> tuple[Any, ...]:
    """A cache key for the non-array arguments (their value when hashable)."""
    dynamic = set(dyn)
    key = []
    for i, x in enumerate(leaves):
        if i in dynamic:
            continue
        try:
            hash(x)
            key.append((type(x), x))
        except TypeError:
            key.append((type(x), id(x)))
    return tuple(key)


# A chunk function maps (chunk leaves, chunk length) to the chunk's flat outputs, each
# mapped along its canonical output axis (or unmapped where the axis is None).
ChunkFn = Callable[[list[Any], int], list[Any]]


def _checkpointed(fn: Callable[..., Any], remat: Any) -> Callable[..., Any]:
    """`fn` under `jax.checkpoint` (with `remat` as the policy when it is callable).

    Only the chunk index crosses the checkpoint; the inputs are closed over, so the
    residuals saved for reverse mode are one scalar per chunk (plus what the policy
    saves) instead of every chunk's activations. `prevent_cse=False` is safe inside a
    scan, which already keeps XLA from merging the recomputation with the forward pass.
    """
    if remat is False:
        return fn
    policy = None if remat is True else remat
    return jax.checkpoint(fn, prevent_cse=False, policy=policy)


def _stacked(
    chunk_fn: ChunkFn,
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    plan: _Plan,
    out_avals: Sequence[Any],
    out_axes: Sequence[int | None],
    remat: Any,
    report: Callable[[Any], None] = lambda i: None,
) -> list[Any]:
    """Run every chunk and assemble the stacked outputs without a second output copy.

    Two layouts, both with the user's function once in the program:

    * `B` divides `N` and every mapped output axis is 0: the chunks are the `ys` of the
      scan, shape `(N / B, B, ...)`, and reshaping them to `(N, ...)` is free. Reverse
      mode then reads the output cotangent chunk by chunk as a loop input, so with
      `remat` gradient memory does not grow with `N` at all.
    * otherwise: one buffer per output leaf, preallocated with the mapped axis where
      `out_axes` puts it, and each chunk written in place with `dynamic_update_slice`
      (no concatenation, no transpose). When `B` does not divide `N`, the last chunk is
      the window `[N - B, N)` of real examples, overlapping the previous chunk; it
      rewrites the overlapping `B - N % B` outputs with the same values, and the
      cotangents of overwritten entries are zero, so gradients count each example once.
      No padding is ever evaluated. Reverse mode carries the output cotangent through
      the loop, so gradients need one output-sized buffer more than forward evaluation.
    """
    if plan.single:
        outs = chunk_fn(plan.whole(leaves, axes), plan.size)
        report(0)
        return outs
    size, batch = plan.size, plan.batch

    @ft.partial(_checkpointed, remat=remat)
    def evaluate(i):
        return chunk_fn(plan.chunk(leaves, axes, i), batch)

    def full(aval, length=None, axis=None):
        shape = aval.shape
        if axis is not None:
            shape = (*shape[:axis], length, *shape[axis:])
        return zeros(shape, aval)

    mapped = [k for k, a in enumerate(out_axes) if a is not None]
    unmapped = [k for k, a in enumerate(out_axes) if a is None]

    if plan.rem == 0 and all(out_axes[k] == 0 for k in mapped):

        def body(carry, i):
            ys = evaluate(i)
            report(i)
            return [ys[k] for k in unmapped], [ys[k] for k in mapped]

        init = [full(out_avals[k]) for k in unmapped]
        with jax.named_scope("chunkvmap"):
            last, stacked = lax.scan(body, init, jnp.arange(plan.num_chunks))
        outs: list[Any] = [None] * len(out_axes)
        for k, y in zip(mapped, stacked):
            outs[k] = y.reshape(size, *y.shape[2:])
        for k, y in zip(unmapped, last):
            outs[k] = y
        return outs

    def body(buffers, i):
        ys = evaluate(i)
        report(i)
        start = plan.start(i)
        return [
            y if axis is None else lax.dynamic_update_slice_in_dim(b, y, start, axis)
            for b, y, axis in zip(buffers, ys, out_axes)
        ], None

    buffers = [full(aval, size, axis) for aval, axis in zip(out_avals, out_axes)]
    with jax.named_scope("chunkvmap"):
        buffers, _ = lax.scan(body, buffers, jnp.arange(plan.num_chunks))
    return buffers


def _reduced(
    chunk_fn: ChunkFn,
    chunk_reduction: Callable[[Any], Any],
    out_tree: Any,
    out_axes: Sequence[int | None],
    leaves: Sequence[Any],
    axes: Sequence[int | None],
    plan: _Plan,
    reduction: Callable[[Any, Any], Any],
    summary_avals: Any,
    remat: Any,
    report: Callable[[Any], None] = lambda i: None,
) -> Any:
    """Fold the chunks' summaries with `reduction`, in order, without an identity.

    A forward scan folds `acc = reduction(acc, s_i)`; the first chunk's summary replaces
    the (never used) initial value, so no identity element is needed and order is kept
    (non-commutative reductions work). When `B` does not divide `N`, the last chunk is
    the window `[N - B, N)` as in `_stacked`, and only its last `N % B` outputs (the
    examples no earlier chunk covered) are summarised. Either way the user's function
    appears once in the program.
    """

    def summarise(ys: list[Any]) -> Any:
        return chunk_reduction(out_tree.unflatten(ys))

    if plan.single:
        summary = summarise(chunk_fn(plan.whole(leaves, axes), plan.size))
        report(0)
        return summary
    batch, rem, last = plan.batch, plan.rem, plan.num_chunks - 1

    def tail(ys: list[Any]) -> list[Any]:
        return [
            y if a is None else lax.slice_in_dim(y, batch - rem, batch, axis=a)
            for y, a in zip(ys, out_axes)
        ]

    @ft.partial(_checkpointed, remat=remat)
    def evaluate(i):
        ys = chunk_fn(plan.chunk(leaves, axes, i), batch)
        if rem == 0:
            return summarise(ys)
        return lax.cond(i == last, lambda: summarise(tail(ys)), lambda: summarise(ys))

    def body(acc, i):
        s = evaluate(i)
        report(i)
        return lax.cond(i == 0, lambda: s, lambda: _fold(reduction, acc, s)), None

    init = jax.tree.map(lambda a: zeros(a.shape, a), summary_avals)
    with jax.named_scope("chunkvmap"):
        acc, _ = lax.scan(body, init, jnp.arange(plan.num_chunks))
    return acc


def _fold(reduction: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """`reduction` applied leaf by leaf to two summaries of the same structure."""
    return jax.tree.map(reduction, a, b)


@dataclasses.dataclass(frozen=True)
class _Chunked:
    """Everything about one chunked evaluation except the inputs and the plan."""

    name: str
    chunk_fn: ChunkFn
    axes: Sequence[int | None]
    out_tree: Any
    out_avals: Sequence[Any]
    out_axes: Sequence[int | None]
    reduction: Callable[[Any, Any], Any] | None
    chunk_reduction: Callable[[Any], Any]
    remat: Any
    progress: _progress.Reporter | None = None

    def report(self, plan: _Plan, when: Callable[[], Any] | None = None):
        """The per-chunk progress hook for `plan` (a no-op without `progress`)."""

        def report(i: Any) -> None:
            if plan.num_chunks == 0:  # zero examples: nothing to report
                return
            cond = None if when is None else when()
            _progress.tick(self.progress, i, plan.num_chunks, cond)

        return report

    def __call__(self, leaves: Sequence[Any], plan: _Plan) -> Any:
        """Stack or fold the chunks of `leaves` according to `plan`."""
        if self.reduction is None:
            return self.finish(self.stacked_flat(leaves, plan))
        return self.summary(leaves, plan)

    def finish(self, flat: list[Any]) -> Any:
        """The user's output from the flat stacked outputs."""
        out = self.out_tree.unflatten(flat)
        return out if self.chunk_reduction is identity else self.chunk_reduction(out)

    def stacked_flat(
        self, leaves: Sequence[Any], plan: _Plan, report: Any = None
    ) -> list[Any]:
        return _stacked(
            self.chunk_fn,
            leaves,
            self.axes,
            plan,
            self.out_avals,
            self.out_axes,
            self.remat,
            self.report(plan) if report is None else report,
        )

    def summary(self, leaves: Sequence[Any], plan: _Plan, report: Any = None) -> Any:
        assert self.reduction is not None
        summary = _check_reduction(
            self.name,
            self.reduction,
            self.chunk_reduction,
            self.out_tree,
            self.out_avals,
            self.out_axes,
            [plan.batch, plan.rem or plan.batch],
        )
        return _reduced(
            self.chunk_fn,
            self.chunk_reduction,
            self.out_tree,
            self.out_axes,
            leaves,
            self.axes,
            plan,
            self.reduction,
            summary,
            self.remat,
            self.report(plan) if report is None else report,
        )

    def sharded(
        self,
        mesh: Any,
        paths: Sequence[str],
        leaves: Sequence[Any],
        dyn: Sequence[int],
        size: int,
        batch_size: Any,
    ) -> Any:
        """The evaluation split over the devices of `mesh` (see `_sharding`)."""
        if batch_size == "auto":
            raise ValueError(
                f"{self.name} batch_size='auto' is not supported with shard=True yet: "
                f"pass an int batch_size (it bounds each device's chunks)."
            )
        mesh = _sharding.resolve_mesh(self.name, mesh)
        leaves = _sharding.place_inputs(self.name, mesh, paths, list(leaves), self.axes)
        reduced = self.reduction is not None
        axis = mesh.axis_names[0]

        def local(
            local_leaves: list[Any], n: int, offset: Any = 0, report: bool = True
        ) -> Any:
            plan = _make_plan(n, batch_size, offset)
            # Progress: only the device at mesh index 0 reports, and only its own
            # chunks (the global remainder is reported only when nothing else runs).
            hook = self.report(plan, lambda: lax.axis_index(axis) == 0)
            report = hook if report else (lambda i: None)
            if reduced:
                return self.summary(local_leaves, plan, report)
            return self.stacked_flat(local_leaves, plan, report)

        result = _sharding.evaluate(
            mesh,
            leaves,
            self.axes,
            dyn,
            size,
            local,
            zeros=zeros,
            reduced=reduced,
            out_axes=self.out_axes,
            fold=ft.partial(_fold, self.reduction),
        )
        return result if reduced else self.finish(result)

    def plan(
        self,
        batch_size: Any,
        auto: _AutoBatch | None,
        leaves: Sequence[Any],
        dyn: Sequence[int],
        size: int,
        key: Any,
    ) -> _Plan:
        """The plan for `batch_size`, choosing it first when it is "auto"."""
        if auto is not None:
            measure = _measure_program(self.name, self, leaves, dyn, size)
            batch_size = auto.choose(key, measure, size)
        return _make_plan(size, batch_size)


# --------------------------------------------------------------------------------------
# Static validation shared by batch_vmap and batch_map.


def _check_callable(name: str, arg: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not callable(value):
        raise TypeError(
            f"{name} {arg} must be a callable{' or None' if allow_none else ''}, but "
            f"got {arg}={value!r} of type {type(value).__name__}."
        )


def _check_remat(name: str, remat: Any) -> None:
    if not (isinstance(remat, bool) or callable(remat)):
        raise TypeError(
            f"{name} remat must be True, False, or a jax.checkpoint policy (e.g. "
            f"jax.checkpoint_policies.dots_saveable), but got remat={remat!r} of type "
            f"{type(remat).__name__}."
        )


def _resolve_batch_size(
    name: str, batch_size: Any, kwargs: dict[str, Any]
) -> int | str | None:
    kwargs = dict(kwargs)
    if "chunk_size" in kwargs:
        chunk_size = kwargs.pop("chunk_size")
        if batch_size is not None and chunk_size is not None:
            raise TypeError(
                f"{name} got both batch_size={batch_size!r} and its alias "
                f"chunk_size={chunk_size!r}; pass only one."
            )
        if batch_size is None:
            batch_size = chunk_size
            if batch_size is not None:
                return _check_batch_size(name, "chunk_size", batch_size)
    if kwargs:
        names = ", ".join(repr(k) for k in kwargs)
        raise TypeError(f"{name} got unexpected keyword argument(s) {names}.")
    return _check_batch_size(name, "batch_size", batch_size)


def _check_batch_size(name: str, arg: str, value: Any) -> int | str | None:
    if isinstance(value, str):
        if value == "auto":
            return value
        raise TypeError(
            f"{name} {arg} must be a positive int, None, or 'auto', but got "
            f"{arg}={value!r} of type str."
        )
    return _axes.check_positive_int(arg, value, transform=name)


class _AutoBatch:
    """`batch_size="auto"` state of one function: the budget and chosen sizes."""

    def __init__(self, name: str, memory_limit: Any):
        self.name = name
        self.limit = (
            None if memory_limit is None else _memory.parse_memory(name, memory_limit)
        )
        self.cache: dict[Any, int] = {}
        self.last: int | None = None

    def choose(self, key: Any, measure: Callable[[int], int], size: int) -> int:
        limit = (
            self.limit if self.limit is not None else _memory.default_limit(self.name)
        )
        key = (key, limit)
        if key not in self.cache:
            self.cache[key] = _memory.choose_batch_size(self.name, measure, size, limit)
        self.last = self.cache[key]
        _LAST_AUTO[0] = self.last
        return self.last


_AUTO_STATES: weakref.WeakKeyDictionary[Any, _AutoBatch] = weakref.WeakKeyDictionary()
_LAST_AUTO: list[int | None] = [None]


def _auto_state(name: str, fn: Any, memory_limit: Any) -> _AutoBatch:
    """The auto state registered for `fn` (batch_map's `fun`), made on first use."""
    limit = None if memory_limit is None else _memory.parse_memory(name, memory_limit)
    try:
        state = _AUTO_STATES.get(fn)
    except TypeError:  # not weak-referenceable: no cache across calls
        return _AutoBatch(name, memory_limit)
    if state is None or state.limit != limit:
        state = _AutoBatch(name, memory_limit)
        _AUTO_STATES[fn] = state
    return state


def last_batch_size(fn: Callable[..., Any] | None = None) -> int | None:
    """The chunk size that `batch_size="auto"` chose most recently.

    Args:
      fn: a function returned by `batch_vmap(..., batch_size="auto")`, or the `fun`
        given to `batch_map(fun, xs, "auto")`. None (the default) means the most recent
        choice made by any call.

    Returns:
      The batch size chosen by the most recent call (of `fn`, when given), or None if
      no such call has happened yet.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_vmap, last_batch_size
      >>> f = batch_vmap(jnp.sin, batch_size="auto", memory_limit="1MiB")
      >>> y = f(jnp.ones((1000, 100)))
      >>> 1 <= last_batch_size(f) <= 1000
      True
    """
    if fn is None:
        return _LAST_AUTO[0]
    try:
        state = _AUTO_STATES.get(fn)
    except TypeError:  # not weak-referenceable, so never registered
        state = None
    return None if state is None else state.last


def _measure_program(
    name: str,
    run: Callable[[list[Any], _Plan], Any],
    leaves: Sequence[Any],
    dyn: Sequence[int],
    size: int,
) -> Callable[[int], int]:
    """`B -> compiled temp bytes` of the chunked program, on abstract inputs."""
    abstract = []
    for i in dyn:
        aval = jax.typeof(leaves[i])
        abstract.append(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
        )

    def measure(batch: int) -> int:
        plan = _make_plan(size, batch)

        def program(*values):
            full = list(leaves)
            for i, v in zip(dyn, values):
                full[i] = v
            return run(full, plan)

        return _memory.temp_bytes(name, program, abstract)

    return measure


def _check_memory_limit(name: str, batch_size: Any, memory_limit: Any) -> None:
    if memory_limit is None:
        return
    if batch_size != "auto":
        raise ValueError(
            f"{name} memory_limit={memory_limit!r} is only used with "
            f"batch_size='auto', but got batch_size={batch_size!r}."
        )
    _memory.parse_memory(name, memory_limit)


def _aval_str(tree: Any) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def _with_axis(aval: Any, axis: int | None, length: int) -> jax.ShapeDtypeStruct:
    if axis is None:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    shape = (*aval.shape[:axis], length, *aval.shape[axis:])
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def _check_reduction(
    name: str,
    reduction: Callable[[Any, Any], Any],
    chunk_reduction: Callable[[Any], Any],
    out_tree: Any,
    out_avals: Sequence[Any],
    out_axes: Sequence[int | None],
    lengths: Sequence[int],
) -> Any:
    """Check that `chunk_reduction` removes the mapped axis and `reduction` is a fold.

    `chunk_reduction` is evaluated abstractly on chunks of every length that will occur
    (plus one more when only one does). If its output shapes depend on the chunk length,
    it did not reduce over the mapped axis, and folding such results would be wrong (or
    silently broadcast), so this is an error. `reduction(a, a)` must return `a`'s exact
    structure, shapes and dtypes, as a fold carry must.
    """
    lengths = sorted(set(lengths))
    if len(lengths) == 1:
        lengths.append(lengths[0] + 1)
    summaries = []
    for length in lengths:
        chunk = out_tree.unflatten(
            [_with_axis(a, ax, length) for a, ax in zip(out_avals, out_axes)]
        )
        summaries.append(jax.eval_shape(chunk_reduction, chunk))
    first = summaries[0]
    for length, other in zip(lengths[1:], summaries[1:]):
        same = jax.tree.structure(first) == jax.tree.structure(other) and all(
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other))
        )
        if not same:
            hint = (
                " chunk_reduction is the identity (the default): pass one that sums up "
                "a chunk along the mapped axis, e.g. chunk_reduction=lambda y: "
                "y.sum(0) with reduction=jnp.add, or drop reduction."
                if chunk_reduction is identity
                else " It must reduce over the mapped axis, e.g. lambda y: y.sum(0)."
            )
            raise ValueError(
                f"{name} with a reduction needs a chunk_reduction whose output does "
                f"not depend on the chunk length, but its output still has the mapped "
                f"axis: for a chunk of {lengths[0]} examples it returns "
                f"{_aval_str(first)}, for {length} examples {_aval_str(other)}.{hint}"
            )
    folded = jax.eval_shape(ft.partial(_fold, reduction), first, first)
    same = jax.tree.structure(first) == jax.tree.structure(folded) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(folded))
    )
    if not same:
        raise ValueError(
            f"{name} reduction must combine two chunk summaries into one of the same "
            f"structure, shapes and dtypes (it is applied leaf by leaf), but on "
            f"{_aval_str(first)} it returns {_aval_str(folded)}."
        )
    return first


def _zero_examples(name: str) -> ValueError:
    return ValueError(
        f"{name} cannot reduce over zero examples: the mapped axis has size 0 and the "
        f"reduction has no identity element to return. Check for empty inputs before "
        f"calling, or drop reduction."
    )


# --------------------------------------------------------------------------------------
# batch_vmap


def batch_vmap(
    f: F,
    /,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    *,
    batch_size: int | str | None = None,
    reduction: Callable[[Any, Any], Any] | None = None,
    chunk_reduction: Callable[[Any], Any] = identity,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
    **kwargs: Any,
) -> F:
    """Vectorise `f` like `jax.vmap`, evaluating the examples `batch_size` at a time.

    `batch_vmap(f, in_axes, out_axes, batch_size=B)(*args)` gives the same result as
    `jax.vmap(f, in_axes, out_axes)(*args)`, but maps `jax.vmap(f)` over chunks of `B`
    examples inside a `lax.scan`, so the working memory of `f` scales with `B`, not with
    the number of examples `N`. The result is exact for every `N`; when `B >= N` (or
    `B` is None) it is a single `jax.vmap` call. As pseudo-code::

        vf = jax.vmap(f, in_axes, out_axes)
        chunks = [vf(*args[i:i + B]) for i in range(0, N, B)]
        out = concatenate(chunks, axis=out_axes)

    When `B` does not divide `N`, the last chunk is the window of the last `B` examples
    (it overlaps the previous chunk, and its first `B - N % B` results are discarded):
    `f` appears once in the compiled program and is traced once per call, and no padded
    example is ever evaluated. The cost is at most `B - 1` recomputed examples. The
    chunks are written straight into the output (no concatenation), and the inputs are
    sliced in place along their own mapped axes (no transpose, no copy).

    With `reduction`, the chunk outputs are folded instead of stacked, so nothing of
    size `N` is ever built: each chunk's output pytree `y` is summarised by
    `chunk_reduction(y)`, which must remove the mapped axis (e.g. `lambda y: y.sum(0)`),
    and the summaries are combined in order, leaf by leaf, with the associative
    `reduction` (e.g. `jnp.add`, `jnp.maximum`, `jnp.matmul`): the result is
    `chunk_reduction(jax.vmap(f)(*args))` for reductions compatible with it. No identity
    element is assumed. `chunk_reduction` receives each chunk's outputs exactly as
    `jax.vmap` returns them for that chunk, so outputs with `out_axes=None` appear once
    per chunk: summarise only the mapped ones, or the result depends on `B`. Without
    `reduction`, `chunk_reduction` is applied once to the full output.

    Compared with `jax.lax.map(f, xs, batch_size=B)`: any `in_axes`/`out_axes` (not just
    axis 0 of every argument), keyword arguments, reductions that never materialise the
    `N` outputs, one trace of `f` instead of two, and no copy of the inputs or of the
    output for the remainder. Compared with `optax.microbatching.micro_vmap`: `N` need
    not be divisible by `B`, and any associative reduction is allowed.

    Reverse mode stays bounded too: with `remat=True` (the default) each chunk is
    checkpointed, so `jax.grad` through `batch_vmap` saves one index per chunk instead
    of every chunk's activations, and recomputes a chunk's forward pass during the
    backward pass (about one extra forward evaluation in total). `remat=False` keeps the
    residuals instead: faster, with memory growing with `N`. Where to put `grad`:
    `batch_vmap(jax.grad(loss))` (per-example gradients, chunked) needs no remat at all
    and is usually the better shape; `jax.grad(lambda p: batch_vmap(...)(p, x).sum())`
    is the one that relies on remat.

    Called eagerly (no argument is a tracer), the returned function compiles the
    chunked program once per argument structure, array types and values of non-array
    arguments, as `jax.jit` would, and reuses it on later calls (so `f` is traced on
    the first call only); under an outer `jax.jit` the caller's cache does that.

    `batch_size="auto"` picks the largest chunk whose temporary memory, by XLA's
    compiled estimate for the actual argument shapes, fits `memory_limit`. It compiles
    a few probe programs on the first call for each set of shapes and caches the
    choice; `chunkvmap.last_batch_size(fn)` shows it, and the `chunkvmap` logger
    reports it at INFO level. The budget covers the evaluation as called: under
    `jax.grad` the backward pass adds its own working set, and under an outer
    `jax.vmap` the choice is made for one outer example.

    Args:
      f: the function to vectorise; it receives single examples, as with `jax.vmap`.
      in_axes: an int, None, or a tuple with one entry per positional argument of the
        returned function, each a pytree prefix of that argument whose leaves are ints
        (the mapped axis, negative counts from the end) or None (not mapped). Keyword
        arguments are always mapped over their leading axis.
      out_axes: an int, None, or a pytree prefix of `f`'s output: where the mapped axis
        goes in each output (None: the output does not depend on the mapped axis).
      axis_name: a name for the mapped axis, for collectives inside `f`. Collectives
        would only see one chunk, so it is an error when the evaluation is chunked.
      axis_size: the mapped length, needed when no argument is mapped.
      batch_size: examples per chunk: a positive int, None for one `jax.vmap` call, or
        `"auto"` to choose it from `memory_limit`. `chunk_size` is accepted as an
        alias.
      reduction: None (stack the outputs, as `jax.vmap` does), or an associative binary
        function folding two chunk summaries into one, applied to each leaf of the
        summaries (`jax.tree.map(reduction, a, b)`).
      chunk_reduction: summarises one chunk's output along the mapped axis (with
        `reduction`), or post-processes the whole output (without it).
      shard: spread the examples over the devices of `mesh` first: the divisible
        prefix (N - N % D for D devices) is split evenly, each device runs its own
        chunks of `batch_size` (and its own remainder window), and the global
        remainder (N % D examples) is evaluated once, by one device. Stacked outputs
        stay sharded along the mapped axis when D divides N, and come back replicated
        otherwise; reductions fold the per-device results in device order. Runs
        multi-host under `jax.distributed` unchanged.
      mesh: a one-dimensional `jax.sharding.Mesh` whose axis has type
        `AxisType.Auto`, used with `shard=True`. None means the ambient mesh of
        `jax.set_mesh` if it is such a mesh, else one mesh over all devices (built
        once). Concrete inputs committed to other devices are moved onto the mesh;
        inputs typed with an `Explicit` sharding are an error.
      remat: checkpoint each chunk for reverse mode: True (the default; save nothing,
        recompute the chunk), False (save every chunk's residuals), or a
        `jax.checkpoint` policy such as `jax.checkpoint_policies.dots_saveable`.
      memory_limit: the budget of temporary memory for `batch_size="auto"`: bytes, or
        a string such as `"2GiB"` or `"512MB"`. None means half of the device's
        memory where the backend reports it (it is required on CPU).
      progress: show a host-side progress bar over the chunks: False (the default),
        True (a `tqdm` bar when tqdm is installed, else a line on stderr), a
        callable `progress(done, total)` called after each chunk, or a tqdm-like
        object whose `update(1)` is called after each chunk (its `total` is set when
        it has none). It works under `jax.jit` (one `jax.debug.callback` per chunk,
        no other synchronisation) and with `shard=True`, where only the device at
        mesh index 0 reports its own chunks. Results are unchanged. The callback
        runs with the forward pass: recomputing it (an outer `jax.checkpoint`,
        `nn.remat`, `nnx.remat`) reports the chunks again; chunkvmap's own `remat`
        does not.
      **kwargs: only `chunk_size`, the alias of `batch_size`.

    Returns:
      A function with the signature of `f`, vectorised over the mapped axes.

    Raises:
      TypeError: for a non-callable `f`, `reduction` or `chunk_reduction`, a
        non-integer `batch_size`, a malformed `in_axes`/`out_axes`, or an unknown
        keyword argument.
      ValueError: (when the returned function is called) for mapped arguments of
        different sizes, axes out of range, specs that do not match the arguments, a
        `chunk_reduction` that keeps the mapped axis, a reduction over zero examples,
        or a `memory_limit` too small for one example.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from chunkvmap import batch_vmap
      >>> x = jnp.arange(10.0).reshape(5, 2)
      >>> batch_vmap(jnp.sum, batch_size=2)(x)
      Array([ 1.,  5.,  9., 13., 17.], dtype=float32)
      >>> batch_vmap(jnp.dot, in_axes=(0, None), batch_size=3)(x, jnp.ones(2))
      Array([ 1.,  5.,  9., 13., 17.], dtype=float32)
      >>> batch_vmap(jnp.sum, batch_size=2, reduction=jnp.add,
      ...            chunk_reduction=lambda y: y.sum(0))(x)
      Array(45., dtype=float32)
      >>> batch_vmap(jnp.sum, batch_size=2, reduction=jnp.maximum,
      ...            chunk_reduction=lambda y: y.max(0))(x)
      Array(17., dtype=float32)
    """
    name = "batch_vmap"
    _check_callable(name, "f", f, allow_none=False)
    batch_size = _resolve_batch_size(name, batch_size, kwargs)
    in_axes = _axes.check_axes_spec("in_axes", in_axes, top_level_tuple=True)
    out_axes = _axes.check_axes_spec("out_axes", out_axes, top_level_tuple=False)
    axis_size = _axes.check_positive_int("axis_size", axis_size, allow_zero=True)
    _check_callable(name, "reduction", reduction, allow_none=True)
    _check_callable(name, "chunk_reduction", chunk_reduction, allow_none=False)
    _check_remat(name, remat)
    _check_memory_limit(name, batch_size, memory_limit)
    check_shard_args(name, shard, mesh)
    _progress.check_progress(name, progress)
    report = _progress.reporter(progress)
    auto = _AutoBatch(name, memory_limit) if batch_size == "auto" else None

    def call(args: tuple, call_kwargs: dict) -> Any:
        return _batch_vmap_call(
            f,
            args,
            call_kwargs,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=axis_size,
            batch_size=batch_size,
            reduction=reduction,
            chunk_reduction=chunk_reduction,
            remat=remat,
            auto=auto,
            shard=shard,
            mesh=mesh,
            report=report,
        )

    # Sharded calls place their inputs on the mesh first, so they are not wrapped; a
    # plain vmap (nothing to chunk, fold or report) runs eagerly as jax.vmap does.
    plain = batch_size is None and reduction is None and report is None
    eager = None if shard or plain else _EagerCache(call)

    @ft.wraps(f)
    def batched(*args: Any, **call_kwargs: Any) -> Any:
        if eager is not None:
            return eager(args, call_kwargs)
        return call(args, call_kwargs)

    if auto is not None:
        _AUTO_STATES[batched] = auto
    return batched  # pyright: ignore[reportReturnType]


class _EagerCache:
    """Eager calls (no argument is a tracer) through one cached `jax.jit` per call
    structure, so that calling the same batched function again with arguments of the
    same types reuses the compiled program instead of tracing and compiling the
    chunked loop anew (under an outer `jax.jit` that cache is the caller's own).

    The key is the pytree structure and the values of the non-array leaves (hashable
    Python values, as static arguments of `jax.jit`); array leaves are the jitted
    function's arguments, so `jax.jit` keys them by type and sharding. Calls with
    NumPy arrays or unhashable leaves are not cached (they are evaluated as before).
    """

    max_entries = 32

    def __init__(self, call: Callable[[tuple, dict], Any]):
        self.call = call
        self.entries: dict[Any, Callable[..., Any]] = {}

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        flat, treedef = jax.tree.flatten((args, kwargs))
        static = []
        for i, x in enumerate(flat):
            if isinstance(x, jax.core.Tracer) or isinstance(x, np.ndarray):
                return self.call(args, kwargs)
            if isinstance(x, jax.Array):
                continue
            try:
                hash(x)
            except TypeError:
                return self.call(args, kwargs)
            static.append((i, type(x), x))
        dyn = [i for i, x in enumerate(flat) if isinstance(x, jax.Array)]
        key = (treedef, tuple(static))
        run = self.entries.pop(key, None)
        if run is None:
            if len(self.entries) >= self.max_entries:
                self.entries.pop(next(iter(self.entries)))  # least recently used
            run = self._compile(treedef, flat, dyn)
        self.entries[key] = run
        return run(*[flat[i] for i in dyn])

    def _compile(self, treedef: Any, flat: list, dyn: list[int]):
        template = list(flat)
        for i in dyn:
            template[i] = None  # the arrays of this call are not kept alive

        @jax.jit
        def run(*values: Any) -> Any:
            full = list(template)
            for i, v in zip(dyn, values):
                full[i] = v
            args, kwargs = jax.tree.unflatten(treedef, full)
            return self.call(args, kwargs)

        return run


def chunk_options(
    *,
    reduction: Callable[[Any, Any], Any] | None = None,
    chunk_reduction: Callable[[Any], Any] = identity,
    **options: Any,
) -> dict[str, Any]:
    """`options` for later `batch_vmap` calls, validated now (with `reduction` and
    `chunk_reduction`) by building one, so that wrappers raise the core's errors, which
    name the argument, when they are constructed rather than when first called."""
    batch_vmap(
        identity, reduction=reduction, chunk_reduction=chunk_reduction, **options
    )
    return options


def _flatten_inputs(in_axes: Any, args: tuple, kwargs: dict) -> tuple:
    """Flatten `(args, kwargs)` to leaves, key paths and canonical per-leaf axes."""
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        raise ValueError(
            f"batch_vmap in_axes must have one entry per positional argument, but "
            f"in_axes={in_axes!r} has {len(in_axes)} entries and the function was "
            f"called with {len(args)} positional argument(s)."
        )
    arg_axes = _axes.broadcast_axes("in_axes", in_axes, args, "positional arguments")
    kw_axes = [0] * len(jax.tree.leaves(kwargs))
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    paths = []
    for path, _ in path_leaves:
        head, rest = path[0], path[1:]
        root = "args" if head.idx == 0 else "kwargs"  # pyright: ignore
        paths.append(root + jax.tree_util.keystr(rest))
    leaves = [leaf for _, leaf in path_leaves]
    axes = [
        _axes.canonical_in_axis(a, x, p)
        for a, x, p in zip(arg_axes + kw_axes, leaves, paths)
    ]
    leaves = [
        x if a is None or isinstance(x, jax.Array) else jnp.asarray(x)
        for x, a in zip(leaves, axes)
    ]
    return leaves, paths, axes, treedef


def _batch_vmap_call(
    f,
    args,
    call_kwargs,
    *,
    in_axes,
    out_axes,
    axis_name,
    axis_size,
    batch_size,
    reduction,
    chunk_reduction,
    remat,
    auto,
    shard,
    mesh,
    report,
):
    name = "batch_vmap"
    leaves, paths, axes, treedef = _flatten_inputs(in_axes, args, call_kwargs)
    size = _axes.mapped_size(paths, leaves, axes, axis_size)

    if reduction is None and batch_size is None and not shard and report is None:
        # Plain jax.vmap: nothing to chunk and nothing to fold.
        out = jax.vmap(f, in_axes, out_axes, axis_name=axis_name, axis_size=axis_size)(
            *args, **call_kwargs
        )
        return out if chunk_reduction is identity else chunk_reduction(out)
    if reduction is not None and size == 0:
        raise _zero_examples(name)

    # Array leaves (and every mapped leaf) become arguments of one jitted function;
    # everything else (Python scalars, strings, objects with in_axes=None) is closed
    # over unchanged, exactly as jax.vmap hands it to f.
    dyn = [
        i
        for i, (x, a) in enumerate(zip(leaves, axes))
        if a is not None or isinstance(x, jax.Array)
    ]
    out_box: list[Any] = []

    @jax.jit
    def f_flat(*dyn_leaves):
        full = list(leaves)
        for i, x in zip(dyn, dyn_leaves):
            full[i] = x
        f_args, f_kwargs = jax.tree.unflatten(treedef, full)
        out_leaves, out_tree = jax.tree.flatten(f(*f_args, **f_kwargs))
        out_box[:] = [out_tree]
        return out_leaves

    dyn_axes = [axes[i] for i in dyn]
    no_mapped_arg = all(a is None for a in dyn_axes)
    # Abstract evaluation under vmap (so collectives over axis_name resolve): it learns
    # the output structure and fills JAX's trace cache for the real evaluation below.
    mapped_avals = jax.eval_shape(
        jax.vmap(
            f_flat,
            in_axes=tuple(dyn_axes),
            out_axes=0,
            axis_name=axis_name,
            axis_size=size if no_mapped_arg else None,
        ),
        *[leaves[i] for i in dyn],
    )
    out_avals = [_drop_leading(a) for a in mapped_avals]
    (out_tree,) = out_box
    out_paths = [
        "out" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(out_tree.unflatten(out_avals))[
            0
        ]
    ]
    out_axes_flat = [
        _axes.canonical_out_axis(a, len(aval.shape), p)
        for a, aval, p in zip(
            _axes.broadcast_axes(
                "out_axes", out_axes, out_tree.unflatten(out_avals), "function's output"
            ),
            out_avals,
            out_paths,
        )
    ]

    def chunk_fn(chunk_leaves: list[Any], length: int) -> list[Any]:
        vf = jax.vmap(
            f_flat,
            in_axes=tuple(dyn_axes),
            out_axes=list(out_axes_flat),
            axis_name=axis_name,
            axis_size=length if no_mapped_arg else None,
        )
        return vf(*[chunk_leaves[i] for i in dyn])

    run = _Chunked(
        name,
        chunk_fn,
        axes,
        out_tree,
        out_avals,
        out_axes_flat,
        reduction,
        chunk_reduction,
        remat,
        report,
    )
    if shard and size:
        if axis_name is not None:
            raise ValueError(
                f"{name} got axis_name={axis_name!r} with shard=True: collectives "
                f"over {axis_name!r} inside f would only see one device's chunk."
            )
        return run.sharded(mesh, paths, leaves, dyn, size, batch_size)
    key = (treedef, tuple((jax.typeof(leaves[i]), axes[i]) for i in dyn))
    key += (_static_key(leaves, dyn),)
    plan = run.plan(batch_size, auto, leaves, dyn, size, key)
    if axis_name is not None and not plan.single:
        raise ValueError(
            f"{name} got axis_name={axis_name!r} with batch_size={plan.batch} < "
            f"{size} examples: collectives over {axis_name!r} inside f would only see "
            f"one chunk of examples. Use batch_size=None (or >= {size}) with axis_name."
        )
    return run(list(leaves), plan)


# --------------------------------------------------------------------------------------
# batch_map


def batch_map(
    fun: Callable[[Any], Any],
    xs: Any,
    /,
    batch_size: int | str | None = None,
    *,
    reduction: Callable[[Any, Any], Any] | None = None,
    chunk_reduction: Callable[[Any], Any] = identity,
    strip_dim0: bool = False,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool | Callable[..., Any] = True,
    memory_limit: int | str | None = None,
    progress: Any = False,
) -> Any:
    """Apply an already-vectorised `fun` to `xs` in chunks of `batch_size`.

    `fun` receives whole chunks: a pytree like `xs` whose leaves hold `batch_size` (or,
    for the last chunk, `N % batch_size`) consecutive examples along axis 0, and must
    return a pytree whose leaves have that same leading length. The result is
    `fun(xs)` evaluated piecewise, i.e. ::

        concatenate([fun(xs[i:i + batch_size]) for i in range(0, N, batch_size)])

    with the chunks written into one preallocated output. No `jax.vmap` is added, which
    makes it cheaper to compile than `batch_vmap` and free of vmap-of-control-flow and
    custom-derivative pitfalls. As in `batch_vmap`, the remainder is handled by a last
    window of `batch_size` real examples, so `fun` always sees chunks of one size and is
    traced once; `remat` and `batch_size="auto"` / `memory_limit` work as there.

    With `strip_dim0=True` (which needs `batch_size=1`) `fun` receives single examples
    (the leading axis removed) and its outputs get the axis back, as in `lax.map`.

    `reduction` / `chunk_reduction` work as in `batch_vmap`: `chunk_reduction`
    summarises one chunk's output along axis 0, `reduction` folds the summaries in
    order.

    Args:
      fun: a vectorised function of one pytree argument.
      xs: a pytree of arrays sharing their leading length `N`.
      batch_size: examples per chunk (positive int), None for a single call, or
        `"auto"` to choose it from `memory_limit`.
      reduction: None, or an associative binary function folding chunk summaries.
      chunk_reduction: summarises a chunk's output (with `reduction`), or
        post-processes the whole output (without it).
      strip_dim0: hand `fun` single examples; requires `batch_size=1`.
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: a one-dimensional `Auto` `jax.sharding.Mesh`, with `shard=True`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"` (see `batch_vmap`).
      progress: a progress bar over the chunks (see `batch_vmap`).

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
    _check_callable(name, "fun", fun, allow_none=False)
    batch_size = _check_batch_size(name, "batch_size", batch_size)
    _check_memory_limit(name, batch_size, memory_limit)
    _check_callable(name, "reduction", reduction, allow_none=True)
    _check_callable(name, "chunk_reduction", chunk_reduction, allow_none=False)
    if not isinstance(strip_dim0, bool):
        raise TypeError(
            f"{name} strip_dim0 must be a bool, but got strip_dim0={strip_dim0!r}."
        )
    if strip_dim0 and batch_size != 1:
        raise ValueError(
            f"{name} strip_dim0=True hands fun single examples, so it needs "
            f"batch_size=1, but got batch_size={batch_size}."
        )
    _check_remat(name, remat)
    check_shard_args(name, shard, mesh)
    _progress.check_progress(name, progress)

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
    axes = [
        _axes.canonical_in_axis(0, x, p, transform=name, arg="xs")
        for x, p in zip(leaves, paths)
    ]
    size = _axes.mapped_size(paths, leaves, axes, None, transform=name)
    if reduction is not None and size == 0:
        raise _zero_examples(name)
    out_box: list[Any] = []

    @jax.jit
    def fun_flat(*chunk_leaves):
        chunk = jax.tree.unflatten(treedef, chunk_leaves)
        if strip_dim0:
            out = jax.tree.map(
                lambda y: jnp.expand_dims(y, 0),
                fun(jax.tree.map(lambda a: a[0], chunk)),
            )
        else:
            out = fun(chunk)
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

    def chunk_fn(chunk_leaves: list[Any], length: int) -> list[Any]:
        return fun_flat(*chunk_leaves)

    if strip_dim0 and size == 0:
        example = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves]
        out = jax.eval_shape(lambda *ls: fun(jax.tree.unflatten(treedef, ls)), *example)
        out = jax.tree.map(lambda a: zeros((0, *a.shape), a), out)
        return out if chunk_reduction is identity else chunk_reduction(out)

    if batch_size == "auto":
        probe = min(size, 1)  # the first size the search measures
    else:
        probe = _make_plan(size, batch_size).batch
    chunk_avals = [
        jax.ShapeDtypeStruct(
            (probe, *x.shape[1:]), x.dtype, weak_type=jax.typeof(x).weak_type
        )
        for x in leaves
    ]
    out_chunk_avals = jax.eval_shape(fun_flat, *chunk_avals)
    (out_tree,) = out_box
    out_avals = [_drop_leading(a) for a in out_chunk_avals]
    out_axes = [0] * len(out_avals)

    run = _Chunked(
        name,
        chunk_fn,
        axes,
        out_tree,
        out_avals,
        out_axes,
        reduction,
        chunk_reduction,
        remat,
        _progress.reporter(progress),
    )
    if shard and size:
        return run.sharded(mesh, paths, leaves, range(len(leaves)), size, batch_size)
    auto = _auto_state(name, fun, memory_limit) if batch_size == "auto" else None
    key = (treedef, tuple(jax.typeof(x) for x in leaves))
    key += (id(reduction), id(chunk_reduction), remat, strip_dim0)
    plan = run.plan(batch_size, auto, leaves, range(len(leaves)), size, key)
    return run(list(leaves), plan)
