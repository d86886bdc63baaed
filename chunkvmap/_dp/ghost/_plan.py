"""The ghost plan of one example's loss: every use of every differentiated leaf
(the analysis, `Plan._walk`), each leaf's rule (the mixed rule, `Plan._choose`),
and the instrumented evaluation that records the uses' operands and takes their
cotangents (`Plan.run`, `Plan.backward`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax import lax

from ..._core._jaxprs import call_jaxpr, open_jaxpr
from ._chains import Op, chain_op, layout_of
from ._context import bind
from ._forms import maskable, pair, sanitize
from ._rules import RULES, Use, rule_kind


_INLINE = ("pjit", "jit", "closed_call", "core_call")
_REMAT = ("checkpoint", "remat", "remat2")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")

GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED = (
    "ghost",
    "instantiated",
    "per-example",
    "unused",
)


def _bind_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    outs = bind(eqn.primitive, ins, eqn.params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


@dataclasses.dataclass
class Leaf:
    path: str
    shape: tuple
    dtype: Any
    rule: str = UNUSED
    reason: str = ""
    uses: list = dataclasses.field(default_factory=list)
    pairs: dict = dataclasses.field(default_factory=dict)  # (i, j) -> Pair
    costs: tuple[float, float] | None = None  # (ghost, instantiated) flops

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class _Info:
    """What the analysis knows of a value: the leaf it is a chain of (`origin`:
    (leaf, chain, levels)), whether it depends on the example, and its value when
    it is a known constant."""

    origin: Any = None
    tainted: bool = False
    const: Any = None


_PLAIN = _Info()


class Plan:
    """The ghost plan of one example's loss: a jaxpr, a rule for every leaf, and the
    instrumented evaluation."""

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
        invars = [jaxpr.invars[i] for i in diff_positions]
        self.leaves = [
            Leaf(p, tuple(v.aval.shape), v.aval.dtype)
            for p, v in zip(leaf_paths, invars)
        ]
        self.leaf_specs = [
            getattr(getattr(v.aval, "sharding", None), "spec", None) for v in invars
        ]
        for leaf in self.leaves:
            if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                self._flag(leaf, "complex-valued (ghost norms are for real leaves)")
        infos = [_PLAIN] * len(jaxpr.invars)
        for k, i in enumerate(self.diff_positions):
            infos[i] = _Info((k, (), ()))
        for i in example_positions:
            infos[i] = _Info(tainted=True)
        self.uses: list[Use] = []
        outs = self._walk(jaxpr, closed.consts, infos, (), True)
        for info in outs:
            if info.origin is not None:
                self._flag(self.leaves[info.origin[0]], "returned by the function")
        for leaf in self.leaves:
            if leaf.rule == PER_EXAMPLE:
                leaf.uses = []
            elif leaf.uses:
                self._choose(leaf)
            else:
                leaf.reason = "not used by the loss (zero gradient)"
        self.uses = [u for leaf in self.leaves for u in leaf.uses]
        self.uses_at: dict[tuple, list[Use]] = {}
        for u in self.uses:
            self.uses_at.setdefault(u.path, []).append(u)
        self.probe_paths = sorted(self.uses_at)
        self.touched = {p[:n] for p in self.probe_paths for n in range(1, len(p) + 1)}

    # -- classification --------------------------------------------------------------

    def _flag(self, leaf: Leaf, reason: str) -> None:
        if leaf.rule != PER_EXAMPLE:
            leaf.rule, leaf.reason = PER_EXAMPLE, reason

    def _choose(self, leaf: Leaf) -> None:
        """The mixed rule: the ghost norm when every use has a ghost form, every pair
        a ghost cross term, and their cost (floating-point operations per example)
        is at most instantiation's; else the gradient is instantiated."""
        kinds: dict[str, int] = {}
        for u in leaf.uses:
            kinds[rule_kind(u)] = kinds.get(rule_kind(u), 0) + 1
        where = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())
        for u in leaf.uses:
            u.layout = layout_of(u.chain, leaf.shape)
            u.form = u.rule.form(u)
        inst = leaf.size + sum(_inst_cost(u) for u in leaf.uses)
        missing = [rule_kind(u) for u in leaf.uses if u.form is None]
        if missing:
            leaf.rule = INSTANTIATED
            leaf.reason = (
                f"{where}: formed from its cotangents (no ghost norm for "
                f"{', '.join(sorted(set(missing)))})"
            )
            return
        ghost = sum(u.form.build_cost for u in leaf.uses)
        n = len(leaf.uses)
        for i in range(n):
            for j in range(i, n):
                p = pair(leaf.uses[i].form, leaf.uses[j].form)
                if p is None:
                    leaf.rule, leaf.pairs = INSTANTIATED, {}
                    leaf.reason = f"{where}: no ghost cross term between uses"
                    return
                leaf.pairs[(i, j)] = p
                ghost += p.cost
        relation = "<=" if ghost <= inst else ">"
        costs = f"ghost {_count(ghost)} {relation} instantiated {_count(inst)} flops"
        leaf.costs = (ghost, inst)
        leaf.rule = GHOST if ghost <= inst else INSTANTIATED
        leaf.reason = f"{where}: {costs}"

    # -- analysis ----------------------------------------------------------------------

    def _walk(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        infos: Sequence[_Info],
        path: tuple,
        record: bool,
    ) -> list[_Info]:
        """The infos of `jaxpr`'s outputs; with `record`, uses and fallbacks are
        noted (without, only dependence on the example is propagated)."""
        env: dict[Any, _Info] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = _Info(const=c)
        for v in jaxpr.constvars[len(consts) :]:
            env[v] = _PLAIN
        for v, info in zip(jaxpr.invars, infos):
            env[v] = info

        def read(v: Any) -> _Info:
            if isinstance(v, jcore.Literal):
                return _Info(const=v.val)
            return env[v]

        def flag(ins: Sequence[_Info], reason: str) -> None:
            if record:
                for info in ins:
                    if info.origin is not None:
                        self._flag(self.leaves[info.origin[0]], reason)

        for k, eqn in enumerate(jaxpr.eqns):
            here = (*path, k)
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            tainted = any(i.tainted for i in ins)
            plain = [_Info(tainted=tainted)] * len(eqn.outvars)
            if not any(i.origin is not None for i in ins):
                outs = plain
            elif name in _INLINE or name in _REMAT:
                sub, sub_consts = call_jaxpr(eqn)
                outs = self._walk(sub, sub_consts, ins, (*here, 0), record)
            elif name == "scan":
                outs = self._walk_scan(eqn, ins, here, record)
            elif name == "cond":
                outs = self._walk_cond(eqn, ins, here, record)
            elif name in _CUSTOM:
                fun = eqn.params.get("name", "")
                flag(
                    ins,
                    f"enters {name} {fun!s} (its own derivative rule: per-example "
                    f"gradients keep it)".replace("  ", " "),
                )
                outs = plain
            elif name == "while":
                flag(ins, "enters a while loop")
                outs = plain
            else:
                outs = self._walk_eqn(eqn, ins, here, record, tainted)
            for v, info in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = info
        return [read(v) for v in jaxpr.outvars]

    def _walk_eqn(self, eqn, ins, here, record, tainted) -> list[_Info]:
        name = eqn.primitive.name
        params = [(s, i.origin) for s, i in enumerate(ins) if i.origin is not None]
        consts = [i.const for i in ins]
        if len(params) == 1 and not tainted:
            slot, (leaf, chain, lv) = params[0]
            steps = [
                chain_op(eqn, slot, index, consts) for index in range(len(eqn.outvars))
            ]
            if all(s is not None for s in steps):
                return [_Info((leaf, (*chain, s), lv)) for s in steps]
        rule = RULES.get(name)
        if rule is None:
            if record:
                for _, origin in params:
                    self._flag(self.leaves[origin[0]], f"used by {name}")
            return [_Info(tainted=tainted)] * len(eqn.outvars)
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
            if not record:
                continue
            if reason is not None:
                self._flag(self.leaves[leaf], reason)
                continue
            x = self.leaves[leaf]
            x.uses.append(
                Use(
                    leaf,
                    here,
                    eqn,
                    slot,
                    chain,
                    lv,
                    rule,
                    rule.record(eqn, slot),
                    jax.ShapeDtypeStruct(x.shape, x.dtype),
                    self.leaf_specs[leaf],
                )
            )
        return [_Info(tainted=tainted)] * len(eqn.outvars)

    def _walk_scan(self, eqn, ins, here, record) -> list[_Info]:
        p = eqn.params
        nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
        body, body_consts = open_jaxpr(p["jaxpr"])
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        if record:
            for info in init:
                if info.origin is not None:
                    self._flag(self.leaves[info.origin[0]], "carried through a scan")
        inner_consts = [
            _Info((i.origin[0], i.origin[1], (*i.origin[2], ("repeat", length))), False)
            if i.origin is not None
            else i
            for i in consts
        ]
        inner_xs = [
            _Info(
                (
                    i.origin[0],
                    (*i.origin[1], Op("stack")),
                    (*i.origin[2], ("stack", length)),
                ),
                False,
            )
            if i.origin is not None
            else _Info(tainted=i.tainted)
            for i in xs
        ]
        carry = [_Info(tainted=i.tainted) for i in init]
        sub = (*here, 0)
        for _ in range(ncar + 1):  # the carry's dependence on the example: a fixpoint
            outs = self._walk(
                body, body_consts, [*inner_consts, *carry, *inner_xs], sub, False
            )
            new = [_Info(tainted=c.tainted or o.tainted) for c, o in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        outs = self._walk(
            body, body_consts, [*inner_consts, *carry, *inner_xs], sub, record
        )
        if record:
            for info in outs:
                if info.origin is not None:
                    self._flag(self.leaves[info.origin[0]], "returned from a scan body")
        return [_Info(tainted=o.tainted) for o in outs]

    def _walk_cond(self, eqn, ins, here, record) -> list[_Info]:
        index, ops = ins[0], ins[1:]
        if record and index.origin is not None:
            self._flag(self.leaves[index.origin[0]], "used as a cond index")
        branch_outs = []
        for b, branch in enumerate(eqn.params["branches"]):
            sub, sub_consts = open_jaxpr(branch)
            outs = self._walk(sub, sub_consts, ops, (*here, b), record)
            if record:
                for info in outs:
                    if info.origin is not None:
                        self._flag(
                            self.leaves[info.origin[0]], "returned from a cond branch"
                        )
            branch_outs.append(outs)
        return [
            _Info(tainted=index.tainted or any(o.tainted for o in outs))
            for outs in zip(*branch_outs)
        ]

    # -- the instrumented evaluation -------------------------------------------------

    def probes(self) -> dict[tuple, Any]:
        """A zero probe for each use's output (with its scans' axes)."""
        return {p: self.uses_at[p][0].probe() for p in self.probe_paths}

    def backward(self, values: Sequence[Any], per_example: Sequence[int]) -> tuple:
        """One example's loss at `values`, evaluated with zero probes: every use's
        output cotangent (`{use.path: delta}`), the gradients of the leaves
        `per_example` (formed as they are), the outputs and the records (`run`)."""
        positions = self.diff_positions

        def loss(probes: dict, pe_values: list) -> Any:
            vals = list(values)
            for k, v in zip(per_example, pe_values):
                vals[positions[k]] = v
            outs, records = self.run(vals, probes)
            return outs[0], (outs, records)

        (deltas, pe_grads), (outs, records) = jax.grad(
            loss, argnums=(0, 1), has_aux=True
        )(self.probes(), [values[positions[k]] for k in per_example])
        return deltas, pe_grads, outs, records

    def run(self, invals: Sequence[Any], probes: dict) -> tuple[list, dict]:
        """The jaxpr's outputs at `invals`, with `probes[path]` added to the output
        of each use, and the operands each use records (`{use.key: [arrays]}`)."""
        records: dict = {}
        outs = self._run(
            self.closed.jaxpr, self.closed.consts, invals, probes, (), 0, records
        )
        return outs, records

    def _inside(self, prefix: tuple) -> tuple[list, list]:
        """The probe paths and use keys under `prefix`."""
        n = len(prefix)
        paths = [p for p in self.probe_paths if p[:n] == prefix]
        keys = [u.key for u in self.uses if u.path[:n] == prefix]
        return paths, keys

    def _run(self, jaxpr, consts, args, probes, path, depth, records) -> list:
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
            name = eqn.primitive.name
            if here not in self.touched:
                outs = _bind_eqn(eqn, ins)
            elif name in _INLINE:
                sub, sub_consts = call_jaxpr(eqn)
                outs = self._run(
                    sub, sub_consts, ins, probes, (*here, 0), depth, records
                )
            elif name in _REMAT:
                outs = self._run_remat(eqn, ins, probes, here, depth, records)
            elif name == "scan":
                outs = self._run_scan(eqn, ins, probes, here, depth, records)
            elif name == "cond":
                outs = self._run_cond(eqn, ins, probes, here, depth, records)
            else:
                outs = _bind_eqn(eqn, ins)
                outs = [outs[0] + probes[here]]
                for use in self.uses_at[here]:
                    records[use.key] = [ins[i] for i in use.record]
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _run_remat(self, eqn, ins, probes, here, depth, records) -> list:
        sub, sub_consts = call_jaxpr(eqn)
        paths, keys = self._inside((*here, 0))

        def body(ins: list, prs: list) -> Any:
            recs: dict = {}
            outs = self._run(
                sub, sub_consts, ins, dict(zip(paths, prs)), (*here, 0), depth, recs
            )
            return outs, [recs[k] for k in keys]

        p = eqn.params
        outs, recs = jax.checkpoint(
            body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy")
        )(list(ins), [probes[q] for q in paths])
        records.update(zip(keys, recs))
        return outs

    def _run_scan(self, eqn, ins, probes, here, depth, records) -> list:
        p = eqn.params
        nc, ncar = p["num_consts"], p["num_carry"]
        body, body_consts = open_jaxpr(p["jaxpr"])
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        sub = (*here, 0)
        paths, keys = self._inside(sub)

        def step(carry: list, x: Any) -> Any:
            xs_i, prs = x
            recs: dict = {}
            outs = self._run(
                body,
                body_consts,
                [*consts, *carry, *xs_i],
                dict(zip(paths, prs)),
                sub,
                depth + 1,
                recs,
            )
            return outs[:ncar], (outs[ncar:], [recs[k] for k in keys])

        carry, (ys, recs) = lax.scan(
            step,
            list(init),
            (list(xs), [probes[q] for q in paths]),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        records.update(zip(keys, recs))
        return [*carry, *ys]

    def _run_cond(self, eqn, ins, probes, here, depth, records) -> list:
        index, ops = ins[0], ins[1:]
        paths, keys = self._inside(here)
        by_key = {u.key: u for u in self.uses}
        branches = eqn.params["branches"]

        def branch(b: int) -> Callable[..., Any]:
            sub, sub_consts = open_jaxpr(branches[b])

            def fn(ops: list, prs: list) -> Any:
                recs: dict = {}
                outs = self._run(
                    sub,
                    sub_consts,
                    ops,
                    dict(zip(paths, prs)),
                    (*here, b),
                    depth,
                    recs,
                )
                full = []
                for key in keys:
                    if key in recs:
                        full.append(recs[key])
                    else:  # another branch's use: zeros
                        avals = by_key[key].record_avals(depth)
                        full.append([jnp.zeros(a.shape, a.dtype) for a in avals])
                return outs, full

            return fn

        outs, recs = lax.switch(
            index,
            [branch(b) for b in range(len(branches))],
            list(ops),
            [probes[q] for q in paths],
        )
        records.update(zip(keys, recs))
        return outs

    # -- norms and sums ----------------------------------------------------------------

    def sq_norm(self, k: int, records: dict, deltas: dict, acc: Any) -> Any:
        """`||G||^2` of one example's gradient of rule leaf `k`, by its rule."""
        leaf = self.leaves[k]
        if leaf.rule != GHOST:
            g = self.instantiate(k, records, deltas)
            return jnp.sum(jnp.square(g.astype(acc)))
        return self._ghost_sq(leaf, self.arrays(k, records, deltas), acc)

    def _ghost_sq(self, leaf: Leaf, arrays: list, acc: Any) -> Any:
        total = jnp.zeros((), acc)
        for (i, j), p in leaf.pairs.items():
            u, v = leaf.uses[i], leaf.uses[j]
            term = p.term(u.form, arrays[i], v.form, arrays[j], acc)
            total = total + (term if i == j else 2 * term)
        return total

    # -- through the forms' arrays (non-finite entries masked) -----------------------

    def maskable(self, k: int) -> bool:
        """Whether leaf `k`'s non-finite gradient entries can be zeroed through its
        uses' arrays (`sanitize`) rather than by forming its gradient."""
        uses = self.leaves[k].uses
        return all(u.form is not None for u in uses) and maskable(
            [u.form for u in uses]
        )

    def arrays(self, k: int, records: dict, deltas: dict) -> list:
        """One example's arrays of the forms of leaf `k`'s uses."""
        return [
            u.form.build(records[u.key], deltas[u.path]) for u in self.leaves[k].uses
        ]

    def sanitized(self, k: int, records: dict, deltas: dict) -> list:
        """`arrays`, with zeros wherever they make the gradient non-finite."""
        uses = self.leaves[k].uses
        return sanitize([u.form for u in uses], self.arrays(k, records, deltas))

    def sq_norm_of(self, k: int, arrays: list, acc: Any) -> Any:
        """`||G||^2` of leaf `k` from its forms' arrays, by its rule."""
        leaf = self.leaves[k]
        if leaf.rule == GHOST:
            return self._ghost_sq(leaf, arrays, acc)
        g = self.gradient_of(k, arrays, batched=False)
        return jnp.sum(jnp.square(g.astype(acc)))

    def gradient_of(self, k: int, arrays: list, batched: bool) -> Any:
        """`G` of leaf `k` from its forms' arrays (summed over a leading axis of
        examples when `batched`)."""
        leaf = self.leaves[k]
        total = None
        for u, a in zip(leaf.uses, arrays):
            g = u.form.gradient(a, leaf.shape, batched, u.leaf_spec).astype(leaf.dtype)
            total = g if total is None else total + g
        return total

    def operand_size(self, k: int) -> int:
        """The entries of one example's recorded operands and cotangents of leaf
        `k`'s uses (what a chunk keeps to form its sum from them)."""
        total = 0
        for u in self.leaves[k].uses:
            avals = [*u.record_avals(), u.out_aval()]
            total += sum(math.prod(a.shape) for a in avals)
        return total

    def instantiate(self, k: int, records: dict, deltas: dict) -> Any:
        """One example's gradient of rule leaf `k`, from its uses."""
        total = None
        for u in self.leaves[k].uses:
            g = u.instantiate(records[u.key], deltas[u.path])
            total = g if total is None else total + g
        return total

    def chunk_sum(self, k: int, records: dict, deltas: dict) -> Any:
        """`sum_i G_i` of rule leaf `k` over a chunk's stacked records and (scaled)
        cotangents."""
        leaf = self.leaves[k]
        total = jnp.zeros(leaf.shape, leaf.dtype)
        for u in leaf.uses:
            total = total + u.chunk_sum(records[u.key], deltas[u.path])
        return total


def _inst_cost(use: Use) -> float:
    """Floating-point operations to instantiate one use's gradient (one example)."""
    if use.form is not None:
        return use.form.inst_cost()
    shapes = [use.out_aval().shape, *(a.shape for a in use.record_avals())]
    return float(sum(math.prod(s) for s in shapes))


def _count(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


# --------------------------------------------------------------------------------------
# Norms accumulate in at least float32.


def accumulation_dtype(dtypes: Sequence[Any]) -> Any:
    """Where squared norms are summed: float32, or float64 when any of `dtypes` has
    double precision (real or complex)."""
    wide = any(jnp.finfo(d).dtype.itemsize > 4 for d in dtypes)
    return jnp.float64 if wide else jnp.float32
