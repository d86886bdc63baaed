"""Ghost clipping: clipped per-example gradient sums without per-example gradients.

`method="ghost"` of `clipped_grad` and `clipped_grad_sum`. The loss of one example is
traced once to a jaxpr; `Plan` walks it (into `jit`, `checkpoint`, `scan` and `cond`
bodies) and finds every *use* of each differentiated leaf: an equation that a rule of
`_ghost_rules` covers (contractions, convolutions, embedding lookups, elementwise and
other linear operations), with the leaf reached through example-independent linear
steps (the chain). A leaf with any other use (a nonlinearity applied to it, a
`custom_jvp`/`custom_vjp` function or `while` loop it enters, a scan carry) is a
*per-example* leaf: its exact gradient is computed per example, as with
`method="vmap"`.

`Plan.run` evaluates the jaxpr with a zero *probe* added to the output of every use
and returns the operands each rule records (activations, indices): the
instrumentation recurses into sub-jaxprs, so that a scan takes its probes as extra
`xs` and returns its records as extra `ys`, a checkpoint keeps its policy, and a cond
returns zeros for the branch not taken. `jax.grad` with respect to the probes (and
the per-example leaves) gives every use's cotangent in one backward pass per example.
From records and cotangents each leaf gets its squared norm (`sq_norm`: the ghost norm
or the instantiated gradient, by the mixed rule), and each chunk its clipped sum
(`chunk_sum`: one transpose per use over the chunk's examples): a chunk holds
activations and cotangents, never `batch_size x parameters`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax import lax

from .._core import _axes
from . import _ghost_rules as rules


_INLINE = ("pjit", "jit", "closed_call", "core_call")
_REMAT = ("checkpoint", "remat", "remat2")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")

GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED = (
    "ghost",
    "instantiated",
    "per-example",
    "unused",
)


def _sub_jaxpr(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """A sub-jaxpr and its constants (a ClosedJaxpr or an open Jaxpr)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _call_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    return _sub_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))


def _bind_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    outs = rules.bind(eqn.primitive, ins, eqn.params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


@dataclasses.dataclass
class Leaf:
    path: str
    shape: tuple
    dtype: Any
    rule: str = UNUSED
    reason: str = ""
    uses: list = dataclasses.field(default_factory=list)
    pairs: dict = dataclasses.field(default_factory=dict)  # (i, j) -> rules.Pair
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
        self.uses: list[rules.Use] = []
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
        self.uses_at: dict[tuple, list[rules.Use]] = {}
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
            kinds[rules.rule_kind(u)] = kinds.get(rules.rule_kind(u), 0) + 1
        where = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())
        for u in leaf.uses:
            u.layout = rules.layout_of(u.chain, leaf.shape)
            u.form = u.rule.form(u)
        inst = leaf.size + sum(_inst_cost(u) for u in leaf.uses)
        missing = [rules.rule_kind(u) for u in leaf.uses if u.form is None]
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
                p = rules.pair(leaf.uses[i].form, leaf.uses[j].form)
                if p.kind is None:
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
                sub, sub_consts = _call_jaxpr(eqn)
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
                rules.chain_op(eqn, slot, index, consts)
                for index in range(len(eqn.outvars))
            ]
            if all(s is not None for s in steps):
                return [_Info((leaf, (*chain, s), lv)) for s in steps]
        rule = rules.RULES.get(name)
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
                rules.Use(
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
        body, body_consts = _sub_jaxpr(p["jaxpr"])
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
                    (*i.origin[1], rules.Op("stack")),
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
            sub, sub_consts = _sub_jaxpr(branch)
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
                sub, sub_consts = _call_jaxpr(eqn)
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
        sub, sub_consts = _call_jaxpr(eqn)
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
        body, body_consts = _sub_jaxpr(p["jaxpr"])
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
            sub, sub_consts = _sub_jaxpr(branches[b])

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
            term = rules.pair_term(p.kind, u.form, arrays[i], v.form, arrays[j], acc)
            total = total + (term if i == j else 2 * term)
        return total

    # -- through the forms' arrays (non-finite entries masked) -----------------------

    def maskable(self, k: int) -> bool:
        """Whether leaf `k`'s non-finite gradient entries can be zeroed through its
        uses' arrays (`rules.sanitize`) rather than by forming its gradient."""
        uses = self.leaves[k].uses
        return all(u.form is not None for u in uses) and rules.maskable(
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
        return rules.sanitize([u.form for u in uses], self.arrays(k, records, deltas))

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


def _inst_cost(use: rules.Use) -> float:
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


# --------------------------------------------------------------------------------------
# Tracing one example's loss.


def _one_example_sharding(aval: Any, stripped: bool) -> Any:
    """The sharding type of one example of `aval` (its leading axis removed when
    `stripped`), where it has one on an explicit mesh; else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
    return jax.sharding.NamedSharding(mesh, jax.P(*(spec[1:] if stripped else spec)))


def check_scalar_loss(name: str, traced: Traced) -> None:
    """The traced loss of one example is a real scalar (with aux: its first
    element), as ghost clipping's rules need."""
    value = traced.value_aval
    if (
        value is None
        or value.shape != ()
        or not jnp.issubdtype(value.dtype, jnp.floating)
    ):
        raise TypeError(
            f"{name} fun must return a real scalar loss (with aux: as the first "
            f"element), but it returns {value}."
        )


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
            is_arr = [_axes.is_array(x) for _, x in with_paths]
            self.arg_defs.append((treedef, is_arr))
            mask = []
            for (path, x), arr in zip(with_paths, is_arr):
                if not arr:
                    continue
                aval = jax.typeof(x)
                stripped = strip and is_mapped
                shape = tuple(aval.shape[1:] if stripped else aval.shape)
                position = len(avals)
                avals.append(
                    jax.ShapeDtypeStruct(
                        shape,
                        aval.dtype,
                        weak_type=getattr(aval, "weak_type", False),
                        sharding=_one_example_sharding(aval, stripped),
                    )
                )
                if is_mapped:
                    example_positions.append(position)
                if i in self.diff:
                    mask.append(_axes.is_inexact_array(x))
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
        self.plan = Plan(closed, positions, example_positions, paths)
        self._one = one
        self._plan_args = (positions, example_positions, paths)
        here = jax.sharding.get_abstract_mesh()
        self._plans = {(here, tuple(self._leaf_types(avals))): self.plan}

    def _leaf_types(self, values: Sequence[Any]) -> list[Any]:
        return [jax.typeof(values[i]) for i in self.plan.diff_positions]

    def plan_here(self, values: Sequence[Any]) -> Plan:
        """The plan for one example's `values` in the current mesh context. A jaxpr
        carries the mesh and the shardings it was traced with; inside a `shard_map`
        (some axes manual) the loss is traced again, on `values` there, with the
        same rules."""
        mesh = jax.sharding.get_abstract_mesh()
        key = (mesh, tuple(self._leaf_types(values)))
        plan = self._plans.get(key)
        if plan is None:
            closed = jax.make_jaxpr(self._one)(list(values))
            plan = Plan(closed, *self._plan_args)
            if [(x.rule, [u.key for u in x.uses]) for x in plan.leaves] != [
                (x.rule, [u.key for u in x.uses]) for x in self.plan.leaves
            ]:
                raise RuntimeError(
                    "ghost clipping: the loss traces differently under the mesh "
                    f"{mesh}; use method='vmap' here."
                )
            self._plans[key] = plan
        return plan

    def params_of(self, values: Sequence[Any]) -> list[Any]:
        """The differentiated leaves among one example's `values`: what identifies
        its plan (`plan_of`) where the example's other values are not at hand."""
        return [values[i] for i in self.plan.diff_positions]

    def plan_of(self, params: Sequence[Any]) -> Plan:
        """The plan that `plan_here` made for an example whose differentiated
        leaves are `params` (`params_of`), in the current mesh context: how a
        chunk's sums find the plan of the examples they sum, from those examples'
        own outputs."""
        key = (
            jax.sharding.get_abstract_mesh(),
            tuple(jax.typeof(x) for x in params),
        )
        if key not in self._plans:
            raise RuntimeError(
                "ghost clipping: no example was traced with these parameter types "
                "in this mesh context"
            )
        return self._plans[key]

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
            [(x.path, x.shape, x.rule, x.reason) for x in self.plan.leaves],
            {
                x.path: sorted({rules.rule_kind(u) for u in x.uses})
                for x in self.plan.leaves
            },
        )


# --------------------------------------------------------------------------------------
# The report.


class GhostReport:
    """Which rule `method="ghost"` uses for each differentiated leaf, and why; made
    by `ghost_report`.

    `print` it for a table and a summary, `rule(path)` for one leaf's rule,
    `as_dict()` for all of them, `shares()` for the share of the parameters under
    each rule.

    Attributes:
      rows: `(path, shape, rule, reason)` per floating-point leaf, where rule is
        `"ghost"` (ghost norm: the per-example gradient is never formed),
        `"instantiated"` (that leaf's per-example gradient is formed from the
        activations and cotangents of its uses, in the same backward pass: the
        mixed rule's choice when cheaper, and the rule of biases, scales and other
        elementwise parameters), `"per-example"` (no rule covers one of its uses:
        exact per-example gradients, as `method="vmap"`) or `"unused"` (zero
        gradient).
      uses: for each leaf's path, the kinds of its uses (`"dense"`, `"conv"`,
        `"embedding"`, `"elementwise"`, or a primitive's name).
      runs: `"ghost"` when some leaf has a ghost norm; `"vmap"` when none has, so
        `method="ghost"` runs the per-example path of `method="vmap"` itself.

    Examples:
      >>> from chunkvmap import GhostReport
      >>> report = GhostReport([("args[0]['w']", (3, 2), "ghost", "dense")])
      >>> report.rule("args[0]['w']"), report.runs
      ('ghost', 'ghost')
    """

    def __init__(
        self,
        rows: list[tuple[str, tuple, str, str]],
        uses: dict[str, list[str]] | None = None,
    ):
        self.rows = rows
        self.uses = uses or {}
        self.runs = "ghost" if any(r == GHOST for _, _, r, _ in rows) else "vmap"

    def rule(self, path: str) -> str:
        """The rule of the leaf at key path `path` (as in `rows`)."""
        for p, _, rule, _ in self.rows:
            if p == path:
                return rule
        raise KeyError(f"ghost_report: no differentiated leaf at {path!r}")

    def as_dict(self) -> dict[str, str]:
        return {p: rule for p, _, rule, _ in self.rows}

    def shares(self) -> dict[str, float]:
        """The share of the parameters (entries of the differentiated leaves) under
        each rule, and under each kind of use (a leaf used in several ways counts
        under each kind: `"kind:dense"`, `"kind:embedding"`, ...)."""
        sizes = {p: math.prod(shape) for p, shape, _, _ in self.rows}
        total = sum(sizes.values()) or 1
        out: dict[str, float] = {}
        for p, _, rule, _ in self.rows:
            out[rule] = out.get(rule, 0.0) + sizes[p] / total
        for p, kinds in self.uses.items():
            if self.rule(p) == PER_EXAMPLE:
                continue
            for kind in kinds:
                key = f"kind:{kind}"
                out[key] = out.get(key, 0.0) + sizes[p] / total
        return out

    def fallback(self) -> list[str]:
        """The paths of the leaves that use per-example gradients."""
        return [p for p, _, rule, _ in self.rows if rule == PER_EXAMPLE]

    def __str__(self) -> str:
        width = max([len(p) for p, *_ in self.rows] + [4])
        lines = [f"{'leaf':<{width}}  {'shape':<14} {'rule':<13} why"]
        for p, shape, rule, reason in self.rows:
            lines.append(f"{p:<{width}}  {str(shape):<14} {rule:<13} {reason}")
        shares = self.shares()
        rules_line = ", ".join(
            f"{r} {100 * shares[r]:.1f}%"
            for r in (GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED)
            if r in shares
        )
        lines.append(f"parameters by rule: {rules_line}")
        kinds = sorted(k for k in shares if k.startswith("kind:"))
        if kinds:
            lines.append(
                "parameters by use: "
                + ", ".join(f"{k[5:]} {100 * shares[k]:.1f}%" for k in kinds)
            )
        if self.runs == "vmap":
            lines.append(
                "no leaf has a ghost norm: method='ghost' runs as method='vmap'"
            )
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
    leading axis of size 1). Every use of every floating-point leaf of the
    arguments `argnums` is found, through `jit`, `checkpoint`/remat, `scan` (a
    stacked leaf read through `xs`, or a leaf every iteration reads) and `cond`, and
    through example-independent linear steps between the leaf and its use
    (transposes, reshapes that keep axes, slices and splits, broadcasts, constant
    scales, casts, sharding constraints). The leaf gets one of the rules:

    * `"ghost"`: every use has a ghost norm (contractions: `@`, `einsum`,
      `dot_general`; convolutions, as patches; embedding lookups: `emb[tokens]`,
      `jnp.take`, `nn.Embed`, `eqx.nn.Embedding`), every pair of uses an exact cross
      term, and that costs fewer floating-point operations than forming the
      gradient: the per-example gradient is never formed;
    * `"instantiated"`: the per-example gradient is formed from the uses'
      activations and cotangents in the same backward pass (elementwise uses:
      biases, scales, position tables; `concatenate`, `select_n`, ...; and the
      mixed rule's choice when cheaper than the ghost norm);
    * `"per-example"`: some use has no rule (a nonlinearity applied to the leaf, a
      `custom_jvp`/`custom_vjp` function or a `while` loop it enters, a scan
      carry): exact per-example gradients, as `method="vmap"`;
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
      A `GhostReport`: `print` it for a table and the share of the parameters under
      each rule; `.rows` holds `(path, shape, rule, reason)`, `.as_dict()` maps each
      leaf's key path to its rule, `.runs` says whether the ghost path runs.

    Raises:
      TypeError: when `fun` does not return a real scalar loss (as
        `clipped_grad_sum` requires), or for a keyword argument `fun` does not take
        (or an option of the chunked functions, such as `batch_size`, that `fun`
        does not name): the report takes no chunking options.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ghost_report
      >>> def loss(p, x):
      ...     return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))
      >>> report = ghost_report(loss, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
      ...                       jnp.ones(3))
      >>> report.as_dict()
      {"args[0]['b']": 'instantiated', "args[0]['w']": 'ghost'}
    """
    from .._core._options import check_callable
    from .._transforms._grads import check_argnums, resolve_argnums

    name = "ghost_report"
    check_callable(name, "fun", fun)
    _check_keywords(name, fun, kwargs)
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
    check_scalar_loss(name, traced)
    return traced.report()


# The options of the chunked gradient functions, which ghost_report does not take.
_OPTIONS = frozenset(
    {
        "batch_size", "chunk_size", "shard", "remat", "memory_limit", "progress",
        "l2_clip_norm", "return_norms", "nan_safe", "keep_batch_dim",
        "microbatch_size", "rescale_to_unit_norm",
        "normalize_by", "return_values", "return_grad_norms", "prng_argnum",
        "pre_clipping_transform", "other_batch_size", "spmd_axis_name",
    }
)  # fmt: skip


def _check_keywords(name: str, fun: Callable[..., Any], kwargs: dict) -> None:
    """`ghost_report`'s other keyword arguments are `fun`'s: one it cannot take,
    or an option of the chunked functions that it does not name, is a mistake."""
    import inspect

    from .._transforms._batch_vmap import function_name

    try:
        params = inspect.signature(fun).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    named = {
        k
        for k, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key in named or (takes_any and key not in _OPTIONS):
            continue
        option = (
            f" {key} is an option of the chunked functions (clipped_grad_sum, "
            f"clipped_grad, per_example_grad_norms, ...); the report does not depend "
            f"on it: pass it to those, not here."
            if key in _OPTIONS
            else ""
        )
        raise TypeError(
            f"{name} got the keyword argument {key!r}, which {function_name(fun)} "
            f"does not {'name' if takes_any else 'take'}. {name}(fun, *args, "
            f"argnums=0, batch_argnums=None, has_aux=False, **kwargs) takes one "
            f"example's arguments: *args and **kwargs are passed to fun as they "
            f"are.{option}"
        )
