"""The ghost plan of one example's loss: every use of every differentiated leaf
(the analysis, `Plan.walk`), each leaf's rule (the mixed rule, `Plan._choose`),
and the instrumented evaluation that records the uses' operands and takes their
cotangents (`Plan.run`, `Plan.backward`)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from ._chains import layout_of
from ._context import bind
from ._forms import all_finite, maskable, pair, sanitize
from ._primitives import PLAIN, Info, RunState, handler, known_value
from ._rules import Tap, Use, UseKind, rule_kind


class _Named(enum.StrEnum):
    """An enumeration whose members are their strings (so that reports and messages
    show them, and a user's string compares equal)."""

    def __repr__(self) -> str:
        return repr(self.value)


class Method(_Named):
    """The program that computes per-example quantities: per-example gradients
    (`VMAP`) or ghost norms from activations and cotangents (`GHOST`)."""

    VMAP = "vmap"
    GHOST = "ghost"


class LeafRule(_Named):
    """How `method="ghost"` treats a differentiated leaf (see `ghost_report`)."""

    GHOST = "ghost"
    INSTANTIATED = "instantiated"
    PER_EXAMPLE = "per-example"
    UNUSED = "unused"


GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED = LeafRule


# What a per-example gradient entry costs `method="vmap"` beyond the operations that
# form it, in floating-point operations: it is written to memory, then read for the
# norm and for the clipped sum. Measured on CPU (interleaved medians): the two
# programs are at par on a GPT-style LM of width 256 over 32 positions (ghost norms
# at 8.3 operations per entry they avoid), ghost slower at width 128 (16.8).
_TRAFFIC = 8.0
# What the vmap program's per-example kernel gradient of a convolution costs beyond
# its operations (a batch-grouped convolution, which XLA:CPU runs several times
# slower than the ghost program's contractions of the input's shifted views), per
# operation.
_CONV = 2.0
# The ghost program runs when it is predicted at least this much faster than the
# vmap program (a share of the vmap program's estimated cost) ...
_GAIN = 0.005
# ... or, predicted slower, when the per-example gradients it avoids exceed the
# operands it keeps by this share of the vmap program's per-example gradients.
_MEMORY_GAIN = 0.25


class Verdict(NamedTuple):
    """Which program `method="ghost"` runs: `Method.GHOST`, or `Method.VMAP` (the
    per-example path itself, the same result); whether the ghost program is
    predicted slower than the vmap program (it then runs for its memory); and why,
    in words."""

    runs: Method
    slower: bool
    why: str
    # Running for its memory: the operand entries it keeps per example, over the
    # gradient entries it avoids (a prediction `report_of` may check by measuring).
    kept_share: float = 0.0
    counts: str = ""  # the predicted costs, in words


@jax.tree_util.register_pytree_node_class
class Record:
    """The record of one example's ghost evaluation (`Plan.backward`), or of a
    chunk's examples stacked: each use's recorded operands (`records`, by
    `use.key`: activations, indices) and output cotangent (`deltas`, by
    `use.path`); formed gradients (`grads`, by leaf index: those of the leaves
    formed per example, and any a quantity forms from the uses); and the arrays of
    the forms of leaves' uses (`forms`, by leaf index, where a quantity builds
    them); and the squared norms of the leaves tapped in the backward pass
    (`squares`, by leaf index: `Plan.backward`'s `taps`, whose uses record
    nothing). The clipped sums, norms, moments and Gram all consume it, each keeping
    what it needs of it over a chunk (`only`, `replace`).

    A pytree whose structure holds the `plan` that made it (static: the plan of
    the context it was made in), so that what reads a chunk of records reads them
    by their own plan."""

    __slots__ = ("plan", "records", "deltas", "grads", "forms", "squares")

    def __init__(
        self, plan: Plan, records: dict, deltas: dict, grads: dict, forms: dict,
        squares: dict | None = None,
    ) -> None:  # fmt: skip
        self.plan, self.records, self.deltas = plan, records, deltas
        self.grads, self.forms = grads, forms
        self.squares = {} if squares is None else squares

    def tree_flatten(self) -> tuple[tuple, Plan]:
        children = (self.records, self.deltas, self.grads, self.forms, self.squares)
        return children, self.plan

    @classmethod
    def tree_unflatten(cls, plan: Plan, children: Sequence[Any]) -> Record:
        return cls(plan, *children)

    def replace(self, **changes: Any) -> Record:
        fields = {name: getattr(self, name) for name in Record.__slots__[1:]}
        return Record(self.plan, **{**fields, **changes})

    def only(self, leaves: Sequence[int]) -> Record:
        """The record of the uses of `leaves` only (what a chunk keeps of them)."""
        uses = [u for k in leaves for u in self.plan.leaves[k].uses]
        keys, paths = {u.key for u in uses}, {u.path for u in uses}
        return self.replace(
            records={k: r for k, r in self.records.items() if k in keys},
            deltas={p: d for p, d in self.deltas.items() if p in paths},
        )

    def arrays(self, k: int) -> list:
        """One example's arrays of the forms of leaf `k`'s uses."""
        return self.plan.arrays(k, self.records, self.deltas)

    def instantiate(self, k: int) -> Any:
        """One example's gradient of rule leaf `k`, from its uses."""
        return self.plan.instantiate(k, self.records, self.deltas)

    def sq_norm(self, k: int, acc: Any) -> Any:
        """`||G||^2` of one example's gradient of rule leaf `k`, by its rule (or as
        its tap took it)."""
        if k in self.squares:
            return self.squares[k].astype(acc)
        return self.plan.sq_norm(k, self.records, self.deltas, acc)

    def chunk_sum(self, k: int) -> Any:
        """`sum_i G_i` of rule leaf `k` over a chunk's records (cotangents scaled
        as the sum needs)."""
        return self.plan.chunk_sum(k, self.records, self.deltas)


@dataclasses.dataclass
class Param:
    """A differentiated leaf of the loss, as the plan treats it: where it is
    (`path`), its type, its `rule` (a `LeafRule`) and why, its uses, the cross
    terms of its uses' pairs, and the costs the mixed rule compared."""

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


class Plan:
    """The ghost plan of one example's loss: a rule for every leaf, and the
    instrumented evaluation. Immutable once made: it holds the analysis of the
    program it was made from, never a call's program (the structure is the key's;
    each call passes its own, with the arrays it reads: `backward`, `pullback`).

    `key`, where given, says what the plan is made from (`Traced.key` and where it
    is used): two plans of equal keys are equal, so that the programs that hold one
    (a chunk of `Record`s holds its plan in its structure) are the same program.
    Without one, a plan is equal to itself alone."""

    def __init__(
        self,
        closed: Any,
        diff_positions: Sequence[int],
        example_positions: Sequence[int],
        leaf_paths: Sequence[str],
        key: Hashable | None = None,
    ):
        self.key = key
        jaxpr = closed.jaxpr
        self.diff_positions = list(diff_positions)
        invars = [jaxpr.invars[i] for i in diff_positions]
        self.leaves = [
            Param(p, tuple(v.aval.shape), v.aval.dtype)
            for p, v in zip(leaf_paths, invars)
        ]
        self.leaf_specs = [
            getattr(getattr(v.aval, "sharding", None), "spec", None) for v in invars
        ]
        for leaf in self.leaves:
            if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                self._flag(leaf, "complex-valued (ghost norms are for real leaves)")
        infos = [PLAIN] * len(jaxpr.invars)
        for k, i in enumerate(self.diff_positions):
            infos[i] = Info((k, (), ()))
        for i in example_positions:
            infos[i] = Info(tainted=True)
        self.uses: list[Use] = []
        outs = self.walk(jaxpr, closed.consts, infos, (), True)
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

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, Plan) and self.key is not None and self.key == other.key
        )

    def __hash__(self) -> int:
        return id(self) if self.key is None else hash(self.key)

    def _flag(self, leaf: Param, reason: str) -> None:
        if leaf.rule != PER_EXAMPLE:
            leaf.rule, leaf.reason = PER_EXAMPLE, reason

    def _choose(self, leaf: Param) -> None:
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

    # -- the ghost program or the vmap program --------------------------------------

    def verdict(self) -> Verdict:
        """The whole-program choice between the ghost program and the vmap program,
        from each leaf's costs (floating-point operations per example).

        * The vmap program forms every per-example gradient (`inst`) and moves it
          through memory (`_TRAFFIC` per entry).
        * The ghost program takes the ghost norm (`ghost`) of its ghost leaves and
          their share of the clipped sum from their operands (as many operations as
          forming one example's gradient, in one contraction over the chunk). It
          forms the small instantiated gradients (biases, scales) as vmap does, and
          a large instantiated gradient twice (for its norm, then for the sum).
          Per-example leaves cost both programs the same.

        Memory: the ghost program keeps the operands and cotangents of its ghost and
        large instantiated leaves for the chunk's sum, where the vmap program keeps
        those leaves' per-example gradients."""
        if not any(x.rule == GHOST for x in self.leaves):
            return Verdict(Method.VMAP, False, "no parameter has a ghost norm")
        extra = vmap_cost = convs = 0.0  # flops
        avoided = kept = everything = 0  # entries per example
        for k, leaf in enumerate(self.leaves):
            if leaf.rule == UNUSED:
                continue
            everything += leaf.size
            vmap_cost += _TRAFFIC * leaf.size
            if leaf.rule == PER_EXAMPLE:
                continue
            inst = sum(_inst_cost(u) for u in leaf.uses)
            convs += _CONV * sum(_inst_cost(u) for u in leaf.uses if _by_views(u))
            vmap_cost += 3 * inst  # with its share of the backward pass
            operands = self.operand_size(k)
            if leaf.rule == GHOST:
                extra += leaf.costs[0] if leaf.costs else 0.0
            elif leaf.size > operands:  # formed twice
                extra += inst
            else:
                continue
            avoided, kept = avoided + leaf.size, kept + operands
        vmap_cost += convs
        moved = _TRAFFIC * avoided
        counts = (
            f"its norms cost {_count(extra)} flops per example, against "
            f"{_count(moved)} to move the {_count(avoided)} per-example gradient "
            f"entries they avoid through memory"
        )
        if convs:
            counts += (
                f" and {_count(convs)} more for the vmap program's per-example "
                "convolution kernel gradients"
            )
        moved += convs
        if moved - extra >= _GAIN * vmap_cost:
            return Verdict(Method.GHOST, False, counts)
        if avoided - kept >= _MEMORY_GAIN * everything:
            return Verdict(
                Method.GHOST,
                True,
                f"{counts}; it runs for its memory: it keeps {_count(kept)} "
                f"operand entries per example in place of {_count(avoided)} "
                "gradient entries",
                kept / avoided,
                counts,
            )
        return Verdict(
            Method.VMAP,
            False,
            f"the ghost program is predicted no faster ({counts}) and saves little "
            f"memory ({_count(max(avoided - kept, 0))} of {_count(everything)} "
            "gradient entries per example)",
        )

    # -- analysis ----------------------------------------------------------------------

    def flag_leaf(self, k: int, reason: str) -> None:
        """Leaf `k` falls back to per-example gradients, for `reason`."""
        self._flag(self.leaves[k], reason)

    def flag_all(self, infos: Sequence[Info], reason: str) -> None:
        """Every leaf that one of `infos` is a chain of falls back, for `reason`."""
        for info in infos:
            if info.origin is not None:
                self._flag(self.leaves[info.origin[0]], reason)

    def add_use(self, k, path, eqn, slot, chain, levels, *, rule) -> None:
        """A use of leaf `k`: operand `slot` of `eqn` at `path`, by `rule`."""
        x = self.leaves[k]
        record = rule.record(eqn, slot)
        aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
        use = Use(k, path, eqn, slot, chain, levels, rule, record, aval)
        use.leaf_spec = self.leaf_specs[k]
        x.uses.append(use)

    def walk(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        infos: Sequence[Info],
        path: tuple,
        record: bool,
    ) -> list[Info]:
        """The infos of `jaxpr`'s outputs; with `record`, uses and fallbacks are
        noted (without, only dependence on the example is propagated). Each
        equation that reads a leaf goes to its primitive's handler."""
        env: dict[Any, Info] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Info(const=known_value(c))
        for v in jaxpr.constvars[len(consts) :]:
            env[v] = PLAIN
        for v, info in zip(jaxpr.invars, infos):
            env[v] = info

        def read(v: Any) -> Info:
            if isinstance(v, jcore.Literal):
                return Info(const=known_value(v.val))
            return env[v]

        for k, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            if any(i.origin is not None for i in ins):
                outs = handler(eqn).walk(self, eqn, ins, (*path, k), record)
            else:
                outs = [Info(tainted=any(i.tainted for i in ins))] * len(eqn.outvars)
            for v, info in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = info
        return [read(v) for v in jaxpr.outvars]

    # -- the instrumented evaluation -------------------------------------------------

    def probes(self, taps: Sequence[int] = ()) -> dict[tuple, Any]:
        """A zero probe for each use's output (with its scans' axes); a `Tap` for
        the use of each leaf of `taps`."""
        probes = {p: self.uses_at[p][0].probe() for p in self.probe_paths}
        acc = accumulation_dtype([x.dtype for x in self.leaves])
        for k in taps:
            (u,) = self.leaves[k].uses
            probes[u.path] = Tap(jnp.zeros(u.level_shape(), acc))
        return probes

    def tappable(self, k: int) -> bool:
        """Whether leaf `k`'s squared norm can be taken in the backward pass, one
        scan iteration at a time (`tap`): a ghost leaf with one dense use, alone at
        its equation, every scan around it reading it through its `xs` (so that
        the iterations' gradients are disjoint slices of the leaf)."""
        leaf = self.leaves[k]
        if leaf.rule != GHOST or len(leaf.uses) != 1:
            return False
        (u,) = leaf.uses
        return (
            u.rule.kind is UseKind.DENSE
            and len(self.uses_at[u.path]) == 1
            and all(level.stacked for level in u.levels)
            and (0, 0) in leaf.pairs
        )

    def stack_taps(self) -> list[int]:
        """The leaves a clipped sum taps (`tap`) and sums by a second backward pass:
        every `tappable` one, where one of them is inside a scan (a layer stack,
        whose records over every iteration would outweigh that pass); else none."""
        taps = [k for k in range(len(self.leaves)) if self.tappable(k)]
        return taps if any(self.leaves[k].uses[0].levels for k in taps) else []

    def tap(self, path: tuple, eqn: Any, ins: Sequence[Any], zero: Any) -> Any:
        """The output of the tapped use at `path`: `eqn` at `ins`, whose backward
        pass also gives the cotangent of `zero` (its `Tap`, here one iteration's
        scalar) as this iteration's `||G||^2` of the use's leaf, from its operands
        and output cotangent there. Nothing is recorded; under a checkpoint the
        operands are recomputed."""
        (use,) = self.uses_at[path]
        lead = (1,) * len(use.levels)  # the form's scans' axes, one iteration each

        def forward(ins: list) -> Any:
            return self.bind(eqn, ins)[0]

        def backward(ins: list, g: Any) -> tuple:
            (cotangents,) = jax.vjp(forward, ins)[1](g)
            recorded = [
                jnp.reshape(ins[i], lead + jnp.shape(ins[i])) for i in use.record
            ]
            arrays = use.form.build(recorded, jnp.reshape(g, lead + jnp.shape(g)))
            term = self.leaves[use.leaf].pairs[(0, 0)].term
            sq = term(use.form, arrays, use.form, arrays, zero.dtype)
            return cotangents, sq.astype(zero.dtype)

        tapped = jax.custom_vjp(lambda ins, zero: forward(ins))
        tapped.defvjp(lambda ins, zero: (forward(ins), ins), backward)
        return tapped(list(ins), zero)

    def backward(
        self, closed: Any, values: Sequence[Any], per_example: Sequence[int], taps=()
    ) -> tuple[Record, list]:
        """One example's ghost evaluation at `values`: its loss evaluated with zero
        probes and differentiated once, giving every use's recorded operands and
        output cotangent, and the gradients of the leaves `per_example` (the
        `Record`), and the loss's outputs: `pullback` at the cotangent 1. The
        leaves `taps` (each `tappable`) get their squared norms instead
        (`Record.squares`)."""
        outs, records, pull = self.pullback(closed, values, per_example, taps)
        deltas, grads = pull(jnp.ones_like(outs[0]))
        squares = {
            k: jnp.sum(deltas.pop(self.leaves[k].uses[0].path).zero) for k in taps
        }
        return Record(self, records, deltas, grads, {}, squares), outs

    def pullback(
        self, closed: Any, values: Sequence[Any], per_example: Sequence[int], taps=()
    ) -> tuple:
        """One example's evaluation of the call's program `closed` (of the plan's
        structure) at `values` with zero probes, linearised: the outputs, the
        operands each use records, and `pull(cotangent)` of the outputs' first
        leaf giving `(deltas, grads)`: every use's output cotangent
        (by `use.path`) and the gradients of the leaves `per_example` (by leaf
        index). A quantity of several cotangents per example (the curvature's)
        maps `pull` over them: the forward pass is made once."""
        positions = self.diff_positions

        def first(probes: dict, pe_values: list) -> Any:
            vals = list(values)
            for k, v in zip(per_example, pe_values):
                vals[positions[k]] = v
            outs, records = self.run(closed, vals, probes)
            return outs[0], (outs, records)

        pe = [values[positions[k]] for k in per_example]
        _, vjp, (outs, records) = jax.vjp(first, self.probes(taps), pe, has_aux=True)

        def pull(cotangent: Any) -> tuple[dict, dict]:
            deltas, pe_grads = vjp(cotangent)
            return deltas, dict(zip(per_example, pe_grads))

        return outs, records, pull

    def with_rule(self, *rules: str) -> list[int]:
        """The indices of the leaves whose rule is one of `rules`."""
        return [k for k, x in enumerate(self.leaves) if x.rule in rules]

    def run(
        self, closed: Any, invals: Sequence[Any], probes: dict
    ) -> tuple[list, dict]:
        """The outputs of `closed` (a call's program: the plan's own structure,
        the call's arrays) at `invals`, with `probes[path]` added to the output of
        each use, and the operands each use records (`{use.key: [arrays]}`)."""
        at = RunState(probes, 0, {})
        outs = self.run_jaxpr(closed.jaxpr, closed.consts, invals, (), at)
        return outs, at.records

    def inside(self, prefix: tuple, probes: dict) -> tuple[list, list]:
        """The probe paths under `prefix`, and the keys of the uses there that
        record their operands (those not tapped)."""
        n = len(prefix)
        paths = [p for p in self.probe_paths if p[:n] == prefix]
        keys = [
            u.key
            for u in self.uses
            if u.path[:n] == prefix and not isinstance(probes[u.path], Tap)
        ]
        return paths, keys

    @staticmethod
    def bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
        """`eqn` bound on `ins` in the current context, its outputs as a list."""
        outs = bind(eqn.primitive, ins, eqn.params)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def run_jaxpr(self, jaxpr, consts, args, path, at: RunState) -> list:
        """`jaxpr` at `args`; each equation that is, or holds, a use goes to its
        primitive's handler (`at`: the run's state, `at.depth` the scans around
        `jaxpr`)."""
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for k, eqn in enumerate(jaxpr.eqns):
            here = (*path, k)
            ins = [read(v) for v in eqn.invars]
            if here in self.touched:
                outs = handler(eqn).run(self, eqn, ins, here, at)
            else:
                outs = self.bind(eqn, ins)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    # -- norms and sums ----------------------------------------------------------------

    def sq_norm(self, k: int, records: dict, deltas: dict, acc: Any) -> Any:
        """`||G||^2` of one example's gradient of rule leaf `k`, by its rule."""
        leaf = self.leaves[k]
        u = self._windowed(k)  # (whichever the rule: the kernel is never formed whole)
        if u is not None:
            return u.form.windows.sq_norm(records[u.key], deltas[u.path], acc)
        if leaf.rule != GHOST:
            g = self.instantiate(k, records, deltas)
            return jnp.sum(jnp.square(g.astype(acc)))
        return self._ghost_sq(leaf, self.arrays(k, records, deltas), acc)

    def _ghost_sq(self, leaf: Param, arrays: list, acc: Any) -> Any:
        terms = {}
        for (i, j), p in leaf.pairs.items():
            u, v = leaf.uses[i], leaf.uses[j]
            terms[i, j] = p.term(u.form, arrays[i], v.form, arrays[j], acc)
        same = total([t for (i, j), t in terms.items() if i == j], acc)
        cross = [t for (i, j), t in terms.items() if i != j]
        return same + 2 * total(cross, acc) if cross else same

    # -- through the forms' arrays (non-finite entries masked) -----------------------

    def maskable(self, k: int) -> bool:
        """Whether leaf `k`'s non-finite gradient entries can be zeroed through its
        uses' arrays (`sanitize`) rather than by forming its gradient."""
        uses = self.leaves[k].uses
        return all(u.form is not None for u in uses) and maskable(
            [u.form for u in uses]
        )

    def _windowed(self, k: int) -> Use | None:
        """Leaf `k`'s one use where it is a kernel whose gradient, norm and masked
        arrays come from its input's windows (`_rules.Windows`): no patches."""
        uses = self.leaves[k].uses
        if len(uses) != 1 or uses[0].form is None:
            return None
        windows = uses[0].form.windows
        return uses[0] if windows is not None and windows.whole else None

    def arrays(self, k: int, records: dict, deltas: dict) -> list:
        """One example's arrays of the forms of leaf `k`'s uses."""
        return [
            u.form.build(records[u.key], deltas[u.path]) for u in self.leaves[k].uses
        ]

    def sanitized(self, k: int, records: dict, deltas: dict) -> tuple[list, Any]:
        """One example's masked arrays of leaf `k` (`arrays` with zeros wherever they
        make the gradient non-finite, or a windowed kernel's, `Windows.sanitized`),
        and whether its gradient is finite. `sq_norm_of` and `gradient_of` read
        them."""
        u = self._windowed(k)
        if u is not None:
            arrays, finite = u.form.windows.sanitized(records[u.key], deltas[u.path])
            return [arrays], finite
        uses = self.leaves[k].uses
        arrays = self.arrays(k, records, deltas)
        return sanitize([u.form for u in uses], arrays), all_finite(arrays)

    def sq_norm_of(self, k: int, arrays: list, acc: Any) -> Any:
        """`||G||^2` of leaf `k` from its masked arrays (`sanitized`)."""
        leaf = self.leaves[k]
        u = self._windowed(k)
        if u is not None:
            ((x, columns, features, delta),) = arrays
            return u.form.windows.sq_norm([x], delta, acc, (columns, features))
        if leaf.rule == GHOST:
            return self._ghost_sq(leaf, arrays, acc)
        g = self.gradient_of(k, arrays, batched=False)
        return jnp.sum(jnp.square(g.astype(acc)))

    def gradient_of(self, k: int, arrays: list, batched: bool) -> Any:
        """`G` of leaf `k` from its masked arrays (`sanitized`; summed over a leading
        axis of examples when `batched`)."""
        leaf = self.leaves[k]
        u = self._windowed(k)
        if u is not None:
            ((x, columns, features, delta),) = arrays
            g = u.form.windows.gradient([x], delta, batched, (columns, features))
            return g.astype(leaf.dtype)
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


def _by_views(use: Use) -> bool:
    """Whether the ghost program forms the use's gradient from its operands by
    contractions where the vmap program runs a convolution's kernel gradient."""
    return use.form is not None and use.form.windows is not None


def _count(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


# --------------------------------------------------------------------------------------
# Norms accumulate in at least float32.


def total(terms: Sequence[Any], acc: Any) -> Any:
    """The sum of scalar `terms` in `acc`, as one reduction of them stacked (a chain
    of additions costs a trace an equation per term)."""
    if not terms:
        return jnp.zeros((), acc)
    return jnp.sum(jnp.stack([t.astype(acc) for t in terms]))


def accumulation_dtype(dtypes: Sequence[Any]) -> Any:
    """Where squared norms are summed: float32, or float64 when any of `dtypes` has
    double precision (real or complex)."""
    wide = any(jnp.finfo(d).dtype.itemsize > 4 for d in dtypes)
    return jnp.float64 if wide else jnp.float32
