"""An eager call's traced program as its cache sees it: what tells two programs
apart, and one function of everything that varies between calls.

`Program.of(closed)` reads a program traced by `jax.make_jaxpr`:

* **Its key** tells apart any two programs that could compute different things:
  the jaxpr's structure (each equation's primitive, operands, output types and
  parameters; literal constants by their bits), every Python object a parameter
  holds besides jaxprs and JAX's own values (host callbacks, say) as `Held`, and
  where the constants of its nested jaxprs sit. It is built in one pass over the
  equations, several times cheaper than the program's text.
* **Its arguments** are everything else that varies: the arrays the trace closed
  over (`closed.consts`) and the arrays that nested jaxprs hold as constants (a
  `jax.jit` inside the user's function closing over a NumPy or JAX array). Nested
  constants become arguments wherever the equation holding them can be evaluated
  here (`jit`, `checkpoint`, custom derivatives, `scan`, `while`, `cond`: each is
  bound again as JAX binds it, its nested jaxprs closure-converted to take the
  constants as operands, so that values, derivative rules and batching are JAX's
  own; a call's body is evaluated in place); elsewhere (an
  equation of any other primitive) they stay compiled in and are part of the key:
  a JAX array by identity, a NumPy array by its value.

So a program compiled for one call serves another only when it computes the same
function of the other's arguments, and it holds none of them. Differentiation
rules (`custom_jvp`'s, `custom_vjp`'s) are not part of the key: a cached program is
only evaluated, on concrete arguments (a program that closes over a tracer is
evaluated as traced, never cached: `EagerCache`). A trace evaluated under an outer
transformation (`jax.grad` of an eager call) keeps every rule: its equations are
bound with them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools as ft
import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.extend.core.primitives as prims
import numpy as np

from . import _equivalence
from ._jaxprs import bind, evaluate


# Parameters holding differentiation rules: a cached program is evaluated, never
# differentiated, so they do not tell programs apart.
_RULES = frozenset(
    {"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp", "fwd_jaxpr_thunk", "bwd", "fwd",
     "out_trees"}
)  # fmt: skip
# A custom JVP rule's function (made anew at each trace; `exact_key` keys the rule
# by the loss's traced JVP instead).
_JVP_RULES = frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp"})


MAX_ENTRIES = 32


class LRU(collections.OrderedDict):
    """A bounded mapping that forgets its least recently used entry (`limit`
    entries at most)."""

    def __init__(self, limit: int = MAX_ENTRIES):
        super().__init__()
        self.limit = limit

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of `key` (built when missing)."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = build()
        self[key] = value
        if len(self) > self.limit:
            self.popitem(last=False)
        return value


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A traced program: its `key`, and the nested constants that are its arguments
    (`hoisted`, at the positions `slots` gives each nested jaxpr's; `Trace.apply`
    takes a later trace's own in their place)."""

    jaxpr: Any
    key: tuple
    hoisted: list[Any]
    slots: dict[int, int]
    inlined: frozenset[int]

    @classmethod
    def of(cls, jaxpr: Any) -> Program:
        walk = _Walk()
        key, _ = walk.key(jaxpr, hoisting=True)
        return cls(jaxpr, key, walk.hoisted, walk.slots, frozenset(walk.inlined))


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A function traced once, at the types it runs with: its `Program` and every
    array it reads (`consts`: the trace's own constants, `top` of them, then those
    of its nested jits that can be arguments), which `apply` takes as arguments, so
    that a program built on it holds none of them (closure conversion)."""

    program: Program
    consts: list[Any]
    top: int

    @classmethod
    def of(cls, closed: Any) -> Trace:
        """The trace of a `ClosedJaxpr`."""
        program = Program.of(closed.jaxpr)
        consts = list(closed.consts)
        return cls(program, consts + list(program.hoisted), len(consts))

    @property
    def key(self) -> tuple:
        """What tells it apart from any trace that could compute something else
        (the types of its constants are the caller's: they are arguments)."""
        return (self.program.key, self.top)

    @property
    def traced(self) -> bool:
        """Whether it closes over a value an outer transformation traces."""
        return any(isinstance(c, jax.core.Tracer) for c in self.consts)

    def apply(self, consts: Sequence[Any], *args: Any) -> list[Any]:
        """The traced function of `args`, with `consts` for the arrays it reads
        (`Trace.consts`, or arrays of the same types)."""
        top, hoisted = consts[: self.top], consts[self.top :]
        if not hoisted:
            return jax.core.eval_jaxpr(self.program.jaxpr, top, *args)
        return _Evaluation(self.program, hoisted).jaxpr(self.program.jaxpr, top, args)

    def reads(self, consts: Sequence[Any]) -> bool:
        """Whether this trace reads the very arrays `consts` (another trace's), in
        that order."""
        return len(consts) == len(self.consts) and all(
            a is b for a, b in zip(consts, self.consts)
        )


def traced(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """`fn` traced at `args` (values or types): its `ClosedJaxpr` (a value an outer
    transformation traces, closed over, among its constants) and its flat outputs'
    types."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return closed, jax.tree.leaves(shape)


def run_traced(
    program: Callable[..., Any], values: Sequence[Any], programs: LRU, key: Hashable
) -> Any:
    """`program(*values)` (concrete arrays) by the program it traces to, compiled
    once per distinct traced program and `key` and kept in `programs`: every array
    the trace reads is an argument of the compiled program (`Trace`), so a new one
    compiles nothing and none is kept. A program that reads a value an outer
    transformation traces is evaluated as traced, under it, and not kept."""
    return compiled_for(program, values, programs, key)(values)


def compiled_for(
    program: Callable[..., Any], values: Sequence[Any], programs: LRU, key: Hashable
) -> Callable[[Sequence[Any]], Any]:
    """`program` traced once at `values`' types, as a function of values of those
    types: by the program it traces to, compiled once per distinct traced program
    and `key` and kept in `programs` (see `run_traced`)."""
    closed, shape = jax.make_jaxpr(program, return_shape=True)(*values)
    trace = Trace.of(closed)
    out_tree = jax.tree.structure(shape)
    if trace.traced:
        return lambda vs: jax.tree.unflatten(
            out_tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *vs)
        )
    key = (trace.key, tuple(_const_type(c) for c in trace.consts), key)
    consts = trace.consts
    compiled = programs.get_or_build(
        key, lambda: jax.jit(trace.apply).lower(consts, *values).compile()
    )
    return lambda vs: jax.tree.unflatten(out_tree, compiled(consts, *vs))


def _const_type(c: Any) -> Any:
    """A constant's type, with its sharding (an argument of a compiled program)."""
    return (jax.typeof(c), getattr(c, "sharding", None))


class Retraced:
    """A function traced at its first input types (`first`, keyed by `key`), and
    again at others: `jitted(length)` is the function, jitted, for chunks of
    `length`, flat outputs; `tree()` the structure of the outputs of the trace it
    last made (a new `jitted` runs the function at every trace). Each trace keeps
    its own structure, so that what the function put in it in one context (ghost
    clipping's plan of that context) comes back with that trace's outputs.

    A later trace that reads the very arrays the first one reads takes
    them as `params` (the arrays passed for the first's); one that reads others (it
    made arrays of its own while traced, or chose them by the chunk's length) keeps
    its own, and `kept` turns False: a compiled program of it must not be kept for
    other calls. A function
    that closes over a value an outer transformation traces (`first.traced`) is
    called as it is, its closure left to JAX (`params` then holds nothing)."""

    def __init__(
        self,
        first: Trace,
        at: tuple[int, Sequence[Any]],
        jitted: Callable[[int], Any],
        tree: Callable[[], Any],
    ):
        """`at`: the first trace's chunk length and input types."""
        self.first = first
        self.kept = not first.traced
        self.params = () if first.traced else tuple(first.consts)
        self._jitted, self._tree = jitted, tree
        length, avals = at
        here = jax.sharding.get_abstract_mesh()
        key = (length, tuple(map(_type_key, avals)))
        self._traces = {key: [(here, first, tree())]}

    def __call__(self, params: Sequence[Any], values: list[Any], length: int) -> Any:
        """The function of `values` (chunks of `length`), reading `params`: its
        outputs, in the structure its trace gave them."""
        if self.first.traced:
            outs = self._jitted(length)(*values)
            return self._tree().unflatten(outs)
        key = (length, tuple(_type_key(jax.typeof(v)) for v in values))
        here = jax.sharding.get_abstract_mesh()
        made = self._traces.setdefault(key, [])
        found = next(((t, s) for m, t, s in made if runs_here(m, here)), None)
        if found is None:  # (at the values' own types, in this context)
            found = Trace.of(self._jitted(length).trace(*values).jaxpr), self._tree()
            made.append((here, *found))
        this, tree = found
        if not this.reads(self.first.consts):
            self.kept = False
            params = this.consts
        return tree.unflatten(this.apply(params, *values))


def runs_here(made_under: Any, here: Any) -> bool:
    """Whether a trace made under the context mesh `made_under` runs as it is
    under `here`: the same mesh, or a trace made outside any mesh (or inside
    `shard_map`'s Manual axes only: JAX's ops then record no sharding) run where
    no axis is Explicit (a value of no named axis traces the same way there)."""
    if made_under == here:
        return True
    manual = jax.sharding.AxisType.Manual
    portable = all(t is manual for t in made_under.axis_types)
    return portable and jax.sharding.AxisType.Explicit not in here.axis_types


def _type_key(aval: Any) -> Hashable:
    """A value's type as traces tell it apart (`runs_here` tells the contexts):
    its shape, dtype and weakness where neither it (no named axis) nor the context
    (no Explicit axis) names a mesh, else its whole type."""
    sharding = getattr(aval, "sharding", None)
    explicit = jax.sharding.AxisType.Explicit
    if (
        sharding is None
        or explicit in jax.sharding.get_abstract_mesh().axis_types
        or any(p is not None for p in sharding.spec)
        or getattr(aval, "vma", None)
    ):
        return aval
    return (aval.shape, aval.dtype, aval.weak_type)


def exact_key(jaxpr: Any) -> tuple:
    """What evaluating `jaxpr` computes, but for its own constants' values: the key
    `Program.of` gives it (its text, the Python objects it holds) with its
    differentiation rules held too (a rule's closure is compared, not left to a
    later trace; a custom JVP rule, whose function each trace makes anew, by its
    equation's traced JVP: what it computes) and its nested jaxprs' constants
    compiled in (by identity, a NumPy array by value). Two jaxprs of equal keys
    evaluate alike at the same constants."""
    key, _ = _Walk(rules=True).key(jaxpr, hoisting=False)
    return key


def _jvp_key(eqn: Any) -> tuple:
    """The key of a custom JVP equation's JVP (its rule applied), its constants
    compiled in; the rule's equation inside it left as it is (its first order
    tells the rule)."""

    def tangent(aval: Any) -> Any:
        inexact = jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)
        return aval if inexact else aval.update(dtype=jax.dtypes.float0)

    ins = [v.aval for v in eqn.invars]

    def jvp(xs: list, ts: list) -> Any:
        return jax.jvp(lambda *a: bind(eqn, a), xs, ts)

    closed = jax.make_jaxpr(jvp)(ins, [tangent(a) for a in ins])
    key, _ = _Walk(rules=True, jvps=False).key(closed.jaxpr, hoisting=False)
    return key, tuple(map(_compiled_in, closed.consts))


class _Walk:
    """One pass over a program: its key (`key(jaxpr)`: every equation's primitive,
    operands, output types, context and parameters, the Python objects a parameter
    holds as `Held`, and where nested constants sit), the nested constants that
    become arguments (`hoisted`, each nested ClosedJaxpr's from `slots[id(closed)]`
    on) and the equations evaluated here (`inlined`)."""

    def __init__(self, rules: bool = False, jvps: bool = True) -> None:
        self.rules = rules  # (differentiation rules kept in the key, held)
        self.jvps = rules and jvps  # (custom JVP rules by their equations' JVP)
        self.hoisted: list[Any] = []
        self.slots: dict[int, int] = {}
        self.inlined: set[int] = set()

    def key(self, jaxpr: Any, hoisting: bool) -> tuple[tuple, bool]:
        """`jaxpr`'s key, its nested constants hoisted where `hoisting` (the caller
        evaluates `jaxpr` itself); whether any were."""
        names: dict[Any, int] = {}  # each variable by its order of definition

        def define(v: Any) -> Any:
            if isinstance(v, jcore.DropVar):
                return ("_", v.aval)
            return names.setdefault(v, len(names)), v.aval

        def read(v: Any) -> Any:
            return _literal(v) if isinstance(v, jcore.Literal) else names[v]

        parts: list[Any] = [tuple(map(define, (*jaxpr.constvars, *jaxpr.invars)))]
        holds = False
        for eqn in jaxpr.eqns:
            evaluable = hoisting and _evaluable(eqn)
            params, inner = self.params(eqn.params, evaluable)
            if inner:
                self.inlined.add(id(eqn))
            holds |= inner
            ins = tuple(map(read, eqn.invars))
            outs = tuple(map(define, eqn.outvars))
            part = (eqn.primitive, ins, outs, eqn.ctx, params)
            if self.jvps and not _JVP_RULES.isdisjoint(eqn.params):
                part += (_jvp_key(eqn),)
            parts.append(part)
        parts.append(tuple(map(read, jaxpr.outvars)))
        return tuple(parts), holds

    def params(self, params: dict, hoisting: bool) -> tuple[tuple, bool]:
        """An equation's parameters' key (differentiation rules left out); whether
        a nested jaxpr's constants were hoisted."""
        holds = False

        def value(v: Any) -> Any:
            nonlocal holds
            if isinstance(v, jcore.ClosedJaxpr):
                part, inner = self.closed(v, hoisting)
            elif isinstance(v, jcore.Jaxpr):
                part, inner = self.key(v, hoisting)
            elif isinstance(v, (tuple, list)):
                return type(v), tuple(map(value, v))
            else:
                return _equivalence.Held(v) if _equivalence.opaque(v) else _value(v)
            holds |= inner
            return part

        kept = [
            (k, v)
            for k, v in params.items()
            if k not in _JVP_RULES and (self.rules or k not in _RULES)
        ]
        return tuple((k, value(v)) for k, v in kept), holds

    def closed(self, closed: Any, hoisting: bool) -> tuple[tuple, bool]:
        """A nested ClosedJaxpr's key: its constants hoisted where `hoisting` (the
        same object twice: the same arguments), compiled in otherwise."""
        consts = closed.consts
        if hoisting and consts and all(_equivalence.is_array(c) for c in consts):
            base = self.slots.get(id(closed))
            if base is None:
                base = self.slots[id(closed)] = len(self.hoisted)
                self.hoisted.extend(consts)
            part, _ = self.key(closed.jaxpr, hoisting)
            return (("hoisted", base, len(consts)), part), True
        part, holds = self.key(closed.jaxpr, hoisting)
        return (tuple(map(_compiled_in, consts)), part), holds


def _literal(v: Any) -> tuple:
    """A literal operand's key: its type and its value's bits."""
    value = np.asarray(v.val)
    return ("literal", v.aval, value.dtype.str, value.shape, value.tobytes())


def _value(v: Any) -> Any:
    """A parameter's key: immutable values and JAX's own by value (floats by their
    bits), a NumPy array by its contents, anything unhashable by its text."""
    if isinstance(v, (float, complex, np.generic)):
        return type(v), _equivalence.bits(v)
    if isinstance(v, np.ndarray):
        return _compiled_in(v)
    try:
        hash(v)
    except TypeError:
        return type(v), str(v)
    return type(v), v


def _compiled_in(c: Any) -> Any:
    """A key part for a constant compiled into the program: a NumPy array by its
    value (it may change in place), anything else by identity (`Held`)."""
    if isinstance(c, np.ndarray):
        digest = hashlib.blake2b(np.ascontiguousarray(c).view(np.uint8)).digest()
        return ("numpy", c.dtype, c.shape, digest)
    return _equivalence.Held(c)


def _evaluable(eqn: Any) -> bool:
    """Whether `eqn` is one `_Evaluation` evaluates from its parts (a nested `jit`
    only without shardings or compiler options of its own)."""
    if eqn.primitive is prims.jit_p:
        shardings = (*eqn.params["in_shardings"], *eqn.params["out_shardings"])
        return not eqn.params.get("compiler_options_kvs") and not any(
            isinstance(s, jax.sharding.Sharding) for s in shardings
        )
    return eqn.primitive in _EVALUATED


class _Evaluation:
    """A program evaluated with its nested constants given (`hoisted`, by the
    positions `Program.slots` gives them)."""

    def __init__(self, program: Program, hoisted: Sequence[Any]):
        self.program = program
        self.hoisted = hoisted

    def jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        return evaluate(jaxpr, consts, args, self.equation)

    def equation(self, eqn: Any, ins: list[Any]) -> list[Any]:
        if id(eqn) not in self.program.inlined:
            return bind(eqn, ins)
        return _EVALUATED.get(eqn.primitive, _inline)(self, eqn, ins)

    def sub(self, jaxpr: Any, *args: Any) -> list[Any]:
        """A nested jaxpr (open or closed) evaluated on `args`."""
        if isinstance(jaxpr, jcore.Jaxpr):
            return self.jaxpr(jaxpr, (), args)
        base = self.program.slots.get(id(jaxpr))
        consts = (
            jaxpr.consts
            if base is None
            else self.hoisted[base : base + len(jaxpr.consts)]
        )
        return self.jaxpr(jaxpr.jaxpr, consts, args)


def _inline(run: _Evaluation, eqn: Any, ins: list[Any]) -> list[Any]:
    """A call (`jit`, `closed_call`): its body, here (a call is transparent to every
    transformation: its body's equations are bound as they are)."""
    params = eqn.params
    return run.sub(params.get("jaxpr", params.get("call_jaxpr")), *ins)


def _converted(run: _Evaluation, sub: Any) -> Any:
    """A nested jaxpr (open or closed) closure-converted: a closed jaxpr of the same
    computation taking every hoisted constant first, then `sub`'s own inputs."""
    if isinstance(sub, jcore.ClosedJaxpr):
        avals = sub.in_avals
    else:
        avals = [v.aval for v in sub.invars]
    k = len(run.hoisted)

    def closure_converted(*args: Any) -> list[Any]:
        return _Evaluation(run.program, args[:k]).sub(sub, *args[k:])

    hoisted = [jax.typeof(h) for h in run.hoisted]
    return jax.make_jaxpr(closure_converted)(*hoisted, *avals)


def _with_consts(
    name: str, count: str
) -> Callable[[_Evaluation, Any, list[Any]], list[Any]]:
    """The rule of a primitive whose nested jaxpr `name` takes `count` constants
    first (`scan`, the custom derivatives): the same primitive bound, the hoisted
    constants passed as more of those constants (a custom rule's own derivative
    takes none of them: JAX's rules drop the constants, zero their cotangents)."""

    def rule(run: _Evaluation, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        params = dict(p, **{
            name: _converted(run, p[name]), count: p[count] + len(run.hoisted)
        })  # fmt: skip
        return bind(eqn, [*run.hoisted, *ins], params)

    return rule


def _while(run: _Evaluation, eqn: Any, ins: list[Any]) -> list[Any]:
    p, k = eqn.params, len(run.hoisted)
    nc = p["cond_nconsts"]
    params = dict(
        p,
        cond_jaxpr=_converted(run, p["cond_jaxpr"]),
        body_jaxpr=_converted(run, p["body_jaxpr"]),
        cond_nconsts=nc + k,
        body_nconsts=p["body_nconsts"] + k,
    )
    h = list(run.hoisted)
    return bind(eqn, [*h, *ins[:nc], *h, *ins[nc:]], params)


def _cond(run: _Evaluation, eqn: Any, ins: list[Any]) -> list[Any]:
    branches = tuple(_converted(run, b) for b in eqn.params["branches"])
    params = dict(eqn.params, branches=branches)
    return bind(eqn, [ins[0], *run.hoisted, *ins[1:]], params)


def _remat(run: _Evaluation, eqn: Any, ins: list[Any]) -> list[Any]:
    p = eqn.params
    body = jax.checkpoint(
        ft.partial(run.sub, p["jaxpr"]),
        prevent_cse=p["prevent_cse"],
        policy=p["policy"],
    )
    return list(body(*ins))


# The primitives `_Evaluation` evaluates with their nested constants given: each
# one bound again as JAX binds it (its own parameters, derivative rules and
# batching), its nested jaxprs closure-converted to take the constants as
# operands; a call's body is evaluated in place.
_EVALUATED: dict[Any, Callable[[_Evaluation, Any, list[Any]], list[Any]]] = {
    prims.jit_p: _inline,
    prims.closed_call_p: _inline,
    prims.remat_p: _remat,
    prims.custom_jvp_call_p: _with_consts("call_jaxpr", "num_consts"),
    prims.custom_vjp_call_p: _with_consts("call_jaxpr", "num_consts"),
    prims.scan_p: _with_consts("jaxpr", "num_consts"),
    prims.while_p: _while,
    prims.cond_p: _cond,
}
