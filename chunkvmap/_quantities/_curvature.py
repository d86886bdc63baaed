"""Curvature of a model's loss, chunked: the diagonal of the generalised
Gauss-Newton matrix (GGN) or Fisher, and KFAC's Kronecker factors, for any JAX
model, in memory that does not grow with the number of examples.

Both take the model's output of one example, `fun(params, *example)`, and a
`likelihood` (the loss as a negative log-likelihood of that output). With the
loss's Hessian in the output `H = S S^T` and the output's Jacobian `J`, the GGN
of one example is `J^T H J = sum_m (J^T s_m)(J^T s_m)^T` over the columns `s_m` of
`S`: each `J^T s_m` is one backward pass of the model from the output cotangent
`s_m`. The cotangents (`backward_vectors`) are chosen by `fisher`:

* `"exact"`: the columns of the square root of the loss's Hessian (type-2 Fisher,
  equal to the GGN for these likelihoods);
* `"mc"`: `samples` labels drawn from the model's predictive distribution, each
  giving the loss's gradient in the output (scaled by `1 / sqrt(samples)`);
* `"empirical"`: the loss's gradient at the given labels.

`ggn_diagonal` squares each example's backward passes (`jax.vmap` over the
cotangents of one `jax.vjp`). `kfac_factors` reads the model's dense,
convolution and embedding uses from its ghost record (`ghost.Plan.pullback`:
activations once, the cotangents' output gradients per pass) and folds them into
the factors chunk by chunk (`_KFAC`, one accumulator on the record).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Unpack

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np

from .._core._accumulators import Fold, compose
from .._core._loop import regroup
from .._core._options import Chunking, check_choice, decorator_form, takes
from .._transforms._grads import FloatLeaves, differentiable_floats, grad_transform
from . import _choice, ghost
from ._records import Quantity, over_chunks
from .ghost._context import explicit_spec
from .ghost._forms import EinsumForm, LeafAxis, Mark, Part, RowsForm, _equation
from .ghost._rules import UseKind


class Likelihood(enum.StrEnum):
    """The loss as a negative log-likelihood of the model's output `f`:

    * `CATEGORICAL`: softmax cross-entropy, `f` the logits along the last axis
      (leading axes are positions, each with its own integer label), summed over
      positions;
    * `GAUSSIAN`: `sum (f - y)^2 / 2`, unit variance (the squared error halved).
    """

    CATEGORICAL = "categorical"
    GAUSSIAN = "gaussian"


class Fisher(enum.StrEnum):
    """Which cotangents stand for the loss's curvature (see the module)."""

    EXACT = "exact"
    MC = "mc"
    EMPIRICAL = "empirical"


def backward_vectors(
    likelihood: Likelihood,
    fisher: Fisher,
    f: jax.Array,
    labels: Any,
    key: Any,
    samples: int,
) -> jax.Array:
    """The output cotangents `(M, *f.shape)` of one example whose outer products
    sum to its curvature in the output (for `"mc"`, in expectation): `f` the
    output, `labels` its labels (`"empirical"`), `key` its PRNG key (`"mc"`)."""
    f = jax.lax.stop_gradient(f32(f))
    if likelihood is Likelihood.GAUSSIAN:
        if fisher is Fisher.EMPIRICAL:
            return (f - labels)[None]
        if fisher is Fisher.MC:
            noise = jax.random.normal(key, (samples, *f.shape), f.dtype)
            return noise / math.sqrt(samples)
        return jnp.eye(f.size, dtype=f.dtype).reshape(f.size, *f.shape)
    p = _softmax(f)
    classes = f.shape[-1]
    if fisher is Fisher.EMPIRICAL:
        return (p - jax.nn.one_hot(labels, classes, dtype=f.dtype))[None]
    if fisher is Fisher.MC:
        drawn = jax.nn.one_hot(drawn_classes(key, p, samples), classes, dtype=f.dtype)
        return (p[None] - drawn) / math.sqrt(samples)
    # S[..., j, c] = sqrt(p_c) (delta_jc - p_j): S S^T = diag(p) - p p^T per
    # position; one cotangent per (position, class), zero at the other positions
    eye = jnp.broadcast_to(jnp.eye(classes, dtype=f.dtype), (*p.shape, classes))
    root = (eye - p[..., :, None]) * jnp.sqrt(p)[..., None, :]
    positions = math.prod(f.shape[:-1])
    root = root.reshape(positions, classes, classes)
    one = jnp.eye(positions, dtype=f.dtype)
    vectors = jnp.einsum("pq,qjc->pcqj", one, root)
    return vectors.reshape(positions * classes, *f.shape)


def _softmax(f: jax.Array) -> jax.Array:
    """`jax.nn.softmax` over the last axis, its exponentials scaled by one
    reciprocal per position rather than divided one by one (the division of every
    entry was 3.6% of EK-FAC's second pass of an LM on a TPU; the two differ in the
    last bits)."""
    e = jnp.exp(f - f.max(-1, keepdims=True))
    return e * (1 / e.sum(-1, keepdims=True))


# Classes per block of `drawn_classes` (a single block up to twice this many).
_BLOCK = 64


def drawn_classes(key: Any, p: jax.Array, samples: int) -> jax.Array:
    """`samples` classes drawn from each position's probabilities `p` (last axis),
    `(samples, *p.shape[:-1])`, by the inverse of the cumulative distribution: with
    `u = jax.random.uniform(key, (samples, *p.shape[:-1]))`, the first class whose
    cumulative probability exceeds `u` times the total. The cumulative sums are
    taken over blocks of classes, then within the block that holds the draw (one
    uniform and a few passes over `p` per position, where `jax.random.categorical`
    draws and takes two logarithms per class). A class of probability zero is
    never drawn."""
    u = jax.random.uniform(key, (samples, *p.shape[:-1]), p.dtype)
    classes = p.shape[-1]
    width = classes if classes <= 2 * _BLOCK else _BLOCK
    blocks = -(-classes // width)
    pad = [(0, 0)] * (p.ndim - 1) + [(0, blocks * width - classes)]
    # the probabilities' blocks once for every sample (the samples' axis: size 1)
    q = jnp.pad(p, pad).reshape(1, *p.shape[:-1], blocks, width)
    mass = q.sum(-1)
    ends = jnp.cumsum(mass, -1)
    v = u * ends[..., -1]
    j = _first_above(ends, mass, v)
    pick = jax.nn.one_hot(j, blocks, dtype=p.dtype)  # (samples, ..., blocks)
    below = jnp.sum(pick * (ends - mass), -1)
    row = jnp.sum(pick[..., None] * q, -2)
    i = _first_above(jnp.cumsum(row, -1), row, v - below)
    return j * width + i


def _first_above(ends: jax.Array, mass: jax.Array, v: jax.Array) -> jax.Array:
    """The first index whose cumulative `ends` (of `mass`, last axis) exceeds `v`
    (`ends`' other axes), held to the last index of positive
    mass where rounding puts `v` at or past the total."""
    first = jnp.sum(ends <= v[..., None], -1)
    size = mass.shape[-1]
    last = size - 1 - jnp.argmax(jnp.flip(mass > 0, -1), -1)
    return jnp.minimum(first, last)


class Curvature(NamedTuple):
    """A curvature call's settings, checked."""

    likelihood: Likelihood
    fisher: Fisher
    samples: int
    name: str = ""

    def check_output(self, f: jax.Array, labels: Any) -> None:
        """One example's output (and labels) fit the likelihood: categorical logits
        have the classes along a last axis."""
        if self.likelihood is Likelihood.CATEGORICAL and f.ndim == 0:
            raise TypeError(
                f"{self.name} likelihood='categorical' takes the model's logits, "
                f"with the "
                f"classes along their last axis, but fun returns a scalar "
                f"{f.dtype.name} per example: pass the model, not its loss."
            )
        _check_labels(self.name, f, labels, self.likelihood)

    @classmethod
    def make(cls, name: str, likelihood: Any, fisher: Any, samples: Any) -> Any:
        likelihood = check_choice(name, "likelihood", likelihood, Likelihood)
        fisher = check_choice(name, "fisher", fisher, Fisher)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise TypeError(
                f"{name} samples must be a positive int, but got samples={samples!r}."
            )
        return cls(likelihood, fisher, samples, name)

    def prepare(self, transform: Any, args: tuple, kwargs: dict) -> tuple:
        """A call's differentiated argument numbers, `in_axes`, arguments (their
        differentiated leaves floating-point), keyword arguments without
        `labels=`/`key=`, and the per-example inputs those add (`extra`)."""
        kwargs = dict(kwargs)
        labels, key = kwargs.pop("labels", None), kwargs.pop("key", None)
        name = transform.name
        self.check_unused(name, labels, key)
        diff, in_axes = transform.resolve(args)
        if all(a is None for a in in_axes) and not kwargs:
            raise TypeError(
                f"{name} maps no argument: argnums={transform.args.given[0]!r} "
                f"differentiates {', '.join(f'args[{i}]' for i in diff)} and the "
                f"call passed no other argument to hold the examples. Call it with "
                f"fun's arguments, the parameters then the inputs: fun(params, x) "
                f"(an NNX or Equinox model: split its parameters out and pass them "
                f"as params)."
            )
        args = differentiable_floats(args, diff, in_axes)
        n = _choice.examples(transform, args, in_axes, kwargs)
        return diff, in_axes, args, kwargs, self.extra(name, n, labels, key)

    def check_unused(self, name: str, labels: Any, key: Any) -> None:
        """A TypeError where `labels=` or `key=` is given to a Fisher that does not
        read it (it was silently ignored)."""
        for given, arg, wants in (
            (labels, "labels", Fisher.EMPIRICAL),
            (key, "key", Fisher.MC),
        ):
            if given is not None and self.fisher is not wants:
                raise TypeError(
                    f"{name} got {arg}=, which only fisher={wants.value!r} reads, "
                    f"but fisher={self.fisher.value!r}: leave {arg}= out, or pass "
                    f"fisher={wants.value!r}."
                )

    def extra(self, name: str, n: int, labels: Any, key: Any) -> list:
        """The per-example inputs a call adds after `fun`'s: the labels
        (`"empirical"`), or (`"mc"`) the key and the examples' indices, from which
        example `i`'s key `fold_in(key, i)` is made in its chunk."""
        if self.fisher is Fisher.EMPIRICAL:
            if labels is None:
                raise TypeError(
                    f"{name} with fisher='empirical' needs labels=: the labels of "
                    f"the {n} examples."
                )
            if np.ndim(labels) < 1 or np.shape(labels)[0] != n:
                raise ValueError(
                    f"{name} labels= must hold one label per example, {n} along "
                    f"axis 0, but got shape {np.shape(labels)}."
                )
            kind = jnp.result_type(labels)
            if self.likelihood is Likelihood.CATEGORICAL and not jnp.issubdtype(
                kind, jnp.integer
            ):
                raise TypeError(
                    f"{name} with likelihood='categorical' takes labels= as integer "
                    f"class indices, but got dtype {kind.name} (one-hot labels: "
                    f"pass jnp.argmax(labels, axis=-1))."
                )
            return [labels]
        if self.fisher is Fisher.MC:
            if key is None:
                raise TypeError(
                    f"{name} with fisher='mc' needs key=: a PRNG key, split into "
                    f"one key per example to draw its labels."
                )
            # example i's key is jax.random.fold_in(key, i) (with JAX's default
            # generator, jax.random.split(key, n)[i]), made in its chunk from its
            # index: nothing of size n is held
            # (a typed key as it is: its generator, rbg or threefry, goes with it)
            return [key, jnp.arange(n, dtype=jnp.uint32)]
        return []

    def extra_axes(self) -> tuple:
        """How `extra`'s inputs are mapped: the labels and the examples' indices
        along axis 0; the key whole."""
        return (
            (None, 0)
            if self.fisher is Fisher.MC
            else (0,) * (self.fisher is Fisher.EMPIRICAL)
        )

    def vectors(self, f: jax.Array, extra: Sequence[Any]) -> jax.Array:
        labels = extra[0] if self.fisher is Fisher.EMPIRICAL else None
        self.check_output(f, labels)
        key = None
        if self.fisher is Fisher.MC:  # (the key and the example's index)
            key = extra[0] if _typed(extra[0]) else jax.random.wrap_key_data(extra[0])
            key = jax.random.fold_in(key, extra[1])
        vectors = backward_vectors(
            self.likelihood, self.fisher, f, labels, key, self.samples
        )
        return _typed_as_rows_of(vectors, f)


def _check_labels(name: str, f: Any, labels: Any, likelihood: Likelihood) -> None:
    """One example's labels have the shape its output needs (`vectors`)."""
    want = f.shape[:-1] if likelihood is Likelihood.CATEGORICAL else f.shape
    if labels is not None and np.shape(labels) != want:
        raise ValueError(
            f"{name} labels= of one example must have shape {want} for a "
            f"{likelihood.value} output of shape {f.shape} (one "
            f"{'class index per position' if want != f.shape else 'target per entry'}"
            f"), but got shape {np.shape(labels)}."
        )


def _typed_as_rows_of(vectors: jax.Array, f: jax.Array) -> jax.Array:
    """`vectors` (cotangents of `f`, one per row) with `f`'s sharding on each row
    where the mesh has Explicit axes: `jax.vjp` takes cotangents of its output's
    type, and the output of weights sharded over an axis may be sharded over it."""
    spec = getattr(jax.typeof(f).sharding, "spec", None)
    want = None if spec is None else explicit_spec((None, *spec))
    if want is None or getattr(jax.typeof(vectors).sharding, "spec", None) == want:
        return vectors
    return jax.sharding.reshard(vectors, want)


def _typed(keys: Any) -> bool:
    return jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)


def _check_output(name: str, traced: Any) -> None:
    value = traced.value_aval
    if value is None or not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{name} fun must return the model's output of one example as one real "
            f"array (the logits or the prediction), but it returns "
            f"{ghost.shown_types(traced.value_shape)}."
        )


@decorator_form("fun")
@takes(Chunking)
def ggn_diagonal(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    likelihood: str,
    fisher: str = "exact",
    samples: int = 1,
    per_example: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    method: str = "vmap",
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """The diagonal of the generalised Gauss-Newton matrix (or of a Fisher) of a
    model's loss, summed over the examples, `batch_size` examples at a time.

    Example `i`'s share is `sum_m (J_i^T s_m)^2` (elementwise), `J_i` the
    Jacobian of `fun`'s output in the parameters and `s_m` the cotangents
    `fisher` chooses: with `fisher="exact"` the columns of the square root of the
    loss's Hessian in the output (for both likelihoods the GGN equals the
    type-2 Fisher), with `"mc"` the loss's gradients at `samples` labels drawn
    from the model's predictive distribution (over `sqrt(samples)`), with
    `"empirical"` the loss's gradient at the given labels. Memory is that of one
    chunk's backward passes, flat in the number of examples (with `"mc"`, but
    for each example's 4-byte index, from which its key is made in its chunk).

    The result has the structure of the differentiated arguments (None at leaves
    that are not floating-point). With `per_example=True` it is each example's
    diagonal, stacked along axis 0.

    With `method="ghost"`, the model's program is read as ghost clipping reads
    it: a dense use that reads one activation per example (no positions) gives its
    share from its activation and output gradients, `(a^2)(sum_m g_m^2)^T`,
    without forming `J_i^T s_m`; other leaves are formed per cotangent, as with
    `method="vmap"`.

    The returned function takes `fun`'s arguments, and `labels=` (the examples'
    labels, stacked along axis 0: integer classes for "categorical", targets for
    "gaussian") with `fisher="empirical"`, or `key=` (a PRNG key; example `i`'s
    key is `k_i = jax.random.fold_in(key, i)`, which with JAX's default generator
    is `jax.random.split(key, N)[i]`; it draws the classes of
    `jax.random.uniform(k_i, (samples, *logits.shape[:-1]))` under the inverse of
    each position's cumulative distribution (`drawn_classes`),
    or `jax.random.normal(k_i, (samples, *f.shape))` noise for "gaussian")
    with `fisher="mc"`. (Keys of the `rbg` and `unsafe_rbg` generators draw
    differently under `jax.vmap` than alone, in JAX itself: with them, labels are
    these draws in chunks of one example, and other draws of the same
    distribution in larger chunks.)

    Args:
      fun: the model's output of one example, `fun(params, *example)` (a real
        array: logits for `likelihood="categorical"`).
      argnums: which positional argument(s) of `fun` the curvature is of.
      likelihood: "categorical" (softmax cross-entropy over the last axis) or
        "gaussian" (the squared error halved).
      fisher: "exact", "mc" (labels sampled from the model) or "empirical".
      samples: the labels drawn per example with `fisher="mc"`.
      batch_argnums: the arguments holding the examples (default: every argument
        not in `argnums`).
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.
      per_example: each example's diagonal (stacked) rather than their sum.
      method: "vmap" (each cotangent's gradient formed) or "ghost" (see above).

    Returns:
      A function with `fun`'s arguments (and `labels=`, `key=`) returning the
      diagonal, a tree like the differentiated arguments.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ggn_diagonal
      >>> def model(w, x):
      ...     return w * x  # a Gaussian output: the GGN's diagonal is sum x^2
      >>> ggn_diagonal(model, likelihood="gaussian", batch_size=2)(
      ...     jnp.ones(2), jnp.array([[1.0, 2.0], [3.0, 0.0], [1.0, 1.0]]))
      Array([11.,  5.], dtype=float32)
    """
    name = "ggn_diagonal"
    settings = Curvature.make(name, likelihood, fisher, samples)
    method = _choice.check_method(name, method)
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )

    def call(args: tuple, kwargs: dict, known: Any) -> Any:
        diff, in_axes, args, kwargs, extra = settings.prepare(transform, args, kwargs)
        made = _Diagonal(fun, settings, per_example, diff, in_axes)
        return made(transform, method, args, kwargs, extra, known=known)

    return transform.public(call, fun)


class _Diagonal(NamedTuple):
    """`ggn_diagonal`'s call, once its arguments are prepared (`Curvature.prepare`:
    `extra` the per-example inputs its Fisher adds)."""

    fun: Callable[..., Any]
    settings: Curvature
    per_example: bool
    diff: tuple
    in_axes: tuple

    def __call__(self, transform, method, args, kwargs, extra, *, known, runs=None):
        """The diagonal by `method` (with `method="ghost"`: the program `runs`,
        where given, else the one `_choice.decided` says)."""
        if method is ghost.Method.VMAP:
            return self._formed(transform, args, kwargs, extra, known)
        name, diff, in_axes = transform.name, self.diff, self.in_axes
        traced = traced_model(
            transform, name, self.fun, args, kwargs, diff, in_axes=in_axes
        )
        quantity = traced.memo(
            ("ggn diagonal", self.settings, self.per_example),
            lambda: _GhostDiagonal(traced, self.settings, self.per_example),
        )
        if runs is None:
            runs = self._chosen(transform, quantity, args, kwargs, extra)
        if runs is ghost.Method.VMAP:
            return self._formed(transform, args, kwargs, extra, known)
        summary, rows = over_chunks(
            transform, traced, quantity, args, in_axes, kwargs, known=known,
            extra=extra, extra_axes=self.settings.extra_axes(),
        )  # fmt: skip
        tree = rows if self.per_example else summary
        return traced.grads_tree(tree, transform.args.single)

    def _chosen(self, transform, quantity, args, kwargs, extra) -> ghost.Method:
        """The program a ghost call runs (`_choice.decided`): the model's, the ghost
        program where a leaf takes its share from its operands
        (`_GhostDiagonal.outer`), measured on an accelerator."""
        helped = any(quantity.outer)
        report = _choice.ruled_report(quantity.traced, helped, "diagonal")
        n = len(args)

        def program(twin: Any, runs: ghost.Method) -> Callable[..., Any]:
            def run(inputs: tuple, kw: dict) -> Any:
                ghostly = ghost.Method.GHOST
                extra = list(inputs[n:])
                return self(twin, ghostly, inputs[:n], kw, extra, known=None, runs=runs)

            return run

        call = ((*args, *extra), kwargs, (*self.in_axes, *self.settings.extra_axes()))
        size = _choice.examples(transform, args, self.in_axes, kwargs)
        return _choice.decided(
            transform, self.fun, report, quantity, program, call=call, size=size
        )

    def _formed(self, transform, args, kwargs, extra, known) -> Any:
        """The diagonal from each cotangent's formed gradients (`method="vmap"`)."""
        fun, settings, diff, n = self.fun, self.settings, self.diff, len(args)
        name = transform.name

        def example(*inputs: Any, **kw: Any) -> Any:
            floats = FloatLeaves(inputs[:n], diff)
            model = lambda d: fun(*floats.args_with(d), **kw)  # noqa: E731
            f, pull = jax.vjp(model, floats.diff)
            check_model_output(name, f)
            grads = jax.vmap(pull)(settings.vectors(f, inputs[n:]))[0]
            squares = [[jnp.sum(jnp.square(g), 0) for g in part] for part in grads]
            return floats.trees(squares, transform.args.single)

        axes = (*self.in_axes, *settings.extra_axes())
        inputs = (*args, *extra)
        if self.per_example:
            return transform.map(example, inputs, kwargs, axes, 0, known=known)
        total = Fold(jnp.add, lambda out: jax.tree.map(lambda x: jnp.sum(x, 0), out))
        return transform.map(
            example, inputs, kwargs, axes, 0, known=known, accumulator=compose(total)
        )


def traced_model(transform, name, fun, args, kwargs, diff, *, in_axes) -> ghost.Traced:
    """The model of one example traced, with its ghost plan (`traced_loss`, its
    output checked to be a real array)."""
    return ghost.traced_loss(
        transform.memo, name, fun, args, kwargs, diff, in_axes=in_axes,
        check=_check_output,
    )  # fmt: skip


class _GhostDiagonal(Quantity):
    """The GGN diagonal from the examples' ghost records (`Plan.pullback`): a leaf
    whose only use is a product reading one activation per example gets
    `(a^2)(sum_m g_m^2)^T` through its form (`Form.gradient` of the squared
    arrays: each entry of its gradient is one product, nothing summed); any
    other leaf is formed per cotangent and squared."""

    def made_with(self) -> tuple:
        return (self.settings, self.rows)

    def __init__(self, traced: ghost.Traced, settings: Curvature, rows: bool):
        plan = traced.plan
        self.traced = traced
        self.settings, self.rows = settings, rows
        self.per_example = plan.with_rule(ghost.PER_EXAMPLE)
        self.outer = [_outer_product(x) for x in plan.leaves]

    def evaluate(self, traced: ghost.Traced, values: list, *extra: Any) -> Any:
        plan, records, deltas, pe = pulled(
            "ggn_diagonal", traced, values, self.per_example, self.settings, extra
        )
        kept = []
        for k, leaf in enumerate(plan.leaves):
            if self.outer[k]:
                (u,) = leaf.uses
                acts, outs = use_arrays(u, records, deltas)
                a, g = f32(acts[0]), f32(outs[1])
                squares = [a * a, jnp.sum(jnp.square(g), 0)]
                kept.append(u.form.gradient(squares, leaf.shape, False, None))
                continue
            kept.append(_formed_diagonal(plan, k, records, deltas, pe))
        return kept

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        if self.rows:
            return (), kept
        return [jnp.sum(x, 0) for x in kept], ()


def pulled(name, traced, values, per_example, settings, extra) -> tuple:
    """One example's plan (of the current mesh context), records, output
    gradients for each of its cotangents and per-example leaves' gradients (one
    per cotangent, leading): `Plan.pullback` once, pulled back `jax.vmap`-ed over
    `settings.vectors` of the output."""
    plan, closed = traced.plan_here(values)
    outs, records, pull = plan.pullback(closed, values, per_example)
    f = outs[0]
    check_model_output(name, f)
    deltas, pe = jax.vmap(pull)(settings.vectors(f, extra).astype(f.dtype))
    return plan, records, deltas, pe


def use_arrays(u: Any, records: dict, deltas: dict) -> tuple[list, list]:
    """Use `u`'s form arrays: built with the first cotangent (for the arrays of
    the activations, which no cotangent changes), and with each (leading)."""
    one = jax.tree.map(lambda d: d[0], deltas[u.path])
    acts = u.form.build(records[u.key], one)
    outs = jax.vmap(lambda d: u.form.build(records[u.key], d))(deltas[u.path])
    return acts, outs


def formed(plan: Any, k: int, records: dict, deltas: dict, pe: dict) -> jax.Array:
    """One example's gradient of leaf `k` per cotangent (leading): the
    per-example gradients `pe` of the leaves no rule covers, else formed from the
    record's uses; zeros for a leaf not used."""
    leaf = plan.leaves[k]
    if k in pe:
        return pe[k]
    if leaf.uses:
        return jax.vmap(lambda d: plan.instantiate(k, records, d))(deltas)
    return jnp.zeros((1, *leaf.shape), leaf.dtype)


def _formed_diagonal(plan: Any, k: int, records: dict, deltas: dict, pe: dict):
    """One example's `sum_m g_m^2` of leaf `k`, its gradient formed per cotangent
    (`formed`)."""
    return jnp.sum(jnp.square(f32(formed(plan, k, records, deltas, pe))), 0)


def _outer_product(leaf: Any) -> bool:
    """Whether leaf's gradient is one product use's outer product of one
    activation and one output gradient (each of its entries one product)."""
    if len(leaf.uses) != 1:
        return False
    (u,) = leaf.uses
    whole = tuple((0, d, 1) for d in leaf.shape)
    return (
        isinstance(u.form, EinsumForm)
        and u.rule.kind in _PRODUCTS
        and u.form.box == whole
        and u.form.complete
        and _positions(u.form) == 1
    )


def check_model_output(name: str, f: Any) -> None:
    if not isinstance(f, jax.Array) or not jnp.issubdtype(f.dtype, jnp.floating):
        raise TypeError(
            f"{name} fun must return the model's output of one example as one real "
            f"array, but it returns {jax.tree.map(jax.typeof, f)}."
        )


# -- KFAC ------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["inputs", "outputs", "count"],
    meta_fields=["axes", "bias"],
)
@dataclasses.dataclass(frozen=True)
class Kronecker:
    """A leaf's KFAC factors (`kfac_factors`): its block of the curvature is
    approximated by `kron(inputs, outputs) / count` in the leaf's layout flattened
    as `(input axes, output axes)`, for each block.

    Attributes:
      inputs: `sum a a^T` over the examples and positions of the activations `a`
        a dense or convolution use reads (a convolution's patches, in the kernel's
        input axes' order); for an embedding table, the diagonal: how often each
        row is looked up, a vector.
      outputs: `sum g g^T` over the examples, positions and cotangents of the
        use's output gradients `g`.
      count: the number of terms summed into `inputs` (examples times positions;
        examples for `variant="reduce"`; an embedding's lookups), so that
        `kron(inputs, outputs) / count` approximates the curvature summed over
        the examples.
      axes: the leaf's axes `(blocks, inputs, outputs)`, each a tuple in order,
        or None where the uses split a leaf axis between them (static).
      bias: the position, among the differentiated leaves, of the bias joined to
        this weight (the last row and column of `inputs`), or None (static).

    Axes the leaf shares with both (a scanned stack's layer axis, a batched
    product's heads) lead as blocks: `inputs[b]` and `outputs[b]` are block `b`'s.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import kfac_factors
      >>> x = jnp.array([[1.0, 0.0], [1.0, 1.0]])
      >>> factors = kfac_factors(lambda w, x: x @ w, likelihood="gaussian")
      >>> f = factors(jnp.ones((2, 1)), x)
      >>> f.inputs, f.outputs
      (Array([[2., 1.],
             [1., 1.]], dtype=float32), Array([[2.]], dtype=float32))
      >>> f.count, f.axes
      (Array(2., dtype=float32), ((), (0,), (1,)))
    """

    inputs: jax.Array
    outputs: jax.Array
    count: jax.Array
    axes: tuple | None = None
    bias: int | None = None


class Variant(enum.StrEnum):
    """How weight sharing (positions, patches, scan steps) enters the factors
    (Eschenhagen et al. 2023): `EXPAND` sums over the positions like more
    examples; `REDUCE` sums each example's output gradients and averages its
    activations over the positions first."""

    EXPAND = "expand"
    REDUCE = "reduce"


class _Factors(NamedTuple):
    """How one leaf's uses give Kronecker factors: the leaf symbols of the blocks,
    the inputs and the outputs, in the leaf's axis order."""

    blocks: tuple
    inputs: tuple
    outputs: tuple

    @classmethod
    def of(cls, uses: Sequence[Any], shape: Sequence[int]) -> _Factors | None:
        """The layout every use of a leaf shares, or None where the uses are not
        all whole-leaf products (dense, convolution) or all whole-leaf lookups."""
        whole = tuple((0, d, 1) for d in shape)
        found = set()
        for u in uses:
            form = u.form
            if form is None or form.box != whole:
                return None
            if isinstance(form, RowsForm):
                outs = [s for s in form.specs[2] if isinstance(s, LeafAxis)]
                found.add((RowsForm, (), (form.row_symbol,), tuple(sorted(outs))))
            elif isinstance(form, EinsumForm) and u.rule.kind in _PRODUCTS:
                a, d = ({s for s in sp if isinstance(s, LeafAxis)} for sp in form.specs)
                blocks = tuple(sorted(a & d))
                found.add(
                    (EinsumForm, blocks, tuple(sorted(a - d)), tuple(sorted(d - a)))
                )
            else:
                return None
        if len(found) != 1:
            return None
        kind, blocks, inputs, outputs = found.pop()
        factors = cls(blocks, inputs, outputs)
        return (
            factors if set(blocks + inputs + outputs) >= _leaf_symbols(uses) else None
        )


_PRODUCTS = (UseKind.DENSE, UseKind.CONV)  # (their forms: activation, cotangent)


def _biases(leaves: Sequence[Any], layouts: Sequence[Any]) -> dict[int, int]:
    """`{weight: bias}`: the leaves whose every use adds them to the output of one
    of a product weight's uses (and whose shape is its output features'), paired
    with that weight, as kfac-jax's dense and convolution blocks pair them."""
    made = {}  # the output variable of each product use -> its leaf
    for k, layout in enumerate(layouts):
        if layout is not None and not layout.blocks and layout.inputs:
            for u in leaves[k].uses:
                if isinstance(u.form, EinsumForm):
                    made[(u.path[:-1], id(u.eqn.outvars[0]))] = k
    pairs = {}
    for b, leaf in enumerate(leaves):
        if layouts[b] is not None or not leaf.uses:
            continue
        weights = set()
        for u in leaf.uses:
            if u.eqn.primitive is not prims.add_p or u.levels:
                break
            other = u.eqn.invars[1 - u.slot]
            weights.add(made.get((u.path[:-1], id(other))))
        else:
            (w,) = weights if len(weights) == 1 else (None,)
            if w is not None and w not in pairs and _sizes_match(leaves, layouts, w, b):
                pairs[w] = b
    return pairs


def _leaf_axes(layout: _Factors) -> tuple | None:
    """`Kronecker.axes`: the leaf axes of the blocks, inputs and outputs, or None
    where a symbol is part of an axis."""
    groups = (layout.blocks, layout.inputs, layout.outputs)
    if any(s.part is not Part.WHOLE for g in groups for s in g):
        return None
    return tuple(tuple(s.axis for s in g) for g in groups)


def _sizes_match(leaves, layouts, w: int, b: int) -> bool:
    sizes = leaves[w].uses[0].form.leaf_sizes()
    return tuple(leaves[b].shape) == tuple(sizes[s] for s in layouts[w].outputs)


def _leaf_symbols(uses: Sequence[Any]) -> set:
    return {s for u in uses for s in u.form.leaf_symbols}


def _primed(symbols: Sequence[Any]) -> list:
    return [Mark(f"{s}'") for s in symbols]


def f32(x: jax.Array) -> jax.Array:
    # (at least float32: float64 stays, also where dtype promotion is strict)
    wide = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.dtype(jnp.float32)
    return x.astype(wide)


def _gram(x: jax.Array, spec: Sequence[Any], blocks, axes) -> jax.Array:
    """`sum x x^T` over every symbol of `spec` but `blocks`, keeping `axes` (and
    their primed copies); replicated where the mesh has Explicit axes (an axis
    `x` is sharded over cannot shard both copies)."""
    x = f32(x)
    primed = _primed(axes)
    spec2 = tuple(primed[axes.index(s)] if s in axes else s for s in spec)
    out = (*blocks, *axes, *primed)
    return jnp.einsum(
        _equation([spec, spec2], out), x, x, optimize="optimal",
        out_sharding=explicit_spec([None] * len(out)),
    )  # fmt: skip


def _positions(form: Any) -> int:
    """The entries of a product use's activation that are not the leaf's (its
    positions: tokens, patches, scan steps)."""
    return math.prod(
        n for s, n in zip(form.specs[0], form.shapes[0]) if not isinstance(s, LeafAxis)
    )


def _rows_grams(form: RowsForm, layout: Any, arrays: tuple) -> tuple:
    """A lookup's counts of each row and `sum g g^T` of its kept positions'
    output gradients, over a chunk's examples."""
    rows, valid, delta = arrays
    size = form.leaf_sizes()[form.row_symbol]
    counts = (
        jnp.zeros(size, jnp.float32)
        .at[rows.reshape(-1)]
        .add(valid.reshape(-1).astype(jnp.float32))
    )
    mask = valid[:, None]  # (examples, cotangent, positions, ...)
    mask = mask.reshape(mask.shape + (1,) * (delta.ndim - mask.ndim))
    d = jnp.where(mask, f32(delta), 0)
    spec = (Mark("example"), Mark("cotangent"), *form.specs[2])
    return counts, _gram(d, spec, layout.blocks, layout.outputs)


class _KFAC(Quantity):
    """KFAC's factors of every leaf from the examples' ghost records: the
    activations once, the output gradients of each of the example's cotangents
    (`Plan.pullback`). A leaf whose uses give no factors gets its diagonal, as
    `ggn_diagonal` computes it."""

    def made_with(self) -> tuple:
        return (self.settings, self.variant)

    def __init__(self, traced: ghost.Traced, settings: Curvature, variant: Variant):
        plan = traced.plan
        self.traced = traced
        self.settings, self.variant = settings, variant
        self.leaves = plan.leaves
        self.layouts = [
            _Factors.of(x.uses, x.shape) if x.uses else None for x in plan.leaves
        ]
        self.per_example = plan.with_rule(ghost.PER_EXAMPLE)
        self.biases = _biases(plan.leaves, self.layouts)
        self.paired = set(self.biases.values())
        self.meta = [None if x is None else _leaf_axes(x) for x in self.layouts]

    def evaluate(self, traced: ghost.Traced, values: list, *extra: Any) -> Any:
        """One example's activations once and output gradients per cotangent
        (`Plan.pullback`, by the plan of the current mesh context), kept as each
        leaf's factors need them."""
        plan, records, deltas, pe = pulled(
            "kfac_factors", traced, values, self.per_example, self.settings, extra
        )
        kept = []
        for k, leaf in enumerate(plan.leaves):
            if k in self.paired:  # in its weight's factors
                kept.append(None)
                continue
            if self.layouts[k] is not None:
                kept.append(self._arrays(leaf, records, deltas))
                continue
            kept.append(_formed_diagonal(plan, k, records, deltas, pe))
        return kept

    @staticmethod
    def _arrays(leaf: Any, records: dict, deltas: dict) -> list:
        """One example's reduced or expanded operands of each use: the
        activations (no cotangent axis) and the output gradients (one per
        cotangent, leading)."""
        kept = []
        for u in leaf.uses:
            acts, outs = use_arrays(u, records, deltas)
            if isinstance(u.form, RowsForm):
                kept.append((acts[0], acts[1], outs[2]))
                continue
            kept.append((acts[0], outs[1]))
        return kept

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        factors = []
        for k, leaf in enumerate(self.leaves):
            layout, part = self.layouts[k], kept[k]
            if k in self.paired:
                factors.append(None)
            elif layout is None:
                factors.append(jnp.sum(part, 0))
            else:
                inputs, outputs, count = self._factors(
                    leaf, layout, part, k in self.biases
                )
                count = jnp.asarray(count, jnp.float32)
                meta = dict(axes=self.meta[k], bias=self.biases.get(k))
                factors.append(Kronecker(inputs, outputs, count, **meta))
        return factors, ()

    def _factors(self, leaf: Any, layout: _Factors, parts: list, bias: bool) -> tuple:
        """A chunk's sums of `a a^T` and `g g^T` over its examples and the uses'
        positions (`EXPAND`), or of the examples' operands reduced over them
        first: the activations averaged, the output gradients summed (`REDUCE`).
        With a `bias` added to the outputs, the activations have a last entry 1
        (kfac-jax's dense and convolution blocks with a bias). Returns `(inputs,
        outputs, count)`."""
        example, cot = Mark("example"), Mark("cotangent")
        blocks, ins, outs = layout
        if isinstance(leaf.uses[0].form, RowsForm):
            grams = [_rows_grams(u.form, layout, p) for u, p in zip(leaf.uses, parts)]
            counts, outputs = map(sum, zip(*grams))
            return (*self._flat(leaf, layout, counts, outputs), jnp.sum(counts))
        keep_a, keep_d = (example, *blocks, *ins), (example, cot, *blocks, *outs)
        a_sum = outputs = inputs = 0
        count = 0
        for u, (a, d) in zip(leaf.uses, parts):
            spec_a, spec_d = (
                (example, *u.form.specs[0]),
                (example, cot, *u.form.specs[1]),
            )
            if self.variant is Variant.EXPAND:
                inputs = inputs + _gram(a, spec_a, blocks, ins)
                outputs = outputs + _gram(d, spec_d, blocks, outs)
                a_sum = a_sum + jnp.einsum(_equation([spec_a], ins), f32(a))
                count += a.shape[0] * _positions(u.form)
            else:
                a_sum = a_sum + jnp.einsum(_equation([spec_a], keep_a), f32(a))
                outputs = outputs + jnp.einsum(_equation([spec_d], keep_d), f32(d))
                count += _positions(u.form)
        if self.variant is Variant.REDUCE:
            mean = a_sum / count
            inputs = _gram(mean, keep_a, blocks, ins)
            outputs = _gram(outputs, keep_d, blocks, outs)
            a_sum, count = jnp.sum(mean, 0), mean.shape[0]
        inputs, outputs = self._flat(leaf, layout, inputs, outputs)
        if bias:
            column = regroup(a_sum, (a_sum.size, 1))
            corner = jnp.full((1, 1), count, inputs.dtype)
            inputs = jnp.block([[inputs, column], [column.T, corner]])
        return inputs, outputs, count

    @staticmethod
    def _flat(leaf, layout: _Factors, inputs, outputs) -> tuple:
        sizes = leaf.uses[0].form.leaf_sizes()
        lead = tuple(sizes[s] for s in layout.blocks)
        n_in = math.prod(sizes[s] for s in layout.inputs)
        n_out = math.prod(sizes[s] for s in layout.outputs)
        if inputs.ndim > 1:
            inputs = regroup(inputs, (*lead, n_in, n_in))
        return inputs, regroup(outputs, (*lead, n_out, n_out))


@decorator_form("fun")
@takes(Chunking)
def kfac_factors(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    likelihood: str,
    fisher: str = "exact",
    samples: int = 1,
    variant: str = "expand",
    batch_argnums: int | Sequence[int] | None = None,
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """KFAC's Kronecker factors of every dense, convolution and embedding weight
    of a model, found in its program (no layer registration), summed over the
    examples, `batch_size` examples at a time.

    For a weight whose every use is a product with an activation (`dot_general`:
    dense layers, attention projections, a scanned stack's layers; a
    convolution: over its patches), the result is `Kronecker(inputs, outputs)`:
    `inputs = sum a a^T` over the examples and positions of the activations,
    `outputs = sum g g^T` over the examples, positions and cotangents of the
    output gradients (the cotangents `fisher` chooses, as in `ggn_diagonal`). With
    `variant="reduce"` each example's activations are averaged and its output
    gradients summed over the positions first. An embedding table looked up by
    rows gets the count of each row's lookups as `inputs` (its diagonal). A bias
    added to a product's output is part of that weight's factors, as in
    kfac-jax's dense and convolution blocks: the weight's `inputs` has one more
    row and column, last, for the bias (the activations with a last entry 1),
    and the bias's own entry is None. Exactly when: the bias leaf has the
    shape of the product's output features, and every use of it is one `add`
    to the product's own output, outside any scan (`x @ w + b`, `nn.Dense`,
    `nn.Conv`, `eqx.nn.Linear`, a convolution of a batch `conv(x, k) + b[:,
    None, None]`). A bias added after the product's output is reshaped (the
    one-example form `conv(x[None], k)[0] + b[:, None, None]`, `eqx.nn.Conv2d`,
    whose bias has shape `(C, 1, 1)`), or inside a scanned stack, keeps its own
    diagonal. Any other leaf (normalisation scales and
    shifts, a weight used in two different ways, such as a tied embedding and
    output layer) gets its diagonal, as `ggn_diagonal` computes it.

    The factors are sums. kfac-jax's (read from its source) are averages:
    its dense block's factors are these divided by the number of examples `N`;
    its convolution block's by `N` times the positions `L` (with the block
    scaled by `L`); its scale-and-shift block is the diagonal over `N`.

    The returned function takes `fun`'s arguments and `labels=` or `key=` (see
    `ggn_diagonal`), and returns a tree like the differentiated arguments.

    Args:
      fun: the model's output of one example, `fun(params, *example)` (a real
        array: logits for `likelihood="categorical"`).
      argnums: which positional argument(s) of `fun` the curvature is of.
      likelihood: "categorical" (softmax cross-entropy over the last axis) or
        "gaussian" (the squared error halved).
      fisher: "exact", "mc" (labels sampled from the model) or "empirical".
      samples: the labels drawn per example with `fisher="mc"`.
      batch_argnums: the arguments holding the examples (default: every argument
        not in `argnums`).
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.
      variant: "expand" or "reduce" (how positions enter, see above).

    Returns:
      A function with `fun`'s arguments (and `labels=`, `key=`) returning, per
      leaf, a `Kronecker` or the diagonal.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import kfac_factors
      >>> def model(w, x):
      ...     return x @ w
      >>> x = jnp.array([[1.0, 0.0], [1.0, 1.0]])
      >>> kfac_factors(model, likelihood="gaussian")(jnp.ones((2, 3)), x).inputs
      Array([[2., 1.],
             [1., 1.]], dtype=float32)
    """
    name = "kfac_factors"
    settings = Curvature.make(name, likelihood, fisher, samples)
    variant = check_choice(name, "variant", variant, Variant)
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )

    def call(args: tuple, kwargs: dict, known: Any) -> Any:
        diff, in_axes, args, kwargs, extra = settings.prepare(transform, args, kwargs)
        traced = traced_model(transform, name, fun, args, kwargs, diff, in_axes=in_axes)
        quantity = traced.memo(
            ("kfac", settings, variant), lambda: _KFAC(traced, settings, variant)
        )
        factors, _ = over_chunks(
            transform,
            traced,
            quantity,
            args,
            in_axes,
            kwargs,
            known=known,
            extra=extra,
            extra_axes=settings.extra_axes(),
        )
        return traced.grads_tree(factors, transform.args.single)

    return transform.public(call, fun)
