"""The plan's one dispatch table, keyed by primitive: for each primitive how the
analysis walks it (`walk`: which leaves it uses and whether its outputs depend on
the example) and how the instrumented evaluation runs it (`run`: the jaxpr's
values with probes added to the uses' outputs, and the uses' operands recorded).

A higher-order primitive (a call, a checkpoint, a scan, a cond) is one class here
with both methods; a first-order primitive with a rule of `_rules.RULES` is a
`Ruled` entry; any other primitive is `UNRULED` (the default `Primitive`): a
linear step of a chain, or a use no rule covers (its leaf falls back to per-example
gradients).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
from jax import lax

from ..._core._jaxprs import call_jaxpr, open_jaxpr
from ._chains import STACK, Op, chain_op, layout_of
from ._rules import RULES, Level, Rule, Tap


if TYPE_CHECKING:
    from ._plan import Plan


def known_value(c: Any) -> Any:
    """A constant as the analysis may read it: a concrete numeric array (or
    scalar), else None: a value an outer transformation traces (a scale passed to
    a jitted step) or a typed PRNG key is never read."""
    if c is None or isinstance(c, jax.core.Tracer):
        return None
    dtype = getattr(c, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return c


@dataclasses.dataclass(frozen=True)
class Info:
    """What the analysis knows of a value: the leaf it is a chain of (`origin`:
    (leaf, chain, levels)), whether it depends on the example, and its value when
    it is a known constant."""

    origin: Any = None
    tainted: bool = False
    const: Any = None


PLAIN = Info()


class RunState(NamedTuple):
    """Where the instrumented run is (`Plan.run_jaxpr`): the probes added to the
    uses' outputs (by path), the scans around (`depth`), and the operands each use
    has recorded so far (`{use.key: [arrays]}`, written as the run goes)."""

    probes: dict
    depth: int
    records: dict


class Primitive:
    """How the plan treats one primitive (the default: an unruled first-order one).

    `walk(plan, eqn, ins, here, record)` gets the `Info` of the equation's inputs
    (at least one of them a leaf's chain) and returns its outputs'; with `record`
    it notes uses and fallbacks on `plan`. `run(plan, eqn, ins, here, at)`
    evaluates an equation at `here` that is, or holds, a use (`at`: the run's
    `RunState`, its probes, the scans around and the records); the others are
    bound as they are."""

    def walk(self, plan: Plan, eqn, ins, here, record) -> list[Info]:
        return _walk_first_order(plan, eqn, ins, here, record, None)

    def run(self, plan: Plan, eqn, ins, here, at: RunState) -> list:
        if isinstance(at.probes[here], Tap):
            return [plan.tap(here, eqn, ins, at.probes[here].zero)]
        outs = plan.bind(eqn, ins)
        outs = [outs[0] + at.probes[here]]
        for use in plan.uses_at[here]:
            at.records[use.key] = [ins[i] for i in use.record]
        return outs


@dataclasses.dataclass(frozen=True)
class Ruled(Primitive):
    """A first-order primitive a parameter may enter, by its `rule`."""

    rule: Rule

    def walk(self, plan, eqn, ins, here, record):
        return _walk_first_order(plan, eqn, ins, here, record, self.rule)


@dataclasses.dataclass(frozen=True)
class Opaque(Primitive):
    """A primitive the analysis does not enter (`custom_jvp`/`custom_vjp`
    functions, `while` loops): a leaf used in it gets per-example gradients."""

    why: Callable[[Any], str]

    def walk(self, plan, eqn, ins, here, record):
        if record:
            plan.flag_all(ins, self.why(eqn))
        return [Info(tainted=any(i.tainted for i in ins))] * len(eqn.outvars)


class Inline(Primitive):
    """A call (`jit`, `closed_call`): its body, walked and run in place."""

    def walk(self, plan, eqn, ins, here, record):
        sub, sub_consts = call_jaxpr(eqn)
        return plan.walk(sub, sub_consts, ins, (*here, 0), record)

    def run(self, plan, eqn, ins, here, at):
        sub, sub_consts = call_jaxpr(eqn)
        return plan.run_jaxpr(sub, sub_consts, ins, (*here, 0), at)


class Remat(Inline):
    """`jax.checkpoint`: run as a checkpoint with its policy, the probes passed in
    and the records returned."""

    def run(self, plan, eqn, ins, here, at):
        sub, sub_consts = call_jaxpr(eqn)
        paths, keys = plan.inside((*here, 0), at.probes)

        def body(ins: list, prs: list) -> Any:
            inner = RunState(dict(zip(paths, prs)), at.depth, {})
            outs = plan.run_jaxpr(sub, sub_consts, ins, (*here, 0), inner)
            return outs, [inner.records[k] for k in keys]

        p = eqn.params
        outs, recs = jax.checkpoint(
            body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy")
        )(list(ins), [at.probes[q] for q in paths])
        at.records.update(zip(keys, recs))
        return outs


class Scan(Primitive):
    """`lax.scan`: a leaf read through `xs` is stacked (one slice per iteration),
    one among the constants is repeated; a carried leaf falls back. Run as a scan
    that takes its probes as extra `xs` and returns its records as extra `ys`."""

    def walk(self, plan, eqn, ins, here, record):
        p = eqn.params
        nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
        body, body_consts = open_jaxpr(p["jaxpr"])
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        if record:
            plan.flag_all(init, "carried through a scan")
        inner = [_level(i, Level(False, length), None) for i in consts]
        inner_xs = [_stacked(plan, i, length, record) for i in xs]
        carry = [Info(tainted=i.tainted) for i in init]
        sub = (*here, 0)
        for _ in range(ncar + 1):  # the carry's dependence on the example: a fixpoint
            outs = plan.walk(body, body_consts, [*inner, *carry, *inner_xs], sub, False)
            new = [Info(tainted=c.tainted or o.tainted) for c, o in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        outs = plan.walk(body, body_consts, [*inner, *carry, *inner_xs], sub, record)
        if record:
            plan.flag_all(outs, "returned from a scan body")
        return [Info(tainted=o.tainted) for o in outs]

    def run(self, plan, eqn, ins, here, at):
        p = eqn.params
        nc, ncar = p["num_consts"], p["num_carry"]
        body, body_consts = open_jaxpr(p["jaxpr"])
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        sub = (*here, 0)
        paths, keys = plan.inside(sub, at.probes)

        def step(carry: list, x: Any) -> Any:
            xs_i, prs = x
            inner = RunState(dict(zip(paths, prs)), at.depth + 1, {})
            outs = plan.run_jaxpr(
                body, body_consts, [*consts, *carry, *xs_i], sub, inner
            )
            return outs[:ncar], (outs[ncar:], [inner.records[k] for k in keys])

        carry, (ys, recs) = lax.scan(
            step,
            list(init),
            (list(xs), [at.probes[q] for q in paths]),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        at.records.update(zip(keys, recs))
        return [*carry, *ys]


class Cond(Primitive):
    """`lax.cond`/`switch`: every branch walked; run as a switch whose branches
    return zero records for the uses of the others."""

    def walk(self, plan, eqn, ins, here, record):
        index, ops = ins[0], ins[1:]
        if record:
            plan.flag_all([index], "used as a cond index")
        branch_outs = []
        for b, branch in enumerate(eqn.params["branches"]):
            sub, sub_consts = open_jaxpr(branch)
            outs = plan.walk(sub, sub_consts, ops, (*here, b), record)
            if record:
                plan.flag_all(outs, "returned from a cond branch")
            branch_outs.append(outs)
        return [
            Info(tainted=index.tainted or any(o.tainted for o in outs))
            for outs in zip(*branch_outs)
        ]

    def run(self, plan, eqn, ins, here, at):
        index, ops = ins[0], ins[1:]
        paths, keys = plan.inside(here, at.probes)
        by_key = {u.key: u for u in plan.uses}
        branches = eqn.params["branches"]

        def branch(b: int) -> Callable[..., Any]:
            sub, sub_consts = open_jaxpr(branches[b])

            def fn(ops: list, prs: list) -> Any:
                inner = RunState(dict(zip(paths, prs)), at.depth, {})
                outs = plan.run_jaxpr(sub, sub_consts, ops, (*here, b), inner)
                full = []
                for key in keys:
                    if key in inner.records:
                        full.append(inner.records[key])
                    else:  # another branch's use: zeros
                        avals = by_key[key].record_avals(at.depth)
                        full.append([jnp.zeros(a.shape, a.dtype) for a in avals])
                return outs, full

            return fn

        outs, recs = lax.switch(
            index,
            [branch(b) for b in range(len(branches))],
            list(ops),
            [at.probes[q] for q in paths],
        )
        at.records.update(zip(keys, recs))
        return outs


def _level(info: Info, level: Level, step: Op | None) -> Info:
    """A scan's operand as its body sees it: a leaf's chain one level deeper (and,
    read through `xs`, one `stack` step longer)."""
    if info.origin is None:
        return info if step is None else Info(tainted=info.tainted)
    leaf, chain, levels = info.origin
    chain = chain if step is None else (*chain, step)
    return Info((leaf, chain, (*levels, level)), False)


def _stacked(plan: Plan, info: Info, length: int, record: bool) -> Info:
    """A scan's `xs` operand as its body sees it: a leaf's slice, one per iteration,
    only where the iterations provably read disjoint entries of the leaf (the
    scanned axis is one of the leaf's own axes: `layout_of`); a leaf that reaches
    `xs` otherwise (broadcast or repeated over the layers, so that every iteration
    reads the same entries) falls back to per-example gradients."""
    if info.origin is not None:
        leaf, chain, _ = info.origin
        view = layout_of((*chain, STACK), plan.leaves[leaf].shape)
        if view is None or view.stacked[-1].leaf is None:
            if record:
                plan.flag_leaf(
                    leaf,
                    "read by a scan through its xs where the iterations may share "
                    "its entries (broadcast or repeated over the iterations)",
                )
            return Info(tainted=info.tainted)
    return _level(info, Level(True, length), STACK)


def _walk_first_order(plan: Plan, eqn, ins, here, record, rule) -> list[Info]:
    """A first-order equation: a linear step of a leaf's chain (one leaf operand,
    nothing from the example), a use by `rule`, or a use no rule covers."""
    name = eqn.primitive.name
    params = [(s, i.origin) for s, i in enumerate(ins) if i.origin is not None]
    tainted = any(i.tainted for i in ins)
    plain = [Info(tainted=tainted)] * len(eqn.outvars)
    if len(params) == 1 and not tainted:
        slot, (leaf, chain, lv) = params[0]
        consts = [i.const for i in ins]
        steps = [chain_op(eqn, slot, k, consts) for k in range(len(eqn.outvars))]
        if all(s is not None for s in steps):
            return [Info((leaf, (*chain, s), lv)) for s in steps]
    if not record:
        return plain
    if rule is None:
        plan.flag_all(ins, f"used by {name}")
        return plain
    taints = [i.tainted for i in ins]
    complex_values = any(
        jnp.issubdtype(v.aval.dtype, jnp.complexfloating)
        for v in (*eqn.invars, *eqn.outvars)
    )
    for slot, (leaf, chain, lv) in params:
        if complex_values:  # a real leaf's gradient is then a real part
            reason = f"used by {name} with complex values"
        else:
            reason = rule.accepts(eqn, slot, taints)
        if reason is not None:
            plan.flag_leaf(leaf, reason)
            continue
        plan.add_use(leaf, here, eqn, slot, chain, lv, rule=rule)
    return plain


def _custom(eqn: Any) -> str:
    fun = eqn.params.get("name", "")
    return (
        f"enters {eqn.primitive.name} {fun!s} (its own derivative rule: per-example "
        f"gradients keep it)".replace("  ", " ")
    )


_INLINE, _REMAT = Inline(), Remat()
PRIMITIVES: dict[Any, Primitive] = {
    **{prim: Ruled(rule) for prim, rule in RULES.items()},
    **dict.fromkeys((prims.jit_p, prims.closed_call_p), _INLINE),
    prims.remat_p: _REMAT,
    lax.scan_p: Scan(),
    lax.cond_p: Cond(),
    **dict.fromkeys(
        (prims.custom_jvp_call_p, prims.custom_vjp_call_p, prims.custom_lin_p),
        Opaque(_custom),
    ),
    lax.while_p: Opaque(lambda eqn: "enters a while loop"),
}
"""Every primitive the plan treats specially, keyed by JAX's primitive objects; any
other is `UNRULED`. A new higher-order primitive is one `Primitive` subclass here
(its `walk` and `run`); a new first-order rule is an entry of `_rules.RULES`."""

UNRULED = Primitive()


def handler(eqn: Any) -> Primitive:
    return PRIMITIVES.get(eqn.primitive, UNRULED)
