"""The kernel: the chunk plan, in-place slicing, and the stacked and reduced scans.

* the chunks (`Chunks`): how many chunks, how large the remainder, where the examples
  start (a device of a sharded evaluation reads its share in place);
* slicing (`take`): a chunk is a `dynamic_slice` of the original input along its own
  mapped axis, so inputs are never transposed or copied (in the stacked loop without
  remainder, a leaf mapped along axis 0 is instead the scan's `xs`, a free reshape to
  `(N / B, B, ...)`; on a TPU a loop that reads more than it writes reads its
  float32 and bfloat16 chunks through `hold`, so that XLA does not convert the
  whole input before the loop);
* the loop (`stacked`, `reduced`): a `lax.scan` over chunk indices, each chunk
  checkpointed for reverse mode (`checkpointed`);
* the remainder: when `B` does not divide `N`, the last chunk is the window of the last
  `B` real examples, overlapping the previous chunk, so the chunk function has one
  shape and appears once in the program (no padding, no second trace);
* a padded buffer (`Chunks.padded`): its real examples are evaluated first, gathered
  chunk by chunk, and the folding scan skips the chunks of padding alone at run time
  (a `cond` around the step), so one program serves every count of real examples;
* output assembly: stacked outputs are written with `dynamic_update_slice` into one
  preallocated buffer per output leaf, at the requested output axis (no concatenation,
  no transpose, no second output-sized buffer); an `Accumulator` folds summaries in a
  carry and writes per-example rows into such buffers, leaf by leaf.

Nothing else in chunkvmap slices or loops; nothing here knows about axis specs, caching,
sharding or the user's function beyond its chunk function (`ChunkFn`).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _memory
from ._axes import ARRAY_TYPES, combine, stacked as stacked_type
from ._options import identity


@dataclasses.dataclass(frozen=True)
class Chunks:
    size: int  # N, the mapped length
    # B, 1 <= B <= N (or B = N = 0); or B > N: one window of B examples ending where
    # the N end, only its last N outputs kept (`window`)
    batch: int
    # Where the N examples start in the leaves' mapped axes (may be traced): a device
    # of a sharded evaluation reads its examples in place from whole inputs.
    offset: Any = 0
    # A padded buffer (`padded`): the N examples in the order they are evaluated
    # (real ones first; traced indices, None: as they are), and how many are real
    # (traced): chunks of padding alone are skipped at run time.
    order: Any = None
    count: Any = None
    # The leaf of a padded buffer's flags (read as it is), and the example that
    # stands in for its padding in every other mapped leaf (`stand_in`): no padding
    # value reaches the function, so none reaches a derivative either.
    flags: int | None = None
    real: Any = None
    # Of shares: one real example of each mapped leaf (of any share: a share of
    # padding alone has none of its own), replicated.
    rows: Any = None

    @property
    def num_chunks(self) -> int:
        """Loop iterations: ceil(N / B)."""
        return -(-self.size // self.batch) if self.batch else 0

    @property
    def rem(self) -> int:
        return self.size % self.batch if self.batch else 0

    @property
    def single(self) -> bool:
        """Whether everything is one vmap call (no loop; of a padded buffer,
        skipped where it holds padding alone: `when_active`)."""
        return self.batch == self.size

    @property
    def wide(self) -> bool:
        """Whether the one chunk is a window wider than the N examples (`window`)."""
        return self.batch > self.size

    def start(self, i: Any) -> Any:
        """First example of chunk `i`; the last chunk is the window `[N - B, N)`."""
        # lax, not jnp, on the traced index: this is traced once per loop, and jnp's
        # operators cost noticeably more Python per call.
        first = lax.mul(i, np.array(self.batch, i.dtype))
        if self.rem == 0:
            return first
        return lax.min(first, np.array(self.size - self.batch, i.dtype))

    def chunk(self, leaves: Sequence[Any], axes: Sequence[int | None], i: Any):
        """The inputs of chunk `i` (read at `offset + start(i)`; of a padded
        buffer, the examples `order` puts there, gathered)."""
        start = self.start(i)
        if self.order is not None:
            chunk = gather(leaves, axes, self.indices(i), self.shared)
        else:
            if not (isinstance(self.offset, int) and self.offset == 0):
                start = self.offset + start
            chunk = take(leaves, axes, start, self.batch)
        return self.stand_in(chunk, leaves, axes)

    def padded(self, padding: jax.Array, flags: int, rows: Any = None) -> Chunks:
        """This plan over a padded buffer: `padding[j]` marks example `j` as
        padding, and the leaf `flags` holds the flags. The real examples are
        evaluated first, in their order (a stable partition, `_real_first`), and
        the chunks after the last real one are skipped (`active`); a window wider
        than the examples (`wide`) is evaluated as it is. Either way, the padding a
        chunk holds is evaluated on a real example's values (`stand_in`).
        `padding` of shape `(D, N)`: D shares' (`Body.run_shares`), each in its
        own order, and a chunk is skipped where every share's is padding alone;
        `rows` then holds the real example that stands in (`stand_in`)."""
        if self.wide:  # `padding`: the window's, from its first example
            first = self.offset + (self.size - self.batch)
            real = jnp.argmin(padding).astype(np.int32) + first
            return dataclasses.replace(self, flags=flags, real=real)
        if padding.ndim == 2:  # each share's, by the same rule
            order, count = jax.vmap(lambda p: _real_first(p, self.size))(padding)
            real = order[:, 0] + self.offset  # (each share's first real example)
        else:
            order, count = _real_first(padding, self.size)
            real = order[0] + self.offset
        return dataclasses.replace(
            self, order=order, count=count, flags=flags, real=real, rows=rows
        )

    def stand_in(
        self, chunk: list[Any], leaves: Sequence[Any], axes: Sequence[int | None]
    ) -> list[Any]:
        """A padded buffer's chunk with each padding example's values replaced,
        leaf by leaf, by those of a real example (the flags kept): the function's
        outputs there are zeroed, and its derivatives there are then finite (zero
        cotangents times a finite Jacobian), whatever the padding holds."""
        if self.flags is None:
            return chunk
        pad = chunk[self.flags]  # (B,), or (D, B) for shares
        out = []
        for k, (x, a) in enumerate(zip(chunk, axes)):
            if a is None or k == self.flags:
                out.append(x)
                continue
            if self.shared and self.rows is not None:  # one for every share
                s = jnp.expand_dims(self.rows[k], (a - 1, a))
            elif self.shared:  # each share's own
                (s,) = gather([leaves[k]], [a], self.real[:, None], shared=True)
            else:
                s = lax.dynamic_slice_in_dim(leaves[k], self.real, 1, a)
            shape = [1] * x.ndim
            shape[a - pad.ndim + 1 : a + 1] = pad.shape
            out.append(jnp.where(pad.reshape(shape), s, x))
        return out

    @property
    def shared(self) -> bool:
        """Whether the plan is over D shares' padded buffers (`padded`)."""
        return self.order is not None and self.order.ndim == 2

    def positions(self, i: Any) -> jax.Array:
        """The examples chunk `i` of a padded buffer evaluates (their places among
        the plan's N; of each share's, `(D, B)`, for shares)."""
        return lax.dynamic_slice_in_dim(self.order, self.start(i), self.batch, -1)

    def indices(self, i: Any) -> jax.Array:
        """`positions(i)` in the leaves' mapped axes (`offset` added)."""
        idx = self.positions(i)
        if isinstance(self.offset, int) and self.offset == 0:
            return idx
        return idx + self.offset

    def fresh(self, i: Any) -> jax.Array:
        """Which of chunk `i`'s rows no earlier chunk covered: all of them, but of
        the last window only its last `N % B` (of a window wider than N, its last
        N)."""
        if self.wide:
            first = np.int32(self.batch - self.size)
        else:
            last = np.array(self.num_chunks - 1, i.dtype)
            first = lax.select(i == last, np.int32(self.batch - self.rem), np.int32(0))
        return lax.iota(jnp.int32, self.batch) >= first

    def active(self, i: Any) -> Any:
        """Whether chunk `i` holds a real example (always, without padding)."""
        if self.count is None:
            return True
        real = jnp.max(self.count) if self.shared else self.count
        return lax.lt(lax.mul(i, np.array(self.batch, i.dtype)), real)

    def when_active(self, evaluate: Callable[[], Any]) -> Any:
        """`evaluate()` of the one chunk of a `single` plan; of a padded buffer,
        zeros where it holds padding alone (a `cond`: not evaluated then, so that
        no padding value reaches a derivative)."""
        if self.count is None:
            return evaluate()
        shapes = jax.eval_shape(evaluate)
        return lax.cond(
            self.active(jnp.int32(0)),
            evaluate,
            lambda: jax.tree.map(lambda a: zeros(a.shape, a), shapes),
        )

    def whole(self, leaves: Sequence[Any], axes: Sequence[int | None]) -> list[Any]:
        """The leaves restricted to the plan's N examples (one chunk, no loop)."""
        if isinstance(self.offset, int) and self.offset == 0:
            whole = list(leaves)
        else:
            whole = take(leaves, axes, self.offset, self.size)
        return self.stand_in(whole, leaves, axes)


def _real_first(padding: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """The `size` examples with the real ones first, each group in its order (a
    stable partition: a running count places each example, cheaper than a sort),
    and how many are real."""
    real = ~padding
    count = jnp.sum(real, dtype=np.int32)
    place = jnp.where(
        real,
        jnp.cumsum(real, dtype=np.int32) - 1,
        count + jnp.cumsum(padding, dtype=np.int32) - 1,
    )
    examples = jnp.arange(size, dtype=np.int32)
    order = jnp.zeros(size, np.int32).at[place].set(examples, unique_indices=True)
    return order, count


def make_plan(size: int, batch_size: Any, offset: Any = 0) -> Chunks:
    if batch_size is None or batch_size >= size:
        return Chunks(size, size, offset)
    return Chunks(size, batch_size, offset)


def share_length(size: int, devices: int, batch_size: Any) -> int:
    """The length of the chunks of `size` examples split over `devices` shares (all
    of them on one device when fewer than the devices), at most `batch_size`: what
    each device's chunks and a global remainder's have (`window`), and what the
    chunk is first traced at."""
    return make_plan(size // devices or size, batch_size).batch


def window(size: int, length: int, offset: Any) -> Chunks:
    """The `size` examples from `offset`, in chunks of `length` (`length` examples
    must end where they end): where fewer than `length`, one window of `length`
    examples ending with them, of which only their `size` outputs are kept, so
    that a chunk traced at `length` serves them (a sharded call's global
    remainder, after the devices' shares, is not traced at its own length)."""
    if size >= length:
        return make_plan(size, length, offset)
    return Chunks(size, length, offset)


def gather(
    leaves: Sequence[Any], axes: Sequence[int | None], indices: jax.Array,
    shared: bool = False,
) -> list[Any]:  # fmt: skip
    """The examples `indices` of each mapped leaf (a chunk of a padded buffer).
    `shared`: `indices` is `(D, B)`, each share's examples (the shares before each
    mapped axis)."""

    def pick(x: jax.Array, idx: jax.Array, a: int) -> jax.Array:
        return jnp.take(x, idx, axis=a, mode="clip", unique_indices=True)

    def take_at(x: jax.Array, a: int) -> jax.Array:
        if shared:  # share by share (the shares at a - 1)
            one = ft.partial(pick, a=a - 1)
            return jax.vmap(one, in_axes=(a - 1, 0), out_axes=a - 1)(x, indices)
        return pick(x, indices, a)

    return [x if a is None else take_at(x, a) for x, a in zip(leaves, axes)]


def take(leaves: Sequence[Any], axes: Sequence[int | None], start: Any, length: int):
    """The chunk `[start, start + length)` of each mapped leaf (`start` traced)."""
    return [
        x if a is None else lax.dynamic_slice_in_dim(x, start, length, axis=a)
        for x, a in zip(leaves, axes)
    ]


# The platforms where a stacked loop reads each chunk's floating inputs through
# `hold` and writes its outputs in place (`_write_chunks`), where it reads more
# than it writes (`_holding`). Measured on a TPU v5e (`benchmarks/probe_loop.py`,
# `bench_loop.py`: a 784-1024-1024-1024-10 MLP forward over 65536 examples in 16
# chunks), XLA:TPU otherwise narrows the whole input to bfloat16 (the default
# precision's operand type) in one pass before the loop, where `jax.vmap`'s single
# product reads it as it is: 0.81x `jax.vmap`'s throughput before, 0.995x with each
# chunk held (the loop form alone, `fori+rp`).
HELD = frozenset({"tpu"})


def hold(x: Any) -> Any:
    """`x` itself, for a float32 or bfloat16 `x`: rounded to its own type's precision
    (`lax.reduce_precision` at its own exponent and mantissa bits, which changes no
    value). XLA:TPU does not narrow a value through it, so each chunk is converted
    where it is used, not the whole input before the loop. It is linear, with
    JAX's own derivatives to every order and a transpose (no custom rule, which
    JAX's partial evaluation would drop inside a differentiated loop; no bit cast,
    which has no transpose)."""
    if not _holdable(x):
        return x
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


# The types `hold` rounds: the TPU's own floating types (float32 is the one XLA:TPU
# narrows, and the one measured); float16, float64 (emulated there) and the 8-bit
# types are read as they are.
_HELD_TYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def _holdable(x: Any) -> bool:
    return x.dtype in _HELD_TYPES and not jax.typeof(x).weak_type


def _read(
    plan: Chunks, leaves: Sequence[Any], axes: Sequence[int | None], i: Any, held: bool
) -> list[Any]:
    """The inputs of `plan`'s chunk `i`, its mapped ones read through `hold` where
    `held`."""
    chunk = plan.chunk(leaves, axes, i)
    if not held:
        return chunk
    return [x if a is None else hold(x) for x, a in zip(chunk, axes)]


def _holding(
    leaves: Sequence[Any], axes: Sequence[int | None], out_avals: Sequence[Any]
) -> bool:
    """Whether a stacked loop reads its chunks through `hold` and writes its
    outputs in place: on the platforms `HELD`, where it has inputs to hold
    and its outputs take no more bytes than they do (on the TPU, writing per-example
    gradients in place took twice the time of stacking them as the scan's outputs:
    `per_example_grads` of the MLP at 0.52x `jax.vmap`'s throughput against 0.98x),
    none of them weakly typed (`_write_chunks` types its outputs strongly)."""
    if _memory.call_platform() not in HELD:
        return False
    held = [(x, a) for x, a in zip(leaves, axes) if a is not None and _holdable(x)]
    # (bytes per example: `out_avals` are an example's outputs)
    read = sum(x.size // max(x.shape[a], 1) * x.dtype.itemsize for x, a in held)
    written = sum(math.prod(a.shape) * a.dtype.itemsize for a in out_avals)
    weak = any(getattr(a, "weak_type", False) for a in out_avals)
    return bool(held) and not weak and written <= read


def regroup(x: Any, shape: Sequence[int]) -> Any:
    """`x.reshape(shape)`, one group of adjacent axes merged or split at a time:
    JAX refuses a reshape of several groups at once of an array sharded over
    Explicit axes (a batched `(8@d, 3, 3, 2, 3, 3, 2)` to `(8, 18, 18)`), not one
    group's (`(8@d, 3, 3, 2, 18)`, then `(8, 18, 18)`)."""
    src, dst = tuple(x.shape), tuple(int(n) for n in shape)
    if 0 in src or math.prod(src) != math.prod(dst):
        return jnp.reshape(x, dst)  # (JAX's own error, or nothing to regroup)
    i = j = 0
    while i < len(src) or j < len(dst):
        i0, j0, left, right = i, j, 1, 1
        if i < len(src):
            left, i = src[i], i + 1
        if j < len(dst):
            right, j = dst[j], j + 1
        while left != right:
            if left < right:
                left, i = left * src[i], i + 1
            else:
                right, j = right * dst[j], j + 1
        if (i - i0, j - j0) != (1, 1):
            x = jnp.reshape(x, dst[:j] + src[i:])
    return x


def explicit_spec(spec: Any = ()) -> Any:
    """`spec` (a PartitionSpec or its entries) where the current mesh has Explicit
    axes (a contraction over sharded axes must then say its output's sharding),
    else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return None
    names = set(mesh.explicit_axes)

    def keep(entry: Any) -> Any:  # axes manual here are not the output's to name
        parts = entry if isinstance(entry, tuple) else (entry,)
        parts = tuple(a for a in parts if a in names)
        return parts[0] if len(parts) == 1 else (parts or None)

    return jax.P(*(keep(e) for e in spec))


def example_at(x: jax.Array, i: Any, axis: int) -> jax.Array:
    """Example `i` (traced) of `x` along `axis`, sharded as `x`'s other axes are
    (where the mesh has Explicit axes, the gather must say so)."""
    x = jnp.moveaxis(x, axis, 0)
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    rest = () if spec is None else tuple(spec)[1:]
    out = explicit_spec((None, *rest) + (None,) * (x.ndim - 1 - len(rest)))
    return x.at[jnp.reshape(i, (1,))].get(out_sharding=out)[0]  # (a gather)


def zeros(shape: Sequence[int], aval: Any) -> Any:
    """Zeros of `shape` with `aval`'s dtype, weakly typed when `aval` is, and with its
    sharding type when it has one (Explicit mesh axes) of the same rank."""
    sharding = getattr(aval, "sharding", None)
    context = jax.sharding.get_abstract_mesh()
    if (
        isinstance(sharding, jax.sharding.NamedSharding)
        and sharding.mesh.empty
        and not context.empty
    ):
        # A value typed without a mesh under a context mesh (an input the caller
        # did not place): zeros of that type, not of the context's.
        with jax.sharding.use_abstract_mesh(sharding.mesh):
            return zeros(shape, aval)
    if not (
        isinstance(sharding, jax.sharding.NamedSharding)
        and any(sharding.spec)
        and len(shape) == len(aval.shape)
        and (context.empty or sharding.mesh.abstract_mesh == context)
    ):
        sharding = None
    if getattr(aval, "weak_type", False):
        # A Python scalar keeps the weak type (weak types have the default width).
        return lax.full(shape, np.zeros((), aval.dtype).item(), sharding=sharding)
    return lax.full(shape, 0, aval.dtype, sharding=sharding)


def sharding_in_types(leaves: Sequence[Any]) -> bool:
    """Whether any of `leaves` is typed with a sharding over Explicit mesh axes, or
    an Explicit context mesh types new values (then loop carries must be built with
    the types of the values, not of abstract shapes)."""
    context = jax.sharding.get_abstract_mesh()
    if any(t == jax.sharding.AxisType.Explicit for t in context.axis_types):
        return True
    for x in leaves:
        if isinstance(x, jax.Array):
            mesh = getattr(jax.typeof(x).sharding, "mesh", None)
            types = getattr(mesh, "axis_types", ())
            if any(t == jax.sharding.AxisType.Explicit for t in types):
                return True
    return False


def typed_as(y: Any, like: Any) -> Any:
    """`y` with `like`'s sharding type (a value typed without a mesh, written into a
    buffer typed with the context's, is replicated over it: nothing moves)."""
    want = jax.typeof(like).sharding
    mesh = getattr(want, "mesh", None)
    if mesh is None or mesh.empty or jax.typeof(y).sharding == want:
        return y
    return jax.sharding.reshard(y, want)


def spec_entries(x: Any) -> list[Any]:
    """The PartitionSpec entries of `x`'s type, one per dimension."""
    spec = getattr(jax.typeof(x).sharding, "spec", ())
    return [spec[d] if d < len(spec) else None for d in range(np.ndim(x))]


def _with_entry(y: Any, axis: int, entry: Any) -> Any:
    """`y` with dimension `axis` sharded over `entry` (a no-op when it is)."""
    entries = spec_entries(y)
    if entries[axis] == entry:
        return y
    entries[axis] = entry
    mesh = jax.sharding.get_abstract_mesh()
    return jax.sharding.reshard(
        y, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))
    )


def _write_chunks(
    evaluate: Callable[[Any], list[Any]],
    out_axes: Sequence[int | None],
    chunk_avals: Sequence[Any],
    plan: Chunks,
    report: Callable[[Any], None],
) -> list[Any]:
    """A scan over `plan`'s chunks writing each chunk's outputs (`evaluate(i)`, of
    types `chunk_avals`, mapped along `out_axes`) in place into one buffer per output
    leaf, preallocated with the plan's N examples along its mapped axis (an unmapped
    output keeps the last chunk's value). Over a padded buffer, each chunk is
    written at the examples it evaluated, and the outputs of the chunks of padding
    alone, which are skipped, stay zeros."""

    if plan.order is not None:
        writers = [None if a is None else _scattering_writer(plan, a) for a in out_axes]

        def write(buffers, i):  # a padded buffer's chunk, at the examples it holds
            ys = evaluate(i)
            report(i)
            return [
                typed_as(y, b) if w is None else w(b, typed_as(y, b), i)
                for b, y, w in zip(buffers, ys, writers)
            ]

    def body(buffers, i):
        if plan.order is not None:  # a chunk of padding alone is not evaluated
            return lax.cond(plan.active(i), write, lambda b, i: b, buffers, i), None
        ys = evaluate(i)
        report(i)
        start = plan.start(i)
        if plan.wide:  # the window's last N outputs, from the buffers' start
            ys = [
                y if a is None else _tail(y, plan.size, a) for y, a in zip(ys, out_axes)
            ]
            start = 0
        return [
            y
            if axis is None
            else lax.dynamic_update_slice_in_dim(b, typed_as(y, b), start, axis)
            for b, y, axis in zip(buffers, ys, out_axes)
        ], None

    buffers = _buffers(chunk_avals, out_axes, plan.size)
    with jax.named_scope("chunkvmap"):
        buffers, _ = lax.scan(
            body, buffers, jnp.arange(plan.num_chunks, dtype=np.int32)
        )
    return buffers


def _scanned_stacked(
    evaluate: Callable[[Any], list[Any]],
    out_axes: Sequence[int | None],
    chunk_avals: Sequence[Any],
    plan: Chunks,
    report: Callable[[Any], None],
) -> list[Any]:
    """`Body.stacked` when every mapped output is along axis 0 and `B` divides
    `N`: the mapped outputs are the scan's `ys`, reshaped to `(N, ...)` (free); an
    unmapped output is carried, keeping the last chunk's value."""
    mapped = [k for k, a in enumerate(out_axes) if a is not None]
    unmapped = [k for k, a in enumerate(out_axes) if a is None]

    def body(carry, i):
        ys = evaluate(i)
        report(i)
        return [ys[k] for k in unmapped], [ys[k] for k in mapped]

    init = [zeros(chunk_avals[k].shape, chunk_avals[k]) for k in unmapped]
    with jax.named_scope("chunkvmap"):
        last, stacked = lax.scan(
            body, init, jnp.arange(plan.num_chunks, dtype=np.int32)
        )
    outs: list[Any] = [None] * len(out_axes)
    for k, y in zip(mapped, stacked):
        outs[k] = y.reshape(plan.size, *y.shape[2:])
    for k, y in zip(unmapped, last):
        outs[k] = y
    return outs


def _summary_of_chunk(
    fold: _Fold, leaves: Sequence[Any], plan: Chunks
) -> Callable[[Any], Any]:
    """`Body._fold`'s `(summary, rows)` of chunk `i`: of the last window when `B`
    does not divide `N`, only the rows no earlier chunk covered."""
    batch, rem, last = plan.batch, plan.rem, plan.num_chunks - 1
    remainder = _remainder_summary(fold, batch, rem)

    def evaluate(i):
        ys = fold.chunk_fn(plan.chunk(leaves, fold.axes, i), batch)
        if rem == 0 or fold.windows:
            return fold.summarise(ys)
        if fold.counted is not None:  # the window, its covered rows uncounted
            return fold.counted(ys, plan.fresh(i))
        if plan.wide:  # its one chunk is the window: no branch to trace
            return remainder(ys)
        return lax.cond(i == last, lambda: remainder(ys), lambda: fold.summarise(ys))

    return evaluate


def _buffers(chunk_avals: Sequence[Any], out_axes: Sequence[Any], size: int) -> list:
    """Zeros of each chunk output's type (`chunk_avals`), `size` examples long
    along its mapped axis (`out_axes`; an unmapped output: one chunk's)."""
    buffers = []
    for aval, axis in zip(chunk_avals, out_axes):
        shape = list(aval.shape)
        if axis is not None:
            shape[axis] = size
        buffers.append(zeros(shape, aval))
    return buffers


# A chunk function maps (chunk leaves, chunk length) to the chunk's outputs, each
# leaf mapped along its canonical output axis (or unmapped where the axis is None),
# in the structure the chunk's own trace gave them (`_program.Retraced`): the
# leaves are as the body's `Signature` describes them; the structure may hold what
# the function put in it in its context (ghost clipping's plan there).
ChunkFn = Callable[[list[Any], int], Any]


# How many derivatives taken through a loop that saves residuals keep the custom
# JVP rules of its function: each reverse-mode pass through the loop takes one
# checkpoint of the nest apart (`checkpointed`).
RULE_ORDERS = 4


def checkpointed(fn: Callable[..., Any], remat: Any) -> Callable[..., Any]:
    """`fn` under `jax.checkpoint` (with `remat` as the policy when it is callable).

    Only the chunk index crosses the checkpoint; the inputs are closed over, so the
    residuals saved for reverse mode are one scalar per chunk (plus what the policy
    saves) instead of every chunk's activations. `prevent_cse=False` is safe inside a
    scan, which already keeps XLA from merging the recomputation with the forward pass.

    A loop that saves residuals (`remat=False`, or a policy) is a checkpoint with
    that policy around a nest of checkpoints saving everything, not a bare body:
    differentiating a scan, JAX hoists the residuals that do not change from one
    step to the next out of the loop by partially evaluating the forward body, and
    that pass replaces every custom JVP rule there by the function it was defined
    on, so the values a further derivative is taken of (`jax.hessian`, `jax.jvp` of
    `jax.grad`) would be differentiated without the user's rule (a straight-through
    estimator's second derivative 0, where `jax.vmap` gives the rule's). A
    checkpoint in the body keeps its forward half whole through that pass, rules in
    it; each reverse-mode pass splits one checkpoint of the nest (by the outer
    policy, so the residuals saved are the policy's: every one for `remat=False`, as
    a bare body saves), so the rules hold for `RULE_ORDERS` derivatives.
    `remat=True` saves nothing and recomputes from the rules, at every order.
    """
    if remat is True:
        return jax.checkpoint(fn, prevent_cse=False)
    everything = jax.checkpoint_policies.everything_saveable
    for _ in range(RULE_ORDERS - 1):
        fn = jax.checkpoint(fn, prevent_cse=False, policy=everything)
    policy = everything if remat is False else remat
    return jax.checkpoint(fn, prevent_cse=False, policy=policy)


def fold(reduction: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """`reduction` applied leaf by leaf to two summaries of the same structure."""
    return jax.tree.map(reduction, a, b)


# Reductions that are sums: summaries split over devices are then combined by one
# all-reduce (in the order XLA chooses) instead of a gather and an ordered fold.
SUMS = (jnp.add, lax.add, operator.add)


def _pair(summary: Any, rows: Any) -> Any:
    return summary, rows


@dataclasses.dataclass(frozen=True, eq=False)
class Accumulator:
    """How the chunks' outputs combine into one result when they are not simply
    stacked: three functions.

    * `summarise(out)` maps one chunk's outputs (the chunk function's tree, the
      chunk's examples along each output's mapped axis) to a pair `(summary, rows)`;
    * `combine(a, b)` folds the summaries over the chunks, in order and without an
      identity element (a user's reduction leaf by leaf, or a merge of whole
      summaries such as running means and variances); None: they are added leaf by
      leaf (devices' summaries are then combined by one all-reduce);
    * `finish(summary, rows)` gives the caller's result, where every leaf of
      `rows` holds one row per example along its axis 0, stacked over the chunks
      in example order, as `jax.vmap` stacks (each chunk's rows are written in
      place at its offset, so a call costs O(N) writes, not O(N) per chunk).

    The loop takes the types of a chunk's summary and rows from one abstract
    evaluation of the first chunk. Two properties say what the functions cannot:
    `windows`, that the rows do not depend on the window of examples that made them
    (the last chunk of a remainder then summarises its whole window, and its rows
    of examples an earlier chunk covered are not written again: one `summarise`
    is traced, not a branch for the remainder); `uncount(out, fresh)`, where
    given, the chunk's outputs with only the rows `fresh` marks counted by
    `summarise` (the last window's other rows an earlier chunk covered: the
    remainder is then summarised at the chunk's length too, one `summarise`
    traced, rather than in a branch at its own length, whose buffers would add to
    the loop's); `pure`, that it computes from the
    chunks' outputs alone, by code that is the same from call to call (none of the
    user's functions, nothing traced for the call), so that an eager program of it
    is known by its chunk's trace and its own fields.

    Accumulators are composed from small leaves over a prefix tree of the outputs
    (`_accumulators.compose`: a user's `reduction` / `chunk_reduction` is one
    `Fold`, clipping a `Fold` of the clipped gradients beside a `Stack` of
    per-example norms, values and auxiliary outputs).
    """

    summarise: Callable[[Any], tuple[Any, Any]]
    combine: Callable[[Any, Any], Any] | None = None
    finish: Callable[[Any, Any], Any] = _pair
    windows: bool = False
    uncount: Callable[[Any, jax.Array], Any] | None = None
    pure: bool = False

    @property
    def sums(self) -> bool:
        """Whether the summaries are added leaf by leaf."""
        return self.combine is None

    def merge(self, a: Any, b: Any) -> Any:
        """Two summaries folded (`combine`, or added)."""
        return fold(jnp.add, a, b) if self.combine is None else self.combine(a, b)


class Signature(NamedTuple):
    """A chunk function's outputs: their structure, per-example types and canonical
    output axes (None: unmapped)."""

    out_tree: Any
    out_avals: Sequence[Any]
    out_axes: Sequence[int | None]


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """One traced chunk of the user's function, and how the chunks' outputs combine.

    `chunk_fn(chunk_leaves, length)` maps the flat input leaves of a chunk (mapped
    along `axes`) to its flat outputs, described by `signature` (their structure,
    per-example types and output axes), which the front end knows before the loop is
    built: it traced the function once to learn it, and `chunk_fn` reuses that trace.
    Without an `accumulator` the outputs are stacked (and `post` is applied to the
    whole output); with one, they are folded and stacked as it says. `remat`
    checkpoints each chunk; `name` is the caller's public name, for messages.
    """

    name: str
    chunk_fn: ChunkFn
    axes: Sequence[int | None]
    signature: Signature
    accumulator: Accumulator | None = None
    post: Callable[[Any], Any] = identity
    remat: Any = True
    # The arrays the chunk function's trace reads (its closure's), its first inputs
    # (unmapped: `axes` starts with a None for each).
    params: tuple[Any, ...] = ()
    # What tells this body apart from any other that could compute something else
    # on inputs of the same types (None: nothing does; an eager program of it is
    # not kept), and whether a program built from it may be kept (`Retraced.kept`).
    key: Any = None
    kept: Callable[[], bool] = lambda: True

    @property
    def out_tree(self) -> Any:
        return self.signature.out_tree

    @property
    def out_avals(self) -> Sequence[Any]:
        return self.signature.out_avals

    @property
    def out_axes(self) -> Sequence[int | None]:
        return self.signature.out_axes

    def run(
        self,
        leaves: Sequence[Any],
        plan: Chunks,
        report: Callable[[Any], None] = lambda i: None,
    ) -> Any:
        """The flat stacked outputs, or the accumulated `(summary, rows)`, of
        `plan`'s chunks."""
        if self.accumulator is None:
            return self.stacked(leaves, plan, report)
        return self.accumulated(leaves, plan, report)

    def stacked(
        self, leaves: Sequence[Any], plan: Chunks, report: Callable[[Any], None]
    ) -> list[Any]:
        """Run every chunk and assemble the stacked outputs without a second copy.

        Two layouts, both with the user's function once in the program:

        * `B` divides `N` and every mapped output axis is 0: the chunks are the `ys`
          of the scan, shape `(N / B, B, ...)`, and reshaping them to `(N, ...)` is
          free. Reverse mode then reads the output cotangent chunk by chunk as a loop
          input, so with `remat` gradient memory does not grow with `N` at all.
        * otherwise: one buffer per output leaf, preallocated with the mapped axis
          where `out_axes` puts it, and each chunk written in place with
          `dynamic_update_slice` (no concatenation, no transpose). When `B` does not
          divide `N`, the last chunk is the window `[N - B, N)` of real examples,
          overlapping the previous chunk; it rewrites the overlapping `B - N % B`
          outputs with the same values, and the cotangents of overwritten entries
          are zero, so gradients count each example once. No padding is ever
          evaluated. Reverse mode carries the output cotangent through the loop, so
          gradients need one output-sized buffer more than forward evaluation.
        """
        axes = self.axes
        if plan.single:
            outs = plan.when_active(
                lambda: jax.tree.leaves(
                    self.chunk_fn(plan.whole(leaves, axes), plan.size)
                )
            )
            report(0)
            return outs
        batch = plan.batch
        chunk_fn, out_axes, out_avals = self.chunk_fn, self.out_axes, self.out_avals
        held = _holding(leaves, axes, out_avals)
        if (
            not held
            and plan.order is None
            and plan.rem == 0
            and all(a == 0 for a in out_axes)
            and not sharding_in_types(leaves)
        ):
            return self._split_stacked(leaves, plan, report)

        @ft.partial(checkpointed, remat=self.remat)
        def evaluate(i):
            return jax.tree.leaves(chunk_fn(_read(plan, leaves, axes, i, held), batch))

        # The types of one chunk's outputs (from the values themselves when they
        # carry sharding types, so that loop carries match them).
        if sharding_in_types(leaves):
            chunk_avals = jax.eval_shape(evaluate, jnp.int32(0))
        else:
            chunk_avals = [
                stacked_type(a, x, batch) for a, x in zip(out_avals, out_axes)
            ]

        if (
            not held
            and plan.order is None
            and plan.rem == 0
            and all(a in (0, None) for a in out_axes)
        ):
            return _scanned_stacked(evaluate, out_axes, chunk_avals, plan, report)
        return _write_chunks(evaluate, out_axes, chunk_avals, plan, report)

    def _split_stacked(
        self, leaves: Sequence[Any], plan: Chunks, report: Callable[[Any], None]
    ) -> list[Any]:
        """`stacked` when every output is along axis 0 and `B` divides `N`: the
        chunks' outputs are the scan's `ys` (nothing to preallocate).

        A leaf mapped along axis 0 and read from its start is the scan's `xs`,
        reshaped to `(N / B, B, ...)` (free); the others are sliced at the chunk's
        start. `xs` run faster on XLA's CPU backend than a `dynamic_slice` at a
        traced offset (up to 2x on a memory-heavy function), and reverse mode
        forwards them as residuals instead of saving copies, so memory is the same.
        """
        chunk_fn, axes, size, batch = self.chunk_fn, self.axes, plan.size, plan.batch
        num = plan.num_chunks
        from_start = isinstance(plan.offset, int) and plan.offset == 0
        # (chunks of one example are sliced: XLA copies an input reshaped to
        # `(N, 1, ...)` whole before the loop)
        split = [
            j
            for j, (x, a) in enumerate(zip(leaves, axes))
            if from_start and a == 0 and x.shape[0] == size and batch > 1
        ]
        sliced = [None if j in split else a for j, a in enumerate(axes)]
        xs = [lax.reshape(leaves[j], (num, batch, *leaves[j].shape[1:])) for j in split]
        slicing = any(a is not None for a in sliced)

        @ft.partial(checkpointed, remat=self.remat)
        def evaluate(i, chunks):
            chunk = plan.chunk(leaves, sliced, i) if slicing else leaves
            return jax.tree.leaves(chunk_fn(combine(chunk, split, chunks), batch))

        def body(carry, i_chunks):
            i, chunks = i_chunks
            ys = evaluate(i, chunks)
            report(i)
            return carry, ys

        with jax.named_scope("chunkvmap"):
            _, stacked = lax.scan(body, (), (jnp.arange(num, dtype=np.int32), xs))
        return [y.reshape(size, *y.shape[2:]) for y in stacked]

    def accumulated(
        self, leaves: Sequence[Any], plan: Chunks, report: Callable[[Any], None]
    ) -> Any:
        """Fold the chunks' summaries, in order, with no identity, and stack their
        rows.

        A forward scan folds `acc = combine(acc, s_i)`; the first chunk's summary
        replaces the (never used) initial value, so no identity element is needed and
        order is kept (non-commutative reductions work). Rows are written into one
        preallocated buffer per leaf at the chunk's offset. When `B` does not divide
        `N`, the last chunk is the window `[N - B, N)` as in `stacked`, and only its
        last `N % B` outputs (the examples no earlier chunk covered) are summarised
        and written. Either way the user's function appears once in the program.
        """
        accumulator = self.accumulator
        assert accumulator is not None
        fold = _Fold(
            self.chunk_fn, self.axes, self.out_axes, accumulator.summarise,
            accumulator.merge, 0, accumulator.windows, _counting(accumulator),
        )  # fmt: skip
        return self._fold(fold, leaves, plan, report)

    def _fold(
        self, fold: _Fold, leaves: Sequence[Any], plan: Chunks,
        report: Callable[[Any], None],
    ) -> Any:  # fmt: skip
        """The scan of `accumulated`: `fold.chunk_fn`'s outputs summarised per chunk
        into `(summary, rows)`, the summaries folded with `fold.combine` and the rows
        written at the chunk's offset (`_Fold`)."""
        chunk_fn, axes = fold.chunk_fn, fold.axes
        if plan.single:
            result = plan.when_active(
                lambda: fold.summarise(chunk_fn(plan.whole(leaves, axes), plan.size))
            )
            report(0)
            return result
        evaluate = checkpointed(_summary_of_chunk(fold, leaves, plan), self.remat)
        write = _row_writer(plan, fold.row_axis)

        def step(carry, i):
            acc, buffers = carry
            s, rows = evaluate(i)
            report(i)
            acc = lax.cond(i == 0, lambda: s, lambda: fold.combine(acc, s))
            buffers = jax.tree.map(lambda b, r: write(b, r, i), buffers, rows)
            return acc, buffers

        def body(carry, i):
            if plan.count is None:
                return step(carry, i), None
            # a chunk of padding alone: not evaluated (nothing to fold or write)
            return lax.cond(plan.active(i), step, lambda c, i: c, carry, i), None

        init = _fold_init(fold, leaves, plan)
        with jax.named_scope("chunkvmap"):
            acc, _ = lax.scan(body, init, jnp.arange(plan.num_chunks, dtype=np.int32))
        return acc

    def run_shares(
        self,
        leaves: Sequence[Any],
        plan: Chunks,
        report: Callable[[Any], None] = lambda i: None,
    ) -> Any:
        """`run` over D shares at once: every mapped leaf's axis is split as
        `(D, n)` (the shares at the mapped axis, `plan`'s n examples after it). Each
        chunk reads `plan.batch` examples of every share and evaluates them together
        (the chunk function vmapped over the shares). Stacked outputs come back split
        as `(D, n)` at their mapped axes; with an accumulator, one summary per share
        (a leading axis of D), each folded in its share's order, and the rows split
        as `(D, n)` at axis 0."""
        local = [None if a is None else a + 1 for a in self.axes]
        shifted = [None if o is None else o + 1 for o in self.out_axes]
        # The shares' sharding (of their axis, at each mapped input's axis). A value
        # that does not depend on the examples comes back from the vmap over the
        # shares broadcast, unsharded; it takes this sharding, as every other has.
        entry = next(
            spec_entries(x)[a]
            for x, a in zip(leaves, self.axes)
            if a is not None and isinstance(x, jax.Array)
        )
        shares = ft.partial(self._over_shares, entry=entry)
        if self.accumulator is not None:
            fold = _shares_fold(self.accumulator, shares, local, shifted, entry)
            return self._fold(fold, leaves, plan, report)
        if plan.single:
            ys = plan.when_active(
                lambda: jax.tree.leaves(shares(plan.whole(leaves, local), plan.size))
            )
            report(0)
            return ys

        @ft.partial(checkpointed, remat=self.remat)
        def evaluate(i):
            return jax.tree.leaves(shares(plan.chunk(leaves, local, i), plan.batch))

        types = jax.eval_shape(evaluate, jnp.int32(0))
        return _write_chunks(evaluate, shifted, types, plan, report)

    def _over_shares(self, part: list[Any], length: int, entry: Any) -> Any:
        """The chunk function vmapped over the shares of the leaves `part` (each
        share's chunk of `length`), the outputs' shares axis sharded as `entry`.
        Only arrays go through the vmap over the shares; anything else (a function
        an Equinox module holds, say) is closed over as it is."""
        axes, out_axes = self.axes, self.out_axes
        mapped = [
            k for k, (x, a) in enumerate(zip(part, axes))
            if a is not None or isinstance(x, ARRAY_TYPES)
        ]  # fmt: skip
        tree: list[Any] = []  # the structure of this trace's outputs

        def one(values: list[Any]) -> list[Any]:
            full = combine(part, mapped, values)
            leaves, structure = jax.tree.flatten(self.chunk_fn(full, length))
            tree[:] = [structure]
            return leaves

        ys = jax.vmap(
            one, in_axes=([axes[k] for k in mapped],), out_axes=list(out_axes)
        )([part[k] for k in mapped])
        return tree[0].unflatten(
            [y if o is None else _with_entry(y, o, entry) for y, o in zip(ys, out_axes)]
        )

    def finish(self, result: Any) -> Any:
        """The caller's output from `run`'s: the stacked outputs' tree (`post`
        applied), or the accumulator's result."""
        if self.accumulator is not None:
            return self.accumulator.finish(*result)
        out = self.out_tree.unflatten(result)
        return out if self.post is identity else self.post(out)


class _Fold(NamedTuple):
    """What `Body._fold` folds: `chunk_fn`'s outputs (its leaves mapped along
    `axes`, its outputs along `out_axes`) summarised by `summarise` into
    `(summary, rows)`; the summaries folded with `combine`, the rows (the chunk's
    examples along `row_axis`) written at the chunk's offset. `windows`: the last
    chunk's whole window is summarised too (`Accumulator.windows`); `counted(out,
    fresh)`, where given, summarises it with only its `fresh` rows counted
    (`Accumulator.uncount`)."""

    chunk_fn: ChunkFn
    axes: Sequence[int | None]
    out_axes: Sequence[int | None]
    summarise: Callable[[Any], Any]
    combine: Callable[[Any, Any], Any]
    row_axis: int
    windows: bool
    counted: Callable[[Any, jax.Array], Any] | None = None


def _shares_fold(
    accumulator: Accumulator, shares: ChunkFn, local: Sequence[int | None],
    shifted: Sequence[int | None], entry: Any,
) -> _Fold:  # fmt: skip
    """`run_shares`' fold: `shares`' outputs (the shares at each output's axis
    `shifted`) summarised and folded share by share, each summary and row with
    the shares' sharding `entry` at its axis 0."""
    out_axes = [None if o is None else o - 1 for o in shifted]

    def summarise(ys: Any) -> Any:  # one summary per share
        tree = jax.tree.structure(ys)
        result = jax.vmap(accumulator.summarise, in_axes=(tree.unflatten(out_axes),))(
            ys
        )
        return jax.tree.map(lambda y: _with_entry(y, 0, entry), result)

    def combine(a: Any, b: Any) -> Any:  # share by share
        if not jax.tree.leaves(a):  # nothing to fold (rows only)
            return a
        return jax.vmap(accumulator.merge)(a, b)

    one, counted = _counting(accumulator), None
    if one is not None:

        def counted(ys: Any, fresh: jax.Array) -> Any:  # share by share
            axes = jax.tree.structure(ys).unflatten(out_axes)
            result = jax.vmap(one, in_axes=(axes, None))(ys, fresh)
            return jax.tree.map(lambda y: _with_entry(y, 0, entry), result)

    return _Fold(
        shares, local, shifted, summarise, combine, 1, accumulator.windows, counted
    )


def _counting(accumulator: Accumulator) -> Callable[[Any, jax.Array], Any] | None:
    """`summarise` of a chunk's outputs with only its `fresh` rows counted, where
    the accumulator can uncount rows (`Accumulator.uncount`)."""
    uncount = accumulator.uncount
    if uncount is None:
        return None
    return lambda ys, fresh: accumulator.summarise(uncount(ys, fresh))


def _remainder_summary(fold: _Fold, batch: int, rem: int) -> Callable[..., Any]:
    """The last chunk's summary where `rem` does not fill a chunk: only its last
    `rem` outputs summarised, their rows at the end of a chunk-long block (zeros
    before: they are never written, see `_row_writer`)."""
    row_axis = fold.row_axis

    def pad(r: jax.Array) -> jax.Array:
        config = [(0, 0, 0)] * r.ndim
        config[row_axis] = (batch - rem, 0, 0)
        return lax.pad(r, jnp.zeros((), r.dtype), config)

    def remainder(ys: Any) -> Any:
        leaves, tree = jax.tree.flatten(ys)
        tail = [
            y if a is None else lax.slice_in_dim(y, batch - rem, batch, axis=a)
            for y, a in zip(leaves, fold.out_axes)
        ]
        summary, rows = fold.summarise(tree.unflatten(tail))
        return summary, jax.tree.map(pad, rows)

    return remainder


def _tail(y: jax.Array, n: int, axis: int) -> jax.Array:
    """The last `n` entries of `y` along `axis`."""
    return lax.slice_in_dim(y, y.shape[axis] - n, y.shape[axis], axis=axis)


def _row_writer(plan: Chunks, row_axis: int) -> Callable[..., jax.Array]:
    """`write(buffer, rows, i)`: chunk `i`'s rows written into `buffer` at its
    offset (the last window keeps the rows earlier chunks wrote)."""
    batch, rem = plan.batch, plan.rem
    if plan.order is not None:
        return _scattering_writer(plan, row_axis)

    def write(buffer: jax.Array, rows: jax.Array, i: Any) -> jax.Array:
        if plan.wide:  # the window's last N rows, at the buffer's start
            return lax.dynamic_update_slice_in_dim(
                buffer, _tail(rows, plan.size, row_axis), 0, row_axis
            )
        start = plan.start(i)
        if rem:
            shape = [1] * rows.ndim
            shape[row_axis] = batch
            new = plan.fresh(i).reshape(shape)
            old = lax.dynamic_slice_in_dim(buffer, start, batch, axis=row_axis)
            rows = jnp.where(new, rows, old)
        return lax.dynamic_update_slice_in_dim(buffer, rows, start, row_axis)

    return write


def _scattering_writer(plan: Chunks, row_axis: int) -> Callable[..., jax.Array]:
    """`_row_writer` of a padded buffer: chunk `i`'s rows written at the examples
    it evaluated (`plan.order`; the rows of skipped chunks stay zeros). Of shares'
    (`Chunks.shared`): share by share, the shares at `row_axis - 1`."""
    batch, rem = plan.batch, plan.rem

    def put(buffer: jax.Array, rows: jax.Array, idx: jax.Array, i: Any, axis: int):
        shape = [1] * rows.ndim
        shape[axis] = batch
        at = lambda x: jnp.moveaxis(x, axis, 0)  # noqa: E731
        if rem:  # the last window: the rows earlier chunks wrote stay
            old = jnp.take(at(buffer), idx, axis=0, mode="clip")
            rows = jnp.where(
                plan.fresh(i).reshape(shape), rows, jnp.moveaxis(old, 0, axis)
            )
        new = at(buffer).at[idx].set(at(rows), unique_indices=True)
        return jnp.moveaxis(new, 0, axis)

    def write(buffer: jax.Array, rows: jax.Array, i: Any) -> jax.Array:
        idx = plan.positions(i)
        if not plan.shared:
            return put(buffer, rows, idx, i, row_axis)
        s = row_axis - 1
        one = lambda b, r, k: put(b, r, k, i, s)  # noqa: E731
        return jax.vmap(one, in_axes=(s, s, 0), out_axes=s)(buffer, rows, idx)

    return write


def _fold_init(fold: _Fold, leaves: Sequence[Any], plan: Chunks) -> tuple:
    """The fold's initial carry: zero summaries and zero row buffers, of the types
    of the first chunk's (one abstract evaluation of `summarise`, not one per
    branch of the last chunk's `cond`)."""
    summary_avals, row_avals = jax.eval_shape(
        lambda: fold.summarise(
            fold.chunk_fn(plan.chunk(leaves, fold.axes, jnp.int32(0)), plan.batch)
        )
    )

    def buffer(a: Any) -> jax.Array:
        shape = list(a.shape)
        shape[fold.row_axis] = plan.size
        return zeros(shape, a)

    return (
        jax.tree.map(lambda a: zeros(a.shape, a), summary_avals),
        jax.tree.map(buffer, row_avals),
    )
