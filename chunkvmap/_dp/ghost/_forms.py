"""Ghost forms: a use's per-example gradient as an einsum of arrays or as rows,
without forming it; the cross term of two forms (`pair`, `pair_term`); and the
masking of non-finite entries through the forms' arrays (`sanitize`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import opt_einsum

from ._chains import _boxes_disjoint
from ._context import explicit_spec


Symbol = tuple  # ("leaf", j) | ("leaf", j, part) | ("private", n)


class _Fresh:
    def __init__(self) -> None:
        self.n = itertools.count()

    def __call__(self) -> Symbol:
        return ("private", next(self.n))


@dataclasses.dataclass
class Form:
    """A use's gradient without forming it.

    `kind == "einsum"`: `G = einsum(*arrays -> leaf symbols)` with `specs` the
    operands' symbols; `kind == "rows"`: `G = scatter_add(rows, delta)` along leaf
    axis `row` (arrays: `(rows, valid, delta)`; `specs[2]` the cotangent's symbols,
    positions first). `build(recorded, delta)` makes the arrays of one example;
    `shapes` are their static shapes; `leaf_symbols` is the view the gradient has
    (pairs need equal views); `box` the leaf entries it covers."""

    kind: str
    specs: list[tuple[Symbol, ...]]
    shapes: list[tuple[int, ...]]
    build: Callable[[Sequence[Any], Any], list[Any]]
    leaf_symbols: frozenset
    box: tuple
    row: int | None = None
    build_cost: float = 0.0
    # every leaf axis is named, in full (so `gradient` can form G in the leaf's
    # layout, and non-finite entries can be masked: `sanitize`)
    complete: bool = False
    direct: bool = False  # `gradient` forms G (else the primitive's transpose does)

    def gradient(
        self, arrays: Sequence[Any], shape: Sequence[int], batched: bool, spec: Any
    ):
        """`G` from the einsum form's arrays (summed over a leading axis of examples
        when `batched`), in the leaf's layout: every leaf axis present, in full."""
        if self.kind == "rows":
            return self._rows_gradient(arrays, shape, batched, spec)
        out: list[Symbol] = []
        out_spec: list[Any] = []
        for j in range(len(shape)):
            parts = sorted(s for s in self.leaf_symbols if s[1] == j)
            out += parts  # ("leaf", j) or its (group, within) split, in that order
            entry = spec[j] if spec is not None and j < len(spec) else None
            out_spec += [entry] if len(parts) == 1 else [None] * len(parts)
        specs = [(("example",), *sp) if batched else sp for sp in self.specs]
        g = jnp.einsum(
            _equation(specs, out),
            *arrays,
            optimize="optimal",
            out_sharding=explicit_spec(out_spec),
        )
        return g.reshape(shape)

    def _rows_gradient(self, arrays, shape, batched, spec):
        rows, valid, delta = arrays
        if batched:  # the chunk's examples' positions, all together
            rows, valid = rows.reshape(-1), valid.reshape(-1)
            delta = delta.reshape((-1, *delta.shape[2:]))
        offsets = self.specs[2][1:]
        private = tuple(1 + i for i, s in enumerate(offsets) if s[0] != "leaf")
        mask = valid.reshape(valid.shape + (1,) * (delta.ndim - 1))
        d = jnp.where(mask, delta, jnp.zeros((), delta.dtype)).sum(private)
        named = [("leaf", self.row), *(s for s in offsets if s[0] == "leaf")]
        g = jnp.zeros((shape[self.row], *d.shape[1:]), d.dtype).at[rows].add(d)
        g = g.transpose([named.index(("leaf", j)) for j in range(len(shape))])
        want = explicit_spec(spec or ())
        return g if want is None else jax.sharding.reshard(g, want)

    def inst_cost(self) -> float:
        """Floating-point operations to instantiate `G` (one example)."""
        if self.kind == "rows":
            return float(math.prod(self.shapes[2]))
        out = sorted(self.leaf_symbols)
        return _einsum_cost(self.specs, self.shapes, tuple(out))


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
        max([s[1] + 1 for s in taken if s[0] == "private"], default=0)
    )
    table: dict = {}
    out = []
    for spec in specs:
        renamed = []
        for s in spec:
            if s[0] == "private":
                if s not in table:
                    table[s] = ("private", next(counter))
                renamed.append(table[s])
            else:
                renamed.append(s)
        out.append(tuple(renamed))
    return out


def _all_symbols(specs) -> set:
    return {s for spec in specs for s in spec}


def _row_symbol(form: Form) -> Symbol:
    return ("leaf", form.row)


# -- pairs -----------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    """How `<G_u, G_v>` is computed: "zero" (disjoint entries), "einsum", "rows",
    "rows-einsum", or None (no ghost cross term: the leaf is instantiated)."""

    kind: str | None
    cost: float = 0.0


def pair(u: Form, v: Form) -> Pair:
    """The ghost cross term of two forms of one leaf, and its cost."""
    if any(_boxes_disjoint(a, b) for a, b in zip(u.box, v.box)):
        return Pair("zero")
    if u.box != v.box or u.leaf_symbols != v.leaf_symbols:
        return Pair(None)
    if _leaf_sizes(u) != _leaf_sizes(v):  # e.g. one kernel, two group counts
        return Pair(None)
    if u.kind == "einsum" and v.kind == "einsum":
        vs = _rename(v.specs, _all_symbols(u.specs))
        return Pair("einsum", _einsum_cost([*u.specs, *vs], [*u.shapes, *v.shapes]))
    if u.kind == "rows" and v.kind == "rows":
        if u.row != v.row:
            return Pair(None)
        p, q = u.shapes[2][0], v.shapes[2][0]
        return Pair("rows", float(p * q * (math.prod(u.shapes[2][1:]) + 2)))
    rows, dense = (u, v) if u.kind == "rows" else (v, u)
    if _row_symbol(rows) not in dense.leaf_symbols:
        return Pair(None)
    specs, shapes = _gathered(dense, rows)
    return Pair("rows-einsum", _einsum_cost(specs, shapes))


def _leaf_sizes(form: Form) -> dict:
    """The size of each leaf symbol of a form (the row symbol of a row form: its
    rows, which its own arrays do not carry)."""
    sizes = {}
    for spec, shape in zip(form.specs, form.shapes):
        for sym, n in zip(spec, shape):
            if sym[0] == "leaf":
                sizes[sym] = n
    if form.kind == "rows":
        sizes[_row_symbol(form)] = form.box[form.row][1]
    return sizes


def _gathered(dense: Form, rows: Form) -> tuple[list, list]:
    """The einsum `<G_rows, G_dense>`: the dense form's operands that carry the row
    symbol taken at the rows' positions, with the rows' cotangent."""
    row = _row_symbol(rows)
    position = ("position",)
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


def pair_term(kind: str, u: Form, au: list, v: Form, av: list, acc: Any) -> Any:
    """`<G_u, G_v>` of one example from the forms' arrays, in dtype `acc`."""
    if kind == "zero":
        return jnp.zeros((), acc)
    if kind == "einsum":
        vs = _rename(v.specs, _all_symbols(u.specs))
        ops = [x.astype(acc) for x in (*au, *av)]
        return jnp.einsum(
            _equation([*u.specs, *vs]),
            *ops,
            optimize="optimal",
            out_sharding=explicit_spec(),
        )
    if kind == "rows":
        (ru, mu, du), (rv, mv, dv) = au, av
        gram = _rows_gram(u, du, v, dv, acc)
        same = (ru[:, None] == rv[None, :]) & mu[:, None] & mv[None, :]
        return jnp.sum(jnp.where(same, gram, 0))
    rows, ar, dense, ad = (u, au, v, av) if u.kind == "rows" else (v, av, u, au)
    r, valid, delta = ar
    specs, _ = _gathered(dense, rows)
    row = _row_symbol(rows)
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


def _rows_gram(u: Form, du: Any, v: Form, dv: Any, acc: Any) -> Any:
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
    forms' arrays (`sanitize`): complete einsum forms in which every array's leaf
    axes are also carried together by some array of every form, or complete row
    forms with the same offsets."""
    if not forms or not all(f.complete for f in forms):
        return False
    if all(f.kind == "rows" for f in forms):
        offsets = {tuple(s for s in f.specs[2][1:] if s[0] == "leaf") for f in forms}
        return len(offsets) == 1
    if not all(f.kind == "einsum" for f in forms):
        return False
    cylinders = [{s for s in spec if s[0] == "leaf"} for f in forms for spec in f.specs]
    return all(
        any(c <= set(spec) for spec in f.specs) for c in cylinders for f in forms
    )


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
    if forms[0].kind == "rows":
        return _sanitize_rows(forms, arrays)
    cylinders = []
    for f, arrs in zip(forms, arrays):
        for spec, x in zip(f.specs, arrs):
            keep = [i for i, s in enumerate(spec) if s[0] == "leaf"]
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
        private = tuple(1 + i for i, s in enumerate(offsets) if s[0] != "leaf")
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
        leaf_offsets = [s for s in offsets if s[0] == "leaf"]
        hit = _on_spec(hit, [("position",), *leaf_offsets], f.specs[2])
        gone = hit | ~valid.reshape(valid.shape + (1,) * (delta.ndim - 1))
        out.append([rows, valid, jnp.where(gone, jnp.zeros((), delta.dtype), delta)])
    return out
