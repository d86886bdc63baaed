"""Ghost clipping: clipped per-example gradient sums without per-example gradients.

`method="ghost"` of `clipped_grad` and `clipped_grad_sum`. The loss of one example is
traced once to a jaxpr (`jax.make_jaxpr`; `jit` and `closed_call` sub-jaxprs are
inlined). Every use of each differentiated leaf is found:

* a leaf whose every use is an operand of a `dot_general` (reached through layout-only
  operations: `transpose`, `reshape`, `convert_element_type`, `copy`) whose other
  operand depends on the example is a *ghost* leaf. Its per-example gradient is
  `G = sum_u chain_u^T(contraction(a_u, delta_u))` over its uses `u`, from the
  activation `a_u` (the other operand) and the cotangent `delta_u` of the dot's output;
* every other float leaf (biases, norm scales, embeddings read by `gather`,
  convolution kernels, leaves used inside `custom_jvp`/`scan`/`cond`/... bodies,
  anything unrecognised) is a *per-example* leaf: its exact per-example gradient is
  computed (vmapped `jax.grad`), as with `method="vmap"`.

Per example, the jaxpr is evaluated by an interpreter that adds a zero "probe" to
the output of every ghost dot and records its activation; `jax.grad` with respect to
the probes and the per-example leaves gives every `delta_u` and the per-example
leaves' gradients in one backward pass. A ghost leaf's squared norm is either the
ghost norm `sum_{u,v} <G_u, G_v>`, evaluated over pairs of positions (cost ~ T^2 for
T positions; cross terms between uses are exact), or, when that is dearer than the
leaf's size (Bu et al.'s mixed rule: ghost iff T^2 <= size), `||G||^2` of `G`
instantiated for that example ("instantiated"). The clip factors follow; then each
chunk's clipped sum is one contraction of its stacked activations with its scaled
cotangents over (examples, positions): what a chunk holds is activations and
cotangents (a forward pass), never `batch_size x parameters`.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax


_INLINE = ("pjit", "jit", "closed_call", "core_call")
_LAYOUT = ("transpose", "reshape", "convert_element_type", "copy", "copy_p")
_PERMUTE = ("transpose", "convert_element_type", "copy", "copy_p")

GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED = (
    "ghost",
    "instantiated",
    "per-example",
    "unused",
)


def is_float_leaf(x: Any) -> bool:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return False


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _sub_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, jcore.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a leaf as an operand of a `dot_general`."""

    leaf: int  # index into the differentiated leaves
    chain: tuple  # ((primitive, params), ...) from the leaf to the operand
    side: int  # 0: the leaf is the lhs, 1: the rhs
    path: tuple  # where the dot is (equation indices through inlined jaxprs)
    params: Any  # the dot's parameters
    act_shape: tuple  # the other operand's shape (one example)
    positions: int  # product of the other operand's free (non-contracted) dims

    def operand(self, w: Any) -> Any:
        """The leaf through its chain of layout operations."""
        for prim, params in self.chain:
            w = prim.bind(w, **params)
        return w

    def dot(self, w: Any, a: Any) -> Any:
        """The dot's output as a (linear) function of the leaf, for activation `a`."""
        ops = (self.operand(w), a) if self.side == 0 else (a, self.operand(w))
        return lax.dot_general(
            *ops,
            self.params["dimension_numbers"],
            precision=self.params.get("precision"),
            preferred_element_type=self.params.get("preferred_element_type"),
        )

    def permutation(self) -> tuple[int, ...] | None:
        """Operand axis j is leaf axis perm[j], or None when the chain reshapes."""
        perm: tuple[int, ...] | None = None
        for prim, params in self.chain:
            if prim.name not in _PERMUTE:
                return None
            if prim.name == "transpose":
                p = tuple(params["permutation"])
                perm = p if perm is None else tuple(perm[i] for i in p)
        return perm

    def specs(self, leaf_rank: int, letters: str, fresh: str) -> tuple[str, str, str]:
        """Einsum specs (activation, cotangent, leaf) with `G_u = einsum(a, d -> w)`;
        the leaf's axes are `letters`, the positions take letters from `fresh`."""
        perm = self.permutation()
        perm = tuple(range(leaf_rank)) if perm is None else perm
        op = [letters[perm[j]] for j in range(leaf_rank)]
        (lc, rc), (lb, rb) = self.params["dimension_numbers"]
        wc, ac = (lc, rc) if self.side == 0 else (rc, lc)
        wb, ab = (lb, rb) if self.side == 0 else (rb, lb)
        act = []
        it = iter(fresh)
        for m in range(len(self.act_shape)):
            if m in ac:
                act.append(op[wc[list(ac).index(m)]])
            elif m in ab:
                act.append(op[wb[list(ab).index(m)]])
            else:
                act.append(next(it))
        w_free = [op[j] for j in range(leaf_rank) if j not in wc and j not in wb]
        a_free = [act[m] for m in range(len(act)) if m not in ac and m not in ab]
        batch = [op[j] for j in wb]
        out = batch + (w_free + a_free if self.side == 0 else a_free + w_free)
        return "".join(act), "".join(out), letters[:leaf_rank]


@dataclasses.dataclass
class Leaf:
    path: str
    shape: tuple
    dtype: Any
    rule: str = UNUSED
    reason: str = ""
    uses: list = dataclasses.field(default_factory=list)


class Analysis:
    """The ghost plan of one example's loss: a jaxpr, and a rule for every leaf."""

    def __init__(
        self,
        closed: Any,
        diff_positions: Sequence[int],
        example_positions: Sequence[int],
        leaf_paths: Sequence[str],
    ):
        self.closed = closed
        jaxpr = closed.jaxpr
        self.diff_positions = list(diff_positions)
        self.leaves = [
            Leaf(p, tuple(v.aval.shape), v.aval.dtype)
            for p, v in zip(leaf_paths, [jaxpr.invars[i] for i in diff_positions])
        ]
        for leaf in self.leaves:
            if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                self._flag(leaf, "complex-valued (ghost norms are for real leaves)")
        # var info: (origin, tainted); origin = (leaf index, chain) or None
        infos: list[tuple[Any, bool]] = [(None, False)] * len(jaxpr.invars)
        for k, i in enumerate(self.diff_positions):
            infos[i] = ((k, ()), False)
        for i in example_positions:
            infos[i] = (None, True)
        outs = self._walk(jaxpr, infos, ())
        for origin, _ in outs:
            if origin is not None:
                self._flag(self.leaves[origin[0]], "returned by the function")
        for leaf in self.leaves:
            if leaf.rule == PER_EXAMPLE:
                leaf.uses = []
            elif leaf.uses:
                self._choose(leaf)
            else:
                leaf.reason = "not used by the loss (zero gradient)"
        self.ghost_dots: dict[tuple, list[Use]] = {}
        for leaf in self.leaves:
            for use in leaf.uses:
                self.ghost_dots.setdefault(use.path, []).append(use)

    # -- classification --------------------------------------------------------------

    def _flag(self, leaf: Leaf, reason: str) -> None:
        if leaf.rule != PER_EXAMPLE:
            leaf.rule, leaf.reason = PER_EXAMPLE, reason

    def _choose(self, leaf: Leaf) -> None:
        """The mixed rule: ghost norms when (sum of positions)^2 <= the leaf's size
        (and every chain is a permutation), else instantiate."""
        size = math.prod(leaf.shape)
        t = sum(u.positions for u in leaf.uses)
        n = len(leaf.uses)
        where = f"{n} dot{'s' if n > 1 else ''}, {t} position{'s' if t > 1 else ''}"
        if any(u.permutation() is None and u.chain for u in leaf.uses):
            if any(
                p.name == "reshape" for u in leaf.uses for p, _ in u.chain
            ):  # einsum specs need axes that map one to one
                leaf.rule = INSTANTIATED
                leaf.reason = f"{where}; reached through a reshape"
                return
        if t * t <= size:
            leaf.rule, leaf.reason = GHOST, f"{where}: T^2 = {t * t} <= size {size}"
        else:
            leaf.rule = INSTANTIATED
            leaf.reason = f"{where}: T^2 = {t * t} > size {size}"

    def _walk(self, jaxpr: Any, infos: Sequence[Any], path: tuple) -> list:
        env: dict[Any, tuple[Any, bool]] = {}
        for v in jaxpr.constvars:
            env[v] = (None, False)
        for v, info in zip(jaxpr.invars, infos):
            env[v] = info

        def read(v: Any) -> tuple[Any, bool]:
            if isinstance(v, jcore.Literal):
                return (None, False)
            return env[v]

        for k, eqn in enumerate(jaxpr.eqns):
            here = (*path, k)
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            tainted = any(t for _, t in ins)
            outs: list[tuple[Any, bool]]
            if name in _INLINE:
                sub, _ = _sub_jaxpr(eqn)
                outs = self._walk(sub, ins, here)
            elif name == "dot_general":
                for side in (0, 1):
                    origin = ins[side][0]
                    if origin is None:
                        continue
                    leaf = self.leaves[origin[0]]
                    other = eqn.invars[1 - side]
                    if not ins[1 - side][1]:
                        self._flag(
                            leaf,
                            "a dot_general whose other operand does not depend on "
                            "the example",
                        )
                        continue
                    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                    ac, ab = (rc, rb) if side == 0 else (lc, lb)
                    shape = tuple(other.aval.shape)
                    free = [d for m, d in enumerate(shape) if m not in ac + ab]
                    leaf.uses.append(
                        Use(
                            origin[0],
                            origin[1],
                            side,
                            here,
                            dict(eqn.params),
                            shape,
                            math.prod(free),
                        )
                    )
                outs = [(None, tainted)]
            elif (
                name in _LAYOUT
                and len(eqn.invars) == 1
                and ins[0][0] is not None
                and (
                    name != "convert_element_type"
                    or jnp.issubdtype(eqn.params["new_dtype"], jnp.floating)
                )
            ):
                leaf_index, chain = ins[0][0]
                outs = [((leaf_index, (*chain, (eqn.primitive, eqn.params))), False)]
            else:
                for origin, _ in ins:
                    if origin is not None:
                        self._flag(self.leaves[origin[0]], f"used by {name}")
                outs = [(None, tainted)] * len(eqn.outvars)
            for v, info in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = info
        return [read(v) for v in jaxpr.outvars]

    # -- evaluation ------------------------------------------------------------------

    def evaluate(self, invals: Sequence[Any], probes: dict) -> tuple[list, dict]:
        """The jaxpr's outputs at `invals`, with `probes[path]` added to the output of
        each ghost dot, and the activations `{(path, side): other operand}`."""
        acts: dict[tuple, Any] = {}

        def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], path: tuple):
            env: dict[Any, Any] = {}

            def read(v: Any) -> Any:
                return v.val if isinstance(v, jcore.Literal) else env[v]

            for v, x in zip(jaxpr.constvars, consts):
                env[v] = x
            for v, x in zip(jaxpr.invars, args):
                env[v] = x
            for k, eqn in enumerate(jaxpr.eqns):
                here = (*path, k)
                ins = [read(v) for v in eqn.invars]
                if eqn.primitive.name in _INLINE:
                    sub, sub_consts = _sub_jaxpr(eqn)
                    outs = run(sub, sub_consts, ins, here)
                else:
                    bind = eqn.primitive.get_bind_params(eqn.params)
                    # (older JAX returns (subfuns, params), newer the params)
                    subfuns, params = ((), bind) if isinstance(bind, dict) else bind
                    outs = eqn.primitive.bind(*subfuns, *ins, **params)
                    if not eqn.primitive.multiple_results:
                        outs = [outs]
                    if here in probes:
                        outs = [outs[0] + probes[here]]
                        for use in self.ghost_dots[here]:
                            acts[(here, use.side)] = ins[1 - use.side]
                for v, x in zip(eqn.outvars, outs):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = x
            return [read(v) for v in jaxpr.outvars]

        outs = run(self.closed.jaxpr, self.closed.consts, invals, ())
        return outs, acts

    def probe_avals(self) -> dict:
        """The output type of each ghost dot (for the zero probes)."""
        avals = {}

        def walk(jaxpr: Any, path: tuple) -> None:
            for k, eqn in enumerate(jaxpr.eqns):
                here = (*path, k)
                if eqn.primitive.name in _INLINE:
                    walk(_sub_jaxpr(eqn)[0], here)
                elif here in self.ghost_dots:
                    avals[here] = eqn.outvars[0].aval

        walk(self.closed.jaxpr, ())
        return avals


# --------------------------------------------------------------------------------------
# Norms and sums from activations and cotangents.


def accumulation_dtype(dtypes: Sequence[Any]) -> Any:
    """Where squared norms are summed: float32, or float64 when any of `dtypes` has
    double precision (real or complex)."""
    wide = any(jnp.finfo(d).dtype.itemsize > 4 for d in dtypes)
    return jnp.float64 if wide else jnp.float32


def instantiate(leaf: Leaf, acts: Sequence[Any], deltas: Sequence[Any]) -> Any:
    """One example's gradient of a ghost leaf, from its uses' activations and
    cotangents (in the leaf's layout and dtype)."""
    aval = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    total = None
    for use, a, d in zip(leaf.uses, acts, deltas):
        (g,) = jax.linear_transpose(lambda w, a=a, use=use: use.dot(w, a), aval)(d)
        total = g if total is None else total + g
    return total


def ghost_sq_norm(leaf: Leaf, acts: Sequence[Any], deltas: Sequence[Any]) -> Any:
    """`||G||^2` of one example's gradient of a ghost leaf, by its rule, accumulated
    in at least float32."""
    acc = accumulation_dtype(
        [leaf.dtype, *(a.dtype for a in acts), *(d.dtype for d in deltas)]
    )
    if leaf.rule == INSTANTIATED:
        g = instantiate(leaf, acts, deltas)
        return jnp.sum(jnp.square(g.astype(acc)))
    rank = len(leaf.shape)
    letters = string.ascii_letters
    w_letters, pool = letters[:rank], letters[rank:]
    specs = []
    used = 0
    for use in leaf.uses:
        fresh = pool[used : used + len(use.act_shape)]
        used += len(use.act_shape)
        specs.append(use.specs(rank, w_letters, fresh))
    total = jnp.zeros((), acc)
    ops = [(a.astype(acc), d.astype(acc)) for a, d in zip(acts, deltas)]
    n = len(leaf.uses)
    for u in range(n):
        for v in range(u, n):
            (au, du, _), (av, dv, _) = specs[u], specs[v]
            if u == v:  # the other copy of the same use gets new position letters
                rename = {
                    c: pool[used + i]
                    for i, c in enumerate(sorted(set(au) - set(w_letters)))
                }
                av = "".join(rename.get(c, c) for c in au)
                dv = "".join(rename.get(c, c) for c in du)
            term = jnp.einsum(
                f"{au},{du},{av},{dv}->",
                ops[u][0],
                ops[u][1],
                ops[v][0],
                ops[v][1],
                optimize="optimal",
            )
            total = total + (term if u == v else 2 * term)
    return total


def ghost_sum(leaf: Leaf, acts: Sequence[Any], deltas: Sequence[Any]) -> Any:
    """`sum_i G_i` over a chunk's stacked activations and (scaled) cotangents: one
    contraction over the examples and the positions per use."""
    aval = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    total = jnp.zeros(leaf.shape, leaf.dtype)
    for use, a, d in zip(leaf.uses, acts, deltas):

        def batched(w, a=a, use=use):
            return jax.vmap(use.dot, in_axes=(None, 0))(w, a)

        (g,) = jax.linear_transpose(batched, aval)(d)
        total = total + g
    return total


# --------------------------------------------------------------------------------------
# Tracing one example's loss.


class Traced:
    """One example's loss as a jaxpr of its array leaves, with the ghost plan.

    `args`/`kwargs` are a call's arguments; with `strip`, the mapped ones (`mapped`
    argument numbers, and every keyword argument) hold the examples along axis 0,
    which is removed for the trace. With `keep_batch_dim`, the arguments `expand`
    (default: `mapped`) get a leading axis of size 1 back when `fun` is called: a
    per-example PRNG key (`prng_argnum`) is mapped but not expanded. The
    differentiated leaves are the floating-point leaves of the arguments `diff`.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict,
        diff: Sequence[int],
        mapped: Sequence[int],
        *,
        strip: bool,
        has_aux: bool,
        keep_batch_dim: bool,
        expand: Sequence[int] | None = None,
    ):
        self.diff = tuple(diff)
        expand = tuple(mapped if expand is None else expand)
        self.arg_defs = []
        avals, positions, paths, example_positions = [], [], [], []
        named = [(f"args[{i}]", a, i in mapped) for i, a in enumerate(args)]
        named.append(("kwargs", kwargs, True))
        self.diff_masks: list[list[bool]] = []
        for i, (root, arg, is_mapped) in enumerate(named):
            with_paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
            is_arr = [_is_array(x) for _, x in with_paths]
            self.arg_defs.append((treedef, is_arr))
            mask = []
            for (path, x), arr in zip(with_paths, is_arr):
                if not arr:
                    continue
                aval = jax.typeof(x)
                shape = tuple(aval.shape[1:] if (strip and is_mapped) else aval.shape)
                position = len(avals)
                avals.append(
                    jax.ShapeDtypeStruct(
                        shape, aval.dtype, weak_type=getattr(aval, "weak_type", False)
                    )
                )
                if is_mapped:
                    example_positions.append(position)
                if i in self.diff:
                    mask.append(is_float_leaf(x))
                    if mask[-1]:
                        positions.append(position)
                        paths.append(root + jax.tree_util.keystr(path))
            if i in self.diff:
                self.diff_masks.append(mask)
        self.batch_args = tuple(mapped)
        self.keep_batch_dim = keep_batch_dim

        def one(values: list) -> Any:
            new_args, new_kwargs = self.rebuild(args, kwargs, values)
            if keep_batch_dim:
                for i in expand:
                    new_args[i] = jax.tree.map(
                        lambda x: jnp.expand_dims(x, 0), new_args[i]
                    )
            out = fun(*new_args, **new_kwargs)
            return out if has_aux else (out, None)

        closed, shape = jax.make_jaxpr(one, return_shape=True)(avals)
        self.out_tree = jax.tree.structure(shape)
        value = jax.tree.leaves(shape)[0] if jax.tree.leaves(shape) else None
        self.value_aval = value
        self.analysis = Analysis(closed, positions, example_positions, paths)

    def rebuild(self, args: Sequence[Any], kwargs: dict, values: Sequence[Any]):
        """`(args, kwargs)` with their array leaves replaced by `values`."""
        it = iter(values)
        rebuilt = []
        for (treedef, is_arr), arg in zip(self.arg_defs, [*args, kwargs]):
            leaves = jax.tree.leaves(arg)
            rebuilt.append(
                treedef.unflatten(
                    [next(it) if a else x for x, a in zip(leaves, is_arr)]
                )
            )
        return rebuilt[:-1], rebuilt[-1]

    def arrays(self, args: Sequence[Any], kwargs: dict) -> list[Any]:
        """The array leaves of a call (the jaxpr's inputs), in order."""
        out = []
        for (_, is_arr), arg in zip(self.arg_defs, [*args, kwargs]):
            out += [x for x, a in zip(jax.tree.leaves(arg), is_arr) if a]
        return out

    def grads_tree(self, values: Sequence[Any], single: bool) -> Any:
        """Per-leaf values (one per differentiated leaf) structured like the
        differentiated arguments, None at the other leaves."""
        it = iter(values)
        trees = []
        for i, mask in zip(self.diff, self.diff_masks):
            treedef, is_arr = self.arg_defs[i]
            m = iter(mask)
            trees.append(
                treedef.unflatten(
                    [next(it) if (a and next(m)) else None for a in is_arr]
                )
            )
        return trees[0] if single else tuple(trees)

    def report(self) -> GhostReport:
        return GhostReport(
            [(x.path, x.shape, x.rule, x.reason) for x in self.analysis.leaves]
        )


# --------------------------------------------------------------------------------------
# The report.


class GhostReport:
    """Which rule `method="ghost"` uses for each differentiated leaf, and why; made
    by `ghost_report`.

    `print` it for a table, `rule(path)` for one leaf's rule, `as_dict()` for all of
    them.

    Attributes:
      rows: `(path, shape, rule, reason)` per floating-point leaf, where rule is
        `"ghost"` (ghost norm), `"instantiated"` (that leaf's per-example gradient is
        formed from its activations and cotangents: the mixed rule), `"per-example"`
        (exact per-example gradients, vmapped) or `"unused"` (zero gradient).

    Examples:
      >>> from chunkvmap import GhostReport
      >>> report = GhostReport([("args[0]['w']", (3, 2), "ghost", "1 dot")])
      >>> report.rule("args[0]['w']")
      'ghost'
    """

    def __init__(self, rows: list[tuple[str, tuple, str, str]]):
        self.rows = rows

    def rule(self, path: str) -> str:
        """The rule of the leaf at key path `path` (as in `rows`)."""
        for p, _, rule, _ in self.rows:
            if p == path:
                return rule
        raise KeyError(f"ghost_report: no differentiated leaf at {path!r}")

    def as_dict(self) -> dict[str, str]:
        return {p: rule for p, _, rule, _ in self.rows}

    def __str__(self) -> str:
        width = max([len(p) for p, *_ in self.rows] + [4])
        lines = [f"{'leaf':<{width}}  {'shape':<14} {'rule':<13} why"]
        for p, shape, rule, reason in self.rows:
            lines.append(f"{p:<{width}}  {str(shape):<14} {rule:<13} {reason}")
        return "\n".join(lines)

    __repr__ = __str__


def ghost_report(
    fun: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **kwargs: Any,
) -> GhostReport:
    """Which rule `method="ghost"` applies to each parameter leaf of `fun`, and why.

    `fun` is traced once on ONE example's arguments, exactly as it receives them
    (with `clipped_grad`'s default `keep_batch_dim=True`, pass the example with its
    leading axis of size 1). Every floating-point leaf of the arguments `argnums`
    gets one of the rules:

    * `"ghost"`: every use is an operand of a `dot_general` (through `transpose`,
      `convert_element_type`, `copy`) whose other operand depends on the example,
      and (sum of positions)^2 <= the leaf's size: ghost norms, never the
      per-example gradient;
    * `"instantiated"`: the same uses, but the mixed rule (T^2 > size, or a reshape
      between the leaf and its dots) forms that leaf's per-example gradient from the
      activations and cotangents;
    * `"per-example"`: any other use (gather, convolution, elementwise, inside
      `custom_jvp`/`scan`/`cond`/`while`, ...): exact per-example gradients;
    * `"unused"`: the loss does not use the leaf.

    Args:
      fun: the per-example loss.
      *args: one example's positional arguments (parameters included).
      argnums: the differentiated argument(s).
      batch_argnums: the arguments that hold the example (None: every argument not
        in `argnums`); keyword arguments always do.
      has_aux: `fun` returns `(loss, aux)`.
      **kwargs: one example's keyword arguments.

    Returns:
      A `GhostReport`: `print` it for a table; `.rows` holds `(path, shape, rule,
      reason)`, `.as_dict()` maps each leaf's key path to its rule.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ghost_report
      >>> def loss(p, x):
      ...     return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))
      >>> report = ghost_report(loss, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
      ...                       jnp.ones(3))
      >>> report.as_dict()
      {"args[0]['b']": 'per-example', "args[0]['w']": 'ghost'}
    """
    from ._grads import check_argnums, resolve_argnums

    name = "ghost_report"
    if not callable(fun):
        raise TypeError(f"{name} fun must be callable, but got {fun!r}.")
    nums, _ = check_argnums(name, "argnums", argnums)
    diff = resolve_argnums(name, "argnums", nums, len(args))
    if batch_argnums is None:
        mapped = tuple(i for i in range(len(args)) if i not in diff)
    else:
        nums, _ = check_argnums(name, "batch_argnums", batch_argnums)
        mapped = resolve_argnums(name, "batch_argnums", nums, len(args))
    args = tuple(
        jnp.asarray(a) if i in diff and isinstance(a, (float, complex)) else a
        for i, a in enumerate(args)
    )
    traced = Traced(
        fun,
        args,
        kwargs,
        diff,
        mapped,
        strip=False,
        has_aux=has_aux,
        keep_batch_dim=False,
    )
    return traced.report()
