"""The rules of ghost clipping: how each kind of parameter use gives its per-example
gradient, its squared norm and its share of a chunk's clipped sum.

A *use* is one equation of the loss's jaxpr with an operand that is a differentiated
leaf reached through a *chain* of example-independent linear operations (transpose,
reshape, slicing, broadcasting, constant scaling, casts, sharding constraints, and the
per-iteration slice of a `scan` over a stacked leaf). Its per-example gradient is

    G_u = transpose(w -> use(chain(w), recorded operands))(delta_u)

where `delta_u` is the cotangent of the use's output and the recorded operands are what
the rule keeps from the forward pass (the activation of a product, the indices of a
lookup). Every rule gets this *instantiation* and the chunk's clipped sum (one
transpose of the use vmapped over the chunk's examples) from `jax.linear_transpose`,
so both are exact for any chain. Rules differ in their *ghost form*: the squared norm
`||sum_u G_u||^2 = sum_{u,v} <G_u, G_v>` from activations and cotangents without
forming `G`:

* contractions (`dot_general`) and convolutions (`conv_general_dilated`, unfolded
  into patches) are einsum forms, `G_u = einsum(a, delta)`, so `<G_u, G_v>` is one
  einsum of four operands (cost ~ positions^2);
* embedding lookups (`gather` of rows) are row forms, `G_u = scatter_add(rows,
  delta)`, so `<G_u, G_v> = sum_{t,s} [row_t = row_s] <delta_t, delta_s>`; a row form
  meets an einsum form (a tied output layer) by gathering the einsum operand that
  carries the rows;
* elementwise and other linear uses (biases, norm scales, position tables,
  concatenated tokens, ...) are instantiated: their gradient costs no more than the
  activation it comes from.

A leaf takes the ghost norm when every use has a ghost form, every pair of uses has a
ghost cross term, and that costs less than instantiating (the mixed rule, by
floating-point operations); otherwise it is instantiated. Both are exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum
from jax import lax

from .._core._conv import bind_params


# --------------------------------------------------------------------------------------
# Sharding parameters, bound in the current context.


def in_context(params: dict) -> dict:
    """`params` with every `NamedSharding` moved onto the current abstract mesh.

    A jaxpr traced outside a `shard_map` carries shardings on the mesh it was traced
    under; bound again inside one (where some axes are manual), JAX rejects them. The
    same specs on the context's mesh are what tracing there would have given."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return params
    out = dict(params)
    for key, value in params.items():
        mesh = getattr(value, "mesh", None)
        if (
            isinstance(value, jax.sharding.NamedSharding)
            and mesh is not None
            and mesh != context
            and tuple(mesh.axis_names) == tuple(context.axis_names)
        ):
            out[key] = jax.sharding.NamedSharding(context, value.spec)
    return out


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


def bind(prim: Any, operands: Sequence[Any], params: dict) -> Any:
    """`prim.bind(*operands, **params)` with `params` as bind takes them, in context."""
    subfuns, kw = bind_params(prim, params)
    return prim.bind(*subfuns, *operands, **in_context(kw))


# --------------------------------------------------------------------------------------
# Chains: example-independent linear operations between a leaf and its use.


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a chain: a primitive (output `index` of a multiple-result one), a
    constant `scale`, or `stack` (the iteration's slice of a scanned leaf)."""

    kind: str  # "prim" | "scale" | "stack"
    prim: Any = None
    params: Any = None
    index: int = 0
    scale: float = 1.0

    def apply(self, w: Any) -> Any:
        if self.kind == "scale":
            return w * jnp.asarray(self.scale, w.dtype)
        out = bind(self.prim, [w], self.params)
        return out[self.index] if self.prim.multiple_results else out


# Unary primitives that pass a value through unchanged (up to dtype or layout hints).
IDENTITY = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "reduce_precision",
    }
)
# Unary linear primitives that move, select or broadcast entries.
LAYOUT = frozenset(
    {"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice"}
)
MULTI = frozenset({"split"})


@dataclasses.dataclass(frozen=True)
class Axis:
    """An axis of a value made from a leaf: leaf axis `leaf` (None: a broadcast axis
    not from the leaf), of `size`."""

    leaf: int | None
    size: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a chain's output comes from in its leaf.

    `axes`: the output's axes; `box[j] = (start, size, stride)`: the entries of leaf
    axis j that the output reads (axes of box size 1 may be absent from `axes`);
    `stacked`: the axes consumed by scans over the leaf (outer first); `scale`: the
    product of the chain's constant factors."""

    axes: tuple[Axis, ...]
    box: tuple[tuple[int, int, int], ...]
    stacked: tuple[Axis, ...] = ()
    scale: float = 1.0

    def present(self) -> frozenset[int]:
        return frozenset(
            a.leaf for a in (*self.axes, *self.stacked) if a.leaf is not None
        )


def _boxes_disjoint(a: tuple, b: tuple) -> bool:
    """Whether two strided ranges `(start, size, stride)` share no index."""
    (s1, n1, d1), (s2, n2, d2) = a, b
    if n1 == 0 or n2 == 0:
        return True
    if s1 + (n1 - 1) * d1 < s2 or s2 + (n2 - 1) * d2 < s1:
        return True
    if n1 * n2 <= 4096:
        return not set(range(s1, s1 + n1 * d1, d1)) & set(range(s2, s2 + n2 * d2, d2))
    return False


def layout_of(chain: Sequence[Op], shape: Sequence[int]) -> Layout | None:
    """The layout of a chain's output in its leaf, or None when the chain mixes
    entries in a way an einsum cannot name (a reshape that merges or splits axes)."""
    axes = [Axis(j, n) for j, n in enumerate(shape)]
    box = [(0, n, 1) for n in shape]
    stacked: list[Axis] = []
    scale = 1.0
    for op in chain:
        if op.kind == "scale":
            scale *= op.scale
            continue
        if op.kind == "stack":
            stacked.append(axes.pop(0))
            continue
        name, p = op.prim.name, op.params
        if name in IDENTITY:
            continue
        if name == "transpose":
            axes = [axes[i] for i in p["permutation"]]
        elif name == "squeeze":
            dims = {d % len(axes) for d in p["dimensions"]}
            axes = [a for i, a in enumerate(axes) if i not in dims]
        elif name == "expand_dims":
            for d in sorted(p["dimensions"]):
                axes.insert(d, Axis(None, 1))
        elif name == "broadcast_in_dim":
            new = [Axis(None, n) for n in p["shape"]]
            for i, d in enumerate(p["broadcast_dimensions"]):
                if axes[i].size == p["shape"][d]:
                    new[d] = axes[i]
            axes = new
        elif name == "reshape":
            if p.get("dimensions") is not None:
                return None
            kept = [a for a in axes if a.size != 1]
            sizes = [n for n in p["new_sizes"] if n != 1]
            if [a.size for a in kept] != sizes:
                return None
            it = iter(kept)
            axes = [next(it) if n != 1 else Axis(None, 1) for n in p["new_sizes"]]
        elif name in ("slice", "split"):
            if name == "slice":
                starts, limits = p["start_indices"], p["limit_indices"]
                strides = p["strides"] or (1,) * len(axes)
            else:
                starts = [0] * len(axes)
                limits = [a.size for a in axes]
                strides = [1] * len(axes)
                axis = p["axis"]
                starts[axis] = int(sum(p["sizes"][: op.index]))
                limits[axis] = starts[axis] + int(p["sizes"][op.index])
            new = []
            for a, s, lim, st in zip(axes, starts, limits, strides):
                size = max(0, -(-(lim - s) // st))
                if a.leaf is not None:
                    b0, _, d0 = box[a.leaf]
                    box[a.leaf] = (b0 + d0 * s, size, d0 * st)
                new.append(Axis(a.leaf, size))
            axes = new
        else:
            return None
        # a leaf axis that left the output must be a single entry
        present = {a.leaf for a in (*axes, *stacked) if a.leaf is not None}
        for j in range(len(shape)):
            if j not in present and box[j][1] != 1:
                return None
    return Layout(tuple(axes), tuple(box), tuple(stacked), scale)


def chain_op(eqn: Any, position: int, index: int, consts: Sequence[Any]) -> Op | None:
    """The chain step that equation `eqn` applies to its operand `position` (the leaf
    side), or None when it is not one. `consts[i]` is the concrete value of operand i
    when it is an example-independent constant (else None)."""
    name = eqn.primitive.name
    if name in IDENTITY or name in LAYOUT or name in MULTI:
        if len(eqn.invars) != 1:
            return None
        if name == "convert_element_type" and not jnp.issubdtype(
            eqn.params["new_dtype"], jnp.floating
        ):  # (a cast to complex mixes real and imaginary parts into the use)
            return None
        return Op("prim", eqn.primitive, dict(eqn.params), index)
    if name == "neg":
        return Op("scale", scale=-1.0)
    if name in ("mul", "div") and len(eqn.invars) == 2:
        other = consts[1 - position]
        if other is None or np.ndim(other) != 0:
            return None
        value = float(np.asarray(other))
        if name == "mul":
            return Op("scale", scale=value)
        if position == 0 and value != 0:
            return Op("scale", scale=1.0 / value)
    return None


# --------------------------------------------------------------------------------------
# Uses and their replay.


@dataclasses.dataclass
class Use:
    """One use of a leaf: operand `slot` of equation `eqn` at `path`, reached through
    `chain`, inside scans `levels` (`(kind, length)`, outer first: "stack" when the
    leaf is read through the scan's xs, "repeat" when every iteration reads it)."""

    leaf: int
    path: tuple
    eqn: Any
    slot: int
    chain: tuple[Op, ...]
    levels: tuple[tuple[str, int], ...]
    rule: Rule
    record: tuple[int, ...]
    leaf_aval: Any
    leaf_spec: Any = None  # the leaf's PartitionSpec where its type has one
    layout: Layout | None = None
    form: Form | None = None

    @property
    def key(self) -> tuple:
        return (self.path, self.slot)

    def level_shape(self, skip: int = 0) -> tuple[int, ...]:
        """The lengths of the scans around the use, less the `skip` outermost."""
        return tuple(n for _, n in self.levels[skip:])

    def record_avals(self, skip: int = 0) -> list[jax.ShapeDtypeStruct]:
        """The recorded operands' types (with the scans' axes, less `skip`)."""
        lead = self.level_shape(skip)
        return [
            jax.ShapeDtypeStruct(lead + tuple(v.aval.shape), v.aval.dtype)
            for v in (self.eqn.invars[i] for i in self.record)
        ]

    def out_aval(self) -> jax.ShapeDtypeStruct:
        out = self.eqn.outvars[0].aval
        return jax.ShapeDtypeStruct(self.level_shape() + tuple(out.shape), out.dtype)

    def probe(self) -> Any:
        """A zero of the use's output type (its scans' axes leading), sharded like
        the output where the current mesh has Explicit axes."""
        out = self.eqn.outvars[0].aval
        spec = getattr(getattr(out, "sharding", None), "spec", None)
        spec = None if spec is None else (None,) * len(self.levels) + tuple(spec)
        aval = self.out_aval()
        return jnp.zeros(aval.shape, aval.dtype, out_sharding=explicit_spec(spec or ()))

    def forward(self, w: Any, recorded: Sequence[Any]) -> Any:
        """The use's output (with its levels' axes) as a linear function of the leaf
        `w`, at the recorded operands; the other floating-point operands (added,
        concatenated, ...) are zeros."""
        return self._nest(w, list(recorded), 0, 0)

    def _nest(self, w: Any, recorded: list, i: int, level: int) -> Any:
        while i < len(self.chain) and self.chain[i].kind != "stack":
            w = self.chain[i].apply(w)
            i += 1
        if level < len(self.levels):
            kind, length = self.levels[level]
            if kind == "repeat":
                return jax.vmap(
                    lambda r: self._nest(w, r, i, level + 1), axis_size=length
                )(recorded)
            return jax.vmap(
                lambda wl, r: self._nest(wl, r, i + 1, level + 1), axis_size=length
            )(w, recorded)
        operands: list[Any] = []
        it = iter(recorded)
        for k, v in enumerate(self.eqn.invars):
            if k == self.slot:
                operands.append(w)
            elif k in self.record:
                operands.append(self.rule.operand(k, next(it)))
            else:
                operands.append(jnp.zeros(v.aval.shape, v.aval.dtype))
        return bind(self.eqn.primitive, operands, self.eqn.params)

    def typed_leaf(self) -> jax.ShapeDtypeStruct:
        """The leaf's type, with its sharding where the current mesh has Explicit
        axes (so that its transposes come out sharded like the leaf)."""
        spec = explicit_spec(self.leaf_spec or ())
        if spec is None:
            return self.leaf_aval
        mesh = jax.sharding.get_abstract_mesh()
        return jax.ShapeDtypeStruct(
            self.leaf_aval.shape,
            self.leaf_aval.dtype,
            sharding=jax.sharding.NamedSharding(mesh, spec),
        )

    def instantiate(self, recorded: Sequence[Any], delta: Any) -> Any:
        """One example's gradient of the leaf through this use."""
        if self.form is not None and self.form.direct:
            arrays = self.form.build(recorded, delta)
            return self.form.gradient(
                arrays, self.leaf_aval.shape, False, self.leaf_spec
            ).astype(self.leaf_aval.dtype)
        fun = lambda w: self.forward(w, recorded)  # noqa: E731
        leaf = self.typed_leaf()
        (g,) = jax.linear_transpose(fun, leaf)(_typed_like(delta, fun, leaf))
        return g

    def chunk_sum(self, recorded: Sequence[Any], delta: Any) -> Any:
        """`sum_i G_i` over a chunk's stacked operands and (scaled) cotangents: one
        transpose of the use vmapped over the examples."""
        size = delta.shape[0]
        if self.form is not None and self.form.direct:
            arrays = jax.vmap(self.form.build)(recorded, delta)
            return self.form.gradient(
                arrays, self.leaf_aval.shape, True, self.leaf_spec
            ).astype(self.leaf_aval.dtype)

        def fun(w: Any) -> Any:
            return jax.vmap(lambda r: self.forward(w, r), axis_size=size)(recorded)

        leaf = self.typed_leaf()
        (g,) = jax.linear_transpose(fun, leaf)(_typed_like(delta, fun, leaf))
        return g


def _typed_like(delta: Any, fun: Callable[[Any], Any], leaf: Any) -> Any:
    """`delta` resharded to the type of `fun(leaf)` where their shardings differ (the
    chunks' stacking may drop an Explicit sharding of a cotangent)."""
    if explicit_spec() is None:
        return delta
    want = jax.eval_shape(fun, leaf).sharding
    have = jax.typeof(delta).sharding
    if getattr(have, "spec", None) == getattr(want, "spec", None):
        return delta
    return jax.sharding.reshard(delta, want.spec)


# --------------------------------------------------------------------------------------
# Ghost forms: a use's gradient as an einsum of arrays, or as rows.

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


# --------------------------------------------------------------------------------------
# Rules, registered by primitive.


class Rule:
    """How one primitive family uses a parameter operand.

    `linear`: the operands in which the primitive is linear jointly (add,
    concatenate, ...); `bilinear`: the operands of a product (one linear in the
    other). A leaf may be operand `slot` if that slot is linear or bilinear; the
    other bilinear operands and every non-float operand are recorded."""

    kind = "linear"
    linear: tuple[int, ...] | None = None  # None: every operand
    bilinear: tuple[int, ...] = ()

    def accepts(self, eqn: Any, slot: int, tainted: Sequence[bool]) -> str | None:
        """None when the rule covers the leaf at operand `slot`, else why not."""
        if slot in self.bilinear:
            return None
        if self.linear is None or slot in self.linear:
            return None
        return f"operand {slot} of {eqn.primitive.name} (not linear in it)"

    def record(self, eqn: Any, slot: int) -> tuple[int, ...]:
        out = []
        for k, v in enumerate(eqn.invars):
            if k == slot:
                continue
            float_ = jnp.issubdtype(v.aval.dtype, jnp.inexact)
            if not float_ or (slot in self.bilinear and k in self.bilinear):
                out.append(k)
            elif (
                not (self.linear is None or k in self.linear) and k not in self.bilinear
            ):
                out.append(k)
        return tuple(out)

    def form(self, use: Use) -> Form | None:
        return None

    def operand(self, k: int, recorded: Any) -> Any:
        """Recorded operand `k` as the replayed use binds it."""
        return recorded


class Elementwise(Rule):
    """`x + b`, `x - b`, `x * s`, `x / s`, `select(pred, x, b)`: biases, scales and
    position tables (instantiated: `sum_t delta_t`, `sum_t a_t * delta_t`)."""

    kind = "elementwise"

    def __init__(self, linear: tuple[int, ...] | None = None, bilinear=()):
        self.linear = linear
        self.bilinear = bilinear


class Dot(Rule):
    """`dot_general`: `G = einsum(activation, delta)`."""

    kind = "dense"
    linear = ()
    bilinear = (0, 1)

    def accepts(self, eqn, slot, tainted):
        if not tainted[1 - slot]:
            return "a dot_general whose other operand does not depend on the example"
        return None

    def form(self, use: Use) -> Form | None:
        layout = use.layout
        if layout is None:
            return None
        fresh = _Fresh()
        op_syms = [_axis_symbol(a, fresh) for a in layout.axes]
        lead = _level_symbols(use, layout, fresh)
        (lc, rc), (lb, rb) = use.eqn.params["dimension_numbers"]
        wc, ac = (lc, rc) if use.slot == 0 else (rc, lc)
        wb, ab = (lb, rb) if use.slot == 0 else (rb, lb)
        other = use.eqn.invars[1 - use.slot].aval
        act = []
        for m in range(other.ndim):
            if m in ac:
                act.append(op_syms[wc[list(ac).index(m)]])
            elif m in ab:
                act.append(op_syms[wb[list(ab).index(m)]])
            else:
                act.append(fresh())
        w_free = [
            op_syms[j] for j in range(len(op_syms)) if j not in wc and j not in wb
        ]
        a_free = [act[m] for m in range(other.ndim) if m not in ac and m not in ab]
        batch = [op_syms[j] for j in wb]
        out = batch + (w_free + a_free if use.slot == 0 else a_free + w_free)
        specs = [tuple(lead + act), tuple(lead + out)]
        levels = use.level_shape()
        shapes = [levels + tuple(other.shape), use.out_aval().shape]
        scale = layout.scale

        def build(recorded, delta):
            (a,) = recorded
            return [a if scale == 1.0 else a * jnp.asarray(scale, a.dtype), delta]

        return _einsum_form(specs, shapes, build, layout, use)


class Conv(Rule):
    """`conv_general_dilated` with the kernel as the parameter: unfolded into patches
    (`lax.conv_general_dilated_patches`), `G = einsum(patches, delta)`."""

    kind = "conv"
    linear = ()
    bilinear = (0, 1)

    def accepts(self, eqn, slot, tainted):
        if not tainted[1 - slot]:
            return "a convolution whose other operand does not depend on the example"
        return None

    def form(self, use: Use) -> Form | None:
        p = use.eqn.params
        layout = use.layout
        if layout is None or use.slot != 1 or p["batch_group_count"] != 1:
            return None
        dn = p["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        lhs = use.eqn.invars[0].aval
        kernel = use.eqn.invars[1].aval
        groups = p["feature_group_count"]
        fresh = _Fresh()
        k_syms = [_axis_symbol(a, fresh) for a in layout.axes]
        lead = _level_symbols(use, layout, fresh)
        n_spatial = len(rhs_spec) - 2
        window = tuple(kernel.shape[d] for d in rhs_spec[2:])
        c_in = lhs.shape[lhs_spec[1]]
        cg = c_in // groups
        o_sym = k_syms[rhs_spec[0]]
        out_aval = use.eqn.outvars[0].aval
        out_feat = out_aval.shape[out_spec[1]]
        batch = fresh()
        spatial = [fresh() for _ in range(n_spatial)]
        if groups > 1:
            if o_sym[0] != "leaf":
                return None
            g_sym, og_sym = o_sym + ("group",), o_sym + ("within",)
            grp: list[Symbol] = [g_sym]
            o_syms = [g_sym, og_sym]
            o_sizes = [groups, out_feat // groups]
        else:
            grp, o_syms, o_sizes = [], [o_sym], [out_feat]
        # patches as (levels..., n, out spatial..., [groups], c, window...)
        patch_spec = (
            lead
            + [batch]
            + spatial
            + grp
            + [k_syms[rhs_spec[1]]]
            + [k_syms[d] for d in rhs_spec[2:]]
        )
        delta_spec = lead + [batch] + spatial + o_syms
        levels = use.level_shape()
        out_spatial = tuple(out_aval.shape[d] for d in out_spec[2:])
        n = out_aval.shape[out_spec[0]]
        patch_shape = (
            levels
            + (n,)
            + out_spatial
            + ((groups,) if groups > 1 else ())
            + (cg,)
            + window
        )
        delta_shape = levels + (n,) + out_spatial + tuple(o_sizes)
        scale = layout.scale
        n_lead = len(levels)

        def patches(x):
            pt = _patches(
                x, window, out_spatial, p["window_strides"], p["padding"],
                p["lhs_dilation"], p["rhs_dilation"], lhs_spec,
            )  # fmt: skip
            return pt.reshape(patch_shape[n_lead:])

        def build(recorded, delta):
            (x,) = recorded
            f = patches
            for _ in range(n_lead):
                f = jax.vmap(f)
            pt = f(x)
            if scale != 1.0:
                pt = pt * jnp.asarray(scale, pt.dtype)
            perm = (
                *range(n_lead),
                *(n_lead + d for d in (out_spec[0], *out_spec[2:], out_spec[1])),
            )
            return [pt, delta.transpose(perm).reshape(delta_shape)]

        build_cost = float(math.prod(patch_shape))
        form = _einsum_form(
            [tuple(patch_spec), tuple(delta_spec)],
            [patch_shape, delta_shape],
            build,
            layout,
            use,
        )
        if form is not None:
            form.build_cost = build_cost
            # XLA:CPU runs a convolution's kernel gradient far slower inside a loop
            # (the chunks' scan) than a contraction of patches
            form.direct = form.complete
        return form


class Gather(Rule):
    """`gather` of rows of the parameter (`emb[tokens]`, `jnp.take`, `nn.Embed`,
    `eqx.nn.Embedding`): `G = scatter_add(rows, delta)`, ghost norm by matching
    rows."""

    kind = "embedding"
    linear = (0,)

    def record(self, eqn, slot):
        return (1,)

    def operand(self, k, recorded):
        # Narrow indices as int32 (the same values): XLA:CPU's scatter transposing a
        # lookup can mishandle indices whose dtype cannot count the table's rows
        # (uint8 ids into more than 256 rows).
        if k == 1 and jnp.dtype(recorded.dtype).itemsize < 4:
            return recorded.astype(jnp.int32)
        return recorded

    def form(self, use: Use) -> Form | None:
        layout = use.layout
        if layout is None or use.slot != 0 or layout.scale != 1.0:
            return None
        if any(kind == "stack" for kind, _ in use.levels):
            return None
        p = use.eqn.params
        dn = p["dimension_numbers"]
        operand = use.eqn.invars[0].aval
        indices = use.eqn.invars[1].aval
        if dn.operand_batching_dims or dn.start_indices_batching_dims:
            return None
        sizes = p["slice_sizes"]
        lookup = [d for d in range(operand.ndim) if sizes[d] != operand.shape[d]]
        if len(lookup) != 1 or sizes[lookup[0]] != 1:
            return None
        r = lookup[0]
        if r not in dn.start_index_map or layout.axes[r].leaf is None:
            return None
        component = list(dn.start_index_map).index(r)
        others = [k for k, d in enumerate(dn.start_index_map) if d != r]
        out = use.eqn.outvars[0].aval
        offsets = [d for d in range(operand.ndim) if d not in dn.collapsed_slice_dims]
        fresh = _Fresh()
        off_syms = []
        for d in offsets:
            if d == r:
                off_syms.append(fresh())  # size 1
            else:
                off_syms.append(_axis_symbol(layout.axes[d], fresh))
        batch_axes = [a for a in range(out.ndim) if a not in dn.offset_dims]
        perm = tuple(batch_axes) + tuple(dn.offset_dims)
        levels = use.level_shape()
        positions = math.prod(levels) * math.prod(out.shape[a] for a in batch_axes)
        off_shape = tuple(out.shape[a] for a in dn.offset_dims)
        rows_n = operand.shape[r]
        # An out-of-range index reads a clamped row in every mode, but its gradient
        # is only kept in clip mode (the scatter that transposes a fill-or-drop or
        # promise-in-bounds gather drops it).
        dropped = "CLIP" not in str(p["mode"]).upper()
        n_lead = len(levels)

        def build(recorded, delta):
            (idx,) = recorded
            idx = idx.reshape(positions, idx.shape[-1]) if indices.ndim else idx
            row, in_range = _row_index(idx[:, component], rows_n)
            if dropped:
                valid = in_range
                for k in others:
                    valid = valid & (idx[:, k] == 0)
            else:
                valid = jnp.ones(row.shape, bool)
            d = delta.transpose((*range(n_lead), *(n_lead + a for a in perm)))
            return [row, valid, d.reshape((positions, *off_shape))]

        syms = frozenset(
            s for s in (("leaf", layout.axes[r].leaf), *off_syms) if s[0] == "leaf"
        )
        form = Form(
            "rows",
            [(), (), (("position",), *off_syms)],
            [(positions,), (positions,), (positions, *off_shape)],
            build,
            syms,
            layout.box,
            row=layout.axes[r].leaf,
        )
        form.complete = _complete(layout, use.leaf_aval.shape)
        return form


def _row_index(row: jax.Array, rows_n: int) -> tuple[jax.Array, jax.Array]:
    """Indices `row` of any integer dtype as int32 rows clamped into `[0, rows_n)`,
    and whether each was in range. Exact for narrow dtypes (`uint8` ids into a table
    of more than 256 rows: `rows_n` is never cast to the ids' dtype, where it would
    wrap) and for wide ones (clamped in their own dtype before the cast)."""
    dtype = jnp.dtype(row.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):  # (gather takes integer indices)
        row = row.astype(jnp.int32)
        dtype = jnp.dtype(jnp.int32)
    top = int(jnp.iinfo(dtype).max)
    in_range = row >= 0 if jnp.issubdtype(dtype, jnp.signedinteger) else None
    if rows_n - 1 < top:  # else every non-negative index is in range
        below = row < np.asarray(rows_n, dtype)
        in_range = below if in_range is None else in_range & below
    if in_range is None:
        in_range = jnp.ones(row.shape, bool)
    hi = np.asarray(max(min(rows_n - 1, top), 0), dtype)
    row = jnp.clip(row, np.asarray(0, dtype), hi).astype(jnp.int32)
    return row, in_range


def _patches(x, window, out_spatial, strides, padding, lhs_dil, rhs_dil, lhs_spec):
    """The patches a convolution reads: `(n, out spatial..., channels, window...)`,
    by slicing the padded (and lhs-dilated) input once per window offset. Exact:
    no entry is multiplied (`lax.conv_general_dilated_patches`, a convolution with a
    one-hot kernel, spreads a non-finite input to every offset through `NaN * 0`)."""
    x = x.transpose(lhs_spec)  # (n, c, spatial...)
    config = [(0, 0, 0), (0, 0, 0)]
    config += [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dil)]
    x = lax.pad(x, jnp.zeros((), x.dtype), config)
    pieces = []
    for offset in itertools.product(*(range(w) for w in window)):
        starts = [0, 0, *(k * d for k, d in zip(offset, rhs_dil))]
        limits = [
            *x.shape[:2],
            *(
                (o - 1) * st + s0 + 1
                for o, st, s0 in zip(out_spatial, strides, starts[2:])
            ),
        ]
        pieces.append(lax.slice(x, starts, limits, (1, 1, *strides)))
    pt = jnp.stack(pieces, -1).reshape((*pieces[0].shape, *window))
    spatial = len(window)
    # (n, c, out..., window...) -> (n, out..., c, window...)
    return pt.transpose(
        (0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    )


def _axis_symbol(axis: Axis, fresh: _Fresh) -> Symbol:
    return ("leaf", axis.leaf) if axis.leaf is not None else fresh()


def _level_symbols(use: Use, layout: Layout, fresh: _Fresh) -> list[Symbol]:
    """The symbols of a use's level axes: the leaf axis a stacked scan consumed, a
    private (summed) symbol for a scan that reads the whole leaf every iteration."""
    out, stacked = [], iter(layout.stacked)
    for kind, _ in use.levels:
        out.append(_axis_symbol(next(stacked), fresh) if kind == "stack" else fresh())
    return out


def _einsum_form(specs, shapes, build, layout: Layout, use: Use) -> Form | None:
    syms = frozenset(s for spec in specs for s in spec if s[0] == "leaf")
    leaf_axes = {s[1] for s in syms}
    if leaf_axes != set(layout.present()):
        return None
    form = Form("einsum", specs, shapes, build, syms, layout.box)
    form.complete = _complete(layout, use.leaf_aval.shape)
    return form


def _complete(layout: Layout, shape: Sequence[int]) -> bool:
    """Whether a layout names every axis of the leaf, in full."""
    return layout.present() == frozenset(range(len(shape))) and all(
        b == (0, n, 1) for b, n in zip(layout.box, shape)
    )


RULES: dict[str, Rule] = {
    "dot_general": Dot(),
    "conv_general_dilated": Conv(),
    "gather": Gather(),
    "add": Elementwise(),
    "sub": Elementwise(),
    "add_any": Elementwise(),
    "mul": Elementwise(linear=(), bilinear=(0, 1)),
    "div": Elementwise(linear=(0,)),
    "select_n": Elementwise(linear=None),  # the predicate (not float) is recorded
    "concatenate": Rule(),
    "pad": Rule(),
    "dynamic_slice": Rule(),
    "dynamic_update_slice": Rule(),
    "reduce_sum": Rule(),
    "cumsum": Rule(),
}
"""The primitives a parameter may enter, by name. Each rule's instantiation and chunk
sum come from the primitive's own transpose; `form` adds a ghost norm."""


def rule_kind(use: Use) -> str:
    return use.rule.kind if use.rule.kind != "linear" else use.eqn.primitive.name
