"""Ghost forms: a use's per-example gradient as an einsum of arrays or as rows,
without forming it (`EinsumForm`, `RowsForm`); the cross term of two forms, from a
table keyed by their types (`PAIRS`, `pair`); and the
masking of non-finite entries through the forms' arrays (`sanitize`)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum

from ._chains import _boxes_disjoint
from ._context import explicit_spec


class Part(enum.IntEnum):
    """A leaf axis whole, or one factor of its split (a grouped convolution's
    output features: the group, then the feature within it)."""

    WHOLE = 0
    GROUP = 1
    WITHIN = 2


@dataclasses.dataclass(frozen=True, order=True)
class LeafAxis:
    """The symbol of leaf axis `axis` (or of its `part`)."""

    axis: int
    part: Part = Part.WHOLE


@dataclasses.dataclass(frozen=True)
class Private:
    """A symbol of the use's own (summed over when two forms meet), number `n`."""

    n: int


@dataclasses.dataclass(frozen=True)
class Mark:
    """A symbol added where forms are evaluated: the chunk's examples, or a
    lookup's positions."""

    name: str


Symbol = LeafAxis | Private | Mark
EXAMPLE, POSITION = Mark("example"), Mark("position")


class _Fresh:
    def __init__(self) -> None:
        self.n = itertools.count()

    def __call__(self) -> Symbol:
        return Private(next(self.n))


@dataclasses.dataclass
class Form:
    """A use's gradient without forming it: the arrays `build(recorded, delta)`
    makes from one example's recorded operands and cotangent, of static `shapes`
    and axis symbols `specs`. `leaf_symbols` is the view of the leaf the gradient
    has (two forms pair only on equal views) and `box` the leaf entries it covers.
    The kinds are `EinsumForm` and `RowsForm`; two forms meet through `PAIRS`."""

    specs: list[tuple[Symbol, ...]]
    shapes: list[tuple[int, ...]]
    build: Callable[[Sequence[Any], Any], list[Any]]
    leaf_symbols: frozenset
    box: tuple
    build_cost: float = 0.0
    # every leaf axis is named, in full (so `gradient` can form G in the leaf's
    # layout, and non-finite entries can be masked: `sanitize`)
    complete: bool = False
    direct: bool = False  # `gradient` forms G (else the primitive's transpose does)
    # G, its norm and its masked arrays from the use's recorded operands and
    # cotangent, without the arrays (a convolution's, without its patches:
    # `_rules.Windows`)
    windows: Any = None

    def gradient(
        self, arrays: Sequence[Any], shape: Sequence[int], batched: bool, spec: Any
    ) -> Any:
        """`G` from the form's arrays (summed over a leading axis of examples when
        `batched`), in the leaf's layout: needs a `complete` form."""
        raise NotImplementedError

    def inst_cost(self) -> float:
        """Floating-point operations to instantiate `G` (one example)."""
        raise NotImplementedError

    def leaf_sizes(self) -> dict:
        """The size of each leaf symbol the form names."""
        sizes = {}
        for spec, shape in zip(self.specs, self.shapes):
            for sym, n in zip(spec, shape):
                if isinstance(sym, LeafAxis):
                    sizes[sym] = n
        return sizes

    @classmethod
    def maskable(cls, forms: Sequence[Form]) -> bool:
        """Whether `sanitize` can zero the non-finite entries of `sum_u G_u`
        through these forms' arrays (all of this type and complete)."""
        return False

    @classmethod
    def sanitize(cls, forms: Sequence[Form], arrays: Sequence[list]) -> list[list]:
        raise NotImplementedError


@dataclasses.dataclass
class EinsumForm(Form):
    """`G = einsum(*arrays -> leaf symbols)`, with `specs` the operands' symbols
    (contractions, convolutions as patches)."""

    def gradient(self, arrays, shape, batched, spec):
        out: list[Symbol] = []
        out_spec: list[Any] = []
        for j in range(len(shape)):
            parts = sorted(s for s in self.leaf_symbols if s.axis == j)
            out += parts  # axis j whole, or its (group, within) split, in that order
            entry = spec[j] if spec is not None and j < len(spec) else None
            out_spec += [entry] if len(parts) == 1 else [None] * len(parts)
        specs = [(EXAMPLE, *sp) if batched else sp for sp in self.specs]
        g = jnp.einsum(
            _equation(specs, out),
            *_common_type(arrays),
            optimize="optimal",
            out_sharding=explicit_spec(out_spec),
        )
        return g.reshape(shape)

    def inst_cost(self) -> float:
        return _einsum_cost(self.specs, self.shapes, tuple(sorted(self.leaf_symbols)))

    @classmethod
    def maskable(cls, forms):
        """Every array's leaf axes are also carried together by some array of
        every form."""
        cylinders = [
            {s for s in spec if isinstance(s, LeafAxis)}
            for f in forms
            for spec in f.specs
        ]
        return all(
            any(c <= set(spec) for spec in f.specs) for c in cylinders for f in forms
        )

    @classmethod
    def sanitize(cls, forms, arrays):
        return _sanitize_einsum(forms, arrays)


@dataclasses.dataclass
class RowsForm(Form):
    """`G = scatter_add(rows, delta)` along leaf axis `row` (embedding lookups):
    arrays `(rows, valid, delta)`, `specs[2]` the cotangent's symbols, positions
    first."""

    row: int = 0

    def gradient(self, arrays, shape, batched, spec):
        rows, valid, delta = arrays
        if batched:  # the chunk's examples' positions, all together
            rows, valid = rows.reshape(-1), valid.reshape(-1)
            delta = delta.reshape((-1, *delta.shape[2:]))
        offsets = self.specs[2][1:]
        private = tuple(
            1 + i for i, s in enumerate(offsets) if not isinstance(s, LeafAxis)
        )
        mask = valid.reshape(valid.shape + (1,) * (delta.ndim - 1))
        d = jnp.where(mask, delta, jnp.zeros((), delta.dtype)).sum(private)
        named = [LeafAxis(self.row), *(s for s in offsets if isinstance(s, LeafAxis))]
        g = jnp.zeros((shape[self.row], *d.shape[1:]), d.dtype).at[rows].add(d)
        g = g.transpose([named.index(LeafAxis(j)) for j in range(len(shape))])
        want = explicit_spec(spec or ())
        return g if want is None else jax.sharding.reshard(g, want)

    def inst_cost(self) -> float:
        return float(math.prod(self.shapes[2]))

    def leaf_sizes(self) -> dict:
        # the row symbol's size: the table's rows, which the arrays do not carry
        return {**super().leaf_sizes(), self.row_symbol: self.box[self.row][1]}

    @property
    def row_symbol(self) -> Symbol:
        return LeafAxis(self.row)

    @classmethod
    def maskable(cls, forms):
        """The same leaf offsets in every form."""
        offsets = {
            tuple(s for s in f.specs[2][1:] if isinstance(s, LeafAxis)) for f in forms
        }
        return len(offsets) == 1

    @classmethod
    def sanitize(cls, forms, arrays):
        return _sanitize_rows(forms, arrays)


def _letters(symbol_lists: Sequence[Sequence[Symbol]]) -> dict:
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    table: dict = {}
    for symbols in symbol_lists:
        for s in symbols:
            if s not in table:
                table[s] = next(letters)
    return table


def _equation(specs: Sequence[Sequence[Symbol]], out: Sequence[Symbol] = ()) -> str:
    table = _letters([*specs, out])
    ins = ",".join("".join(table[s] for s in spec) for spec in specs)
    return ins + "->" + "".join(table[s] for s in out)


def _einsum_cost(specs, shapes, out=()) -> float:
    eq = _equation(specs, out)
    _, info = opt_einsum.contract_path(eq, *shapes, shapes=True, optimize="optimal")
    return float(info.opt_cost)


def _rename(specs, taken: set) -> list[tuple[Symbol, ...]]:
    """`specs` with their private symbols renamed apart from `taken`."""
    counter = itertools.count(
        max([s.n + 1 for s in taken if isinstance(s, Private)], default=0)
    )
    table: dict = {}
    out = []
    for spec in specs:
        renamed = []
        for s in spec:
            if isinstance(s, Private):
                if s not in table:
                    table[s] = Private(next(counter))
                renamed.append(table[s])
            else:
                renamed.append(s)
        out.append(tuple(renamed))
    return out


def _all_symbols(specs) -> set:
    return {s for spec in specs for s in spec}


# -- pairs: the cross term <G_u, G_v> of two forms of one leaf, by their types --------


@dataclasses.dataclass(frozen=True)
class Pair:
    """How `<G_u, G_v>` of one example is computed from the two forms' arrays:
    `term(u, arrays_u, v, arrays_v, acc)`, at `cost` floating-point operations;
    `kind` names it ("zero" for disjoint entries, "einsum", "rows",
    "rows-einsum")."""

    kind: str
    cost: float
    term: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class PairRule:
    """The cross term of two form types: `cost(u, v)` (None: none exists for these
    two forms) and `term`, as in `Pair`."""

    kind: str
    cost: Callable[[Form, Form], float | None]
    term: Callable[..., Any]

    def swapped(self) -> PairRule:
        """The rule for the two types the other way round."""
        return PairRule(
            self.kind,
            lambda u, v: self.cost(v, u),
            lambda u, au, v, av, acc: self.term(v, av, u, au, acc),
        )


def pair(u: Form, v: Form) -> Pair | None:
    """The ghost cross term of two forms of one leaf (None: there is none, and the
    leaf is instantiated)."""
    if any(_boxes_disjoint(a, b) for a, b in zip(u.box, v.box)):
        return Pair("zero", 0.0, _zero_term)
    if u.box != v.box or u.leaf_symbols != v.leaf_symbols:
        return None
    if u.leaf_sizes() != v.leaf_sizes():  # e.g. one kernel, two group counts
        return None
    rule = PAIRS.get((type(u), type(v)))
    cost = None if rule is None else rule.cost(u, v)
    return None if cost is None else Pair(rule.kind, cost, rule.term)


def _zero_term(u: Form, au: list, v: Form, av: list, acc: Any) -> Any:
    return jnp.zeros((), acc)


def _einsum_cost_of(u: EinsumForm, v: EinsumForm) -> float:
    vs = _rename(v.specs, _all_symbols(u.specs))
    return _einsum_cost([*u.specs, *vs], [*u.shapes, *v.shapes])


def _einsum_term(u: EinsumForm, au: list, v: EinsumForm, av: list, acc: Any) -> Any:
    """`<G_u, G_v>`, each form split into its part centred over positions and its
    part at the positions' mean (`_centred`), so that a large component common to
    every position (an activation's mean, which a softmax's cotangent, summing to
    zero, cancels) does not cancel inside the sum: four exact einsums."""
    terms = []
    centred_u = _centred(u.specs, au, acc)
    # (centred once each: a form with itself, a norm, shares its centred arrays)
    centred_v = centred_u if (v is u and av is au) else _centred(v.specs, av, acc)
    for us, ua in centred_u:
        for vs, va in centred_v:
            vs = _rename(vs, _all_symbols(us))
            terms.append(
                jnp.einsum(
                    _equation([*us, *vs]),
                    *_common_type([*ua, *va]),  # (a bf16 record beside acc ones)
                    optimize="optimal",
                    preferred_element_type=acc,
                    out_sharding=explicit_spec(),
                )
            )
    return terms[0] if len(terms) == 1 else jnp.sum(jnp.stack(terms))


def _centred(specs: list, arrays: list, acc: Any) -> list[tuple[list, list]]:
    """A two-operand einsum form `G = sum_p B(a_p, d_p)` over its positions `p`
    (the private symbols both operands carry) as two forms of the same sum:
    `sum_p B(a_p - mean_p a, d_p)` and `B(mean_p a, sum_p d_p)` (exact, as `B` is
    bilinear), the means and sums in `acc`. A 16-bit float array (a bfloat16
    record) keeps its type in the first form, centred in `acc` and rounded back: its
    products are exact in `acc`, which the einsum accumulates in, and the records
    it reads stay half the size. Other forms come as they are."""
    kept = [_narrow(x.dtype, acc) for x in arrays]
    if len(specs) != 2:
        return [(list(specs), [x.astype(k) for x, k in zip(arrays, kept)])]
    (sa, sd), (a, d) = specs, arrays
    positions = [s for s in sa if isinstance(s, Private) and s in sd]
    if not positions:
        return [(list(specs), [x.astype(k) for x, k in zip(arrays, kept)])]
    ia = tuple(sa.index(s) for s in positions)
    idd = tuple(sd.index(s) for s in positions)
    wide = a.astype(acc)
    mean = jnp.mean(wide, ia, keepdims=True)
    rest = (
        tuple(s for s in sa if s not in positions),
        tuple(s for s in sd if s not in positions),
    )
    parts = [jnp.squeeze(mean, ia), jnp.sum(d.astype(acc), idd)]
    centred = (wide - mean).astype(kept[0])
    return [(list(specs), [centred, d.astype(kept[1])]), (list(rest), parts)]


def _common_type(arrays: Sequence[Any]) -> list[Any]:
    """`arrays` in the type they promote to (a bf16 activation meeting the f32
    cotangent of a product accumulated in f32), whatever the promotion mode."""
    types = {x.dtype for x in arrays}
    if len(types) < 2:
        return list(arrays)
    with jax.numpy_dtype_promotion("standard"):
        common = functools.reduce(jnp.promote_types, types)
    return [x.astype(common) for x in arrays]


def _narrow(dtype: Any, acc: Any) -> Any:
    """`dtype` where it is a 16-bit float type and `acc` a wider real one (whose
    products it is exact in), else `acc`."""
    dtype, acc = np.dtype(dtype), np.dtype(acc)
    if (
        jnp.issubdtype(dtype, jnp.floating)
        and jnp.issubdtype(acc, jnp.floating)
        and dtype.itemsize == 2 < acc.itemsize
    ):
        return dtype
    return acc


def _rows_cost(u: RowsForm, v: RowsForm) -> float | None:
    if u.row != v.row:
        return None
    p, q = u.shapes[2][0], v.shapes[2][0]
    return float(p * q * (math.prod(u.shapes[2][1:]) + 2))


def _rows_term(u: RowsForm, au: list, v: RowsForm, av: list, acc: Any) -> Any:
    (ru, mu, du), (rv, mv, dv) = au, av
    gram = _rows_gram(u, du, v, dv, acc)
    same = (ru[:, None] == rv[None, :]) & mu[:, None] & mv[None, :]
    return jnp.sum(jnp.where(same, gram, 0))


def _rows_dense_cost(rows: RowsForm, dense: EinsumForm) -> float | None:
    if rows.row_symbol not in dense.leaf_symbols:
        return None
    specs, shapes = _gathered(dense, rows)
    return _einsum_cost(specs, shapes)


def _rows_dense_term(
    rows: RowsForm, ar: list, dense: EinsumForm, ad: list, acc: Any
) -> Any:
    """A lookup table meeting a contraction (a tied output layer): the dense form's
    operands that carry the row symbol, gathered at the looked-up rows."""
    r, valid, delta = ar
    specs, _ = _gathered(dense, rows)
    row = rows.row_symbol
    ops = []
    for spec, x in zip(dense.specs, ad):
        if row in spec:
            x = jnp.take(x, r, axis=spec.index(row), mode="clip")
        ops.append(x.astype(acc))
    mask = valid.reshape(valid.shape + (1,) * (delta.ndim - 1))
    ops.append(jnp.where(mask, delta, 0).astype(acc))
    return jnp.einsum(
        _equation(specs), *ops, optimize="optimal", out_sharding=explicit_spec()
    )


_ROWS_DENSE = PairRule("rows-einsum", _rows_dense_cost, _rows_dense_term)
PAIRS: dict[tuple[type, type], PairRule] = {
    (EinsumForm, EinsumForm): PairRule("einsum", _einsum_cost_of, _einsum_term),
    (RowsForm, RowsForm): PairRule("rows", _rows_cost, _rows_term),
    (RowsForm, EinsumForm): _ROWS_DENSE,
    (EinsumForm, RowsForm): _ROWS_DENSE.swapped(),
}
"""The cross terms, keyed by the two forms' types: a new form type adds its rows
here (a missing pair makes the leaf instantiated, which is always exact)."""


def _gathered(dense: EinsumForm, rows: RowsForm) -> tuple[list, list]:
    """The einsum `<G_rows, G_dense>`: the dense form's operands that carry the row
    symbol taken at the rows' positions, with the rows' cotangent."""
    row, position = rows.row_symbol, POSITION
    specs, shapes = [], []
    for spec, shape in zip(dense.specs, dense.shapes):
        if row in spec:
            k = spec.index(row)
            spec = spec[:k] + (position,) + spec[k + 1 :]
            shape = shape[:k] + (rows.shapes[2][0],) + shape[k + 1 :]
        specs.append(spec)
        shapes.append(shape)
    (own,) = _rename([rows.specs[2]], _all_symbols(dense.specs))
    specs.append((position, *own[1:]))
    shapes.append(rows.shapes[2])
    return specs, shapes


def _rows_gram(u: RowsForm, du: Any, v: RowsForm, dv: Any, acc: Any) -> Any:
    """`<delta_u[t], delta_v[s]>` for all positions t, s (offsets contracted)."""
    su = u.specs[2]
    (sv,) = _rename([v.specs[2]], _all_symbols([su]))
    sv = (("other-position",), *sv[1:])
    eq = _equation([su, sv], (su[0], sv[0]))
    return jnp.einsum(
        eq, du.astype(acc), dv.astype(acc), out_sharding=explicit_spec((None, None))
    )


# -- non-finite entries --------------------------------------------------------------


def maskable(forms: Sequence[Form]) -> bool:
    """Whether the non-finite entries of `sum_u G_u` can be zeroed through the
    forms' arrays (`sanitize`): complete forms of one type that its rule allows."""
    if not forms or not all(f.complete for f in forms):
        return False
    kinds = {type(f) for f in forms}
    return len(kinds) == 1 and kinds.pop().maskable(forms)


def all_finite(tree: Any) -> jax.Array:
    """Whether every inexact entry of `tree` is finite."""
    ok = jnp.ones((), bool)
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def sanitize(forms: Sequence[Form], arrays: Sequence[list]) -> list[list]:
    """One example's arrays of a leaf's uses (`maskable` forms), with zeros where
    they make an entry of `G = sum_u G_u` non-finite: `G` from the result is the
    gradient with its non-finite entries replaced by 0 (`method="vmap"`'s
    `nan_safe`), and every array is finite.

    An einsum form's entry `G[e]` is a sum of products of one entry of each array at
    `e`'s coordinates; it is non-finite exactly when some array is non-finite at
    some entry with `e`'s coordinates along that array's leaf axes (a NaN or an
    infinity times anything is not finite). Those are "cylinders" over each array's
    leaf axes; zeroing every array at every cylinder over its own axes leaves the
    finite entries as they were and makes the others 0. Row forms: `G[r, o]` is not
    finite when a position looking up row `r` has a non-finite cotangent at `o`."""
    return type(forms[0]).sanitize(forms, arrays)


def _sanitize_einsum(forms: Sequence[Form], arrays: Sequence[list]) -> list[list]:
    cylinders = []
    for f, arrs in zip(forms, arrays):
        for spec, x in zip(f.specs, arrs):
            keep = [i for i, s in enumerate(spec) if isinstance(s, LeafAxis)]
            other = tuple(i for i in range(len(spec)) if i not in keep)
            bad = jnp.any(~jnp.isfinite(x), axis=other)
            cylinders.append((tuple(spec[i] for i in keep), bad))
    out = []
    for f, arrs in zip(forms, arrays):
        new = []
        for spec, x in zip(f.specs, arrs):
            mask = None
            for syms, bad in cylinders:
                if set(syms) <= set(spec):
                    m = _on_spec(bad, syms, spec)
                    mask = m if mask is None else mask | m
            new.append(
                x if mask is None else jnp.where(mask, jnp.zeros((), x.dtype), x)
            )
        out.append(new)
    return out


def _on_spec(values: Any, symbols: Sequence[Symbol], spec: Sequence[Symbol]) -> Any:
    """`values` (axes named by `symbols`) broadcastable against an array `spec`."""
    order = sorted(range(len(symbols)), key=lambda i: spec.index(symbols[i]))
    values = values.transpose(order) if len(order) > 1 else values
    sizes = iter(values.shape)
    named = set(symbols)
    return values.reshape([next(sizes) if s in named else 1 for s in spec])


def _sanitize_rows(forms: Sequence[Form], arrays: Sequence[list]) -> list[list]:
    bad = []
    for f, (rows, valid, delta) in zip(forms, arrays):
        offsets = f.specs[2][1:]
        private = tuple(
            1 + i for i, s in enumerate(offsets) if not isinstance(s, LeafAxis)
        )
        b = jnp.any(~jnp.isfinite(delta), axis=private)
        bad.append(b & valid.reshape(valid.shape + (1,) * (b.ndim - 1)))
    out = []
    for f, (rows, valid, delta) in zip(forms, arrays):
        hit = None
        for (rows_v, valid_v, _), bad_v in zip(arrays, bad):
            match = (rows[:, None] == rows_v[None, :]) & valid_v[None, :]
            h = jnp.einsum(
                "ts,s...->t...", match.astype(jnp.float32), bad_v.astype(jnp.float32)
            )
            hit = h > 0 if hit is None else hit | (h > 0)
        offsets = f.specs[2][1:]
        leaf_offsets = [s for s in offsets if isinstance(s, LeafAxis)]
        hit = _on_spec(hit, [POSITION, *leaf_offsets], f.specs[2])
        gone = hit | ~valid.reshape(valid.shape + (1,) * (delta.ndim - 1))
        out.append([rows, valid, jnp.where(gone, jnp.zeros((), delta.dtype), delta)])
    return out
