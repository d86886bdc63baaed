"""Clipped per-example gradient sums (DP-SGD): `clipped_grad` and `clipped_grad_sum`.

`clipped_grad` has the signature, options and return values of jax-privacy's
`jax_privacy.clipping.clipped_grad` (2.0), so that a DP-SGD program switches by changing
one import; `clipped_grad_sum` is chunkvmap's compact form (every non-differentiated
argument mapped, the count returned). One implementation serves both (`clipped_sums`):
the gradient of one example is computed, optionally transformed, cast and made NaN-safe,
clipped, and returned with the example's extras (value, unclipped norm, aux); the
`batch_vmap` pipeline evaluates examples in chunks and folds each chunk's summary with
`jnp.add`. A chunk's summary is the sum of its clipped gradients and its extras written
at their examples' positions, so at most `batch_size` gradients exist at once, any `N`
works, and the chunks are contiguous (`microbatch_size` is an alias of `batch_size`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import _accumulators, _axes, _cache, _memory, _padding, _program
from .._core._accumulators import Fold, Stack
from .._core._loop import example_at
from .._core._options import (
    Chunking,
    ClipChunking,
    check_bool,
    check_bools,
    check_callable,
    decorator_form,
    identity,
    takes,
)
from .._transforms._batch_vmap import Transform
from .._transforms._grads import (
    FloatLeaves,
    differentiable_floats,
    filtered_value_and_grad,
    grad_transform,
    noting_errors,
    one_example_note,
    resolve_argnums,
)
from . import _choice, ghost
from ._records import Quantity, over_chunks


class AuxiliaryOutput(NamedTuple):
    """The per-example outputs of `clipped_grad` (jax-privacy's fields).

    Each field has a leading axis of the examples, or is None when not requested.

    Attributes:
      values: the loss of each example (`return_values=True`).
      grad_norms: the L2 norm of each example's gradient, before the pre-clipping
        transform and before clipping, in at least float32 (`return_grad_norms=True`).
      aux: `fun`'s auxiliary output for each example (`has_aux=True`).

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import clipped_grad
      >>> f = lambda w, x: jnp.sum(x @ w)  # x: a batch of one example
      >>> _, aux = clipped_grad(f, l2_clip_norm=1.0, return_grad_norms=True)(
      ...     jnp.ones(2), jnp.array([[3.0, 4.0], [0.0, 1.0]]))
      >>> aux.grad_norms, aux.values is None
      (Array([5., 1.], dtype=float32), True)
    """

    values: Any = None
    grad_norms: Any = None
    aux: Any = None


_RELATIONS = ("ADD_OR_REMOVE_ONE", "REPLACE_ONE", "REPLACE_SPECIAL")


class ClippedGrad:
    """The function `clipped_grad` returns: call it like `fun`, and ask it for its
    sensitivity (jax-privacy's `BoundedSensitivityCallable`).

    Attributes:
      l2_norm_bound: the bound on the L2 norm of each example's contribution to the
        sum: `1` with `rescale_to_unit_norm`, else `l2_clip_norm`, divided by
        `normalize_by`.
      has_aux: whether the function returns `(grad_sum, AuxiliaryOutput)`.
      fun: the chunked function that computes the clipped sum.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import clipped_grad
      >>> g = clipped_grad(lambda w, x: jnp.sum(w * x), l2_clip_norm=2.0,
      ...                  normalize_by=4.0)
      >>> g.l2_norm_bound, g.sensitivity(), g.sensitivity("REPLACE_ONE")
      (0.5, 0.5, 1.0)
    """

    def __init__(self, fun: Callable[..., Any], l2_norm_bound: Any, has_aux: bool):
        self.fun = fun
        self.l2_norm_bound = l2_norm_bound
        self.has_aux = has_aux
        ft.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fun(*args, **kwargs)

    def sensitivity(self, neighboring_relation: Any = None) -> Any:
        """The L2 sensitivity of the clipped sum under `neighboring_relation`.

        Args:
          neighboring_relation: a `dp_accounting.NeighboringRelation` (or its name as
            a string, so dp-accounting need not be installed): `ADD_OR_REMOVE_ONE`
            and `REPLACE_SPECIAL` (the default, None) give `l2_norm_bound`,
            `REPLACE_ONE` twice that (one example removed and another added).

        Returns:
          The sensitivity, a number (or a traced scalar for a traced clip norm).
        """
        if neighboring_relation is None:
            relation = "REPLACE_SPECIAL"
        else:
            relation = getattr(neighboring_relation, "name", neighboring_relation)
        if isinstance(relation, str) and relation.upper() in _RELATIONS:
            relation = relation.upper()
            return self.l2_norm_bound * (2 if relation == "REPLACE_ONE" else 1)
        raise ValueError(
            f"clipped_grad sensitivity: unsupported neighboring_relation="
            f"{neighboring_relation!r}; expected a dp_accounting.NeighboringRelation "
            f"(or its name): one of {', '.join(_RELATIONS)}."
        )

    def __repr__(self) -> str:
        return (
            f"ClippedGrad({getattr(self, '__name__', self.fun)!s}, l2_norm_bound="
            f"{self.l2_norm_bound!r}, has_aux={self.has_aux})"
        )


# --------------------------------------------------------------------------------------
# Norms and clipping of one example's gradient.


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves together, accumulated in at least float32.

    Zero-safe under differentiation: the square root is only taken of positive values,
    so a zero gradient gives norm 0 and finite derivatives. A gradient with a NaN has a
    NaN norm; one with an infinity (and no NaN) an infinite norm.
    """
    return _norm_of_square(global_sq_norm(tree))


def global_sq_norm(tree: Any) -> jax.Array:
    """The squared L2 norm of all leaves together, accumulated in at least float32
    (float64 for double-precision leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    acc = ghost.accumulation_dtype([x.dtype for x in leaves])
    return sum(_squared(x, acc) for x in leaves)


def leaf_norms(tree: Any) -> Any:
    """Each leaf's L2 norm (a tree like `tree`), accumulated as `global_norm`'s."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return tree
    acc = ghost.accumulation_dtype([x.dtype for x in leaves])
    return jax.tree.map(lambda x: _norm_of_square(_squared(x, acc)), tree)


def _squared(x: jax.Array, acc: Any) -> jax.Array:
    """`||x||^2`, summed in `acc`."""
    return jnp.sum(jnp.square(jnp.abs(x).astype(acc)))


def _norm_of_square(total: jax.Array) -> jax.Array:
    """`sqrt(total)`, zero-safe under differentiation, NaN kept."""
    positive = total > 0
    norm = jnp.where(positive, jnp.sqrt(jnp.where(positive, total, 1)), 0)
    return jnp.where(jnp.isnan(total), total, norm)


def clip_scale(norm: jax.Array, clip: Any, rescale_to_unit_norm: bool) -> jax.Array:
    """The factor that clips a tree of L2 norm `norm` to `clip` (jax-privacy's rule).

    `min(1, clip / norm)`, divided by `clip` with `rescale_to_unit_norm` (by `norm`
    when `clip` is 0); a zero norm leaves the tree unchanged; a NaN or infinite
    factor becomes 0 (NaN norms, `clip = norm = inf`, and the unit rescaling of an
    infinite clip), and a negative `clip` counts as 0. Every division is guarded, so
    the factor has finite derivatives.
    """
    clip = jnp.maximum(jnp.asarray(clip, norm.dtype), 0)
    positive = norm > 0  # False for 0 and NaN
    safe_norm = jnp.where(positive, norm, 1)
    at_zero = jnp.where(clip > 0, jnp.inf, jnp.nan)  # clip / 0 (0 / 0 is NaN)
    bad = jnp.where(norm == 0, at_zero, jnp.nan)
    scale = jnp.minimum(1, jnp.where(positive, clip / safe_norm, bad))
    if rescale_to_unit_norm:
        clip_positive = clip > 0
        inverse = jnp.where(positive, 1 / safe_norm, jnp.where(norm == 0, jnp.inf, bad))
        scale = jnp.where(
            clip_positive, scale / jnp.where(clip_positive, clip, 1), inverse
        )
    return jnp.nan_to_num(scale, nan=0.0, posinf=0.0)


def _nan_to_zero(x: jax.Array) -> jax.Array:
    return jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


@dataclasses.dataclass(frozen=True)
class Clipping:
    """What is done to each example's gradient, and which extras are returned."""

    l2_clip_norm: Any
    rescale_to_unit_norm: bool = False
    nan_safe: bool = True
    dtype: Any = None
    pre_clipping_transform: Callable[[Any], Any] = identity
    keep_batch_dim: bool = False
    return_values: bool = False
    return_grad_norms: bool = False
    has_aux: bool = False
    prng_argnum: int | None = None
    # jax-privacy's call rules: the differentiated arguments may not hold examples.
    jax_privacy: bool = False
    method: ghost.Method = ghost.Method.VMAP
    # Whether the clipped sum is wanted (else only the per-example extras: norms).
    sums: bool = True
    # Whether the norms are each differentiated leaf's (a tree like the gradient's)
    # rather than one global norm per example.
    per_leaf_norms: bool = False
    # The program `method="ghost"` runs, where given (a measurement's); None: the
    # one `_choice.choose` says.
    runs: ghost.Method | None = None

    def norms(self, grads: Any) -> Any:
        """One example's gradient norm (global, or per leaf), as returned."""
        return leaf_norms(grads) if self.per_leaf_norms else global_norm(grads)

    def factor(self, norm: jax.Array, pad: Any) -> jax.Array:
        """The factor that clips a gradient of norm `norm` (0 where `pad`, if
        given); elementwise, for one example or a chunk's."""
        scale = clip_scale(norm, self.l2_clip_norm, self.rescale_to_unit_norm)
        return scale if pad is None else jnp.where(pad, 0, scale)

    def prepare(self, grads: Any, pad: Any) -> tuple[Any, jax.Array]:
        """One example's gradient, transformed, cast and made NaN-safe, and the
        factor that clips it (0 for a padding example, whose gradient is then zero
        too, even where it is NaN)."""
        tree = self.pre_clipping_transform(grads)
        if self.dtype is not None:
            tree = jax.tree.map(lambda x: jnp.asarray(x).astype(self.dtype), tree)
        if self.nan_safe:
            tree = jax.tree.map(_nan_to_zero, tree)
        scale = self.factor(global_norm(tree), pad)
        if pad is not None and not self.nan_safe:
            tree = jax.tree.map(lambda x: jnp.where(pad, 0, x).astype(x.dtype), tree)
        return tree, scale

    def clip(self, grads: Any, pad: Any) -> Any:
        """One example's gradient, transformed, cast, made NaN-safe and clipped (zero
        for a padding example)."""
        tree, scale = self.prepare(grads, pad)
        return jax.tree.map(lambda x: x * scale.astype(x.dtype), tree)


def scaled_sum(scales: jax.Array, tree: Any) -> Any:
    """`sum_i scales[i] * tree_i` over the leading axis of every leaf: one
    contraction per leaf (a matrix-vector product, where multiplying and then summing
    over the examples' axis would make XLA reduce along a strided axis, several times
    slower on CPU)."""
    return jax.tree.map(lambda g: jnp.tensordot(scales.astype(g.dtype), g, 1), tree)


@contextlib.contextmanager
def _single_example_hint(name: str, config: Clipping):
    """With `keep_batch_dim=False`, a shape error from `fun` gets a note: a loss
    written for a batch of one example needs the default `keep_batch_dim=True`."""
    try:
        yield
    except (IndexError, TypeError, ValueError) as e:
        if config.jax_privacy and not config.keep_batch_dim:
            e.add_note(
                f"{name} called the loss with one example and no batch axis "
                f"(keep_batch_dim=False); a loss written for a batch of one example "
                f"needs keep_batch_dim=True, the default."
            )
        raise


def _note(name: str, fun: Any, config: Clipping) -> str | None:
    """The note on an error `fun` raises on one example (see `one_example_note`):
    for the compact functions, which call `fun` on one example without a batch
    axis (`clipped_grad` has its own, `_single_example_hint`)."""
    return None if config.jax_privacy else one_example_note(name, fun)


def _squeeze_leading_one(x: Any) -> Any:
    """An aux leaf of one example without the size-1 batch axis `fun` kept."""
    if np.ndim(x) >= 1 and np.shape(x)[0] == 1:
        return jnp.squeeze(x, 0)
    return x


def clipped_sums(
    transform: Transform,
    fun: Callable[..., Any],
    config: Clipping,
    args: tuple,
    kwargs: dict,
    known: _cache.Known,
) -> tuple[Any, AuxiliaryOutput, int]:
    """The clipped gradient sum of a call, its per-example extras, and the count of
    its real examples (`N`, less the padding: traced then; `known`: the concrete
    shardings of an eager call's arguments)."""
    call = _ClippedCall.of(transform, config, args, kwargs)
    total, extras, size = _sums(transform, fun, config, call, known)
    if call.padding is None:
        return total, extras, size
    # the padding's per-example outputs: zeros
    extras = _padding.zeroed(call.padding, extras)
    return total, extras, size - jnp.sum(call.padding, dtype=jnp.int32)


def _sums(transform, fun, config, call, known) -> tuple:
    """`clipped_sums` of a checked call, by the method that runs."""
    if config.method is ghost.Method.GHOST and call.size > 0:
        sums = _GhostSums.of(transform, fun, config, call)
        runs = config.runs
        if runs is None:
            runs = _chosen(transform, fun, config, call, sums)
        if runs is ghost.Method.GHOST:  # (else: the per-example path)
            return (
                *sums(call.args, call.in_axes, call.kwargs, call.padding, known),
                call.size,
            )
    return _formed_sums(transform, fun, config, call, known)


def _method_program(fun, config, call) -> Callable[..., Any]:
    """`program(twin, method)`: the clipping call's program for `method`, as a
    function of `(args, kwargs)` (`_choice.choose`'s)."""

    def program(twin: Transform, method: ghost.Method) -> Callable[..., Any]:
        forced = dataclasses.replace(config, runs=method)

        def run(args: tuple, kwargs: dict) -> Any:
            one = call._replace(
                args=args, kwargs=kwargs, size=twin.options.batch_size, padding=None
            )
            total, extras, _ = _sums(twin, fun, forced, one, None)
            return total, extras

        return run

    return program


def _chosen(transform, fun, config, call, sums) -> ghost.Method:
    """The program a ghost call runs (`_choice.decided`: both programs of one
    chunk of the call measured on an accelerator; else the plan's verdict)."""
    inputs = (call.args, call.kwargs, call.in_axes)
    program = _method_program(fun, config, call)
    return _choice.decided(
        transform, fun, sums.report, sums, program, call=inputs, size=call.size
    )


# `ghost_report` measures (on an accelerator) chunks of this many examples.
_REPORT_CHUNK = 64


def report_for(
    fun: Callable[..., Any], args: tuple, kwargs: dict, diff: tuple,
    mapped: tuple, has_aux: bool, *, traced: Any,
) -> ghost.GhostReport:  # fmt: skip
    """`ghost_report`'s report of one example's arguments (`traced`: its loss):
    the verdict of `clipped_grad_sum(method="ghost")`'s choice for chunks of
    `_REPORT_CHUNK` examples (measured on an accelerator; the model's on CPU, a
    ghost program it predicts slower checked for memory)."""
    timed = _choice.measurable()
    modelled = ghost.report_of(traced.plan)
    settled = _choice.settled_report(modelled, timed)
    if settled is not None:
        return settled
    try:
        with warnings.catch_warnings():  # (the clipping call's, not the report's)
            warnings.simplefilter("ignore")
            return _measured_report(fun, args, kwargs, diff, mapped, has_aux)
    except Exception:  # noqa: BLE001 (arguments a clipping call would map otherwise)
        return _choice.settled_report(modelled, False) or modelled


def _measured_report(fun, args, kwargs, diff, mapped, has_aux) -> ghost.GhostReport:
    """`report_for`'s measured verdict: a clipping call of the example (its arrays
    given a batch axis of one), its programs measured for chunks of
    `_REPORT_CHUNK` (timed on an accelerator; on CPU, their memory)."""
    name = "ghost_report"
    transform = grad_transform(name, fun, diff, mapped, exclusive=True)
    config = Clipping(1.0, nan_safe=False, has_aux=has_aux, method=ghost.Method.GHOST)

    def one(tree: Any) -> Any:
        return jax.tree.map(
            lambda x: jnp.expand_dims(x, 0) if _axes.is_array(x) else x, tree
        )

    batched = tuple(one(a) if i in mapped else a for i, a in enumerate(args))
    kwargs = one(kwargs)
    call = _ClippedCall.of(transform, config, batched, kwargs)
    sums = _GhostSums.of(transform, fun, config, call)
    inputs = (call.args, call.kwargs, call.in_axes)
    program = _method_program(fun, config, call)
    return _choice.choose(
        transform, sums.report, sums, program, inputs, call.size, chunk=_REPORT_CHUNK
    )


class _ClippedCall(NamedTuple):
    """A clipped sum's call, resolved: its arguments (floats made differentiable,
    the key split per example), their axes, the keywords, the differentiated and
    batched argument positions, `N`, and the checked padding flags (or None)."""

    args: tuple
    in_axes: tuple
    kwargs: dict
    diff: tuple
    batch_args: list
    size: int
    padding: Any

    @classmethod
    def of(
        cls, transform: Transform, config: Clipping, args: tuple, kwargs: dict
    ) -> _ClippedCall:
        name, kwargs = transform.name, dict(kwargs)
        padding = kwargs.pop("is_padding_example", None)  # (jax-privacy's keyword)
        diff, in_axes = transform.resolve(args)
        batch_args = [i for i, a in enumerate(in_axes) if a is not None]
        args = differentiable_floats(args, diff, in_axes)  # as jax.grad differentiates
        mapped = _choice.mapped_leaves(name, args, in_axes, kwargs)
        size = _axes.mapped_size(
            *mapped, None, transform=name,
            # jax-privacy's phrase, for code that matches it
            hint="Batch axis must have the same size for all inputs in batch_argnums",
        )  # fmt: skip
        args, in_axes = list(args), list(in_axes)
        if config.prng_argnum is not None:  # one key per example, split from the given
            (k,) = resolve_argnums(
                name, "prng_argnum", (config.prng_argnum,), len(args)
            )
            if k in diff or k in batch_args:
                raise ValueError(
                    f"{name} prng_argnum={config.prng_argnum} is also in "
                    f"{'argnums' if k in diff else 'batch_argnums'}; the key argument "
                    f"must be passed whole (it is split into one key per example)."
                )
            args[k] = jax.tree.map(lambda key: jax.random.split(key, size), args[k])
            in_axes[k] = 0
        if padding is not None:
            padding = _padding.check(name, padding, size)
        return cls(tuple(args), tuple(in_axes), kwargs, diff, batch_args, size, padding)

    def flagged(self) -> tuple[tuple, tuple]:
        """The arguments and their axes, the padding flags last where padded (the
        loop's `padding=` argument: `len(self.args)`)."""
        if self.padding is None:
            return self.args, self.in_axes
        return (*self.args, self.padding), (*self.in_axes, 0)

    def as_batch_of_one(self, config: Clipping, inputs: list) -> list:
        """One example's `inputs` as `fun` takes them: with `keep_batch_dim`
        (jax-privacy's default), each example argument a batch of one."""
        if config.keep_batch_dim:
            for i in self.batch_args:
                inputs[i] = jax.tree.map(lambda x: jnp.expand_dims(x, 0), inputs[i])
        return inputs


def _formed_sums(
    transform: Transform, fun: Callable[..., Any], config: Clipping,
    call: _ClippedCall, known: Any,
) -> tuple[Any, AuxiliaryOutput, int]:  # fmt: skip
    """The clipped sum from each example's formed gradient (`method="vmap"`, and
    ghost's per-example path)."""
    name, padded = transform.name, call.padding is not None
    value_and_grad = filtered_value_and_grad(
        fun, call.diff, transform.args.single, config.has_aux, name,
        _note(name, fun, config),
    )  # fmt: skip

    def evaluated(inputs: list, kw: dict) -> tuple[Any, AuxiliaryOutput]:
        """One example's gradient, as its loss gives it, and its extras."""
        inputs = call.as_batch_of_one(config, inputs)
        with _single_example_hint(name, config):
            value, grads = value_and_grad(*inputs, **kw)
        value, aux = value if config.has_aux else (value, None)
        if config.keep_batch_dim:
            aux = jax.tree.map(_squeeze_leading_one, aux)
        extras = AuxiliaryOutput(
            value if config.return_values else None,
            config.norms(grads) if config.return_grad_norms else None,
            aux if config.has_aux else None,
        )
        return grads, extras

    def example(*inputs: Any, **kw: Any) -> Any:
        inputs = list(inputs)
        pad = inputs.pop() if padded else None
        grads, extras = evaluated(inputs, kw)
        return config.prepare(grads, pad), extras

    all_args, all_axes = call.flagged()
    if call.size == 0:  # the empty sum (a Poisson-sampled lot may be empty)
        (grads, *_), extras = jax.tree.map(
            lambda a: jnp.zeros(a.shape, a.dtype),
            _one_example_avals(example, all_args, call.kwargs, all_axes),
        )
        empty = jax.tree.map(lambda x: jnp.zeros((0, *x.shape), x.dtype), extras)
        return grads, empty, call.size

    def chunk_sum(chunk: Any) -> Any:
        return _clipped_chunk_sum(chunk) if config.sums else ()

    if _in_passes(transform, config, call):
        total, extras = _passes(transform, fun, config, call, known, evaluated)
        return total, extras, call.size
    total, extras = transform.map(
        example, all_args, call.kwargs, all_axes, 0, known=known,
        accumulator=_accumulators.compose((Fold(jnp.add, chunk_sum), Stack())),
        padding=len(call.args) if padded else None,
    )  # fmt: skip
    return total, extras, call.size


def _clipped_chunk_sum(chunk: tuple) -> Any:
    """A chunk's clipped sum from its examples' made-safe gradients and clip
    factors (`Clipping.prepare`'s, stacked)."""
    grads, scales = chunk
    return scaled_sum(scales, grads)


# The platforms where `_formed_sums` takes a NaN-safe clipped sum in passes
# (`_passes`). On the TPU the select over every example's gradient keeps XLA from
# contracting the clipped gradients into their sum as one product (`clipped_grad`
# at 0.67x of `clipped_grad_sum` on an MLP); on XLA:CPU the select's program is the
# faster (the passes measured 0.84x of it), and GPUs are not measured.
IN_PASSES = frozenset({"tpu"})


def _fixed(transform, config, call, known, evaluated, fix) -> Any:
    """The clipped sum of the examples `fix` marks, each formed, its non-finite
    entries zeroed and clipped as one example is, chunk by chunk: the others are
    padding here, so a chunk holding none of them is skipped."""

    def formed(*inputs: Any, **kw: Any) -> Any:
        inputs = list(inputs)
        pad = inputs.pop()
        return config.prepare(evaluated(inputs, kw)[0], pad)

    return transform.map(
        formed, (*call.args, ~fix), call.kwargs, (*call.in_axes, 0), 0,
        known=known, options=transform.options.quiet(),
        accumulator=_accumulators.compose(Fold(jnp.add, _clipped_chunk_sum)),
        padding=len(call.args),
    )  # fmt: skip


def _in_passes(transform: Transform, config: Clipping, call: _ClippedCall) -> bool:
    """Whether `_formed_sums` makes a NaN-safe clipped sum in passes (`_passes`): on
    the platforms `IN_PASSES`, where each example's gradient is summed as its loss's
    gradient is (no transform or cast before clipping) and every differentiated
    argument is shared by the examples, so that the counted examples' sum is
    `grad sum_i c_i L_i`."""
    return (
        _memory.call_platform(transform.options.mesh) in IN_PASSES
        and config.nan_safe
        and config.sums
        and config.pre_clipping_transform is identity
        and config.dtype is None
        and all(call.in_axes[i] is None for i in call.diff)
    )


def _passes(transform, fun, config, call, known, evaluated) -> tuple[Any, Any]:
    """A NaN-safe clipped sum of formed gradients in three passes, so that the sum
    of the examples whose gradients are finite (nearly all) is one backward pass
    over each chunk, not a select over every example's gradient: each example's
    clip factor, whether its gradient is finite and its extras (the norms need
    its gradient); then `grad sum_i c_i L_i` over the finite ones
    (`weighted_sums`); then the others formed, their non-finite entries zeroed and
    clipped, chunk by chunk (a chunk holding none of them is skipped).
    `evaluated(inputs, kwargs)`: `_formed_sums`'s, one example's gradient and
    extras."""
    name, padded = transform.name, call.padding is not None
    all_args, all_axes = call.flagged()

    def factors(*inputs: Any, **kw: Any) -> Any:
        inputs = list(inputs)
        pad = inputs.pop() if padded else None
        grads, extras = evaluated(inputs, kw)
        # One reduction, as the unsafe sum's: where `||g||^2` is finite every entry
        # is, and nothing is zeroed; else the example is formed apart (`_fixed`),
        # its clip factor that of its entries made finite.
        sq = global_sq_norm(grads)
        scale = config.factor(_norm_of_square(sq), pad)
        return (scale, jnp.isfinite(sq)), extras

    (scales, finite), extras = transform.map(
        factors, all_args, call.kwargs, all_axes, 0, known=known,
        padding=len(call.args) if padded else None,
    )  # fmt: skip
    counted = finite if call.padding is None else finite & ~call.padding
    floats = FloatLeaves(call.args, call.diff)

    def loss(ins: list, kw: dict) -> Any:
        with noting_errors(_note(name, fun, config)):
            out = fun(*call.as_batch_of_one(config, ins), **kw)
        return out[0] if config.has_aux else out

    def rebuild(diff: list) -> tuple:
        return tuple(floats.args_with(diff)), call.kwargs

    sums = weighted_sums(
        transform, loss, (call.args, call.in_axes, call.kwargs, known),
        at=(floats.diff, rebuild), scales=scales, counted=counted, skip=padded,
    )  # fmt: skip
    total = floats.trees(sums, transform.args.single)
    left_out = ~finite if call.padding is None else ~finite & ~call.padding
    fixed = _fixed(transform, config, call, known, evaluated, left_out)
    total = jax.tree.map(lambda t, f: t + f.astype(t.dtype), total, fixed)
    return total, extras


def weighted_sums(
    transform: Transform, loss: Callable[[list, dict], Any], call: tuple, *,
    at: tuple, scales: Any, counted: Any, skip: bool = False,
) -> Any:  # fmt: skip
    """`sum_i c_i G_i` as `grad sum_i c_i L_i`: one backward pass over the chunks of
    `call` (`(args, in_axes, kwargs, known)`), with the examples' clip factors
    `scales`, differentiated at `params` (`at`: `(params, rebuild)`,
    `rebuild(params)` the call's `(args, kwargs)` holding them; `loss(inputs,
    kwargs)`: one example's loss). An example
    not `counted` (padding, or a non-finite gradient) has weight 0 and another
    example's inputs, so that no non-finite value of it meets the sum: with `skip`,
    as the loop stands in for padding (and skips the chunks of such examples
    alone); else a counted example's (`stand_in`). Where `counted` is None every
    example counts."""
    args, in_axes, kwargs, known = call
    params, rebuild = at
    n = len(args)
    mapped = [i for i, a in enumerate(in_axes) if a is not None]
    extra, axes, stand_in = (scales,), (0,), None
    if counted is not None:
        extra, axes = (scales, ~counted), (0, 0)
    if counted is not None and not skip:
        first = jnp.argmax(counted)  # (where none counts, nothing runs)
        take = lambda a, x: example_at(x, first, a)  # noqa: E731
        stand_in = [jax.tree.map(ft.partial(take, in_axes[i]), args[i]) for i in mapped]
        stand_in.append(jax.tree.map(ft.partial(take, 0), kwargs))
        extra, axes = (*extra, stand_in), (*axes, None)

    def weighted(*inputs: Any, **kw: Any) -> Any:
        ins, c = list(inputs[:n]), inputs[n]
        if counted is not None:
            left_out = inputs[n + 1]
            c = jnp.where(left_out, jnp.zeros((), c.dtype), c)
        if stand_in is not None:
            pick = lambda x, y: jnp.where(left_out, y, x)  # noqa: E731
            for i, other in zip(mapped, inputs[n + 2]):
                ins[i] = jax.tree.map(pick, ins[i], other)
            kw = jax.tree.map(pick, kw, inputs[n + 2][-1])
        value = loss(ins, kw)
        return c.astype(value.dtype) * value

    def total(leaves: Any) -> Any:
        new_args, new_kwargs = rebuild(leaves)
        return transform.map(
            weighted, (*new_args, *extra), new_kwargs, (*in_axes, *axes), 0,
            known=known, padding=n + 1 if skip and counted is not None else None,
            options=transform.options.quiet(),
            accumulator=_accumulators.compose(Fold(jnp.add, lambda c: c.sum(0))),
        )  # fmt: skip

    def summed() -> Any:
        if stand_in is None:
            return jax.grad(total)(params)
        # Where no example counts (an empty lot, or every example non-finite), no
        # example can stand in: the pass is not run, and the sum is zero.
        return lax.cond(
            jnp.any(counted),
            jax.grad(total),
            lambda ps: jax.tree.map(jnp.zeros_like, ps),
            params,
        )

    leaves = jax.tree.leaves((params, args, kwargs, scales, counted))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return summed()
    # Eagerly, the pass is one program compiled once (`_program.run_traced`): run
    # as it is, its derivative's loop and branch are programs traced, and
    # compiled, anew at every call.
    programs = transform.memo(("weighted_sums",), _program.LRU)
    return _program.run_traced(summed, [], programs, ())


class _Parts(NamedTuple):
    """What one example of ghost clipping leaves for its chunk's sum, beside its
    record."""

    scale: jax.Array  # its clip factor
    keep: jax.Array  # whether its gradient enters the sum (not padding, ...)
    finite: jax.Array  # whether its `other` leaves' records are finite
    pad: Any  # its padding flag, or None
    safe_sq: jax.Array  # ||G||^2 of the leaves not in `other`, made finite
    raw: jax.Array  # the same, as it is
    fresh: Any = None  # whether no earlier chunk counted it (`uncount`), or None

    @property
    def counted(self) -> jax.Array:
        """Whether its gradient enters this chunk's sum."""
        return self.keep if self.fresh is None else self.keep & self.fresh

    @property
    def to_fix(self) -> jax.Array:
        """Whether `_fix_nonfinite` forms the example's sum again: its `other`
        leaves are not finite, it is not padding, and no earlier chunk counted
        it."""
        fix = ~self.finite if self.pad is None else ~self.finite & ~self.pad
        return fix if self.fresh is None else fix & self.fresh


class _GhostSums(Quantity):
    """`clipped_sums` by ghost clipping (`ghost`): the same results, without
    per-example gradients of the leaves whose uses have rules; an accumulator on
    the ghost record (`_records`).

    What a chunk keeps of each example's record for its sum: the instantiated
    gradients where they are smaller than the operands they come from (biases,
    scales, a depthwise kernel) or have to be masked and cannot be through their
    arrays (`formed`), and the gradients formed per example (`per_example`), as the
    record's `grads`; the arrays of the other leaves whose non-finite entries can be
    masked through them (`masked`, with nan_safe), as its `forms`; the recorded
    operands and cotangents of the others (`other`). With nan_safe, each example's
    non-finite gradient entries are zeroed before its norm, except `other`'s, whose
    non-finite examples are fixed after the chunk's sum (`_fix_nonfinite`).

    Norms alone, or a sum over a scanned layer stack (`two_pass`), take the norms
    of the leaves `taps` in the backward pass (`Plan.tap`): nothing is kept of
    them, and the sum is a second backward pass (`_weighted_sums`)."""

    @classmethod
    def of(cls, transform, fun, config, call: _ClippedCall):
        """The ghost sums of a checked call: its loss traced, and the plan of an
        earlier call of the transform with the same loss program (`Traced.key`)
        kept, so that an eager call does not plan again."""
        args, in_axes, kwargs, diff = call.args, call.in_axes, call.kwargs, call.diff
        batch_args = call.batch_args
        name = transform.name
        note = _note(name, fun, config)

        def noted(*args: Any, **kwargs: Any) -> Any:
            with noting_errors(note):
                return fun(*args, **kwargs)

        with _single_example_hint(name, config):
            traced = ghost.traced_loss(
                transform.memo,
                name,
                noted,
                args,
                kwargs,
                diff,
                # the examples' arguments, and the per-example keys of prng_argnum
                # (split into one key per example, but passed without a batch axis)
                in_axes=in_axes,
                has_aux=config.has_aux,
                keep_batch_dim=config.keep_batch_dim,
                expand=batch_args,
            )
        return traced.memo("sums", lambda: cls(transform, fun, config, traced))

    def __init__(self, transform, fun, config, traced):
        self.traced = traced
        self.report = ghost.report_of(self.traced.plan)
        self.transform, self.config = transform, config
        plan = self.traced.plan
        leaves = plan.leaves
        self.per_example = plan.with_rule(ghost.PER_EXAMPLE)
        self.ruled = plan.with_rule(ghost.GHOST, ghost.INSTANTIATED)
        safe = config.nan_safe

        def small(k: int) -> bool:  # its gradient no larger than its operands
            return leaves[k].size <= plan.operand_size(k)

        instantiated = [k for k in self.ruled if leaves[k].rule == ghost.INSTANTIATED]
        self.masked = [
            k
            for k in self.ruled
            if safe and plan.maskable(k) and not (k in instantiated and small(k))
        ]
        self.formed = [
            k for k in instantiated if k not in self.masked and (safe or small(k))
        ]
        self.other = [k for k in self.ruled if k not in (*self.masked, *self.formed)]
        self.acc = ghost.accumulation_dtype([x.dtype for x in leaves])  # global_norm's
        # Norms in the backward pass (`Plan.tap`), where no record is needed for a
        # sum: norms alone, or a scanned stack's (whose records, cotangents and
        # probes over every iteration outweigh a second backward pass: the sum is
        # then `grad sum_i c_i L_i`, `_weighted_sums`, and with nan_safe the
        # non-finite examples are formed apart, `_fixed_sums`).
        taps = [k for k in self.ruled if plan.tappable(k)]
        self.two_pass = config.sums and bool(plan.stack_taps())
        if self.two_pass:
            self.masked = []
            self.formed = [k for k in instantiated if small(k)]
            self.other = [k for k in self.ruled if k not in self.formed]
        taps = [k for k in taps if k in self.other]
        self.taps = taps if self.two_pass or not (config.sums or safe) else []

    def made_with(self) -> tuple:
        transform = self.transform
        return (self.config, transform.options, transform.args, transform.axis_name)

    def _kept_and_squares(self, g: jax.Array) -> tuple[Any, Any, Any]:
        """`g` as a chunk keeps it (non-finite entries zeroed with nan_safe), and
        `||g||^2` as it is and as kept."""
        s = _squared(g, self.acc)
        if not self.config.nan_safe:
            return g, s, s
        kept = _nan_to_zero(g)
        return kept, s, _squared(kept, self.acc)

    def _squares(self, record: ghost.Record) -> tuple:
        """One example's `||G||^2` over the leaves not in `other`, made finite and
        as it is, the record the chunk keeps of them (formed gradients and masked
        forms), and each of those leaves' own `||G_k||^2` (by leaf index):
        `(safe_sq, raw, kept, squares)`."""
        plan = record.plan
        forms, grads, squares, safe = {}, {}, {}, []
        for k in self.masked:
            forms[k], finite = plan.sanitized(k, record.records, record.deltas)
            safe.append(plan.sq_norm_of(k, forms[k], self.acc))
            # a non-finite gradient's norm: NaN
            squares[k] = jnp.where(finite, safe[-1], jnp.nan)
        formed = {k: record.instantiate(k) for k in self.formed}
        for k, g in {**formed, **record.grads}.items():
            grads[k], squares[k], s_kept = self._kept_and_squares(g)
            safe.append(s_kept)
        raw = ghost.total(list(squares.values()), self.acc)
        unchanged = not self.masked and not self.config.nan_safe  # (safe is squares)
        safe_sq = raw if unchanged else ghost.total(safe, self.acc)
        kept = record.only(self.other).replace(grads=grads, forms=forms)
        return safe_sq, raw, kept, squares

    def keep(self, record: ghost.Record, out: Any, pad: Any = None) -> Any:
        """One example's parts for its chunk's sum, the record the chunk keeps, and
        its extras."""
        config = self.config
        safe_sq, raw, kept, squares = self._squares(record)
        for k in self.other:
            squares[k] = record.sq_norm(k, self.acc)
        rest = ghost.total([squares[k] for k in self.other], self.acc)
        scale = config.factor(_norm_of_square(safe_sq + rest), None)
        keep = jnp.ones((), bool) if pad is None else ~pad
        finite = jnp.ones((), bool)
        if config.nan_safe and self.two_pass:  # formed apart (`_fixed_sums`)
            finite = jnp.isfinite(raw + rest)
        elif config.nan_safe and self.other:  # fixed in _fix_nonfinite
            finite = jnp.isfinite(rest) & ghost.all_finite((kept.records, kept.deltas))
            keep = keep & finite
        value, aux = out
        if config.keep_batch_dim:
            aux = jax.tree.map(_squeeze_leading_one, aux)
        if config.per_leaf_norms:  # a leaf no use reaches: a zero gradient
            zero = jnp.zeros((), self.acc)
            each = [squares.get(k, zero) for k in range(len(record.plan.leaves))]
            norms = [_norm_of_square(s.astype(self.acc)) for s in each]
            norm = self.traced.grads_tree(norms, self.transform.args.single)
        else:
            norm = _norm_of_square(raw + rest)
        extras = AuxiliaryOutput(
            value if config.return_values else None,
            norm if config.return_grad_norms else None,
            aux if config.has_aux else None,
        )
        return (_Parts(scale, keep, finite, pad, safe_sq, raw), kept), extras

    def uncount(self, chunk: Any, fresh: jax.Array) -> Any:
        """A chunk's kept outputs with only the examples `fresh` marks in its sum
        (the others as padding)."""
        (parts, kept), extras = chunk
        return (parts._replace(fresh=fresh), kept), extras

    def chunk(self, chunk: Any) -> Any:
        """A chunk's clipped sum per leaf, and its extras."""
        (parts, kept), extras = chunk
        if self.two_pass:  # the sum is made after the norms
            return (), (extras, parts.scale, parts.keep & parts.finite)
        if not self.config.sums:  # only the norms (the records are then left unused)
            return (), extras
        totals = self._chunk_sums(parts, kept)
        if self.config.nan_safe and self.other:
            chosen = parts.to_fix

            def skip(totals: list, chunk: Any) -> Any:
                return list(totals), jnp.zeros(parts.finite.shape, self.acc)

            totals, norms = lax.cond(
                jnp.any(chosen), self._fix_nonfinite, skip, totals, (parts, kept)
            )
            if extras.grad_norms is not None:
                extras = extras._replace(
                    grad_norms=jnp.where(chosen, norms, extras.grad_norms)
                )
        return totals, extras

    def _chunk_sums(self, parts: _Parts, kept: ghost.Record) -> list:
        """`sum_i c_i G_i` per leaf over a chunk's examples (padding left out)."""
        scale, plan = parts.scale, kept.plan

        def mask(x: jax.Array, m: jax.Array) -> jax.Array:  # shaped to broadcast
            return m.reshape((-1,) + (1,) * (x.ndim - 1))

        def kept_only(x: jax.Array) -> jax.Array:  # x_i, zero for padding
            # (an example an earlier chunk counted keeps its records: its
            # cotangents are zeroed, and its records are as finite as there)
            return jnp.where(mask(x, parts.keep), x, jnp.zeros((), x.dtype))

        def scaled(x: jax.Array) -> jax.Array:  # c_i x_i, zero where not counted
            m = mask(x, parts.counted)
            s = scale.astype(x.dtype).reshape(m.shape)
            return jnp.where(m, x * s, jnp.zeros((), x.dtype))

        totals: list[Any] = [None] * len(plan.leaves)
        scaled_record = kept.replace(
            records=jax.tree.map(kept_only, kept.records),
            deltas=jax.tree.map(scaled, kept.deltas),
        )
        for k in self.other:
            totals[k] = scaled_record.chunk_sum(k)
        for k, arrays in kept.forms.items():  # scaled through each use's cotangent
            arrs = [[*a[:-1], scaled(a[-1])] for a in arrays]
            totals[k] = plan.gradient_of(k, arrs, batched=True)
        counted = jnp.where(parts.counted, scale, jnp.zeros((), scale.dtype))
        for k, g in kept.grads.items():  # one contraction each (`scaled_sum`)
            g = jnp.where(mask(g, parts.counted), g, jnp.zeros((), g.dtype))
            totals[k] = scaled_sum(counted, g)
        for k, leaf in enumerate(plan.leaves):
            if totals[k] is None:  # unused: a zero gradient
                totals[k] = jnp.zeros(leaf.shape, leaf.dtype)
        if self.config.dtype is not None:
            totals = [t.astype(self.config.dtype) for t in totals]
        return totals

    def _fix_nonfinite(self, totals: list, chunk: Any) -> tuple[list, Any]:
        """`totals` plus the clipped gradients of a chunk's examples whose `other`
        leaves have non-finite values (and are not padding), and those examples'
        norms: `other`'s gradients formed one example and one leaf at a time, their
        non-finite entries zeroed, each leaf's clipped gradient added in place, so
        that no more than one leaf's gradient exists at once."""
        parts, kept = chunk
        chosen = parts.to_fix
        raw_norms, scales = self._fixed_norms(parts, kept)

        def gradient(k: int, one: ghost.Record) -> jax.Array:
            if k in one.forms:
                return one.plan.gradient_of(k, one.forms[k], batched=False)
            if k in one.grads:
                return one.grads[k]
            return _nan_to_zero(one.instantiate(k))

        totals = list(totals)
        for k in (*self.ruled, *self.per_example):

            def add(total: jax.Array, xs: Any, k: int = k) -> Any:
                sel, scale, one = xs
                g = gradient(k, one)
                g = (g * scale.astype(g.dtype)).astype(total.dtype)
                return total + jnp.where(sel, g, jnp.zeros((), g.dtype)), None

            totals[k], _ = lax.scan(add, totals[k], (chosen, scales, kept))
        return totals, raw_norms

    def _fixed_norms(self, parts: _Parts, kept: ghost.Record) -> tuple[Any, Any]:
        """Each example's norm with its `other` leaves' gradients formed, as it is
        and made finite (its clip factor), one example at a time."""
        config = self.config

        def norms(_: Any, xs: Any) -> Any:
            one, safe_sq, raw_sq = xs
            for k in self.other:
                g = one.instantiate(k)
                raw_sq = raw_sq + _squared(g, self.acc)
                safe_sq = safe_sq + _squared(_nan_to_zero(g), self.acc)
            scale = config.factor(_norm_of_square(safe_sq), None)
            return None, (_norm_of_square(raw_sq), scale)

        _, (raw_norms, scales) = lax.scan(norms, None, (kept, parts.safe_sq, parts.raw))
        return raw_norms, scales

    def __call__(self, args, in_axes, kwargs, padding, known) -> tuple:
        """The clipped sum (None without sums) and the stacked extras of a call."""
        # (the sums and the stacked norms are not independent here: an example whose
        # non-finite terms are fixed gets its norm from the fix)
        totals, extras = over_chunks(
            self.transform,
            self.traced,
            self,
            args,
            in_axes,
            kwargs,
            known=known,
            padding=padding,
        )
        if not self.config.sums:
            return None, extras
        if self.two_pass:
            extras, scales, counted = extras
            if padding is None and not self.config.nan_safe:
                counted = None  # (every example counts: nothing stands in)
            call = (args, in_axes, kwargs, known)
            totals = self._weighted_sums(
                *call, scales=scales, counted=counted, padded=padding is not None
            )
            if self.config.nan_safe:  # the non-finite examples, formed apart
                skip = counted if padding is None else counted | padding
                fixed = self._fixed_sums(*call, skip)
                totals = [t + f.astype(t.dtype) for t, f in zip(totals, fixed)]
            if self.config.dtype is not None:
                totals = [t.astype(self.config.dtype) for t in totals]
        return self.traced.grads_tree(totals, self.transform.args.single), extras

    def _weighted_sums(self, args, in_axes, kwargs, known, *, scales, counted, padded):
        """`sum_i c_i G_i` per leaf over the examples `counted` (`weighted_sums`;
        `padded`: the call's buffer has padding)."""
        traced = self.traced
        flat = traced.arrays(list(args), kwargs)

        def rebuild(leaves: list) -> tuple:
            return traced.rebuild(args, kwargs, traced.at_leaves(flat, leaves))

        def loss(ins: list, kw: dict) -> Any:
            return traced.loss(traced.arrays(ins, kw))

        params = [flat[i] for i in traced.plan.diff_positions]
        call = (args, in_axes, kwargs, known)
        return weighted_sums(
            self.transform, loss, call, at=(params, rebuild), scales=scales,
            counted=counted, skip=padded,
        )  # fmt: skip

    def _fixed_sums(self, args, in_axes, kwargs, known, skip) -> list:
        """The clipped gradients of the examples not `skip`ped (those with a
        non-finite gradient entry), each formed, its non-finite entries zeroed,
        clipped by its own norm, and summed: one example at a time, the others
        skipped as padding is."""
        traced, n, config = self.traced, len(args), self.config
        positions = traced.plan.diff_positions

        def fixed(*inputs: Any, **kw: Any) -> list:
            values = traced.arrays(list(inputs[:n]), kw)
            grads = jax.grad(lambda g: traced.loss(traced.at_leaves(values, g)))(
                [values[i] for i in positions]
            )
            grads = [_nan_to_zero(g) for g in grads]
            sq = ghost.total([_squared(g, self.acc) for g in grads], self.acc)
            c = config.factor(_norm_of_square(sq), None)
            return [
                jnp.where(inputs[n], jnp.zeros((), g.dtype), g * c.astype(g.dtype))
                for g in grads
            ]

        one = self.transform.options.quiet().replace(batch_size=1, memory_limit=None)
        return self.transform.map(
            fixed, (*args, skip), kwargs, (*in_axes, 0), 0, known=known, options=one,
            accumulator=_accumulators.compose(
                Fold(jnp.add, lambda gs: [g.sum(0) for g in gs])
            ),
            padding=n,
        )  # fmt: skip


def _one_example_avals(
    fn: Callable[..., Any], args: tuple, kwargs: dict, in_axes: Sequence[Any]
) -> Any:
    """The output types of `fn` on one (abstract) example of `args` and `kwargs`."""
    mapped = [i for i, a in enumerate(in_axes) if a is not None]

    def one_example(examples: list, kw: dict) -> Any:
        return fn(*_axes.combine(args, mapped, examples), **kw)

    def example(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x))

    avals = [jax.tree.map(example, args[i]) for i in mapped]
    return jax.eval_shape(one_example, avals, jax.tree.map(example, kwargs))


# --------------------------------------------------------------------------------------
# The public functions.


def _check_clip_norm(name: str, value: Any) -> None:
    """A concrete clip norm must be a non-negative real scalar (0 clips every
    gradient to zero, inf leaves them unclipped: jax-privacy's rule, for both
    clipping functions). A traced clip norm (e.g. a schedule) cannot be checked."""
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise TypeError(
            f"{name} l2_clip_norm must be a non-negative number, but got "
            f"l2_clip_norm={value!r} of type {type(value).__name__}."
        )
    try:
        number = float(np.asarray(value))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} l2_clip_norm must be a non-negative number, but got "
            f"l2_clip_norm={value!r} of type {type(value).__name__}."
        ) from None
    if np.ndim(value) != 0:
        raise TypeError(
            f"{name} l2_clip_norm must be a scalar number, but got "
            f"l2_clip_norm={value!r}."
        )
    if not number >= 0:
        raise ValueError(
            f"{name} l2_clip_norm must be non-negative (0 clips every gradient to "
            f"zero, inf leaves them unclipped), but got l2_clip_norm={value!r}."
        )


def _check_prng_argnum(name: str, prng_argnum: Any) -> None:
    if prng_argnum is not None and (
        isinstance(prng_argnum, bool) or not isinstance(prng_argnum, numbers.Integral)
    ):
        raise TypeError(
            f"{name} prng_argnum must be an int or None, but got "
            f"prng_argnum={prng_argnum!r}."
        )


@decorator_form("fun")
@takes(ClipChunking)
def clipped_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    l2_clip_norm: Any,
    rescale_to_unit_norm: bool = False,
    normalize_by: Any = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    return_values: bool = False,
    return_grad_norms: bool = False,
    pre_clipping_transform: Callable[[Any], Any] = identity,
    nan_safe: bool = True,
    dtype: Any = None,
    prng_argnum: int | None = None,
    spmd_axis_name: Any = None,
    method: str = "vmap",
    **options: Unpack[ClipChunking],
) -> ClippedGrad:
    """The sum of per-example clipped gradients: jax-privacy's `clipped_grad`, for any
    batch size.

    A drop-in for `jax_privacy.clipping.clipped_grad` (2.0): the same signature,
    options and results. For every example (a slice along the leading axis of the
    arguments in `batch_argnums`) the gradient of `fun` with respect to `argnums` is
    computed, transformed by `pre_clipping_transform`, cast to `dtype`, made NaN-safe,
    clipped to L2 norm `l2_clip_norm`, and summed over the examples; the sum is divided
    by `normalize_by`. Examples are evaluated in chunks of `microbatch_size` (alias
    `batch_size`, `chunk_size`): any number of examples works (no divisibility, no
    padding), chunks are contiguous, and at most `microbatch_size` gradients exist at
    once, so memory does not grow with the batch. `microbatch_size="auto"` picks the
    fewest chunks that fit `memory_limit`, each as short as they allow.

    `is_padding_example=` (a boolean vector, one entry per example) is accepted at
    call time with jax-privacy's meaning: padded examples contribute nothing to the
    sum. A Poisson-sampled lot padded to a fixed capacity thus runs one compiled
    program whatever its size, and costs about what its real examples cost: the real
    examples are evaluated first (the padding may sit anywhere), and chunks holding
    only padding are skipped at run time (split over a mesh, by every device in its
    own examples). The padding's per-example outputs (values, norms, aux) are zeros.

    Floating-point arrays and Python floats in plain containers (dicts, lists,
    tuples) are differentiated, as by `jax.grad`; other leaves get None (integer
    arrays, the static parts and float hyperparameters of an Equinox module, as with
    `equinox.filter_grad`), so Equinox modules work as parameters directly.

    Usable as a decorator too, with its options as keywords and without `fun`:
    `@clipped_grad(l2_clip_norm=1.0, batch_size=8)` over a `def`.

    Args:
      fun: the loss, `fun(params, batch, ...)` returning a scalar (or `(scalar, aux)`
        with `has_aux`); with `keep_batch_dim` it sees a batch of one example.
      argnums: the argument(s) to differentiate (int or sequence of ints); they may
        not be in `batch_argnums`.
      has_aux: `fun` returns `(loss, aux)`; the per-example `aux` is returned in
        `AuxiliaryOutput.aux`.
      l2_clip_norm: the clip norm: a non-negative scalar (0 gives zero, inf no
        clipping; it may be traced, and a negative traced value counts as 0).
      rescale_to_unit_norm: divide each clipped gradient by `l2_clip_norm` (the sum
        then has sensitivity 1).
      normalize_by: divide the sum by this positive value.
      batch_argnums: the argument(s) holding the examples along their leading axis
        (jax-privacy's default, 1: `fun(params, batch)`); others are passed whole.
        Keyword arguments are mapped over their leading axis, as in `jax.vmap`.
      keep_batch_dim: pass each example with a leading axis of size 1 (the default);
        False passes single examples (or groups, for per-user clipping). Aux leaves
        of shape `(1, ...)` per example lose that axis.
      return_values: also return the per-example losses.
      return_grad_norms: also return the per-example gradient norms (before the
        pre-clipping transform and clipping; in at least float32).
      pre_clipping_transform: applied to each example's gradient before clipping.
      microbatch_size: examples per chunk (None: one `jax.vmap` over all examples;
        `"auto"`: from `memory_limit`).
      nan_safe: replace NaN and infinite gradient entries by 0 before clipping, so the
        sensitivity holds whatever the inputs.
      dtype: cast each gradient to this dtype before clipping and summing.
      prng_argnum: the argument holding a PRNG key (or a pytree of keys): it is split
        into one key per example (`jax.random.split(key, N)`, as jax-privacy does).
      spmd_axis_name: as in `jax.vmap` (the mapped axis of each chunk is sharded over
        this mesh axis).
      batch_size: an alias of `microbatch_size`.
      chunk_size: an alias of `microbatch_size`.
      memory_limit: the budget for `microbatch_size="auto"`.
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      progress: a host progress bar over the chunks (see `batch_vmap`).
      method: `"vmap"` (the default) forms each example's gradient; `"ghost"` gives
        the same results without forming the per-example gradients of the
        parameters that have ghost rules (dense layers, convolutions, embedding
        lookups: `ghost_report` shows each leaf's rule), in about a forward pass's
        memory per chunk. With `"ghost"`, norms are those of the gradient before
        the cast to `dtype`, a gradient with non-finite entries has norm NaN in
        `grad_norms`, and `pre_clipping_transform` is not available.

    Returns:
      A `ClippedGrad`, callable like `fun`. It returns the clipped sum (structured like
      the differentiated argument(s)), or `(sum, AuxiliaryOutput(values, grad_norms,
      aux))` when `has_aux`, `return_values` or `return_grad_norms` is set (fields not
      asked for are None). Its `l2_norm_bound` and `sensitivity(neighboring_relation)`
      give the sum's sensitivity.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import clipped_grad
      >>> f = lambda param, data: 0.5 * jnp.mean((data - param) ** 2)
      >>> g = clipped_grad(f, l2_clip_norm=jnp.inf, microbatch_size=2)
      >>> g(3.0, jnp.array([0.0, 7.0, -2.0]))
      Array(4., dtype=float32)
      >>> g = clipped_grad(f, l2_clip_norm=1.0, return_grad_norms=True)
      >>> total, aux = g(3.0, jnp.array([0.0, 7.0, -2.0]))
      >>> total, aux.grad_norms
      (Array(1., dtype=float32), Array([3., 4., 5.], dtype=float32))
    """
    name = "clipped_grad"
    _check_clip_norm(name, l2_clip_norm)
    method = _choice.check_method(name, method, pre_clipping_transform)
    flags = dict(
        has_aux=has_aux, rescale_to_unit_norm=rescale_to_unit_norm,
        keep_batch_dim=keep_batch_dim, return_values=return_values,
        return_grad_norms=return_grad_norms, nan_safe=nan_safe,
    )  # fmt: skip
    check_bools(name, **flags)
    check_callable(name, "pre_clipping_transform", pre_clipping_transform)
    _check_normalize_by(name, normalize_by)
    dtype = None if dtype is None else _check_dtype(name, dtype)
    _check_prng_argnum(name, prng_argnum)
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True,
        spmd_axis_name=spmd_axis_name, **options,
    )  # fmt: skip
    config = Clipping(
        l2_clip_norm, dtype=dtype, pre_clipping_transform=pre_clipping_transform,
        prng_argnum=prng_argnum, jax_privacy=True, method=method, **flags,
    )  # fmt: skip
    with_aux = has_aux or return_values or return_grad_norms

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        total, extras, _ = clipped_sums(transform, fun, config, args, kwargs, known)
        if normalize_by != 1.0:
            total = jax.tree.map(lambda x: x / normalize_by, total)
        return (total, extras) if with_aux else total

    bound = (1.0 if rescale_to_unit_norm else l2_clip_norm) / normalize_by
    # attached: `last_batch_size`
    return _memory.attach(
        ClippedGrad(transform.public(call, fun), bound, with_aux), transform.auto
    )


def _check_normalize_by(name: str, value: Any) -> None:
    """A positive real scalar (a number, or a concrete NumPy or JAX scalar)."""
    try:
        ok = not isinstance(value, (str, bytes, bool, np.bool_)) and np.ndim(value) == 0
        ok = ok and float(np.asarray(value)) > 0
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        ok = False
    if not ok:
        raise ValueError(
            f"{name} normalize_by must be a positive number, but got "
            f"normalize_by={value!r}."
        )


def _check_dtype(name: str, dtype: Any) -> Any:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} dtype must be a floating-point dtype or None, but got "
            f"dtype={dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"{name} dtype must be a floating-point dtype or None, but got "
            f"dtype={dtype.name}."
        )
    return dtype


@decorator_form("fun")
@takes(Chunking)
def clipped_grad_sum(
    fun: Callable[..., Any],
    l2_clip_norm: Any,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    return_norms: bool = False,
    method: str = "vmap",
    **options: Unpack[Chunking],
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

    The compact form of `clipped_grad` (the same implementation): `fun` is the loss of
    one example, every argument not differentiated is mapped by default, the count is
    returned, and gradients are not made NaN-safe: a NaN gradient gives a NaN norm and
    NaN entries in the sum, so a diverging model is seen, not hidden. Zero gradients are
    safe (their norm is 0 and they are left unscaled, with no 0/0), the sum keeps each
    parameter's dtype (norms are accumulated in at least float32), and, as in
    `per_example_grads`, floating-point arrays and Python floats in plain containers
    are differentiated (other leaves get None), so Equinox modules and Flax variables
    work as parameters. Zero examples
    give zero sums and a count of 0 (a Poisson-sampled lot may be empty).

    `is_padding_example=` (a boolean vector, one entry per example) is accepted at
    call time, as by `clipped_grad`: padded examples add nothing to the sum and are
    not counted, their norms are zeros, and a lot padded to a fixed capacity runs
    one compiled program whatever its size, skipping the chunks of padding alone.

    Usable as a decorator too, with its options as keywords and without `fun`:
    `@clipped_grad_sum(l2_clip_norm=1.0, batch_size=8)` over a `def`.

    Args:
      fun: the per-example loss, `fun(params, example, ...)` returning a scalar.
      l2_clip_norm: the clipping norm, a non-negative scalar (it may be traced; 0
        gives zero sums, inf no clipping; a negative traced value counts as 0).
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
      method: `"vmap"` (the default) forms each example's gradient; `"ghost"` gives
        the same results without forming the per-example gradients of the
        parameters that have ghost rules (dense layers, convolutions, embedding
        lookups: `ghost_report` shows each leaf's rule), in about a forward pass's
        memory per chunk. With `"ghost"`, a gradient with non-finite entries has
        norm NaN in `norms`.

    Returns:
      A function of `fun`'s arguments returning `(grad_sum, count)` — the clipped sum
      (structured like the differentiated argument(s)) and the number of examples as an
      int32 scalar — or `(grad_sum, count, norms)` with `return_norms`, where `norms`
      has shape `(N,)`. For the DP-SGD update add Gaussian noise of standard deviation
      `noise_multiplier * l2_clip_norm` to `grad_sum` and divide by the lot size: the
      fixed lot size (`count`) with fixed-size lots, the *expected* lot size with
      Poisson sampling.

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
    method = _choice.check_method(name, method)
    transform = grad_transform(
        name,
        fun,
        argnums,
        batch_argnums,
        exclusive=True,
        **options,
    )
    config = Clipping(
        l2_clip_norm, nan_safe=False, return_grad_norms=return_norms, method=method
    )

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        total, extras, size = clipped_sums(transform, fun, config, args, kwargs, known)
        count = jnp.asarray(size, jnp.int32)
        return (total, count, extras.grad_norms) if return_norms else (total, count)

    return transform.public(call, fun)
