"""Per-example gradient statistics in chunks: norms, moments and dot products.

What is wanted from per-example gradients is usually a statistic of them, not the
`N x parameters` tensor itself:

* `per_example_grad_norms`: `||g_i||` for every example (`method="ghost"`: from each
  use's activations and cotangents, without per-example gradients where a rule
  applies; see `clipped_grad_sum`);
* `per_example_grad_stats`: the mean gradient, the per-parameter variance and sum of
  squares over the examples, and the squared norms, in one pass;
* `per_example_grad_gram`: `<g_i(a), g_j(b)>` between the examples of two batches (or
  of one), chunked over both (`method="ghost"`: from activations and cotangents).

Each chunk forms the gradients of its examples only, so memory is that of `batch_size`
gradients (plus the statistic), never `N x parameters`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
from jax import lax

from .._core import _axes, _cache, _memory, _padding
from .._core._accumulators import (
    Leaf,
    Moments,
    Stack,
    compose,
    count_dtype,
    merge_centred,
    merge_moments,
    moments as moments_of,
    unshifted,
)
from .._core._options import Chunking, check_bool, decorator_form, identity, takes
from .._transforms._batch_vmap import Transform, batch_vmap
from .._transforms._grads import (
    differentiable_floats,
    filtered_value_and_grad,
    grad_transform,
)
from . import _choice, _clipping, ghost
from ._records import Quantity, over_chunks


def _stats_dtype(dtype: Any) -> Any:
    """Statistics are accumulated in at least float32 (bfloat16 gradients too)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype if dtype.itemsize >= 8 else jnp.dtype(jnp.complex64)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


@decorator_form("fun")
@takes(Chunking)
def per_example_grad_norms(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    method: str = "vmap",
    per_leaf: bool = False,
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """The L2 norm of every example's gradient, `batch_size` examples at a time.

    `per_example_grad_norms(fun)(*args)[i]` is the global L2 norm (over every
    differentiated leaf) of `jax.grad(fun, argnums)` at example `i`, as
    `jax.vmap(jax.grad(fun, argnums))` followed by a norm per example would give it,
    without holding the `N` gradients. The arguments are mapped as in
    `per_example_grads` (by default every argument that is not differentiated holds
    one example per leading index). With `per_leaf=True`, each differentiated
    leaf's own norm instead (BackPACK's `BatchL2Grad`; what per-layer clipping
    needs): a pytree with the structure of `jax.grad(fun, argnums)`'s, each leaf
    the `(N,)` norms of that leaf's per-example gradients (None at leaves that are
    not differentiated, as `per_example_grads` has them); their root sum of squares
    is the global norm.

    `method="ghost"` computes each norm from the activations and output cotangents of
    every use of a parameter (dense layers, convolutions, embedding lookups,
    elementwise and other linear uses; see `clipped_grad_sum` and `ghost_report`),
    so no per-example gradient is formed for the leaves those rules cover; the others
    get exact per-example gradients, as with `method="vmap"`. Norms are used for
    data pruning scores, outlier and mislabelled-example detection, importance
    sampling and monitoring clipping rates.

    Usable as a decorator too, with its options as keywords and without `fun`.

    A padded buffer (a Poisson-sampled lot padded to a fixed capacity) is passed
    with `is_padding_example=` at call time, as in `clipped_grad`: a boolean (or
    0/1 integer) vector with one entry per example. The padding's norms (and aux)
    are zeros, the real examples are evaluated first wherever the padding sits, and
    chunks of padding alone are skipped at run time, so one compiled program serves
    every lot size.

    Args:
      fun: the loss of one example; it must return a real scalar (or `(scalar, aux)`
        with `has_aux`).
      argnums: which positional argument(s) to differentiate.
      has_aux: whether `fun` returns `(loss, aux)`; `aux` is then stacked per example
        and returned beside the norms.
      batch_argnums: the positional arguments holding the examples (default: every
        argument not in `argnums`).
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      method: "vmap" (per-example gradients, one chunk at a time) or "ghost".
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.
      per_leaf: one norm per differentiated leaf (a pytree of them) rather than one
        global norm per example.

    Returns:
      A function with `fun`'s arguments returning the norms, shape `(N,)` and
      dtype float32 (at least; float64 for float64 gradients), or `(norms, aux)`;
      with `per_leaf`, a pytree of such norms.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grad_norms
      >>> def loss(w, x):
      ...     return jnp.dot(w, x)  # the gradient of example x is x itself
      >>> x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
      >>> per_example_grad_norms(loss, batch_size=2)(jnp.ones(2), x)
      Array([5. , 0.5, 0. ], dtype=float32)
    """
    name = "per_example_grad_norms"
    check_bool(name, "has_aux", has_aux)
    check_bool(name, "per_leaf", per_leaf)
    method = _choice.check_method(name, method)
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )
    config = _clipping.Clipping(
        math.inf,
        nan_safe=False,
        return_grad_norms=True,
        has_aux=has_aux,
        method=method,
        sums=False,
        per_leaf_norms=per_leaf,
    )

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        _, extras, _ = _clipping.clipped_sums(
            transform, fun, config, args, kwargs, known
        )
        return (extras.grad_norms, extras.aux) if has_aux else extras.grad_norms

    return transform.public(call, fun)


class GradStats(NamedTuple):
    """Statistics of the per-example gradients `g_i` of `N` examples.

    Attributes:
      mean: `(1/N) sum_i g_i`, the gradient of the mean loss (the structure of the
        differentiated arguments).
      variance: `(1/N) sum_i (g_i - mean)^2` per parameter: the variance over the
        examples, normalised by `N` (multiply by `N / (N - 1)` for the unbiased
        estimate).
      sum_sq: `sum_i g_i^2` per parameter (for a negative log-likelihood, `N` times
        the empirical Fisher diagonal).
      sq_norms: `||g_i||^2` per example, shape `(N,)` (with `per_leaf`, a pytree
        like the gradient of each leaf's own squared norms).
      aux: `fun`'s auxiliary output per example (with `has_aux`), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grad_stats
      >>> stats = per_example_grad_stats(jnp.dot)(jnp.ones(2), jnp.eye(2))
      >>> stats.variance, stats.sq_norms
      (Array([0.25, 0.25], dtype=float32), Array([1., 1.], dtype=float32))
    """

    mean: Any
    variance: Any
    sum_sq: Any
    sq_norms: jax.Array
    aux: Any = None


@decorator_form("fun")
@takes(Chunking)
def per_example_grad_stats(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    method: str = "vmap",
    per_leaf: bool = False,
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """The mean, variance and sum of squares of the per-example gradients, and their
    squared norms, `batch_size` examples at a time.

    For per-example gradients `g_i = jax.grad(fun, argnums)(example i)`, returns a
    `GradStats` with the mean gradient `(1/N) sum_i g_i`, the per-parameter variance
    `(1/N) sum_i (g_i - mean)^2`, the per-parameter `sum_i g_i^2`, and
    `||g_i||^2` for every example: what `jax.vmap(jax.grad(fun))` followed by these
    reductions gives, without holding the `N` gradients. Each chunk forms its
    examples' gradients and reduces them to its count, mean and centred sum of
    squares; chunks are merged exactly (a parallel variance update, so a large mean
    does not cancel the variance), and means are held shifted by one example's
    gradient (so a float32 mean of 1e6 beside a spread of 1 keeps its variance to
    float32 precision). Statistics are accumulated in at least float32.
    Uses: the gradient noise scale (to choose the batch size), adaptive optimisers
    and curvature proxies such as the empirical Fisher diagonal.

    With `method="vmap"` a chunk holds its examples' gradients at once (`batch_size`
    times the parameters). With `method="ghost"` a chunk holds its examples'
    activations and output cotangents at each use of a parameter (ghost clipping's
    rules: dense layers, convolutions, embedding lookups, elementwise and other
    linear uses; see `clipped_grad_sum`) and forms one example's gradient at a time
    from them, updating the moments example by example: memory of a few copies of
    the parameters plus a chunk of activations, whatever `batch_size`. Leaves no
    rule covers get exact per-example gradients, as with `method="vmap"`. On an
    accelerator the one-at-a-time formation is slower than a chunk of gradients.

    The arguments are mapped as in `per_example_grads`. Usable as a decorator too.

    A padded buffer is passed with `is_padding_example=` at call time (as in
    `clipped_grad`): the statistics are then those of the real examples alone,
    their padding's `sq_norms` (and aux) zeros, and chunks of padding alone are
    skipped, so one compiled program serves every lot size. A lot with no real
    example has a NaN mean and variance.

    Args:
      fun: the loss of one example; a real scalar (or `(scalar, aux)` with
        `has_aux`).
      argnums: which positional argument(s) to differentiate.
      has_aux: whether `fun` returns `(loss, aux)`; `aux` is stacked per example.
      batch_argnums: the positional arguments holding the examples (default: every
        argument not in `argnums`).
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      method: "vmap" (a chunk of gradients at a time) or "ghost" (one example's
        gradient at a time, from activations and cotangents).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.
      per_leaf: `sq_norms` per differentiated leaf (a pytree like the gradient's,
        each leaf `(N,)`) rather than one global squared norm per example.

    Returns:
      A function with `fun`'s arguments returning a `GradStats`.

    Raises:
      ValueError: for zero examples (the mean is undefined).

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grad_stats
      >>> def loss(w, x):
      ...     return jnp.dot(w, x)  # the gradient of example x is x itself
      >>> x = jnp.array([[1.0, 0.0], [3.0, 2.0]])
      >>> stats = per_example_grad_stats(loss, batch_size=1)(jnp.ones(2), x)
      >>> stats.mean, stats.variance, stats.sum_sq, stats.sq_norms
      (Array([2., 1.], dtype=float32), Array([1., 1.], dtype=float32),
       Array([10.,  4.], dtype=float32), Array([ 1., 13.], dtype=float32))
    """
    name = "per_example_grad_stats"
    check_bool(name, "has_aux", has_aux)
    check_bool(name, "per_leaf", per_leaf)
    method = _choice.check_method(name, method)
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )

    def moments_by(runs: ghost.Method, transform: Transform, *call: Any) -> tuple:
        """`(count, mean, m2, sq_norms, aux)` by `runs` (`call`: `diff`, mapped...)."""
        diff, args, kwargs, in_axes, known, padding = call
        batch = dict(args=args, kwargs=kwargs, in_axes=in_axes, known=known)
        if runs is ghost.Method.GHOST:
            moments = _GhostMoments.of(
                transform, name, fun, args=args, kwargs=kwargs, diff=diff,
                in_axes=in_axes, has_aux=has_aux,
            )  # fmt: skip
            return moments.run(transform, per_leaf, **batch, padding=padding)
        return _formed_moments(
            transform, fun, diff, has_aux, per_leaf, name=name, **batch,
            padding=padding,
        )  # fmt: skip

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        kwargs = dict(kwargs)
        padding = kwargs.pop("is_padding_example", None)
        diff, in_axes = transform.resolve(args)
        args = differentiable_floats(args, diff, in_axes)
        size = _choice.examples(transform, args, in_axes, kwargs)
        if size == 0:
            raise ValueError(
                f"{name} needs at least one example (the mean over zero examples is "
                f"undefined), but the examples' axis has size 0."
            )
        if padding is not None:
            padding = _padding.check(name, padding, size)
        runs = ghost.Method.VMAP
        if method is ghost.Method.GHOST:  # (vmap: the per-example path, the same)
            mapped = (args, kwargs, in_axes)
            runs = _chosen(
                transform, name, fun, has_aux, moments_by, diff=diff, call=mapped,
                size=size,
            )  # fmt: skip
        moments = moments_by(
            runs, transform, diff, args, kwargs, in_axes, known, padding
        )
        return _grad_stats(moments, padding)

    return transform.public(call, fun)


def _grad_stats(moments: tuple, padding: Any) -> GradStats:
    """The `GradStats` of a call's `(count, mean, m2, sq_norms, aux)` (the
    padding's rows zeros; with no real example, the mean NaN)."""
    count, mean, m2, sq_norms, aux = moments
    if padding is not None:
        sq_norms, aux = _padding.zeroed(padding, (sq_norms, aux))
        mean = jax.tree.map(lambda m: jnp.where(count > 0, m, jnp.nan), mean)
    variance = jax.tree.map(lambda s: s / count.astype(s.dtype), m2)
    sum_sq = jax.tree.map(
        lambda s, m: s + count.astype(s.dtype) * jnp.real(m * jnp.conj(m)),
        m2,
        mean,
    )
    return GradStats(mean, variance, sum_sq, sq_norms, aux)


def _chosen(
    transform: Transform, name: str, fun: Any, has_aux: bool,
    moments_by: Callable[..., tuple], *, diff: Any, call: tuple, size: int,
) -> ghost.Method:  # fmt: skip
    """The program a ghost call (`call`: its `(args, kwargs, in_axes)`) runs
    (`_choice.choose`: measured on an accelerator), warned where it is not the
    ghost program."""
    args, kwargs, in_axes = call
    moments = _GhostMoments.of(
        transform, name, fun, args=args, kwargs=kwargs, diff=diff, in_axes=in_axes,
        has_aux=has_aux,
    )  # fmt: skip
    report = ghost.report_of(moments.traced.plan)

    def program(twin: Transform, runs: ghost.Method) -> Callable[..., Any]:
        def run(args: tuple, kwargs: dict) -> Any:
            return moments_by(runs, twin, diff, args, kwargs, in_axes, None, None)

        return run

    return _choice.decided(
        transform, fun, report, moments, program, call=call, size=size
    )


def _formed_moments(
    transform: Transform, fun: Callable[..., Any], diff: Any, has_aux: bool,
    per_leaf: bool, *, name: str, args: tuple, kwargs: dict, in_axes: tuple, known: Any,
    padding: Any,
) -> tuple:  # fmt: skip
    """`(count, mean, m2, sq_norms, aux)` from each chunk's formed gradients (of the
    real examples, where `padding` flags the others)."""
    value_and_grad = filtered_value_and_grad(
        fun, diff, transform.args.single, has_aux, name
    )
    n, padded = len(args), padding is not None

    def example(*inputs: Any, **kw: Any) -> Any:
        value, grads = value_and_grad(*inputs[:n], **kw)
        aux = value[1] if has_aux else None
        grads = jax.tree.map(lambda g: g.astype(_stats_dtype(g.dtype)), grads)
        if per_leaf:
            sq_norms = jax.tree.map(_clipping.global_sq_norm, grads)
        else:
            sq_norms = _clipping.global_sq_norm(grads)
        if padded:  # the moments count the real examples
            grads = (~inputs[n], grads)
        return grads, sq_norms, aux

    # The gradients' examples along their last axis: the moments' reductions are
    # contiguous, fused with the subtraction and the square (over a leading axis
    # they are strided, several times slower on CPU, and a contraction would
    # materialise the squares).
    extra = [padding] if padded else []
    (count, mean, m2), sq_norms, aux = transform.map(
        example, (*args, *extra), kwargs, (*in_axes, *[0] * len(extra)),
        ((0, -1) if padded else -1, 0, 0), known=known,
        accumulator=compose((Moments(weighted=padded), Stack(), Stack())),
        padding=n if padded else None,
    )  # fmt: skip
    return count, mean, m2, sq_norms, aux


class _GhostMoments(Quantity):
    """A chunk's gradient moments from its examples' ghost records (an accumulator
    on the record, `_records`): the chunk keeps each use's activations and
    cotangents, and forms one example's gradient at a time from them in a scan,
    updating the mean and centred sum of squares example by example (Welford); the
    leaves no rule covers come formed per example, as with `method="vmap"`."""

    @classmethod
    def of(
        cls, transform: Transform, name: str, fun: Any, *, args: tuple, kwargs: dict,
        diff: tuple, in_axes: tuple, has_aux: bool,
    ) -> _GhostMoments:  # fmt: skip
        """The moments of a call's loss (`ghost.traced_loss`: planned once)."""
        traced = ghost.traced_loss(
            transform.memo,
            name,
            fun,
            args,
            kwargs,
            diff,
            in_axes=in_axes,
            has_aux=has_aux,
        )
        return traced.memo("moments", lambda: cls(traced))

    def made_with(self) -> tuple:
        return ()

    def __init__(self, traced: ghost.Traced):
        self.traced = traced
        self.leaves = leaves = traced.plan.leaves
        self.per_example = traced.plan.with_rule(ghost.PER_EXAMPLE)
        self.ruled = [k for k in range(len(leaves)) if k not in self.per_example]
        self.acc = ghost.accumulation_dtype([x.dtype for x in leaves])

    def run(
        self, transform: Transform, per_leaf: bool, *, args: tuple, kwargs: dict,
        in_axes: tuple, known: Any, padding: Any,
    ) -> tuple:  # fmt: skip
        """`(count, mean, m2, sq_norms, aux)` over the (real) examples, chunk by
        chunk."""
        state, (sq_norms, aux) = over_chunks(
            transform,
            self.traced,
            self,
            args,
            in_axes,
            kwargs,
            known=known,
            padding=padding,
        )
        count, mean, m2 = unshifted(state)
        single = transform.args.single
        mean = self.traced.grads_tree(mean, single)
        m2 = self.traced.grads_tree(m2, single)
        if per_leaf:
            sq_norms = self.traced.grads_tree(sq_norms, single)
        else:
            sq_norms = sum(sq_norms[1:], sq_norms[0])
        return count, mean, m2, sq_norms, aux

    def keep(self, record: ghost.Record, out: Any, pad: Any = None) -> Any:
        grads = {k: g.astype(_stats_dtype(g.dtype)) for k, g in record.grads.items()}
        # a chunk's count is the sum of these (a padded buffer's: of `real`)
        one = jnp.ones((), count_dtype([self.acc]))
        real = None if pad is None else ~pad
        return (record.replace(grads=grads), one, real), out[1]

    def combine(self, a: Any, b: Any) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        return merge_moments(a, b)

    def uncount(self, chunk: Any, fresh: jax.Array) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        """A chunk's kept outputs with only the examples `fresh` marks counted (the
        others weighted 0, as padding)."""
        (record, ones, real), aux = chunk
        real = fresh if real is None else real & fresh
        return (record, ones, real), aux

    def chunk(self, chunk: Any) -> Any:
        (record, ones, real), aux = chunk
        count = ones.sum() if real is None else jnp.sum(real, dtype=ones.dtype)
        n = len(self.leaves)
        shifts: list[Any] = [None] * n
        means: list[Any] = [None] * n
        m2s: list[Any] = [None] * n
        # each leaf's squared norm per example (zero for a leaf no use reaches)
        sq_norms = [jnp.zeros(ones.shape, self.acc) for _ in range(n)]
        for k, g in record.grads.items():  # formed per example: axis 0
            # (moved last: the reductions contiguous, as `_formed_moments`' are;
            # the norms too, else a convolution's gradients, laid out with the
            # examples inside, would be copied examples-first)
            last = jnp.moveaxis(g, 0, -1)
            shifts[k], means[k], m2s[k] = moments_of(last, -1, real)
            sq_norms[k] = _sq_norm(last, self.acc, tuple(range(last.ndim - 1)))
        ruled = [k for k in self.ruled if self.leaves[k].uses]
        uses = record.replace(grads={})

        # The chunk's moments held shifted by its first (real) example's gradient
        # (as `moments`), its examples merged one at a time (Welford's update; the
        # padding of a padded buffer with weight 0).
        at = 0 if real is None else jnp.argmax(real)
        first = jax.tree.map(lambda x: x[at], uses)
        shift = [
            first.instantiate(k).astype(_stats_dtype(self.leaves[k].dtype))
            for k in ruled
        ]

        def step(carry: Any, example: Any) -> Any:
            one, counts = example if real is not None else (example, True)
            gs = [one.instantiate(k).astype(s.dtype) for k, s in zip(ruled, shift)]
            sq = [_sq_norm(g, self.acc) for g in gs]
            d = [g - s for g, s in zip(gs, shift)]
            if real is not None:  # a padded buffer's padding: weight 0
                d = [jnp.where(counts, x, 0) for x in d]
            weight = jnp.asarray(counts, ones.dtype)
            new = (weight, d, [jnp.zeros_like(x) for x in d])
            return merge_centred(carry, new), sq

        zeros = [jnp.zeros_like(s) for s in shift]
        init = (jnp.zeros((), ones.dtype), zeros, zeros)
        examples = uses if real is None else (uses, real)
        rule_means, rule_m2s, sq = [], [], []
        if ruled:  # (else every leaf came formed: nothing to scan)
            (_, rule_means, rule_m2s), sq = lax.scan(step, init, examples)
        for k, rows in zip(ruled, sq):
            sq_norms[k] = rows
        for k, *parts in zip(ruled, shift, rule_means, rule_m2s):
            shifts[k], means[k], m2s[k] = parts
        for k in self.ruled:  # a leaf the loss does not use: zero gradients
            if means[k] is None:
                leaf = self.leaves[k]
                zero = jnp.zeros(leaf.shape, _stats_dtype(leaf.dtype))
                shifts[k] = means[k] = m2s[k] = zero
        return (count, shifts, means, m2s), (sq_norms, aux)


def _sq_norm(g: jax.Array, acc: Any, axis: Any = None) -> jax.Array:
    """`||g||^2` in `acc`, summed over `axis` (all of them by default)."""
    return jnp.sum(jnp.real(g * jnp.conj(g)).astype(acc), axis)


def _chunk_length(rows: Transform, args: tuple, in_axes: tuple) -> tuple[int, int]:
    """A call's number of examples and the length of its chunks of rows."""
    size = _choice.examples(rows, args, in_axes, {})
    batch = rows.options.batch_size
    return size, batch if isinstance(batch, int) and 0 < batch < size else size


def _tree_vdot(a: Any, b: Any) -> jax.Array:
    """`<a, b>` over every leaf of two gradients, in at least float32."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    acc = ghost.accumulation_dtype([x.dtype for pair in pairs for x in pair])
    total = jnp.zeros((), acc)
    for x, y in pairs:
        x, y = x.astype(_stats_dtype(x.dtype)), y.astype(_stats_dtype(y.dtype))
        total = total + jnp.real(jnp.vdot(y, x)).astype(acc)
    return total


def _whole_examples(tree: Any, axis: int | None) -> Any:
    """The other batch of a Gram matrix with its examples' axis not sharded over an
    Explicit mesh: every row's chunk is dotted with all of it, and a row sharded
    like a column would shard their product twice over one mesh axis."""
    if axis is None or ghost.explicit_spec() is None:
        return tree

    def whole(x: Any) -> Any:
        if not isinstance(x, jax.Array) or not jnp.ndim(x):
            return x
        spec = getattr(jax.typeof(x).sharding, "spec", None)
        if not spec or spec[axis] is None:
            return x
        return jax.sharding.reshard(x, jax.P(*spec[:axis], None, *spec[axis + 1 :]))

    return jax.tree.map(whole, tree)


def _shapes(args: tuple, in_axes: tuple) -> list[Any]:
    """The types of one example of the mapped arguments' arrays (and the others'
    whole); other leaves (the functions an Equinox module holds) have none."""
    return [
        (jnp.shape(x)[1:] if a is not None else jnp.shape(x), jnp.result_type(x))
        for arg, a in zip(args, in_axes)
        for x in jax.tree.leaves(arg)
        if _axes.is_arraylike(x)
    ]


class _GhostDots:
    """Dot products of two examples' gradients by ghost clipping's rules: each
    example's loss is evaluated once with probes (`ghost.Plan.run`), giving every
    use's activations and cotangents; a leaf under a ghost rule gets
    `<G(a), G(b)> = sum_{u, v} <G_u(a), G_v(b)>` from those arrays (for a dense use
    `sum_{t, s} <x_t, x'_s> <d_t, d'_s>`; for embedding lookups, the cotangents of
    matching rows), where that costs fewer operations per pair of examples than
    the dot product of its formed gradients; any other leaf has its gradient formed
    per example (from the same activations and cotangents where a rule covers it).

    A pair's ghost terms cost what one example's ghost norm costs (e.g.
    `T^2 (d_in + d_out)` for a dense use at `T` positions), where formed gradients
    cost their size per pair (their formation is shared by the chunk of rows each
    is dotted with, `chunk`): unlike the norms, a Gram's ghost terms pay on short
    sequences and wide layers, embeddings and convolutions (`_pair_pays`)."""

    @classmethod
    def of(
        cls, transform: Transform, name: str, fun: Any, *, args: tuple, diff: tuple,
        in_axes: tuple, has_aux: bool, chunk: int,
    ) -> _GhostDots:  # fmt: skip
        """The dot products of a call's loss (`ghost.traced_loss`: planned once)
        for chunks of `chunk` rows."""
        traced = ghost.traced_loss(
            transform.memo,
            name,
            fun,
            args,
            {},
            diff,
            in_axes=in_axes,
            has_aux=has_aux,
        )
        return traced.memo(("dots", chunk), lambda: cls(traced, chunk))

    def __init__(self, traced: ghost.Traced, chunk: int):
        self.traced, self.chunk = traced, chunk
        leaves = traced.plan.leaves
        plan = traced.plan
        self.ghost = [
            k for k in plan.with_rule(ghost.GHOST) if _pair_pays(leaves[k], chunk)
        ]
        self.formed = [
            k
            for k in plan.with_rule(ghost.GHOST, ghost.INSTANTIATED)
            if k not in self.ghost
        ]
        self.pe = plan.with_rule(ghost.PER_EXAMPLE)
        self.acc = ghost.accumulation_dtype([x.dtype for x in leaves])

    def program_key(self) -> Any:
        """What the dot products compute (`Quantity.program_key`'s)."""
        return (type(self), self.traced.key(), self.chunk)

    def parts(self, *example: Any) -> tuple[Any, Any]:
        """One example's record as the dot products read it (the forms' arrays of
        its ghost leaves, the gradients of the others), and its `aux`."""
        values = self.traced.arrays(list(example), {})
        record, (_, aux) = self.traced.record(values, self.pe)
        forms = {k: record.arrays(k) for k in self.ghost}
        grads = {k: record.instantiate(k) for k in self.formed}
        grads.update(record.grads)
        return ghost.Record(record.plan, {}, {}, grads, forms), aux

    def dot(self, a: ghost.Record, b: ghost.Record) -> jax.Array:
        """`<g(a), g(b)>` from two examples' records (`parts`)."""
        total = jnp.zeros((), self.acc)
        for k in self.ghost:
            leaf = b.plan.leaves[k]
            for (i, j), p in leaf.pairs.items():
                u, v = leaf.uses[i].form, leaf.uses[j].form
                ai, aj = a.forms[k][i], a.forms[k][j]
                bi, bj = b.forms[k][i], b.forms[k][j]
                total = total + p.term(u, ai, v, bj, self.acc)
                if i != j:  # the ordered pair (j, i) too: <G_j(a), G_i(b)>
                    total = total + p.term(u, bi, v, aj, self.acc)
        formed = _tree_vdot(a.grads, {k: b.grads[k] for k in a.grads})
        return total + formed.astype(self.acc)


# A formed gradient's entry is written and read again (as `ghost`'s verdict counts
# moving one: 8 operations), and a pair's ghost terms (small Gram matrices of
# activations and of cotangents) run several times as fast per counted operation as
# the formed gradients' dot products with their formation: measured (2-core CPU, N =
# 256, chunks of 32), ghost terms at 3.7x the formed count run at par with them on a
# width-256 LM (T = 32), and at 6.7-10.8x twice as slow on a width-32 block (T = 16).
_GRAM_TRAFFIC = 8.0
_GRAM_GHOST_SPEED = 5.0


def _pair_pays(leaf: Any, chunk: int) -> bool:
    """Whether a ghost leaf's terms for a pair of examples cost less than the dot
    product of its formed gradients (two operations per entry) with their share of
    forming and moving them: each example's arrays or gradient, made once, serve the
    `chunk` examples of a chunk of rows."""
    ghost = sum(p.cost * (1 if i == j else 2) for (i, j), p in leaf.pairs.items())
    ghost += sum(u.form.build_cost for u in leaf.uses) / chunk
    inst = sum(u.form.inst_cost() for u in leaf.uses) + _GRAM_TRAFFIC * leaf.size
    return ghost < _GRAM_GHOST_SPEED * (2 * leaf.size + inst / chunk)


@dataclasses.dataclass(frozen=True)
class _SymmetricRows(Leaf):
    """The Gram matrix of a batch with itself, from the chunks of its rows, each
    dotted with about half of the batch: a chunk starting at example `s` dots the
    gradients it holds with those of the examples `s, s + 1, ..., s + width - 1`,
    cyclically (modulo `N`), its own among them. With `width = min(N, N // 2 + B)`
    every pair `(i, j)` is reached from `i`'s chunk or from `j`'s (whichever the
    other follows by at most `N / 2` examples), so each chunk evaluates `N / 2 + B`
    other gradients where a full row takes `N`, and the matrix is made symmetric
    from what was reached. `columns(mine, start)`: the chunk's `mine` dotted
    with the `width` examples from `start` on, shape `(width, L)`. (Its own block is
    evaluated again rather than taken from `mine`: `mine` then has no use beside
    the loop over the columns, which would otherwise take a copy of it.)"""

    size: int = 0
    width: int = 0
    columns: Callable[..., Any] = identity
    sums: bool = True  # nothing to combine: the rows are the result
    windows: bool = True  # any window's rows are valid (a chunk's start is in them)

    def summarise(self, out: Any) -> tuple[Any, Any]:
        mine, index = out
        start = index[0]
        values = self.columns(mine, start).T
        return (), (values, jnp.broadcast_to(start, index.shape))

    def combine(self, a: Any, b: Any) -> Any:
        return a

    def finish(self, summary: Any, rows: Any) -> Any:
        values, starts = rows
        spec = ghost.explicit_spec()
        if spec is not None:  # whole, then the rows sharded as they came
            spec = jax.typeof(values).sharding.spec
            values = jax.sharding.reshard(values, jax.P())
            starts = jax.sharding.reshard(starts, jax.P())
        n, width = values.shape
        # Row i holds the columns (starts[i] + m) % n, m < width. Entry (i, j) is
        # read from row i where it reached j (and i <= j or j's row did not reach
        # i), else from row j: one value for (i, j) and (j, i), read in one
        # gather whose indices XLA fuses in (no n x n temporaries).
        i = jnp.arange(n, dtype=starts.dtype)[:, None]  # (int32, x64 on too)
        j = jnp.arange(n, dtype=starts.dtype)[None, :]
        ij, ji = (j - starts[:, None]) % n, (i - starts[None, :]) % n
        mine = (ij < width) & ((i <= j) | (ji >= width))
        gram = values[jnp.where(mine, i, j), jnp.where(mine, ij, ji)]
        if spec is not None:
            gram = jax.sharding.reshard(gram, jax.P(spec[0], None))
        return gram


def _example_at(args: tuple, in_axes: tuple, j: Any) -> list[Any]:
    """Example `j` of the mapped arguments (the others whole)."""
    return [
        arg
        if a is None
        else jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, a, False), arg)
        for arg, a in zip(args, in_axes)
    ]


def _rotated(args: tuple, in_axes: tuple, shift: Any, size: int, count: int) -> tuple:
    """The examples `shift, shift + 1, ..., shift + count - 1` (modulo `size`) of
    the mapped arguments (the others as they are), by static rolls selected by the
    bits of `shift` rather than a gather: `shift` differs between the shares of
    devices that evaluate their chunks together, where a gather of a whole batch
    by a per-share index has no sharding JAX can infer."""

    def rotate(x: Any, axis: int) -> Any:
        bit = 1
        while bit < size:
            rolled = jnp.roll(x, -bit, axis=axis)
            x = jnp.where((shift // bit) % 2 == 1, rolled, x)
            bit *= 2
        return lax.slice_in_dim(x, 0, count, axis=axis)

    return tuple(
        arg if a is None else jax.tree.map(lambda x: rotate(x, a), arg)
        for arg, a in zip(args, in_axes)
    )


@decorator_form("fun")
@takes(Chunking)
def per_example_grad_gram(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    other_batch_size: int | None = None,
    method: str = "vmap",
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """Dot products between per-example gradients: a Gram matrix, chunked over both
    batches.

    `per_example_grad_gram(fun)(*args)` is the `N x N` matrix
    `G[i, j] = <g_i, g_j>` of the per-example gradients `g_i = jax.grad(fun,
    argnums)(example i)` (the dot product summed over every differentiated leaf).
    With a second batch, `gram(*args, other=other_args)` is the `N x M` cross-Gram
    `G[i, j] = <g_i(args), g_j(other_args)>`: `other_args` is a tuple of `fun`'s
    positional arguments for the `M` other examples (its differentiated arguments
    are usually the same parameters), e.g. training examples against test
    predictions for TracIn-style influence scores. To restrict the dot products to
    some parameters (the last layers, as attribution methods often do), pass those
    as the differentiated argument and the others unmapped.

    The rows are evaluated `batch_size` examples at a time, and for each such chunk
    the other batch `other_batch_size` examples at a time (default: `batch_size`),
    so memory holds `batch_size + other_batch_size` gradients (with
    `method="ghost"`: their activations and cotangents) and the `batch_size x M`
    block of the result; the other batch's gradients are recomputed once per chunk
    of rows. A batch against itself (no `other=`) uses the symmetry: the chunk of
    rows from example `s` is dotted with the examples `s, ..., s + N // 2 +
    batch_size - 1` only (cyclically), which reaches every pair from one of its two
    chunks, and the matrix is exactly symmetric; those rows (`N // 2 + batch_size`
    values per example) are held until the matrix is read from them. With
    `batch_size="auto"` the rows take the fewest chunks whose program fits
    `memory_limit` (by XLA's compiled estimate, as in `batch_vmap`), so the more
    memory, the fewer chunks and recomputed gradients: with `other_batch_size`
    given, the other batch is chunked by it; without, both batches are chunked by
    the same size.

    Args:
      fun: the loss of one example; a real scalar (or `(scalar, aux)` with
        `has_aux`).
      argnums: which positional argument(s) to differentiate.
      has_aux: whether `fun` returns `(loss, aux)`; the rows' `aux` is stacked per
        example and returned beside the matrix (the other batch's is not used).
      batch_argnums: the positional arguments holding the examples (default: every
        argument not in `argnums`), in both batches.
      batch_size: examples of the rows' batch per chunk (None: all at once;
        "auto": the fewest chunks that fit `memory_limit`).
      other_batch_size: examples of the other batch per chunk (default:
        `batch_size`).
      method: "vmap" (each chunk's per-example gradients, dotted) or "ghost"
        (each dot product from the two examples' activations and cotangents by
        ghost clipping's rules, e.g. `sum_{t, s} <x_t, x'_s> <d_t, d'_s>` for a
        dense use, matching rows for an embedding lookup, where those cost less
        per pair than the dot product of formed gradients; the gradients of other
        leaves are formed per example). With "ghost" the other batch's examples
        must have the shapes of the call's.
      shard: spread the rows' examples over the devices of `mesh` (see
        `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks of rows.
      chunk_size: an alias of `batch_size`.

    Returns:
      A function of `fun`'s arguments (and `other=`, a tuple of them) returning the
      Gram matrix, float32 (at least), shape `(N, N)` or `(N, M)`; with `has_aux`,
      `(matrix, aux)`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grad_gram
      >>> def loss(w, x):
      ...     return jnp.dot(w, x)  # the gradient of example x is x itself
      >>> x = jnp.array([[1.0, 0.0], [3.0, 2.0], [0.0, 1.0]])
      >>> per_example_grad_gram(loss, batch_size=2)(jnp.ones(2), x)
      Array([[ 1.,  3.,  0.],
             [ 3., 13.,  2.],
             [ 0.,  2.,  1.]], dtype=float32)
    """
    name = "per_example_grad_gram"
    check_bool(name, "has_aux", has_aux)
    method = _choice.check_method(name, method)
    other_batch_size = _axes.check_positive_int(
        "other_batch_size", other_batch_size, transform=name
    )
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )
    # (the rows' transforms choose their own chunk sizes)
    placed = {k: v for k, v in options.items() if k in ("shard", "mesh", "remat")}
    placed["progress"] = options.get("progress", False)
    gram = _Gram(
        name,
        fun,
        argnums,
        batch_argnums,
        has_aux,
        method=method,
        options=placed,
        transform=transform,
        other_batch_size=other_batch_size,
    )
    return transform.public(gram.call, fun)


class _Gram:
    """`per_example_grad_gram`'s evaluation: the rows' chunking (`transform`), the
    other batch's, and the size searched for both when "auto" has no
    `other_batch_size`."""

    def __init__(
        self, name: str, fun: Callable[..., Any], argnums: Any, batch_argnums: Any,
        has_aux: bool, *, method: Any, options: dict, transform: Transform,
        other_batch_size: int | None,
    ) -> None:  # fmt: skip
        self.name, self.fun, self.has_aux, self.method = name, fun, has_aux, method
        self.argnums, self.batch_argnums = argnums, batch_argnums
        self.options, self.transform = options, transform
        # "auto" without other_batch_size: one size for both batches, searched here
        self.joint = transform.options.auto and other_batch_size is None
        if other_batch_size is None and not self.joint:
            other_batch_size = transform.options.batch_size
        self.other_batch_size = other_batch_size
        # the other batch's chunking (validated now, so errors name the transform)
        self.inner = grad_transform(
            name, fun, argnums, batch_argnums, exclusive=True,
            batch_size=None if self.joint else other_batch_size,
        )  # fmt: skip
        self.fixed: dict[tuple[int, bool], Transform] = {}

    def sized(self, b: int, measuring: bool = False) -> Transform:
        """The rows' chunking at a chosen size (a measured program runs on one
        device, as `batch_vmap`'s search measures one)."""
        if (b, measuring) not in self.fixed:
            opts = self.options
            if measuring:
                opts = dict(opts, shard=False, mesh=None)
            self.fixed[b, measuring] = grad_transform(
                self.name, self.fun, self.argnums, self.batch_argnums,
                exclusive=True, batch_size=b, **opts,
            )  # fmt: skip
        return self.fixed[b, measuring]

    def parts(
        self, rows: Transform, args: tuple, diff: Any, in_axes: tuple, runs: Any
    ) -> tuple:
        """`(rep, dot)`: an example's representation `(rep, aux)` and the dot
        product of two representations (with `method="ghost"`: by the program
        `runs`, where given, else the one `_choice.decided` says)."""
        if self.method is ghost.Method.GHOST:
            chunk = _chunk_length(rows, args, in_axes)[1]
            dots = _GhostDots.of(
                self.transform, self.name, self.fun, args=args, diff=diff,
                in_axes=in_axes, has_aux=self.has_aux, chunk=chunk,
            )  # fmt: skip
            if runs is None:
                runs = self.chosen(rows, dots, args, diff, in_axes)
            if runs is ghost.Method.GHOST:
                return dots.parts, dots.dot
        grad = filtered_value_and_grad(
            self.fun, diff, rows.args.single, self.has_aux, self.name
        )

        def rep(*example: Any) -> tuple[Any, Any]:
            value, g = grad(*example)
            return g, value[1] if self.has_aux else None

        return rep, _tree_vdot

    def chosen(self, rows, dots: _GhostDots, args, diff, in_axes) -> ghost.Method:
        """The program a ghost call runs (`_choice.decided`): the model's, the
        ghost program where a leaf's dot products are taken from its operands
        (`_GhostDots.ghost`), measured on an accelerator for the rows' chunk;
        warned once per function (its transform's, not each size "auto" tries)."""
        report = _choice.ruled_report(dots.traced, bool(dots.ghost), "dot products")
        resolved = (diff, in_axes, in_axes)

        def program(twin: Transform, runs: ghost.Method) -> Callable[..., Any]:
            def run(args: tuple, kwargs: dict) -> Any:
                b = twin.options.batch_size
                return self.evaluate(twin, b, args, None, None, resolved, runs=runs)

            return run

        size, chunk = _chunk_length(rows, args, in_axes)
        call = (args, {}, in_axes)
        return _choice.decided(
            self.transform, self.fun, report, dots, program, call=call, size=size,
            chunk=chunk,
        )  # fmt: skip

    def evaluate(
        self, rows: Transform, inner_size: Any, args: tuple, other: tuple | None,
        known: Any, resolved: tuple, *, runs: Any = None,
    ) -> Any:  # fmt: skip
        """The matrix of `args` against `other` (None: against themselves;
        `resolved`: the call's differentiated arguments, its `in_axes` and the other
        batch's; `runs`: `parts`')."""
        diff, in_axes, other_axes = resolved
        rep, dot = self.parts(rows, args, diff, in_axes, runs)
        if other is None:
            return self.symmetric(rows, inner_size, args, known, in_axes, rep, dot=dot)
        axes = (None, *other_axes)
        other = tuple(_whole_examples(a, ax) for a, ax in zip(other, other_axes))

        def row(*example: Any) -> Any:  # one example's dot products with `other`
            mine, aux = rep(*example)

            def entry(mine: Any, *other_example: Any) -> Any:
                return dot(mine, rep(*other_example)[0])

            inner = batch_vmap(entry, in_axes=axes, batch_size=inner_size)
            return inner(mine, *other), aux

        out = rows.map(row, args, {}, in_axes, 0, known=known)
        return out if self.has_aux else out[0]

    def symmetric(
        self, rows: Transform, inner_size: Any, args: tuple, known: Any,
        in_axes: tuple, rep: Callable[..., Any], *, dot: Callable[..., Any],
    ) -> Any:  # fmt: skip
        """The batch against itself (`_SymmetricRows`): each chunk of rows holds
        its examples' `rep` and dots them with half of the batch."""
        size, batch = _chunk_length(rows, args, in_axes)
        width = min(size, size // 2 + batch)
        columns = _columns(rep, dot, args, in_axes, size, width, inner_size=inner_size)

        def row(index: Any, *example: Any) -> Any:
            mine, aux = rep(*example)
            return (mine, index), aux

        index = jnp.arange(size, dtype=jnp.int32)
        out = rows.map(
            row, (index, *args), {}, (0, *in_axes), 0, known=known,
            accumulator=compose((_SymmetricRows(size, width, columns), Stack())),
        )  # fmt: skip
        return out if self.has_aux else out[0]

    def empty(self, args: tuple, n: int, m: int, resolved: tuple) -> Any:
        return _empty_gram(self, args, n, m, resolved)

    def choose(self, args: tuple, other: tuple | None, resolved: tuple) -> int:
        """The size for both batches: the fewest chunks whose program fits the
        budget."""
        leaves, treedef = jax.tree.flatten((args, other))
        dyn = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        abstract = [_axes.sized(leaves[i], None, 0) for i in dyn]

        def measure(b: int) -> int:
            def program(*values: Any) -> Any:
                a, o = jax.tree.unflatten(treedef, _axes.combine(leaves, dyn, values))
                return self.evaluate(self.sized(b, True), b, a, o, None, resolved)

            return _memory.temp_bytes(self.name, program, abstract)

        key = (treedef, tuple(jax.typeof(leaves[i]) for i in dyn))
        size = _choice.examples(self.transform, args, resolved[1], {})
        return self.transform.auto.choose(key, measure, size)

    def resolve(self, args: tuple, kwargs: dict) -> tuple:
        """`(args, other given or None, resolved)` of a call, checked."""
        name, kwargs = self.name, dict(kwargs)
        given = kwargs.pop("other", None)
        other = args if given is None else tuple(given)
        if kwargs:
            raise TypeError(
                f"{name} takes fun's positional arguments and other= only, but got "
                f"the keyword arguments {sorted(kwargs)}."
            )
        diff, in_axes = self.transform.resolve(args)
        other_diff, other_axes = self.inner.resolve(other)
        if other_diff != diff or len(other) != len(args):
            raise ValueError(
                f"{name} other= must hold fun's {len(args)} positional arguments, "
                f"as the call does, but got {len(other)}."
            )
        args = differentiable_floats(args, diff, in_axes)
        other = differentiable_floats(other, diff, other_axes)
        if self.method is ghost.Method.GHOST:
            shapes, other_shapes = _shapes(args, in_axes), _shapes(other, other_axes)
            if other_shapes != shapes:
                raise ValueError(
                    f"{name} method='ghost' needs other= examples of the shapes of "
                    f"the call's ({shapes}), but got {other_shapes}; use "
                    f"method='vmap'."
                )
        against = None if given is None else other  # None: the batch's symmetry
        return args, against, (diff, in_axes, other_axes)

    def call(self, args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        args, against, resolved = self.resolve(args, kwargs)
        n = _choice.examples(self.transform, args, resolved[1], {})
        m = (
            n
            if against is None
            else _choice.examples(self.inner, against, resolved[2], {})
        )
        if n == 0 or m == 0:
            return self.empty(args, n, m, resolved)
        if self.joint:
            b = self.choose(args, against, resolved)
            return self.evaluate(self.sized(b), b, args, against, known, resolved)
        return self.evaluate(
            self.transform, self.other_batch_size, args, against, known, resolved
        )


def _empty_gram(
    gram: Any, args: tuple, n: int, m: int, resolved: tuple
) -> Any:  # fmt: skip
    """The `(n, m)` matrix where `n` or `m` is 0 (and with `has_aux`, the `n`
    examples' aux), as the matrix of no pair: zeros of its dtype."""
    diff, in_axes, _ = resolved
    floats = [
        x.dtype
        for i in diff
        for x in jax.tree.leaves(args[i])
        if _axes.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    matrix = jnp.zeros((n, m), ghost.accumulation_dtype(floats))
    if not gram.has_aux:
        return matrix
    one = [
        jax.tree.map(lambda x: _axes.sized(x, 0, 1), a) if ax == 0 else a
        for a, ax in zip(args, in_axes)
    ]
    _, aux = jax.eval_shape(jax.vmap(gram.fun, in_axes=in_axes), *one)
    return matrix, jax.tree.map(lambda s: jnp.zeros((n, *s.shape[1:]), s.dtype), aux)


def _columns(
    rep: Callable[..., Any], dot: Callable[..., Any], args: tuple, in_axes: tuple,
    size: int, width: int, *, inner_size: Any,
) -> Callable[..., Any]:  # fmt: skip
    """`columns(mine, start)`: a chunk's dot products with the `width` examples
    from `start` (cyclically) of the whole batch `args`."""
    whole = tuple(_whole_examples(a, ax) for a, ax in zip(args, in_axes))

    def entry(mine: Any, *example: Any) -> Any:
        theirs, _ = rep(*example)
        return jax.vmap(lambda a: dot(a, theirs))(mine)

    def at(mine: Any, j: Any) -> Any:
        return entry(mine, *_example_at(whole, in_axes, j))

    def columns(mine: Any, start: Any) -> jax.Array:
        # Over Explicit mesh axes the chunks of all devices' shares may run
        # vmapped together: a per-share start then gathers from a batch they all
        # hold with no output sharding JAX can infer; rolled, not gathered.
        if ghost.explicit_spec(()) is not None:
            them = _rotated(whole, in_axes, start, size, width)
            inner = batch_vmap(entry, in_axes=(None, *in_axes), batch_size=inner_size)
            return inner(mine, *them)
        js = (start + jnp.arange(width, dtype=jnp.int32)) % size
        return batch_vmap(at, in_axes=(None, 0), batch_size=inner_size)(mine, js)

    return columns
