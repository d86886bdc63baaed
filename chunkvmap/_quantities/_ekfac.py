"""Eigenvalue-corrected Kronecker factors (EK-FAC, George et al. 2018), chunked.

KFAC approximates a weight's block of the curvature by `kron(A, G) / count`;
in the eigenbases `Q_A`, `Q_G` of its factors that block is diagonal, with the
products of their eigenvalues on the diagonal. EK-FAC keeps the bases and
replaces those products by the curvature's own second moments in them: for each
example and each of its output cotangents (`backward_vectors`) the weight's
gradient `G_im` (in the leaf's `(inputs, outputs)` layout, a joined bias its
last input row) is rotated, `Q_A^T G_im Q_G`, and its entries squared and summed
over the examples and cotangents. The block is then
`(Q_A x Q_G) diag(vec(eigenvalues)) (Q_A x Q_G)^T`, exact on the diagonal of the
rotated curvature.

`ekfac_factors` runs two chunked passes over the examples: `kfac_factors` for
the bases, then the rotated squares, summed by a fold (each example's gradients
formed per cotangent, `jax.vmap` of one `jax.vjp`). `multiply_inverse` applies
`(F + damping I)^-1` of the factors (EK-FAC's, KFAC's or a diagonal) to
gradients: the influence preconditioner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp

from .._core._accumulators import Fold, compose
from .._core._loop import regroup
from .._core._options import Chunking, decorator_form, takes
from .._transforms._grads import FloatLeaves, grad_transform
from . import _choice, ghost
from ._curvature import (
    Curvature,
    Kronecker,
    check_model_output,
    f32,
    formed,
    kfac_factors as _kfac_factors,
    pulled,
    traced_model,
    use_arrays,
)
from ._eigh import eigh
from ._records import Quantity, over_chunks
from ._squares import squared_products
from .ghost._forms import EinsumForm, LeafAxis, Mark, RowsForm, _equation


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["input_basis", "output_basis", "eigenvalues"],
    meta_fields=["axes", "bias"],
)
@dataclasses.dataclass(frozen=True)
class EigenKronecker:
    """A leaf's EK-FAC factors (`ekfac_factors`): its block of the curvature is
    `(Q_in x Q_out) diag(vec(eigenvalues)) (Q_in x Q_out)^T` in the leaf's layout
    flattened as `(input axes, output axes)`, for each block.

    Attributes:
      input_basis: `Q_in`, the eigenvectors (columns) of KFAC's `inputs` factor,
        `(*blocks, n_in, n_in)`; None for an embedding table, whose `inputs` is
        the diagonal of its rows' counts (the basis is the identity).
      output_basis: `Q_out`, the eigenvectors of KFAC's `outputs` factor,
        `(*blocks, n_out, n_out)`.
      eigenvalues: `(*blocks, n_in, n_out)`: `sum (Q_in^T G Q_out)^2` over the
        examples and their cotangents of the leaf's gradients `G` (a sum over the
        examples, as `ggn_diagonal`'s and `kfac_factors`' are).
      axes: the leaf's axes `(blocks, inputs, outputs)`, as `Kronecker.axes`.
      bias: the position, among the differentiated leaves, of the bias joined to
        this weight (the last input row), or None, as `Kronecker.bias`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ekfac_factors
      >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
      >>> f = ekfac_factors(lambda w, x: x @ w, likelihood="gaussian")(
      ...     jnp.ones((2, 1)), x)
      >>> f.input_basis.shape, f.output_basis.shape, f.eigenvalues.shape, f.axes
      ((2, 2), (1, 1), (2, 1), ((), (0,), (1,)))
    """

    input_basis: jax.Array | None
    output_basis: jax.Array
    eigenvalues: jax.Array
    axes: tuple | None = None
    bias: int | None = None


def _is_factor(x: Any) -> bool:
    return x is None or isinstance(x, (Kronecker, EigenKronecker))


def _rotatable(f: Any) -> bool:
    return isinstance(f, Kronecker) and f.axes is not None


def _eigh(f: Kronecker) -> tuple:
    """`(in_values, Q_in, out_values, Q_out)` of a leaf's KFAC factors: an
    embedding's `inputs`, the rows' counts (a diagonal), are their own values,
    with the identity (None) as their basis."""
    out_vals, q_out = eigh(f.outputs)
    if f.inputs.ndim == f.outputs.ndim - 1:
        return f.inputs, None, out_vals, q_out
    return (*eigh(f.inputs), out_vals, q_out)


def _bases(f: Kronecker) -> tuple[Any, jax.Array]:
    """The eigenbases of a leaf's KFAC factors (None for a diagonal `inputs`)."""
    _, q_in, _, q_out = _eigh(f)
    return q_in, q_out


def _laid_out(g: jax.Array, axes: tuple, lead: int, bias: jax.Array | None) -> Any:
    """Gradients `g` (`lead` leading axes, then the leaf's) as `(..., *blocks,
    n_in, n_out)`, a joined `bias`'s gradients (same leading axes) a last input
    row."""
    blocks, ins, outs = axes
    shape = g.shape[lead:]
    order = [*range(lead), *(lead + a for a in (*blocks, *ins, *outs))]
    n_in, n_out = (math.prod(shape[a] for a in group) for group in (ins, outs))
    g = jnp.transpose(g, order).reshape(
        *g.shape[:lead], *(shape[a] for a in blocks), n_in, n_out
    )
    if bias is None:
        return g
    row = bias.reshape(*bias.shape[:lead], 1, n_out).astype(g.dtype)
    return jnp.concatenate([g, row], axis=-2)


def _rotated(g: jax.Array, q_in: Any, q_out: jax.Array) -> jax.Array:
    """`Q_in^T g Q_out` over the last two axes (`q_in` None: the identity)."""
    if q_in is not None:
        g = jnp.einsum("...ij,...ik->...jk", q_in, g)
    return jnp.einsum("...jk,...kl->...jl", g, q_out)


def _diff_factors(factors: Any, args: Sequence[Any], diff: Sequence[int]) -> list:
    """`factors` (a tree like the differentiated arguments, or their tuple), one
    entry per differentiated (floating-point) leaf, in order."""
    floats = FloatLeaves(args, diff)
    trees = [factors] if len(diff) == 1 else list(factors)
    out = []
    for (leaves, treedef, mask), tree in zip(floats.parts, trees):
        entries = treedef.flatten_up_to(tree)
        out += [e for e, m in zip(entries, mask) if m]
    return out


def _given_factors(name: str, given: Any, found: list, args, diff) -> list:
    """The factors a call was given (`factors=`: `kfac_factors`' or
    `ekfac_factors`' result for these parameters), one entry per differentiated
    leaf, checked against `found` (what `kfac_factors` gives for them: its
    shapes)."""
    what = "kfac_factors' or ekfac_factors' result for these parameters"
    try:
        entries = _diff_factors(given, args, diff)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} factors= must be structured like the differentiated arguments "
            f"({what}): {e}"
        ) from None
    for k, (f, g) in enumerate(zip(found, entries)):
        where = f"{name} factors=, differentiated leaf {k}"
        if _rotatable(f):
            ok = isinstance(g, (Kronecker, EigenKronecker)) and (g.axes, g.bias) == (
                f.axes, f.bias
            )  # fmt: skip
            if ok and isinstance(g, Kronecker):
                ok = (jnp.shape(g.inputs), jnp.shape(g.outputs)) == (
                    f.inputs.shape, f.outputs.shape
                )  # fmt: skip
            elif ok:
                ins = None if f.inputs.ndim < f.outputs.ndim else f.inputs.shape
                ok = jnp.shape(g.output_basis) == f.outputs.shape and (
                    ins == (None if g.input_basis is None else g.input_basis.shape)
                )
            expected = (
                f"Kronecker factors of inputs {f.inputs.shape} and outputs "
                f"{f.outputs.shape}, axes {f.axes}, bias {f.bias} (or the EK-FAC "
                f"factors of those)"
            )
        elif f is None:
            ok, expected = g is None, "None (a bias joined to its weight)"
        else:
            shape = getattr(f, "shape", None)
            ok = not _is_factor(g) and jnp.shape(g) == shape
            expected = f"a diagonal of shape {shape}"
        if not ok:
            raise ValueError(
                f"{where}: expected {expected} ({what}), but got {_described(g)}."
            )
    return entries


def _described(g: Any) -> str:
    if isinstance(g, Kronecker):
        return (
            f"Kronecker factors of inputs {jnp.shape(g.inputs)} and outputs "
            f"{jnp.shape(g.outputs)}, axes {g.axes}, bias {g.bias}"
        )
    if isinstance(g, EigenKronecker):
        return f"EK-FAC factors of axes {g.axes}, bias {g.bias}"
    return "None" if g is None else f"{type(g).__name__} of shape {jnp.shape(g)}"


def _given_bases(g: Any) -> tuple:
    """The eigenbases of a given leaf's factors (an EK-FAC leaf's own)."""
    if isinstance(g, EigenKronecker):
        return g.input_basis, g.output_basis
    return _bases(g)


@decorator_form("fun")
@takes(Chunking)
def ekfac_factors(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    likelihood: str,
    fisher: str = "exact",
    samples: int = 1,
    variant: str = "expand",
    batch_argnums: int | Sequence[int] | None = None,
    method: str = "vmap",
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """EK-FAC's eigenvalue-corrected Kronecker factors of every dense,
    convolution and embedding weight of a model (no layer registration), summed
    over the examples, `batch_size` examples at a time.

    Two passes over the examples: `kfac_factors` (same options) gives each
    weight's factors `A` and `G`, whose eigenbases `Q_in`, `Q_out` are kept;
    then each example's gradient of the weight for each of its output cotangents
    (those `fisher` chooses, as in `ggn_diagonal`), laid out as `(inputs,
    outputs)` with a joined bias as its last input row, is rotated into them and
    squared: `eigenvalues = sum (Q_in^T G Q_out)^2`. A weight's block of the
    curvature is then `(Q_in x Q_out) diag(vec(eigenvalues)) (Q_in x Q_out)^T`.
    Leaves `kfac_factors` gives their diagonal keep it (EK-FAC in the identity
    basis: the same diagonal); a bias joined to its weight is None; a leaf whose
    uses split one of its axes (`Kronecker.axes` None) gets its diagonal.

    With `method="ghost"` the second pass reads the model's program as
    `kfac_factors` does: each example is evaluated once, its record pulled back
    per cotangent, and only the rotated weights' gradients are formed, from
    their uses (`method="vmap"`: every leaf's gradient, by `jax.vjp` per
    cotangent).

    The returned function takes `fun`'s arguments and `labels=` or `key=` (see
    `ggn_diagonal`), and returns a tree like the differentiated arguments: per
    leaf an `EigenKronecker`, the diagonal, or None. With `factors=` (the result
    of `kfac_factors` or `ekfac_factors` for the same parameters: fitted on a
    subset of the examples, as Kronfluence allows, or at an earlier step) the
    first pass is not run: the bases are the given factors' (an `EigenKronecker`'s
    own, a `Kronecker`'s eigenvectors), and the eigenvalues and the other leaves'
    diagonals are summed over these examples, in one pass.

    Args:
      fun: the model's output of one example, `fun(params, *example)`.
      argnums: which positional argument(s) of `fun` the curvature is of.
      likelihood: "categorical" or "gaussian" (see `ggn_diagonal`).
      fisher: "exact", "mc" or "empirical".
      samples: the labels drawn per example with `fisher="mc"`.
      variant: KFAC's "expand" or "reduce", for the bases (see `kfac_factors`).
      batch_argnums: the arguments holding the examples (default: every argument
        not in `argnums`).
      method: "vmap" or "ghost", for the second pass (see above; the first is
        `kfac_factors`', which reads the program either way).
      batch_size: examples per chunk (None: all at once; "auto": the largest that
        fits `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard`.
      remat: checkpoint each chunk for reverse mode (see `batch_vmap`).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size`.

    Returns:
      A function with `fun`'s arguments (and `labels=`, `key=`) returning, per
      leaf, an `EigenKronecker`, the diagonal, or None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ekfac_factors
      >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
      >>> f = ekfac_factors(lambda w, x: x @ w, likelihood="gaussian")(
      ...     jnp.ones((2, 1)), x)
      >>> f.eigenvalues
      Array([[1.],
             [4.]], dtype=float32)
    """
    name = "ekfac_factors"
    settings = Curvature.make(name, likelihood, fisher, samples)
    method = _choice.check_method(name, method)
    kfac = _kfac_factors(
        fun, argnums, likelihood=likelihood, fisher=fisher, samples=samples,
        variant=variant, batch_argnums=batch_argnums, **options,
    )  # fmt: skip
    transform = grad_transform(
        name, fun, argnums, batch_argnums, exclusive=True, **options
    )

    def call(args: tuple, kwargs: dict, known: Any) -> Any:
        kwargs = dict(kwargs)
        given = kwargs.pop("factors", None)
        if given is None:
            factors = kfac(*args, **kwargs)
        else:  # (its shapes alone: the pass is not run)
            factors = jax.eval_shape(lambda a, k: kfac(*a, **k), args, kwargs)
        diff, in_axes, args, kwargs, extra = settings.prepare(transform, args, kwargs)
        found = _diff_factors(factors, args, diff)
        if given is not None:
            given = _given_factors(name, given, found, args, diff)
        bases = [
            _given_bases(g) if given is not None and _rotatable(f)
            else _bases(f) if _rotatable(f) else None
            for f, g in zip(found, given or found)
        ]  # fmt: skip
        data, how = (args, kwargs, extra, bases), (diff, in_axes, known)
        redo = given is not None  # (the diagonals too are these examples')
        sums = None
        if method is ghost.Method.GHOST:
            quantity = _quantity(transform, fun, settings, found, data, how, redo=redo)
            runs = _chosen(transform, fun, found, data, how, quantity, redo=redo)
            if runs is ghost.Method.GHOST:
                sums = _ghost_moments(transform, data, how, quantity)
        if sums is None:
            sums = _second_moments(
                transform, fun, settings, found, data, how, redo=redo
            )
        out = []
        for f, b, s in zip(found, bases, sums):
            if b is not None:
                out.append(EigenKronecker(*b, s, axes=f.axes, bias=f.bias))
            else:
                out.append(s if isinstance(f, Kronecker) or s is not None else f)
        floats = FloatLeaves(args, diff)
        return floats.trees(_split(out, floats), transform.args.single)

    return transform.public(call, fun)


def _split(flat: list, floats: FloatLeaves) -> list:
    """`flat` (one entry per differentiated leaf) as `floats.diff` is split."""
    it = iter(flat)
    return [[next(it) for _ in part] for part in floats.diff]


def _second_moments(transform, fun, settings, found, data, how, *, redo) -> list:
    """Per differentiated leaf: the rotated squares summed over the examples and
    cotangents where `found` has rotatable factors, the squared gradients (the
    diagonal) where its factors' axes are unknown, else None."""
    args, kwargs, extra, bases = data
    diff, in_axes, known = how
    layouts = _layouts(found, redo)
    n, m = len(args), len(extra)

    def example(*inputs: Any, **kw: Any) -> Any:
        floats = FloatLeaves(inputs[:n], diff)
        model = lambda d: fun(*floats.args_with(d), **kw)  # noqa: E731
        f, pull = jax.vjp(model, floats.diff)
        check_model_output(transform.name, f)
        vectors = settings.vectors(f, inputs[n : n + m]).astype(f.dtype)
        grads = [g for part in jax.vmap(pull)(vectors)[0] for g in part]
        bases = inputs[n + m]
        return [
            None if m is False else _rotated_squares(m, bases[k], grads, k)
            for k, m in enumerate(layouts)
        ]

    axes = (*in_axes, *settings.extra_axes(), None)
    total = Fold(jnp.add, lambda out: jax.tree.map(lambda x: jnp.sum(x, 0), out))
    return transform.map(
        example, (*args, *extra, bases), kwargs, axes, 0, known=known,
        accumulator=compose(total),
    )  # fmt: skip


def _rotated_squares(layout: Any, basis: Any, grads: Any, k: int) -> Any:
    """One example's `sum_m (Q_in^T G_m Q_out)^2` of leaf `k` from its gradients
    per cotangent (`grads`, by leaf; `layout` its factors' `(axes, bias)`), or
    `sum_m G_m^2` where `basis` is None."""
    if basis is None:  # (axes unknown: the diagonal)
        return jnp.sum(jnp.square(f32(grads[k])), 0)
    axes, bias = layout
    bias = None if bias is None else f32(grads[bias])
    g = _laid_out(f32(grads[k]), axes, 1, bias)
    return jnp.sum(jnp.square(_rotated(g, *basis)), 0)


def _layouts(found: list, diagonals: bool = False) -> tuple:
    """Per leaf: its factors' `(axes, bias)` where rotated, True where its
    factors' axes are unknown or (`diagonals`) its factors are a diagonal (its
    diagonal is summed), else False (static: a program's key holds them, never
    the factors' arrays)."""
    return tuple(
        (f.axes, f.bias)
        if _rotatable(f)
        else isinstance(f, Kronecker) or (diagonals and f is not None)
        for f in found
    )


class _GhostMoments(Quantity):
    """EK-FAC's second pass from the examples' ghost records: each example
    evaluated once and its record pulled back per cotangent (`Plan.pullback`),
    the rotated weights' gradients (and their joined biases') formed from their
    uses, rotated and squared."""

    def made_with(self) -> tuple:
        return (self.settings, self.meta)

    def __init__(self, traced: ghost.Traced, settings: Curvature, meta: tuple):
        self.traced, self.settings, self.meta = traced, settings, meta
        self.per_example = traced.plan.with_rule(ghost.PER_EXAMPLE)

    def evaluate(self, traced: ghost.Traced, values: list, *extra: Any) -> Any:
        *extra, bases = extra
        plan, records, deltas, pe = pulled(
            "ekfac_factors", traced, values, self.per_example, self.settings, extra
        )
        # rotated from the records: a leaf whose every use is a product's form
        # (its activations and output gradients rotated, then contracted)
        by_records = {
            k
            for k, m in enumerate(self.meta)
            if isinstance(m, tuple) and _from_records(plan.leaves[k], m, bases[k])
        }
        needed = {k for k, m in enumerate(self.meta) if m is not False} - by_records
        needed |= {
            m[1]
            for k, m in enumerate(self.meta)
            if isinstance(m, tuple) and m[1] is not None and k not in by_records
        }
        grads = {k: formed(plan, k, records, deltas, pe) for k in needed}
        return [
            None
            if m is False
            else _record_operands(plan.leaves[k], m, bases[k], records, deltas)
            if k in by_records
            else _rotated_squares(m, bases[k], grads, k)
            for k, m in enumerate(self.meta)
        ]

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        return [
            None if x is None
            else _summed_squares(x) if isinstance(x, tuple)
            else jnp.sum(x, 0)
            for x in kept
        ], ()  # fmt: skip


def _from_records(leaf: Any, layout: tuple, basis: tuple) -> bool:
    """Whether a leaf's rotated gradient is made from its records: every use a
    product's form whose activations and output gradients have the same
    positions, or (an embedding, its input basis the identity) a lookup of the
    leaf's rows."""
    (blocks, ins, _), _ = layout
    for u in leaf.uses:
        if isinstance(u.form, RowsForm):
            if blocks or basis[0] is not None or ins != (u.form.row,):
                return False
        elif not isinstance(u.form, EinsumForm):
            return False
        else:
            pos_a, pos_d = _positions(u, layout)
            if len(pos_a) != len(pos_d) or any(p not in pos_d for p in pos_a):
                return False
    return True


def _positions(u: Any, layout: tuple) -> tuple[list, list]:
    """A product use's positions: the symbols of its activations' and of its
    output gradients' specs that are none of the leaf's axes."""
    (blocks, ins, outs), _ = layout
    leaf_a = [LeafAxis(a) for a in (*blocks, *ins)]
    leaf_d = [LeafAxis(a) for a in (*blocks, *outs)]
    spec_a, spec_d = u.form.specs[0], u.form.specs[1]
    return (
        [s for s in spec_a if s not in leaf_a],
        [s for s in spec_d if s not in leaf_d],
    )


def _record_operands(leaf: Any, layout: tuple, basis: tuple, records, deltas) -> tuple:
    """One example's rotated gradient of a leaf made from its records
    (`_from_records`), as the pair `(a, d)` whose product over the positions is
    that gradient: `a` the uses' activations rotated into the input basis,
    `(*blocks, P, n_in)` (a joined bias's activation 1 its last input; a
    lookup's the rows it reads), `d` their output gradients rotated into the
    output basis, `(cotangents, *blocks, P, n_out)`, the uses' positions one axis
    `P`; their squares are summed over a chunk's examples by `squared_products`.
    (Never the gradient in the leaf's own basis: `T (n_in^2 + n_out^2)` per use
    rather than `n_in n_out (n_in + n_out)`.)"""
    (blocks, ins, outs), bias = layout
    q_in, q_out = basis
    shape = leaf.shape
    b_sym, i_sym, o_sym = ([LeafAxis(a) for a in g] for g in (blocks, ins, outs))
    cot, i2, o2 = Mark("cotangent"), Mark("in'"), Mark("out'")
    lead = [shape[a] for a in blocks]
    q_d = f32(q_out).reshape(*lead, *[shape[a] for a in outs], q_out.shape[-1])
    if q_in is not None:
        q_a = q_in[..., :-1, :] if bias is not None else q_in
        q_a = f32(q_a).reshape(*lead, *[shape[a] for a in ins], q_a.shape[-1])
    pairs = []
    for u in leaf.uses:
        if isinstance(u.form, RowsForm):  # (an embedding: its rows, unrotated)
            pairs.append(_rows_operands(u, q_d, o_sym, records, deltas))
            continue
        acts, outs_ = use_arrays(u, records, deltas)
        spec_a, spec_d = tuple(u.form.specs[0]), (cot, *u.form.specs[1])
        pos_a, _ = _positions(u, layout)  # (the output gradients' too)
        out_a, out_d = (*b_sym, *pos_a, i2), (cot, *b_sym, *pos_a, o2)
        a = jnp.einsum(
            _equation([spec_a, (*b_sym, *i_sym, i2)], out_a), f32(acts[0]), q_a
        )
        if bias is not None:  # the bias's activation: 1 at every position
            row = f32(q_in[..., -1, :])
            a = a + row.reshape(*lead, *([1] * len(pos_a)), row.shape[-1])
        d = jnp.einsum(
            _equation([spec_d, (*b_sym, *o_sym, o2)], out_d), f32(outs_[1]), q_d
        )
        positions = math.prod(a.shape[len(lead) : -1])
        a = regroup(a, (*lead, positions, a.shape[-1]))
        d = regroup(d, (d.shape[0], *lead, positions, d.shape[-1]))
        pairs.append((a, d))
    if len(pairs) == 1:
        return pairs[0]
    return (
        jnp.concatenate([a for a, _ in pairs], axis=-2),
        jnp.concatenate([d for _, d in pairs], axis=-2),
    )


def _rows_operands(u: Any, q_d: jax.Array, o_sym: list, records, deltas) -> tuple:
    """A lookup's pair: the rows each position reads (one-hot, none where it reads
    no row) and its output gradients rotated (`q_d`, over the leaf's output axes
    `o_sym`)."""
    acts, outs = use_arrays(u, records, deltas)
    rows, valid, delta = acts[0], acts[1], outs[2]
    cot, o2 = Mark("cotangent"), Mark("out'")
    spec_d = (cot, *u.form.specs[2])
    d = jnp.einsum(
        _equation([spec_d, (*o_sym, o2)], (cot, spec_d[1], o2)), f32(delta), q_d
    )
    size = u.form.leaf_sizes()[u.form.row_symbol]
    read = jax.nn.one_hot(rows, size, dtype=d.dtype)
    return jnp.where(valid[:, None], read, jnp.zeros((), d.dtype)), d


def _summed_squares(kept: Any) -> Any:
    """A chunk's sum over its examples (and cotangents) of the squares of its
    pairs' products (`squared_products`)."""
    a, d = kept  # (E, *blocks, P, n_in) and (E, C, *blocks, P, n_out)
    examples, cots, lead = d.shape[0], d.shape[1], d.shape[2:-2]
    layers = math.prod(lead)
    a = jnp.broadcast_to(a[:, None], (examples, cots, *a.shape[1:]))
    a = regroup(a, (examples * cots, layers, *a.shape[-2:]))
    d = regroup(d, (examples * cots, layers, *d.shape[-2:]))
    out = squared_products(jnp.swapaxes(a, 0, 1), jnp.swapaxes(d, 0, 1))
    return regroup(out, (*lead, *out.shape[-2:]))


def _quantity(transform, fun, settings, found, data, how, *, redo) -> _GhostMoments:
    """The call's `_GhostMoments` (its model traced, planned once)."""
    args, kwargs, _, _ = data
    diff, in_axes, _ = how
    traced = traced_model(
        transform, transform.name, fun, args, kwargs, diff, in_axes=in_axes
    )
    meta = _layouts(found, redo)
    return traced.memo(
        ("ekfac", settings, meta), lambda: _GhostMoments(traced, settings, meta)
    )


def _chosen(transform, fun, found, data, how, quantity, *, redo) -> ghost.Method:
    """The program a ghost call's second pass runs (`_choice.decided`): the
    model's, the ghost program where a leaf's rotated gradient is made from its
    records (`_from_records`), measured on an accelerator (the bases fixed)."""
    args, kwargs, extra, bases = data
    diff, in_axes, _ = how
    plan = quantity.traced.plan
    helped = any(
        isinstance(m, tuple) and _from_records(plan.leaves[k], m, bases[k])
        for k, m in enumerate(quantity.meta)
    )
    report = _choice.ruled_report(quantity.traced, helped, "rotated moments")
    n, settings = len(args), quantity.settings

    def program(twin: Any, runs: ghost.Method) -> Callable[..., Any]:
        def run(inputs: tuple, kw: dict) -> Any:  # (the bases an argument)
            mine = (inputs[:n], kw, list(inputs[n:-1]), inputs[-1])
            how = (diff, in_axes, None)
            if runs is ghost.Method.VMAP:
                return _second_moments(twin, fun, settings, found, mine, how, redo=redo)
            made = _quantity(twin, fun, settings, found, mine, how, redo=redo)
            return _ghost_moments(twin, mine, how, made)

        return run

    axes = (*in_axes, *settings.extra_axes(), None)
    call = ((*args, *extra, bases), kwargs, axes)
    size = _choice.examples(transform, args, in_axes, kwargs)
    return _choice.decided(
        transform, fun, report, quantity, program, call=call, size=size
    )


def _ghost_moments(transform, data, how, quantity: _GhostMoments) -> list:
    """`_second_moments` by the model's ghost records (`quantity`)."""
    args, kwargs, extra, bases = data
    _, in_axes, known = how
    traced = quantity.traced
    sums, _ = over_chunks(
        transform, traced, quantity, args, in_axes, kwargs, known=known,
        extra=[*extra, bases], extra_axes=[*quantity.settings.extra_axes(), None],
    )  # fmt: skip
    return sums


def multiply_inverse(factors: Any, grads: Any, *, damping: float) -> Any:
    """`(F + damping I)^-1 g` for each leaf's block `F` of the curvature given by
    `factors` (`ekfac_factors`' or `kfac_factors`' result, or diagonals, a tree
    like `grads`) and gradients `grads` (a tree like the differentiated
    arguments, each leaf one gradient): the influence preconditioner.

    An `EigenKronecker` block is inverted in its eigenbasis, a `Kronecker` block
    `kron(A, G) / count` in the eigenbases of its factors (exactly, with the
    products of their eigenvalues), a diagonal entrywise. A bias joined to its
    weight (its entry of `factors` None) is solved with that weight's block.

    Args:
      factors: per leaf an `EigenKronecker`, a `Kronecker`, a diagonal (an array
        of the leaf's shape) or None (a bias joined to its weight).
      grads: one gradient, a tree like the differentiated arguments (for many,
        `jax.vmap` this function over them).
      damping: `lambda >= 0`, added to every eigenvalue (or diagonal entry); a
        traced float scalar is taken as it is (under `jax.jit` or `jax.grad`).

    Returns:
      A tree like `grads`: each leaf's `(F + damping I)^-1 g`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import multiply_inverse
      >>> multiply_inverse(jnp.array([1.0, 3.0]), jnp.array([2.0, 2.0]), damping=1.0)
      Array([1. , 0.5], dtype=float32)
    """
    if isinstance(damping, jax.core.Tracer):  # (traced: a scalar, not checked)
        if jnp.shape(damping) != () or not jnp.issubdtype(damping.dtype, jnp.floating):
            raise TypeError(
                f"multiply_inverse damping must be a float scalar, but got a traced "
                f"array of shape {jnp.shape(damping)} and dtype {damping.dtype}."
            )
    else:
        damping = _nonnegative(damping)
    f_flat, f_tree = jax.tree.flatten(factors, is_leaf=_is_factor)
    g_flat, g_tree = jax.tree.flatten(grads, is_leaf=lambda x: x is None)
    if len(f_flat) != len(g_flat):
        raise ValueError(
            f"multiply_inverse factors must have one entry per leaf of grads "
            f"({len(g_flat)}), but has {len(f_flat)}: {f_tree} against {g_tree}."
        )
    # a factor's `bias` counts the differentiated leaves (those grads holds)
    held = [k for k, g in enumerate(g_flat) if g is not None]
    out = list(g_flat)
    for k, (f, g) in enumerate(zip(f_flat, g_flat)):
        if f is None or g is None:
            continue  # (a joined bias: solved with its weight)
        if not isinstance(f, (Kronecker, EigenKronecker)):
            if jnp.shape(f) != jnp.shape(g):
                raise ValueError(
                    f"multiply_inverse factors leaf {k} has shape {jnp.shape(f)}, "
                    f"but grads leaf {k} has shape {jnp.shape(g)}."
                )
            out[k] = g / (f.astype(g.dtype) + damping)
            continue
        b = None if f.bias is None else held[f.bias]
        solved = _solve_block(f, g, None if b is None else g_flat[b], damping)
        out[k] = solved[0]
        if b is not None:
            out[b] = solved[1]
    return jax.tree.unflatten(g_tree, out)


def _nonnegative(damping: Any) -> float:
    try:  # (a number, or an array of one)
        value = math.nan if isinstance(damping, (bool, str)) else float(damping)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"multiply_inverse damping must be a finite number >= 0, but got "
            f"damping={damping!r}."
        )
    return value


def _eigen(f: Kronecker | EigenKronecker) -> tuple:
    """`(Q_in, Q_out, eigenvalues)` of a block."""
    if isinstance(f, EigenKronecker):
        return f.input_basis, f.output_basis, f.eigenvalues
    if f.axes is None:
        raise ValueError(
            "multiply_inverse needs each Kronecker block's axes, but one has "
            "axes=None (its uses split a leaf axis)."
        )
    in_vals, q_in, out_vals, q_out = _eigh(f)
    return q_in, q_out, in_vals[..., :, None] * out_vals[..., None, :] / f.count


def _solve_block(f: Any, g: jax.Array, bias: Any, damping: float) -> tuple:
    q_in, q_out, values = _eigen(f)
    laid = _laid_out(f32(g), f.axes, 0, None if bias is None else f32(bias))
    r = _rotated(laid, q_in, q_out) / (values + damping)
    if q_in is not None:
        r = jnp.einsum("...ij,...jk->...ik", q_in, r)
    r = jnp.einsum("...jk,...lk->...jl", r, q_out)
    solved_bias = None
    if bias is not None:
        r, last = r[..., :-1, :], r[..., -1, :]
        solved_bias = last.reshape(bias.shape).astype(bias.dtype)
    return _unlaid(r, f.axes, g.shape).astype(g.dtype), solved_bias


def _unlaid(r: jax.Array, axes: tuple, shape: tuple) -> jax.Array:
    """`_laid_out`'s inverse for one gradient of the leaf's `shape`."""
    blocks, ins, outs = axes
    order = (*blocks, *ins, *outs)
    r = r.reshape(tuple(shape[a] for a in order))
    return jnp.transpose(r, [order.index(a) for a in range(len(shape))])
