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
import enum
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._chains import Axis, LeafView, Op, Step
from ._context import bind, explicit_spec
from ._forms import (
    POSITION,
    EinsumForm,
    Form,
    LeafAxis,
    Part,
    RowsForm,
    Symbol,
    _Fresh,
)


class UseKind(enum.StrEnum):
    """The kind of a use a rule covers, as reports name it."""

    LINEAR = "linear"
    ELEMENTWISE = "elementwise"
    DENSE = "dense"
    CONV = "conv"
    EMBEDDING = "embedding"


class Level(NamedTuple):
    """A scan around a use: its `length`, and whether the leaf is `stacked` (read
    through the scan's xs, a slice per iteration) rather than read whole by every
    iteration."""

    stacked: bool
    length: int


class Tap(NamedTuple):
    """The probe of a use whose squared norm is taken in the backward pass
    (`Plan.tap`): a zero of its scans' lengths, whose cotangent is the norm of the
    use's gradient, one per iteration, in place of the use's cotangent."""

    zero: Any


@dataclasses.dataclass
class Use:
    """One use of a leaf: operand `slot` of equation `eqn` at `path`, reached through
    `chain`, inside scans `levels` (`Level`s, outer first)."""

    leaf: int
    path: tuple
    eqn: Any
    slot: int
    chain: tuple[Op, ...]
    levels: tuple[Level, ...]
    rule: Rule
    record: tuple[int, ...]
    leaf_aval: Any
    leaf_spec: Any = None  # the leaf's PartitionSpec where its type has one
    layout: LeafView | None = None
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
        while i < len(self.chain) and self.chain[i].kind is not Step.STACK:
            w = self.chain[i].apply(w)
            i += 1
        if level < len(self.levels):
            stacked, length = self.levels[level]
            if not stacked:
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
        if self.form is not None and self.form.windows is not None:
            g = self.form.windows.gradient(recorded, delta, False)
            return g.astype(self.leaf_aval.dtype)
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
        if self.form is not None and self.form.windows is not None:
            g = self.form.windows.gradient(recorded, delta, True)
            return g.astype(self.leaf_aval.dtype)
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


class Rule:
    """How one primitive family uses a parameter operand.

    `linear`: the operands in which the primitive is linear jointly (add,
    concatenate, ...); `bilinear`: the operands of a product (one linear in the
    other). A leaf may be operand `slot` if that slot is linear or bilinear; the
    other bilinear operands and every non-float operand are recorded."""

    kind = UseKind.LINEAR
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

    kind = UseKind.ELEMENTWISE

    def __init__(self, linear: tuple[int, ...] | None = None, bilinear=()):
        self.linear = linear
        self.bilinear = bilinear


class _Product(Rule):
    """A product of a parameter and an activation (bilinear in its two operands):
    a ghost form needs the other operand to depend on the example."""

    linear = ()
    bilinear = (0, 1)
    what = "a product"

    def accepts(self, eqn, slot, tainted):
        if not tainted[1 - slot]:
            return f"{self.what} whose other operand does not depend on the example"
        return None


class Dot(_Product):
    """`dot_general`: `G = einsum(activation, delta)`."""

    kind = UseKind.DENSE
    what = "a dot_general"

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


class Conv(_Product):
    """`conv_general_dilated` with the kernel as the parameter: unfolded into patches
    (`lax.conv_general_dilated_patches`), `G = einsum(patches, delta)`."""

    kind = UseKind.CONV
    what = "a convolution"

    def form(self, use: Use) -> Form | None:
        p = use.eqn.params
        layout = use.layout
        if layout is None or use.slot != 1 or p["batch_group_count"] != 1:
            return None
        shaped = _conv_operands(use)
        if shaped is None:
            return None
        specs, shapes = shaped
        build = _conv_build(use, shapes[0])
        form = _einsum_form(specs, shapes, build, layout, use)
        if form is not None:
            form.build_cost = float(math.prod(shapes[0]))
            # XLA:CPU runs a convolution's kernel gradient far slower inside a loop
            # (the chunks' scan) than contractions of the input's shifted views;
            # and these, one window offset at a time, never hold the patches
            if not use.levels:
                form.windows = Windows(use, whole=_whole(layout, form))
            form.direct = form.complete
        return form


def _whole(layout: LeafView, form: Form) -> bool:
    """Whether a kernel is its leaf entry for entry: every leaf axis in full, each
    kernel axis one of them (no broadcast axis, none repeated)."""
    leaves = [a.leaf for a in layout.axes]
    return form.complete and None not in leaves and len(set(leaves)) == len(leaves)


def _conv_operands(use: Use) -> tuple[list, list] | None:
    """The symbols and shapes of a convolution's einsum form: the patches
    `(levels..., n, out spatial..., [groups], c, window...)` and the cotangent
    `(levels..., n, out spatial..., [groups], out features)`; None when grouped
    output features do not come from one leaf axis."""
    p, layout = use.eqn.params, use.layout
    dn = p["dimension_numbers"]
    rhs_spec, out_spec = dn.rhs_spec, dn.out_spec
    lhs = use.eqn.invars[0].aval
    kernel = use.eqn.invars[1].aval
    groups = p["feature_group_count"]
    fresh = _Fresh()
    k_syms = [_axis_symbol(a, fresh) for a in layout.axes]
    lead = _level_symbols(use, layout, fresh)
    window = tuple(kernel.shape[d] for d in rhs_spec[2:])
    o_sym = k_syms[rhs_spec[0]]
    out_aval = use.eqn.outvars[0].aval
    out_feat = out_aval.shape[out_spec[1]]
    batch = fresh()
    spatial = [fresh() for _ in range(len(rhs_spec) - 2)]
    if groups > 1:
        if not isinstance(o_sym, LeafAxis):
            return None
        g_sym = LeafAxis(o_sym.axis, Part.GROUP)
        og_sym = LeafAxis(o_sym.axis, Part.WITHIN)
        grp: list[Symbol] = [g_sym]
        o_syms, o_sizes = [g_sym, og_sym], [groups, out_feat // groups]
    else:
        grp, o_syms, o_sizes = [], [o_sym], [out_feat]
    patch_spec = [*lead, batch, *spatial, *grp, k_syms[rhs_spec[1]]]
    patch_spec += [k_syms[d] for d in rhs_spec[2:]]
    delta_spec = [*lead, batch, *spatial, *o_syms]
    levels = use.level_shape()
    out_spatial = tuple(out_aval.shape[d] for d in out_spec[2:])
    n = out_aval.shape[out_spec[0]]
    cg = lhs.shape[dn.lhs_spec[1]] // groups
    patch_shape = (*levels, n, *out_spatial, *((groups,) if groups > 1 else ()), cg)
    patch_shape += window
    delta_shape = (*levels, n, *out_spatial, *o_sizes)
    return [tuple(patch_spec), tuple(delta_spec)], [patch_shape, delta_shape]


def _conv_build(use: Use, patch_shape: tuple) -> Callable[..., list]:
    """A convolution form's `build`: the patches of one example's recorded input
    (sliced, never multiplied) and its cotangent, laid out as `_conv_operands`."""
    p = use.eqn.params
    dn = p["dimension_numbers"]
    out_spec = dn.out_spec
    kernel = use.eqn.invars[1].aval
    out_aval = use.eqn.outvars[0].aval
    window = tuple(kernel.shape[d] for d in dn.rhs_spec[2:])
    out_spatial = tuple(out_aval.shape[d] for d in out_spec[2:])
    scale = use.layout.scale
    n_lead = len(use.levels)
    delta_shape = (*patch_shape[: n_lead + 1 + len(out_spatial)], -1)
    groups = p["feature_group_count"]
    if groups > 1:
        delta_shape = (*delta_shape[:-1], groups, -1)

    def patches(x):
        pt = _patches(
            x,
            window,
            out_spatial,
            p["window_strides"],
            p["padding"],
            p["lhs_dilation"],
            rhs_dil=p["rhs_dilation"],
            lhs_spec=dn.lhs_spec,
        )
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

    return build


class Gather(Rule):
    """`gather` of rows of the parameter (`emb[tokens]`, `jnp.take`, `nn.Embed`,
    `eqx.nn.Embedding`): `G = scatter_add(rows, delta)`, ghost norm by matching
    rows."""

    kind = UseKind.EMBEDDING
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
        if not _row_lookup(use):
            return None
        p = use.eqn.params
        dn = p["dimension_numbers"]
        operand = use.eqn.invars[0].aval
        if dn.operand_batching_dims or dn.start_indices_batching_dims:
            return None
        sizes = p["slice_sizes"]
        lookup = [d for d in range(operand.ndim) if sizes[d] != operand.shape[d]]
        if len(lookup) != 1 or sizes[lookup[0]] != 1:
            return None
        r = lookup[0]
        if r not in dn.start_index_map or layout.axes[r].leaf is None:
            return None
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
        levels = use.level_shape()
        positions = math.prod(levels) * math.prod(out.shape[a] for a in batch_axes)
        off_shape = tuple(out.shape[a] for a in dn.offset_dims)
        build = _lookup_build(use, r, batch_axes, (positions, *off_shape))
        return _rows_form(use, r, off_syms, positions, off_shape, build)


class DynamicSlice(Rule):
    """`dynamic_slice` of one row of the parameter (`emb[token]` with a scalar
    token, as in a scan's step): a lookup at one position per iteration of the
    scans around it, `G = scatter_add(rows, delta)` at the clamped start index (the
    row `dynamic_slice` reads), ghost norm by matching rows."""

    kind = UseKind.EMBEDDING

    def form(self, use: Use) -> Form | None:
        layout = use.layout
        if not _row_lookup(use):
            return None
        operand = use.eqn.invars[0].aval
        sizes = use.eqn.params["slice_sizes"]
        lookup = [d for d in range(operand.ndim) if sizes[d] != operand.shape[d]]
        if len(lookup) != 1 or sizes[lookup[0]] != 1:
            return None
        r = lookup[0]
        if layout.axes[r].leaf is None:
            return None
        fresh = _Fresh()
        off_syms = [
            fresh() if d == r else _axis_symbol(layout.axes[d], fresh)
            for d in range(operand.ndim)
        ]
        positions = math.prod(use.level_shape())
        off_shape = tuple(use.eqn.outvars[0].aval.shape)
        rows_n, start = operand.shape[r], use.record.index(1 + r)

        def build(recorded, delta):
            row, _ = _row_index(recorded[start].reshape(positions), rows_n)
            valid = jnp.ones((positions,), bool)  # (the start is clamped, never out)
            return [row, valid, delta.reshape((positions, *off_shape))]

        return _rows_form(use, r, off_syms, positions, off_shape, build)


def _row_lookup(use: Use) -> bool:
    """Whether a lookup use can have a rows form: the table itself (operand 0,
    through a chain without a scale), outside any scan that slices the leaf."""
    layout = use.layout
    if layout is None or use.slot != 0 or layout.scale != 1.0:
        return False
    return not any(level.stacked for level in use.levels)


def _rows_form(use: Use, r: int, off_syms, positions, off_shape, build) -> RowsForm:
    """A lookup's rows form: rows of leaf axis `r` at `positions` positions, the
    cotangent `(positions, *off_shape)` with symbols `off_syms`."""
    layout = use.layout
    syms = frozenset(
        s for s in (LeafAxis(layout.axes[r].leaf), *off_syms) if isinstance(s, LeafAxis)
    )
    form = RowsForm(
        [(), (), (POSITION, *off_syms)],
        [(positions,), (positions,), (positions, *off_shape)],
        build,
        syms,
        layout.box,
        row=layout.axes[r].leaf,
    )
    form.complete = _complete(layout, use.leaf_aval.shape)
    return form


def _lookup_build(use: Use, r: int, batch_axes: list, delta_shape: tuple):
    """A lookup form's `build`: one example's looked-up rows (leaf axis `r`) as
    int32 in range, whether each position's gradient is kept, and the cotangent as
    `delta_shape` (positions first)."""
    p = use.eqn.params
    dn = p["dimension_numbers"]
    indices = use.eqn.invars[1].aval
    component = list(dn.start_index_map).index(r)
    others = [k for k, d in enumerate(dn.start_index_map) if d != r]
    perm = (*batch_axes, *dn.offset_dims)
    rows_n = use.eqn.invars[0].aval.shape[r]
    positions, n_lead = delta_shape[0], len(use.levels)
    # An out-of-range index reads a clamped row in every mode, but its gradient is
    # only kept in clip mode (the scatter that transposes a fill-or-drop or
    # promise-in-bounds gather drops it).
    dropped = "CLIP" not in str(p["mode"]).upper()

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
        return [row, valid, d.reshape(delta_shape)]

    return build


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


class Windows:
    """A convolution use's quantities from its recorded input and output cotangent,
    one window offset at a time (the input's shifted view, `_offset_view`), so that
    its patches are never formed: the gradient of its leaf (`gradient`), the
    squared norm of its kernel's gradient (`sq_norm`), and its non-finite entries
    masked (`sanitized`). `whole`: the kernel is its leaf, entry for entry (up to a
    constant factor), so that the kernel's norm is the leaf's.

    Where the arrays are masked (`sanitized`), they are `[input, columns,
    features, cotangent]`: `columns[offset, group, channel]` the patches' columns
    with a non-finite entry, zeroed in every view, and `features` the cotangent's
    output features with one, zeroed in the cotangent (`mask=(columns, features)`);
    with the patches `[patches, cotangent]` masked as `sanitize` masks them, both
    give the same gradient and norm."""

    def __init__(self, use: Use, whole: bool):
        p = use.eqn.params
        self.dn = p["dimension_numbers"]
        self.groups = p["feature_group_count"]
        kernel = use.eqn.invars[1].aval
        self.kernel = kernel
        self.window = tuple(kernel.shape[d] for d in self.dn.rhs_spec[2:])
        out = use.eqn.outvars[0].aval
        self.out_spatial = tuple(out.shape[d] for d in self.dn.out_spec[2:])
        self.geometry = (
            p["window_strides"],
            p["padding"],
            p["lhs_dilation"],
            p["rhs_dilation"],
        )
        self.offsets = np.array(
            list(itertools.product(*(range(w) for w in self.window))), np.int32
        ).reshape(-1, len(self.window))
        self.chain = [op for op in use.chain if op.kind is not Step.STACK]
        self.scale = use.layout.scale
        self.use, self.whole = use, whole

    def _views(self, x, lead):
        """`view(offset)`: the input's view at a window offset, `(lead..., n,
        groups, channels, out spatial...)`."""
        g = self.groups
        x = x.transpose((*range(lead), *(lead + a for a in self.dn.lhs_spec)))
        c = x.shape[lead + 1]
        strides, padding, lhs_dil, rhs_dil = self.geometry
        view = _offset_view(
            x, lead, self.out_spatial, strides, padding, lhs_dil, rhs_dil=rhs_dil
        )

        def grouped(offset):
            xs = view(offset)
            return xs.reshape((*xs.shape[: lead + 1], g, c // g, *xs.shape[lead + 2 :]))

        return grouped

    def _cotangent(self, delta, lead):
        """The cotangent as `(lead..., n, groups, out features, out spatial...)`."""
        d = delta.transpose((*range(lead), *(lead + a for a in self.dn.out_spec)))
        o = d.shape[lead + 1]
        # (.., n, groups, features / groups, spatial...): splits, never merges
        g = self.groups
        return d.reshape((*d.shape[: lead + 1], g, o // g, *d.shape[lead + 2 :]))

    def _masked(self, views, bad, lead):
        """`views` with the columns `bad` (`(lead..., offsets, groups, channels)`)
        zeroed: `masked(offset, bad_at_offset)`."""

        def masked(offset, bad_k):
            xs = views(offset)
            if bad_k is None:
                return xs
            shape = (*bad_k.shape[:lead], 1, *bad_k.shape[lead:])
            shape += (1,) * len(self.out_spatial)
            return jnp.where(bad_k.reshape(shape), jnp.zeros((), xs.dtype), xs)

        return masked

    def _over_offsets(self, bad, lead):
        """The scan's inputs: each offset, and its columns of `bad` (or None)."""
        if bad is None:
            return (self.offsets, None)
        return (self.offsets, jnp.moveaxis(bad, lead, 0))

    def gradient(self, recorded, delta, batched, mask=None):
        """The leaf's gradient (summed over a leading axis of examples when
        `batched`): for each window offset, the input's shifted view contracted
        with the cotangent over positions (per group); then back through the chain
        to the leaf (its linear transpose)."""
        (x,) = recorded
        lead = 1 if batched else 0  # the examples' axis, summed with the batch's
        bad, delta = _unmasked(mask, delta)
        views, d = self._views(x, lead), self._cotangent(delta, lead)
        masked = self._masked(views, bad, lead)
        letters = "stuvwxyz"[: len(self.out_spatial)]
        e = "e" if batched else ""
        equation = f"{e}ngi{letters},{e}ngo{letters}->goi"

        def one(_, xs):  # one window offset's kernel entries
            return None, jnp.einsum(equation, masked(*xs), d)

        _, g = lax.scan(one, None, self._over_offsets(bad, lead))  # (window, g, o, i)
        groups, o, i = g.shape[1:]
        g = jnp.concatenate([g[:, j] for j in range(groups)], 1)  # (window, O, I)
        g = jnp.moveaxis(g, 0, -1).reshape(groups * o, i, *self.window)
        g = g.transpose(np.argsort(self.dn.rhs_spec))  # in the kernel's own layout

        def forward(w):
            for op in self.chain:
                w = op.apply(w)
            return w

        leaf = self.use.typed_leaf()
        (out_g,) = jax.linear_transpose(forward, leaf)(g.astype(self.kernel.dtype))
        return out_g

    def sq_norm(self, recorded, delta, acc, mask=None):
        """One example's `||G||^2` of a `whole` kernel, in `acc`: where that costs
        fewer operations (few positions: `P^2 (K c + o) < K P c o` for `P`
        positions, `K` offsets, `c` and `o` channels per group), from the views'
        Gram over positions, centred as `_forms._einsum_term` centres the patches
        (the centred views' Gram, their cross term with the views' means, and the
        means' norms); else from each offset's kernel entries, squared and summed."""
        (x,) = recorded
        bad, delta = _unmasked(mask, delta)
        x = x.astype(acc)
        if self.scale != 1.0:
            x = x * jnp.asarray(self.scale, acc)
        views, d = self._views(x, 0), self._cotangent(delta, 0)
        masked = self._masked(views, bad, 0)
        # positions (n, out spatial...) together: (groups, positions, features)
        d = jnp.moveaxis(d.astype(acc), 0, 2)  # (g, o, n, spatial...)
        g, o = d.shape[:2]
        d = d.reshape(g, o, -1).transpose(0, 2, 1)

        def flat(offset, bad_k):  # (groups, positions, channels)
            xs = jnp.moveaxis(masked(offset, bad_k), 0, 2)
            return xs.reshape(*xs.shape[:2], -1).transpose(0, 2, 1)

        t, c, k = d.shape[1], self.kernel.shape[self.dn.rhs_spec[1]], len(self.offsets)
        over = self._over_offsets(bad, 0)
        # Each offset's share of ||G||^2, summed after the scan: a scan's carry in
        # the chunk function would keep the sharding of the context it was traced
        # in (an Explicit mesh the caller entered), which the chunk's evaluation
        # on a device's share rejects; its outputs do not.
        if t * t * (k * c + o) > k * t * c * o:  # the kernel entries are cheaper

            def entries(_, xs):
                gk = jnp.einsum("gti,gto->gio", flat(*xs), d)
                return None, jnp.sum(jnp.square(gk))

            return jnp.sum(lax.scan(entries, None, over)[1])
        # the cotangents' side of each term, before the views' (then d is done);
        # each term is linear in the views' Gram, cross term and means' norms
        s = jnp.sum(d, 1)  # (g, o): summed over positions
        dd = jnp.einsum("gto,gso->gts", d, d)
        ds = jnp.einsum("gto,go->gt", d, s)
        ss = jnp.sum(jnp.square(s), 1)

        def terms(_, xs):
            v = flat(*xs)
            m = jnp.mean(v, 1, keepdims=True)
            cv = v - m
            gram = jnp.einsum("gti,gsi->gts", cv, cv)
            cross = jnp.einsum("gti,gi->gt", cv, m[:, 0])
            means = jnp.sum(jnp.square(m), (1, 2))
            parts = [
                jnp.sum(gram * dd),
                2 * jnp.sum(cross * ds),
                jnp.sum(means * ss),
            ]
            return None, jnp.sum(jnp.stack(parts))

        return jnp.sum(lax.scan(terms, None, over)[1])

    def sanitized(self, recorded, delta):
        """One example's masked arrays `[input, columns, features, cotangent]`, and
        whether its gradient is finite."""
        (x,) = recorded
        # the views of where the input is not finite (bytes, not the input's floats)
        views = self._views(~jnp.isfinite(x), 0)

        def bad_at(_, offset):  # (groups, channels): a non-finite entry in the view
            xs = views(offset)
            return None, jnp.any(xs, (0, *range(3, xs.ndim)))

        _, bad = lax.scan(bad_at, None, self.offsets)
        features = self.dn.out_spec[1]
        others = tuple(a for a in range(delta.ndim) if a != features)
        bad_out = jnp.any(~jnp.isfinite(delta), others, keepdims=True)
        finite = ~(jnp.any(bad) | jnp.any(bad_out))
        return [x, bad, bad_out, delta], finite


def _unmasked(mask, delta):
    """A `Windows` mask's columns (or None), and the cotangent with its features
    zeroed."""
    if mask is None:
        return None, delta
    columns, features = mask
    return columns, jnp.where(features, jnp.zeros((), delta.dtype), delta)


def _offset_view(x, lead, out_spatial, strides, padding, lhs_dil, *, rhs_dil):
    """`view(offset)`: the view of the input `x` `(lead..., n, c, spatial...)` that
    a convolution's window offset (static or traced) reads, `(lead..., n, c, out
    spatial...)`."""
    config = [(0, 0, 0)] * (lead + 2)  # padded, and lhs-dilated
    config += [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dil)]
    x = lax.pad(x, jnp.zeros((), x.dtype), config)
    span = [(o - 1) * st + 1 for o, st in zip(out_spatial, strides)]
    head = lead + 2

    def view(offset):
        starts = [offset[i] * d for i, d in enumerate(rhs_dil)]
        # (every start of one integer type: under x64 a traced offset is int64)
        kind = jnp.result_type(*starts) if starts else np.int32
        starts = [jnp.asarray(s, kind) for s in [0] * head + starts]
        xs = lax.dynamic_slice(x, starts, (*x.shape[:head], *span))
        return lax.slice(xs, [0] * xs.ndim, xs.shape, (1,) * head + tuple(strides))

    return view


def _patches(x, window, out_spatial, strides, padding, lhs_dil, *, rhs_dil, lhs_spec):
    """The patches a convolution reads: `(n, out spatial..., channels, window...)`,
    by slicing the padded (and lhs-dilated) input once per window offset. Exact:
    no entry is multiplied (`lax.conv_general_dilated_patches`, a convolution with a
    one-hot kernel, spreads a non-finite input to every offset through `NaN * 0`)."""
    x = x.transpose(lhs_spec)  # (n, c, spatial...)
    view = _offset_view(x, 0, out_spatial, strides, padding, lhs_dil, rhs_dil=rhs_dil)
    pieces = [view(o) for o in itertools.product(*(range(w) for w in window))]
    pt = jnp.stack(pieces, -1).reshape((*pieces[0].shape, *window))
    spatial = len(window)
    # (n, c, out..., window...) -> (n, out..., c, window...)
    return pt.transpose(
        (0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    )


def _axis_symbol(axis: Axis, fresh: _Fresh) -> Symbol:
    return LeafAxis(axis.leaf) if axis.leaf is not None else fresh()


def _level_symbols(use: Use, layout: LeafView, fresh: _Fresh) -> list[Symbol]:
    """The symbols of a use's level axes: the leaf axis a stacked scan consumed, a
    private (summed) symbol for a scan that reads the whole leaf every iteration."""
    out, stacked = [], iter(layout.stacked)
    for level in use.levels:
        out.append(_axis_symbol(next(stacked), fresh) if level.stacked else fresh())
    return out


def _einsum_form(specs, shapes, build, layout: LeafView, use: Use) -> Form | None:
    syms = frozenset(s for spec in specs for s in spec if isinstance(s, LeafAxis))
    leaf_axes = {s.axis for s in syms}
    if leaf_axes != set(layout.present()):
        return None
    form = EinsumForm(specs, shapes, build, syms, layout.box)
    form.complete = _complete(layout, use.leaf_aval.shape)
    return form


def _complete(layout: LeafView, shape: Sequence[int]) -> bool:
    """Whether a layout names every axis of the leaf, in full."""
    return layout.present() == frozenset(range(len(shape))) and all(
        b == (0, n, 1) for b, n in zip(layout.box, shape)
    )


RULES: dict[Any, Rule] = {
    lax.dot_general_p: Dot(),
    lax.conv_general_dilated_p: Conv(),
    lax.gather_p: Gather(),
    lax.add_p: Elementwise(),
    lax.sub_p: Elementwise(),
    prims.add_jaxvals_p: Elementwise(),
    lax.mul_p: Elementwise(linear=(), bilinear=(0, 1)),
    lax.div_p: Elementwise(linear=(0,)),
    lax.select_n_p: Elementwise(linear=None),  # the predicate (not float) is recorded
    lax.concatenate_p: Rule(),
    lax.pad_p: Rule(),
    lax.dynamic_slice_p: DynamicSlice(),
    lax.dynamic_update_slice_p: Rule(),
    lax.reduce_sum_p: Rule(),
    lax.cumsum_p: Rule(),
}
"""The primitives a parameter may enter, keyed by JAX's primitive objects. Each
rule's instantiation and chunk sum come from the primitive's own transpose; `form`
adds a ghost norm."""


def rule_kind(use: Use) -> str:
    """The kind a report shows: the rule's, or the primitive's name for a linear
    use."""
    kind = use.rule.kind
    return use.eqn.primitive.name if kind is UseKind.LINEAR else str(kind)
