"""Per-example gradients projected to a few dimensions, chunked: the features of data
attribution (TRAK, TracIn with random projections, LoGra).

The projection is Kronecker-structured, leaf by leaf: axis `j` of a differentiated
leaf, of size `d_j > dim`, is projected by a Gaussian matrix `P_j` of shape
`(d_j, dim)` (entries of variance `1 / dim`); an axis of at most `dim` entries is
kept whole. A leaf's projected gradient is `G x_0 P_0 x_1 P_1 ...` (each axis
contracted with its matrix), flattened; the leaves' are concatenated in the order of
`jax.tree.leaves` of the differentiated arguments. `P_j` is
`jax.random.normal(fold_in(fold_in(key(seed), k), j), (d_j, dim), float32) /
sqrt(dim)` for the `k`-th differentiated leaf (`projection_matrices`; float32
draws on the CPU whether x64 is on or not, so that a seed means one projection on
every backend).

`method="ghost"` projects each use's ghost form (`ghost._forms`): a dense use's
`sum_t a_t g_t^T` becomes `sum_t (P_in^T a_t)(P_out^T g_t)^T` (LoGra's identity, in
one contraction of the form's arrays with the matrices, whose order the einsum
chooses), an embedding lookup's rows are the gathered rows of the row axis' matrix,
so no per-example gradient of those leaves is formed. Other leaves are formed per
example and projected, as `method="vmap"` does for every leaf.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _axes, _cache
from .._core._options import Chunking, check_bool, decorator_form, takes
from .._transforms._batch_vmap import Transform
from .._transforms._grads import (
    FloatLeaves,
    differentiable_floats,
    filtered_value_and_grad,
    floats_to_arrays,
    grad_transform,
)
from . import _choice, ghost
from ._curvature import Kronecker, f32
from ._eigh import eigh
from ._ekfac import EigenKronecker
from ._records import Quantity, over_chunks
from .ghost._forms import EinsumForm, Mark, RowsForm, _equation


def projection_matrices(
    shape: Sequence[int], dim: int, key: jax.Array
) -> list[jax.Array | None]:
    """A leaf's matrices: for each axis, `(d, dim)` Gaussian entries of variance
    `1 / dim` from `fold_in(key, axis)` where `d > dim`, else None (kept whole).
    Concrete arrays, also while tracing (constants of the program)."""
    with jax.ensure_compile_time_eval():
        return [
            jax.random.normal(jax.random.fold_in(key, j), (d, dim), jnp.float32)
            / math.sqrt(dim)
            if d > dim
            else None
            for j, d in enumerate(shape)
        ]


def projected_size(shape: Sequence[int], dim: int) -> int:
    return math.prod(min(d, dim) for d in shape)


def project(g: jax.Array, matrices: Sequence[jax.Array | None]) -> jax.Array:
    """`g` (one leaf's gradient) contracted axis by axis with `matrices`, flattened."""
    g = f32(g)
    for j, p in enumerate(matrices):
        if p is not None:  # (the projected axis takes the contracted one's place)
            g = jnp.moveaxis(jnp.tensordot(g, p.astype(g.dtype), ([j], [0])), -1, j)
    return g.reshape(-1)


def draw_device() -> Any:
    """Where the projections' matrices are drawn: the first CPU device, or where a
    process has no CPU backend, the caller's default device."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        default = jax.config.jax_default_device
        return default if not isinstance(default, str) else jax.devices(default)[0]


def leaf_matrices(shapes: Sequence[Sequence[int]], dim: int, seed: int) -> list:
    """`projection_matrices` of each differentiated leaf (of `shapes`, in order),
    the `k`-th from `fold_in(key(seed), k)`.

    Made on a thread of their own: the caller may be tracing under a mesh (a
    `jit` of sharded inputs, `jax.set_mesh`, the devices' shares), which JAX's
    eager evaluation would apply to the matrices, and a thread starts outside
    every trace and mesh. Drawn on the CPU (`draw_device`): an accelerator's
    float32 Gaussian draws differ from the CPU's in their last digits (its
    transcendental functions are others), and a seed means one projection
    wherever it is drawn."""
    shapes = [tuple(s) for s in shapes]
    device = draw_device()

    def made() -> list:
        with jax.default_device(device):
            base = jax.random.key(seed)
            keys = [jax.random.fold_in(base, k) for k in range(len(shapes))]
            return [projection_matrices(s, dim, key) for s, key in zip(shapes, keys)]

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(made).result()


def _out_symbol(j: int) -> Mark:
    return Mark(f"projected {j}")


def _part(m: jax.Array | None, d: int, box: tuple) -> jax.Array:
    """The rows of axis matrix `m` (the identity's for an axis kept whole, of `d`
    entries) for the entries `box = (start, size, stride)` a use reads."""
    start, size, stride = box
    m = m if m is not None else jnp.eye(d, dtype=jnp.float32)
    return m[start : start + (size - 1) * stride + 1 : stride]


def _form_projection(
    form: Any, arrays: list, shape: Sequence[int], mats: Sequence[Any]
) -> jax.Array | None:
    """One use's projected gradient from its form's arrays (one example), or None
    where the form cannot give it without forming the gradient. A use of part of
    the leaf (a slice, a split: the form's `box`) is projected by the matrices'
    rows of that part (of the identity's, on an axis kept whole)."""
    if isinstance(form, RowsForm):
        rows, valid, delta = arrays
        row = form.row
        # (`rows` index the whole leaf axis, as `RowsForm.gradient` reads them)
        p = _part(mats[row], shape[row], (0, shape[row], 1))
        picked = jnp.where(valid[:, None], jnp.take(p, rows, axis=0), 0)
        operands = [picked, delta]
        specs = [(form.specs[2][0], _out_symbol(row)), form.specs[2]]
    elif isinstance(form, EinsumForm):
        operands, specs = list(arrays), list(form.specs)
    else:
        return None
    sizes = form.leaf_sizes()
    out: list[Any] = []
    for j, d in enumerate(shape):
        if isinstance(form, RowsForm) and j == form.row:
            out.append(_out_symbol(j))
            continue
        parts = sorted(s for s in form.leaf_symbols if s.axis == j)
        if mats[j] is None and form.box[j] == (0, d, 1):  # kept as it is
            out += parts
            continue
        m = _part(mats[j], d, form.box[j])
        if parts:
            operands.append(m.reshape(*(sizes[x] for x in parts), m.shape[-1]))
            specs.append((*parts, _out_symbol(j)))
        else:  # one entry of the axis: its row, an outer factor
            operands.append(m.reshape(-1, m.shape[-1])[0])
            specs.append((_out_symbol(j),))
        out.append(_out_symbol(j))
    operands = [f32(a) for a in operands]
    wide = max((a.dtype for a in operands), key=lambda d: d.itemsize)  # (f64 data)
    operands = [a.astype(wide) for a in operands]
    return jnp.einsum(_equation(specs, out), *operands, optimize="optimal").reshape(-1)


class _GhostProjections(Quantity):
    """Each example's projected gradient from its ghost record (an accumulator on
    the record, `_records`): the uses' forms contracted with the matrices."""

    def made_with(self) -> tuple:
        return (self.dim, self.seed)

    def __init__(self, traced: ghost.Traced, dim: int, seed: int):
        self.traced = traced
        self.seed = seed
        plan = traced.plan
        self.leaves = plan.leaves
        self.mats = leaf_matrices([x.shape for x in self.leaves], dim, seed)
        self.dim = dim
        self.per_example = plan.with_rule(ghost.PER_EXAMPLE)

    def keep(self, record: ghost.Record, out: Any, *extra: Any) -> Any:
        parts = []
        for k, leaf in enumerate(self.leaves):
            mats = self.mats[k]
            if k in record.grads:
                parts.append(project(record.grads[k], mats))
                continue
            if not leaf.uses:  # not used: a zero gradient
                size = projected_size(leaf.shape, self.dim)
                parts.append(jnp.zeros(size, jnp.float32))
                continue
            each = [None]
            if all(u.form is not None for u in leaf.uses):
                each = [
                    _form_projection(u.form, a, leaf.shape, mats)
                    for u, a in zip(leaf.uses, record.arrays(k))
                ]
            if any(p is None for p in each):  # formed, then projected
                parts.append(project(record.instantiate(k), mats))
            else:
                parts.append(sum(each[1:], each[0]))
        return jnp.concatenate(parts), out[1]

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        return (), kept


class _Scored(Quantity):
    """A quantity's per-example rows turned by `post` (one example's row to its
    scores against another batch), as they are made: the rows are never stacked."""

    # (`post`, the call's scoring or whitening, reads the call's arrays: its
    # trace, not a key, shows what it does)
    reusable = False

    def made_with(self) -> tuple:
        return (self.inner,)

    @property
    def traced(self) -> ghost.Traced:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.inner.traced

    def __init__(self, inner: _GhostProjections, post: Callable[[Any], Any]):
        self.inner, self.post = inner, post
        self.per_example = inner.per_example

    def keep(self, record: ghost.Record, out: Any, *extra: Any) -> Any:
        row, aux = self.inner.keep(record, out, *extra)
        return self.post(row), aux

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        return (), kept


SIMILARITIES = ("dot", "cosine")


def _scorer(other: jax.Array, cosine: bool) -> Callable[[Any], Any]:
    """One example's row to its inner product (or `cosine`) with each row of
    `other`."""
    if cosine:
        other = other / jnp.linalg.norm(other, axis=1, keepdims=True)

    def post(row: jax.Array) -> jax.Array:
        if cosine:
            row = row / jnp.linalg.norm(row)
        return other @ row

    return post


@decorator_form("fun")
@takes(Chunking)
def per_example_grad_projections(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    per_position: bool = False,
    dim: int = 16,
    seed: int = 0,
    method: str = "vmap",
    similarity: str = "dot",
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """Every example's gradient, projected to a few dimensions by a seeded random
    projection: an `(N, K)` matrix, `batch_size` examples at a time.

    Row `i` is example `i`'s gradient `jax.grad(fun, argnums)` projected leaf by
    leaf with a Kronecker-structured Gaussian projection: each axis of more than
    `dim` entries is contracted with its own `(d, dim)` matrix (entries of variance
    `1 / dim`), smaller axes are kept, and the leaves' results are flattened and
    concatenated in the order of `jax.tree.leaves` of the differentiated
    arguments (a dense `(d_in, d_out)` weight gives `dim * dim` columns, a bias of
    `d > dim` entries `dim`). Inner products of rows approximate those of the
    gradients (TRAK, TracIn with random projections); the same `seed` gives the
    same projection for every call, so a train set's and a test set's rows can be
    compared. The matrices are `jax.random.normal(fold_in(fold_in(key(seed), k),
    j), (d, dim), jnp.float32) / sqrt(dim)` for axis `j` of the `k`-th
    differentiated leaf (float32 draws on the CPU, with x64 on too: the same on
    every backend).

    With a second batch, `project(*args, other=other_args)` is the `N x M` matrix
    of scores between the two batches' projected gradients (TracIn or TRAK-style
    attribution: `similarity="dot"`, their inner products, or `"cosine"`):
    `other_args` is a tuple of `fun`'s positional arguments for the `M` other
    examples, whose rows are projected first; the `N` rows are then scored chunk
    by chunk as they are made, never held together.

    With `precondition=factors` (`kfac_factors`' or `ekfac_factors`' result for
    the same parameters; a leaf may hold a diagonal instead), the rows are
    whitened leaf by leaf: each leaf's part is multiplied by `(H + lambda
    I)^(-1/2)`, where `H = P^T F P` is the leaf's KFAC block `F = kron(inputs,
    outputs) / count` or EK-FAC block (formed densely in the projected space;
    block by block; a joined bias's is its weight's `outputs`, or its row of
    the EK-FAC block; a diagonal's `diag(D)`)
    seen through the leaf's projection `P`, and `lambda` is `damping` (default
    0.1) times the mean eigenvalue of `H`. Inner products of whitened rows are
    the projected gradients' inner products in the inverse curvature
    (influence-function style scores: TRAK, LoGra), and with `other=` both
    batches' rows are whitened before they are scored. A Kronecker leaf's `H` is
    whitened through the eigendecompositions of its two projected factors; a
    diagonal's densely (up to 8192 projected entries).

    With `method="ghost"`, a dense use's projection is made from its activations
    and output cotangents (`sum_t (P_in^T a_t)(P_out^T g_t)^T`, LoGra's identity),
    convolutions and attention likewise through their ghost forms, and an
    embedding lookup's from the gathered rows of its matrix: no per-example
    gradient of those leaves is formed. Other leaves are formed and projected, as
    `method="vmap"` does for all of them.

    With `per_position=True` (per-token attribution), `fun` returns one loss per
    position of the example (an array, such as a sequence model's per-token
    losses) and each example's row is one row per position: `(N, *positions,
    K)`, the projections of each position's loss's gradient (one backward pass
    per position, by `jax.vjp`; their sum over the positions is the row of the
    summed loss). It forms each position's gradient (`method="vmap"`) and scores
    no `other=` batch (`GradientStore.query(per_position=True)` scores a store).

    Args:
      fun: the loss of one example (a real scalar, or `(scalar, aux)` with
        `has_aux`).
      argnums: which positional argument(s) to differentiate.
      has_aux: whether `fun` returns `(loss, aux)`; aux is stacked per example.
      batch_argnums: the arguments holding the examples (default: every argument
        not in `argnums`).
      per_position: one row per position of `fun`'s (array) output.
      dim: the size each projected axis is reduced to.
      seed: the projection's seed.
      method: "vmap" (each chunk's gradients formed, then projected) or "ghost".
      similarity: with `other=`, "dot" (inner products) or "cosine".
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.

    Returns:
      A function with `fun`'s arguments (and `other=`, `precondition=`,
      `damping=`) returning the `(N, K)`
      float32 matrix, or with `other=` the `(N, M)` scores (with `has_aux`:
      `(matrix, aux)`).

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grad_projections
      >>> def loss(w, x):
      ...     return jnp.dot(w, x)  # the gradient of example x is x itself
      >>> x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
      >>> per_example_grad_projections(loss, dim=2, batch_size=2)(jnp.ones(2), x)
      Array([[3. , 4. ],
             [0.3, 0.4],
             [0. , 0. ]], dtype=float32)
    """
    name = "per_example_grad_projections"
    method = _checked(
        name, has_aux=has_aux, dim=dim, seed=seed, method=method,
        similarity=similarity, per_position=per_position,
    )  # fmt: skip
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )

    def rows_of(args: tuple, kwargs: dict, known: Any, post: Any) -> tuple:
        call = dict(args=args, kwargs=kwargs, known=known, post=post)
        if per_position:
            return _positions(transform, fun, dim=dim, seed=seed, **call), None
        return _rows(
            transform, fun, name, has_aux, dim=dim, seed=seed, method=method, **call
        )

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        kwargs = dict(kwargs)
        other = kwargs.pop("other", None)
        whiten = _preconditioner(name, transform, args, kwargs, dim, seed)
        post = whiten
        if other is not None:
            if not isinstance(other, tuple):
                raise TypeError(
                    f"{name} other must be a tuple of fun's positional arguments "
                    f"for the other examples, but got {type(other).__name__}."
                )
            if per_position:
                raise TypeError(
                    f"{name} per_position=True scores no other= batch: score its "
                    f"rows, or query a store (GradientStore.query)."
                )
            rows = rows_of(other, kwargs, _axes.NOTHING_KNOWN, whiten)[0]
            score = _scorer(rows, cosine=similarity == "cosine")
            post = score if whiten is None else lambda row: score(whiten(row))
        result, aux = rows_of(args, kwargs, known, post)
        return (result, aux) if has_aux else result

    return transform.public(call, fun)


def _checked(name, *, has_aux, dim, seed, method, similarity, per_position) -> Any:
    """`per_example_grad_projections`' options checked; its method."""
    check_bool(name, "has_aux", has_aux)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise TypeError(f"{name} dim must be a positive int, but got dim={dim!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} seed must be an int, but got seed={seed!r}.")
    method = _choice.check_method(name, method)
    check_bool(name, "per_position", per_position)
    if per_position and (method is ghost.Method.GHOST or has_aux):
        raise TypeError(
            f"{name} per_position=True forms each position's gradient: it takes "
            f"method='vmap' and no has_aux, but got method={method.value!r}, "
            f"has_aux={has_aux}."
        )
    if similarity not in SIMILARITIES:
        raise ValueError(
            f"{name} similarity must be one of {SIMILARITIES}, but got "
            f"similarity={similarity!r}."
        )
    return method


def _preconditioner(
    name: str, transform: Transform, args: tuple, kwargs: dict, dim: int, seed: int
) -> Callable[[Any], Any] | None:
    """The whitening of the call's `precondition=` (popped from `kwargs`, with
    `damping=`), or None without one."""
    precondition = kwargs.pop("precondition", None)
    damping = kwargs.pop("damping", None)
    if precondition is None:
        if damping is not None:
            raise TypeError(f"{name} damping is for precondition=, which is missing.")
        return None
    if isinstance(precondition, Whitening) and damping is None:  # (made once)
        return precondition
    damping = _checked_damping(name, 0.1 if damping is None else damping)
    diff, in_axes = transform.resolve(args)
    args = differentiable_floats(args, diff, in_axes)
    return _whitening(
        name,
        args,
        diff,
        transform.args.single,
        precondition,
        dim,
        seed=seed,
        damping=damping,
    )


def _rows(
    transform: Transform, fun: Any, name: str, has_aux: bool, *, dim: int, seed: int,
    method: Any, args: tuple, kwargs: dict, known: Any, post: Any, runs: Any = None,
) -> tuple:  # fmt: skip
    """Each example's row (`post` of it, where given) and aux, by `method` (with
    `method="ghost"`: by the program `runs`, where given, else the one
    `_choice.decided` says)."""
    diff, in_axes = transform.resolve(args)
    args = differentiable_floats(args, diff, in_axes)
    if method is ghost.Method.GHOST:
        traced = ghost.traced_loss(
            transform.memo, name, fun, args, kwargs, diff, in_axes=in_axes,
            has_aux=has_aux,
        )  # fmt: skip
        quantity = traced.memo(
            ("projections", dim, seed), lambda: _GhostProjections(traced, dim, seed)
        )
        if runs is None:
            runs = _chosen(transform, fun, quantity, has_aux, dim=dim, seed=seed,
                           call=(args, kwargs, in_axes))  # fmt: skip
        if runs is ghost.Method.GHOST:
            scored = quantity if post is None else _Scored(quantity, post)
            _, (rows, aux) = over_chunks(
                transform, traced, scored, args, in_axes, kwargs, known=known
            )
            return rows, aux
    return _formed(
        transform, fun, diff, has_aux, name, dim=dim, seed=seed, post=post,
        args=args, kwargs=kwargs, in_axes=in_axes, known=known,
    )  # fmt: skip


def _chosen(
    transform: Transform, fun: Any, quantity: _GhostProjections, has_aux: bool, *,
    dim: int, seed: int, call: tuple,
) -> ghost.Method:  # fmt: skip
    """The program a ghost call (`call`: its `(args, kwargs, in_axes)`) runs:
    `_choice.decided`, the model's the ghost program wherever a leaf has a ghost
    rule (its projection is taken from the leaf's operands)."""
    args, kwargs, in_axes = call
    plan = quantity.traced.plan
    helped = any(x.rule == ghost.GHOST for x in plan.leaves)
    report = _choice.ruled_report(quantity.traced, helped, "projection")

    def program(twin: Transform, runs: ghost.Method) -> Callable[..., Any]:
        def run(args: tuple, kwargs: dict) -> Any:
            return _rows(
                twin, fun, transform.name, has_aux, dim=dim, seed=seed,
                method=ghost.Method.GHOST, args=args, kwargs=kwargs,
                known=_axes.NOTHING_KNOWN, post=None, runs=runs,
            )  # fmt: skip

        return run

    size = _choice.examples(transform, args, in_axes, kwargs)
    return _choice.decided(
        transform, fun, report, quantity, program, call=call, size=size
    )


def _checked_damping(name: str, damping: Any) -> float:
    """`damping=` of a whitening: a non-negative Python number."""
    if (
        isinstance(damping, bool)
        or not isinstance(damping, (int, float))
        or damping < 0
    ):
        raise TypeError(
            f"{name} damping must be a non-negative float, but got damping={damping!r}."
        )
    return damping


def prepared_whitening(
    name: str, params: Any, precondition: Any, *, dim: int, seed: int, damping: Any
) -> Whitening:
    """The whitening of `precondition=` factors for the projected gradients of
    `params` (a loss's argument 0, differentiated), its eigendecompositions made
    now, once: passed as `precondition=` (without `damping=`), a call whitens by
    it as it would by the factors, without making them again."""
    args = (floats_to_arrays(params),)
    damping = _checked_damping(name, damping)
    return _whitening(name, args, (0,), True, precondition, dim, seed=seed,
                      damping=damping)  # fmt: skip


def _positions(
    transform: Transform, fun: Any, *, dim: int, seed: int, args: tuple,
    kwargs: dict, known: Any, post: Any,
) -> Any:  # fmt: skip
    """Each example's rows, one per position of `fun`'s output: the projections of
    each position's gradient (`post` of each, where given)."""
    diff, in_axes = transform.resolve(args)
    args = differentiable_floats(args, diff, in_axes)
    n = len(args)

    def example(*inputs: Any, **kw: Any) -> Any:
        floats = FloatLeaves(inputs[:n], diff)
        value, pull = jax.vjp(lambda d: fun(*floats.args_with(d), **kw), floats.diff)
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(
                f"{transform.name} per_position=True needs fun to return real "
                f"per-position losses, but it returns {jax.typeof(value)}."
            )
        eye = jnp.eye(value.size, dtype=value.dtype).reshape(value.size, *value.shape)
        leaves = [g for part in jax.vmap(pull)(eye)[0] for g in part]
        mats = leaf_matrices([g.shape[1:] for g in leaves], dim, seed)

        def row(*gs: Any) -> Any:
            r = jnp.concatenate([project(g, m) for g, m in zip(gs, mats)])
            return r if post is None else post(r)

        rows = jax.vmap(row)(*leaves)
        return rows.reshape(*value.shape, *rows.shape[1:])

    return transform.map(example, args, kwargs, in_axes, 0, known=known)


def _formed(
    transform: Transform, fun: Any, diff: Any, has_aux: bool, name: str, *, dim: int,
    seed: int, post: Any, args: tuple, kwargs: dict, in_axes: tuple, known: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """The projections of each chunk's formed gradients (`post` of each, where
    given)."""
    value_and_grad = filtered_value_and_grad(
        fun, diff, transform.args.single, has_aux, name
    )

    def example(*inputs: Any, **kw: Any) -> Any:
        value, grads = value_and_grad(*inputs, **kw)
        leaves = jax.tree.leaves(grads)
        mats = leaf_matrices([g.shape for g in leaves], dim, seed)
        parts = [project(g, m) for g, m in zip(leaves, mats)]
        row = jnp.concatenate(parts)
        return row if post is None else post(row), (value[1] if has_aux else None)

    return transform.map(example, args, kwargs, in_axes, 0, known=known)


def _sandwich(factor: jax.Array, sizes: Sequence[int], mats: Sequence[Any]) -> Any:
    """`P^T F P` for `F` (`(..., n, n)`, `n` the product of `sizes`) and `P` the
    Kronecker product of `mats` (None: an axis kept whole)."""
    lead = factor.shape[:-2]
    f = f32(factor).reshape(*lead, *sizes, *sizes)
    for j, p in enumerate(mats):
        if p is not None:
            for axis in (len(lead) + j, len(lead) + len(sizes) + j):
                f = jnp.moveaxis(jnp.tensordot(f, p, ([axis], [0])), -1, axis)
    k = math.prod(f.shape[len(lead) : len(lead) + len(sizes)])
    return f.reshape(*lead, k, k)


def _inverse_root(values: jax.Array, damping: float) -> jax.Array:
    """`(s + lambda)^(-1/2)` of one leaf's eigenvalues `s` (a vector), with
    `lambda = damping * mean(s)` (1 where the curvature is zero)."""
    values = jnp.maximum(values, 0)
    lam = damping * jnp.mean(values)
    return jax.lax.rsqrt(values + jnp.where(lam > 0, lam, 1.0))


@jax.tree_util.register_pytree_node_class
class Whitened:
    """One leaf's whitening with its arrays computed (the eigendecompositions
    made): `kind` "dense" (`u`, `scale`: `u (scale * u^T x)`), "kronecker" (`u_in`,
    `u_out`, `scale`, per block) or "eigen" (`u`, `scale`, per block), `layout`
    the projected leaf's `(kept sizes, (blocks, ins, outs) axes, grouped tail)`
    for the last two. A pytree of its arrays: a program takes them as arguments."""

    def __init__(self, kind: str, arrays: tuple, layout: tuple = ()):
        self.kind, self.arrays, self.layout = kind, tuple(arrays), layout

    def tree_flatten(self) -> tuple:
        return self.arrays, (self.kind, self.layout)

    @classmethod
    def tree_unflatten(cls, aux: tuple, arrays: Any) -> Whitened:
        return cls(aux[0], arrays, aux[1])

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "dense":
            u, scale = self.arrays
            return u @ ((u.T @ x) * scale)
        to, back = _regrouped(*self.layout)
        if self.kind == "kronecker":
            ua, ug, scale = self.arrays
            x = jnp.swapaxes(ua, -1, -2) @ to(x) @ ug
            return back(ua @ (x * scale) @ jnp.swapaxes(ug, -1, -2))
        vecs, scale = self.arrays
        x = jnp.einsum("...ij,...i->...j", vecs, to(x)) * scale
        return back(jnp.einsum("...ij,...j->...i", vecs, x))


@jax.tree_util.register_pytree_node_class
class Whitening:
    """A projected row to its whitened row, every leaf's part by its `Whitened`
    (`splits` the parts' ends): what `precondition=` factors become, computed
    once (`build_store` makes it once for all its blocks)."""

    def __init__(self, leaves: Sequence[Whitened], splits: tuple):
        self.leaves, self.splits = list(leaves), tuple(splits)

    def tree_flatten(self) -> tuple:
        return self.leaves, self.splits

    @classmethod
    def tree_unflatten(cls, splits: tuple, leaves: Any) -> Whitening:
        return cls(leaves, splits)

    def __call__(self, row: jax.Array) -> jax.Array:
        parts = jnp.split(row, list(self.splits))
        return jnp.concatenate([f(x) for f, x in zip(self.leaves, parts)])


def _dense_whitening(h: jax.Array, damping: float) -> Whitened:
    s, u = eigh((h + h.T) / 2)
    return Whitened("dense", (u, _inverse_root(s, damping)))


def _kronecker_whitening(
    entry: Kronecker, shape: Sequence[int], mats: Sequence[Any], damping: float,
    where: str,
) -> Whitened:  # fmt: skip
    """A leaf's projected gradient to `(A' x G' + lambda)^(-1/2)` of it, with
    `A' = P_in^T inputs P_in` and `G' = P_out^T outputs P_out / count` per block,
    through their eigendecompositions."""
    blocks, ins, outs = _block_axes(entry, mats, where)
    inputs = f32(entry.inputs)
    if entry.bias is not None:  # (its joined bias is preconditioned on its own)
        inputs = inputs[..., :-1, :-1]
    if inputs.ndim == len(blocks) + 1:  # an embedding's counts: the diagonal
        inputs = inputs[..., :, None] * jnp.eye(inputs.shape[-1])
    a = _sandwich(inputs, [shape[j] for j in ins], [mats[j] for j in ins])
    g = _sandwich(entry.outputs, [shape[j] for j in outs], [mats[j] for j in outs])
    (sa, ua), (sg, ug) = eigh(a), eigh(g / entry.count)
    values = jnp.maximum(sa, 0)[..., :, None] * jnp.maximum(sg, 0)[..., None, :]
    scale = _inverse_root(values.reshape(-1), damping).reshape(values.shape)
    layout = (_kept(shape, mats), entry.axes, (a.shape[-1], g.shape[-1]))
    return Whitened("kronecker", (ua, ug, scale), layout)


def _kept(shape: Sequence[int], mats: Sequence[Any]) -> tuple:
    """A leaf's axes' sizes once projected."""
    return tuple(
        min(d, m.shape[1]) if m is not None else d for d, m in zip(shape, mats)
    )


def _regrouped(kept: tuple, axes: tuple, tail: tuple) -> tuple:
    """A leaf's projected part (flat; `kept` its axes' sizes) to its `(blocks,
    inputs, outputs)` axes grouped as `(*blocks, *tail)`, and back."""
    blocks, ins, outs = axes
    order = (*blocks, *ins, *outs)
    grouped = (*[kept[j] for j in blocks], *tail)

    def to(x: jax.Array) -> jax.Array:
        return x.reshape(kept).transpose(order).reshape(grouped)

    def back(x: jax.Array) -> jax.Array:
        x = x.reshape([kept[j] for j in order])
        return x.transpose(np.argsort(order)).reshape(-1)

    return to, back


def _block_axes(entry: Any, mats: Sequence[Any], where: str) -> tuple:
    """A Kronecker or EK-FAC leaf's `(blocks, inputs, outputs)` axes, checked for
    whitening: known, and its block axes kept whole by the projection."""
    if entry.axes is None:
        raise ValueError(f"{where}: its uses split a leaf axis between the factors.")
    blocks = entry.axes[0]
    if any(mats[j] is not None for j in blocks):
        raise ValueError(
            f"{where}: its block axes {blocks} have more than dim entries; a larger "
            "dim keeps them whole."
        )
    return entry.axes


def _bias_whitening(
    weight: Any, shape: Sequence[int], mats: Sequence[Any], damping: float
) -> Whitened:
    """A bias joined to `weight`'s factors, its block projected (the weight-bias
    cross terms left out): for KFAC's, the weight's `outputs / count` times the
    last entry of `inputs`, which is `count` (the activations' entry 1, summed);
    for EK-FAC's, `Q_out diag(sum_j Q_in[-1, j]^2 eigenvalues[j]) Q_out^T`."""
    if isinstance(weight, EigenKronecker):
        w = jnp.einsum("j,jl->l", f32(weight.input_basis[-1]) ** 2, weight.eigenvalues)
        q = f32(weight.output_basis)
        g = _sandwich((q * w[None, :]) @ q.T, shape, mats)
    else:
        g = _sandwich(weight.outputs, shape, mats)
    return _dense_whitening(g, damping)


def _projected_rows(q: jax.Array, sizes: Sequence[int], mats: Sequence[Any]) -> Any:
    """`P^T q` for `q` (`(..., n, m)`, `n` the product of `sizes`) and `P` the
    Kronecker product of `mats` (None: an axis kept whole)."""
    lead, m = q.shape[:-2], q.shape[-1]
    q = f32(q).reshape(*lead, *sizes, m)
    for j, p in enumerate(mats):
        if p is not None:
            axis = len(lead) + j
            q = jnp.moveaxis(jnp.tensordot(q, p, ([axis], [0])), -1, axis)
    return q.reshape(*lead, -1, m)


def _eigen_whitening(
    entry: EigenKronecker, shape: Sequence[int], mats: Sequence[Any], damping: float,
    where: str,
) -> Whitened:  # fmt: skip
    """A leaf's projected gradient to `(H + lambda)^(-1/2)` of it, `H = P^T F P`
    of its EK-FAC block `F = K diag(vec(eigenvalues)) K^T` (`K = Q_in x Q_out`;
    a joined bias's row left out), formed densely per block from `U = P_in^T
    Q_in` and `V = P_out^T Q_out`: `H = sum_jl eigenvalues[j, l] (U_j x
    V_l)(U_j x V_l)^T`."""
    blocks, ins, outs = _block_axes(entry, mats, where)
    values = f32(entry.eigenvalues)
    if entry.input_basis is None:  # an embedding: the identity
        n_in = values.shape[-2]
        q_in = jnp.broadcast_to(
            jnp.eye(n_in, dtype=values.dtype), (*values.shape[:-2], n_in, n_in)
        )
    else:
        q_in = f32(entry.input_basis)
    if entry.bias is not None:  # (its joined bias is preconditioned on its own)
        q_in = q_in[..., :-1, :]
    u = _projected_rows(q_in, [shape[j] for j in ins], [mats[j] for j in ins])
    v = _projected_rows(
        f32(entry.output_basis), [shape[j] for j in outs], [mats[j] for j in outs]
    )
    half = jnp.einsum("...aj,...cj,...jl->...acl", u, u, values)
    h = jnp.einsum("...acl,...bl,...dl->...abcd", half, v, v)
    k_in, k_out = u.shape[-2], v.shape[-2]
    h = h.reshape(*h.shape[:-4], k_in * k_out, k_in * k_out)
    s, vecs = eigh((h + jnp.swapaxes(h, -1, -2)) / 2)
    scale = _inverse_root(s.reshape(-1), damping).reshape(s.shape)
    layout = (_kept(shape, mats), entry.axes, (k_in * k_out,))
    return Whitened("eigen", (vecs, scale), layout)


DENSE_LIMIT = 8192  # the projected size up to which a diagonal is whitened densely


def _diagonal_whitening(
    diagonal: Any, shape: Sequence[int], mats: Sequence[Any], damping: float,
    where: str,
) -> Whitened:  # fmt: skip
    """A leaf's diagonal curvature `D`, projected: `P^T diag(D) P` (dense)."""
    if jnp.shape(diagonal) != tuple(shape):
        raise ValueError(
            f"{where}: expected a Kronecker, or a diagonal of the leaf's shape "
            f"{tuple(shape)}, but got {type(diagonal).__name__} of shape "
            f"{jnp.shape(diagonal)}."
        )
    size = math.prod(d if p is None else p.shape[1] for d, p in zip(shape, mats))
    if size > DENSE_LIMIT:
        raise ValueError(
            f"{where}: a diagonal projects to {size} entries, more than the "
            f"{DENSE_LIMIT} whitened densely; a smaller dim keeps it within."
        )
    letters = "abcdefghijklmnopqrstuvwxyz"
    r = len(shape)
    idx, left, right = letters[:r], letters[r : 2 * r], letters[2 * r : 3 * r]
    operands, specs = [f32(jnp.asarray(diagonal))], [idx]
    for j, (d, p) in enumerate(zip(shape, mats)):
        p = jnp.eye(d, dtype=jnp.float32) if p is None else p
        operands += [p, p]
        specs += [idx[j] + left[j], idx[j] + right[j]]
    h = jnp.einsum(f"{','.join(specs)}->{left}{right}", *operands, optimize="optimal")
    return _dense_whitening(h.reshape(size, size), damping)


def _whitening(
    name: str, args: Sequence[Any], diff: Sequence[int], single: bool,
    precondition: Any, dim: int, *, seed: int, damping: float,
) -> Whitening:  # fmt: skip
    """One example's projected row to its whitened row: each leaf's part times
    `(P^T F P + lambda)^(-1/2)`, `F` the leaf's block of `precondition` (a
    `Kronecker`, a diagonal, or None for a bias joined to a weight's factors)."""
    floats = FloatLeaves(args, diff)
    given = (precondition,) if single else precondition
    if not isinstance(given, tuple) or len(given) != len(diff):
        raise TypeError(
            f"{name} precondition must be structured like the differentiated "
            f"arguments (kfac_factors' result), but got {type(precondition).__name__}."
        )
    entries, shapes = [], []
    for (leaves, treedef, mask), tree in zip(floats.parts, given):
        try:
            flat = treedef.flatten_up_to(tree)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{name} precondition must be structured like the differentiated "
                f"arguments (kfac_factors' result): {e}"
            ) from None
        entries += [e for e, m in zip(flat, mask) if m]
        shapes += [jnp.shape(x) for x, m in zip(leaves, mask) if m]
    mats = leaf_matrices(shapes, dim, seed)
    joined = {  # a joined bias's position -> its weight's
        e.bias: k
        for k, e in enumerate(entries)
        if isinstance(e, (Kronecker, EigenKronecker)) and e.bias is not None
    }
    maps = []
    for k, (entry, shape) in enumerate(zip(entries, shapes)):
        where = f"{name} precondition, differentiated leaf {k} of shape {shape}"
        if isinstance(entry, Kronecker):
            maps.append(_kronecker_whitening(entry, shape, mats[k], damping, where))
        elif isinstance(entry, EigenKronecker):
            maps.append(_eigen_whitening(entry, shape, mats[k], damping, where))
        elif entry is None and k in joined:
            maps.append(_bias_whitening(entries[joined[k]], shape, mats[k], damping))
        elif entry is None:
            raise ValueError(f"{where}: None, and no weight's factors join it.")
        else:
            maps.append(_diagonal_whitening(entry, shape, mats[k], damping, where))
    splits = np.cumsum([projected_size(s, dim) for s in shapes])[:-1]
    return Whitening(maps, tuple(int(i) for i in splits))
