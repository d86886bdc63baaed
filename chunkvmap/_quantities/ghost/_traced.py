"""Tracing one example's loss to a jaxpr of its array leaves, with its ghost plan
(one per mesh context)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._core import _axes, _equivalence, _program
from ._plan import Plan, Record


def _one_example_sharding(aval: Any, stripped: bool) -> Any:
    """The sharding type of one example of `aval` (its leading axis removed when
    `stripped`), where it has one on an explicit mesh; else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
    return jax.sharding.NamedSharding(mesh, jax.P(*(spec[1:] if stripped else spec)))


def _scalar(c: Any) -> Any:
    """A scalar constant by its value (its bits), a traced one by identity, a typed
    PRNG key by its type alone (the analysis reads neither: `known_value`)."""
    if isinstance(c, jax.core.Tracer):
        return _equivalence.Held(c)
    if jnp.issubdtype(c.dtype, jax.dtypes.prng_key):
        return ("prng key", str(jax.typeof(c)))
    value = np.asarray(c)
    return (value.dtype.str, value.tobytes())


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
            f"element), but it returns {shown_types(traced.value_shape)}."
        )


def shown_types(shape: Any) -> str:
    """An output's types as a message shows them (a pytree of `dtype[shape]`)."""
    text = str(jax.tree.map(lambda s: jax.typeof(s).str_short(), shape))
    return text.replace("'", "")


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
        avals, positions, paths, example_positions = self._flatten(
            args, kwargs, mapped, strip
        )
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

        self._avals, self._example_positions = avals, list(example_positions)
        closed, shape = jax.make_jaxpr(one, return_shape=True)(avals)
        self.out_tree = jax.tree.structure(shape)
        # (the loss or model output: one array, never the first of several)
        self.value_shape = shape[0]
        bare = jax.tree.structure(shape[0]) == jax.tree.structure(0)
        self.value_aval = shape[0] if bare else None
        self.closed = closed
        self._one = one
        self._plan_args = (positions, example_positions, paths)
        self._plan: Plan | None = None
        self._plans: dict[Any, Plan] = {}
        self._static = [
            x for x in jax.tree.leaves((args, kwargs)) if not _axes.is_array(x)
        ]
        self._quantities: dict[Hashable, Any] = {}
        self._key: Hashable | None = None
        self._exact: tuple | None = None

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()`, kept with this loss for `key`: what a quantity derives from
        the plan once (which leaves it forms, masks or pairs), kept and forgotten
        with the plan itself."""
        if key not in self._quantities:
            self._quantities[key] = build()
        return self._quantities[key]

    @property
    def plan(self) -> Plan:
        """The loss's ghost plan (analysed on first use)."""
        if self._plan is None:
            here = jax.sharding.get_abstract_mesh()
            types = tuple(self._leaf_types(self._avals))
            self._plan = Plan(
                self.closed, *self._plan_args, key=(self.key(), here, types)
            )
            self._plans = {(here, types): (self._plan, None)}
        return self._plan

    def key(self) -> Hashable:
        """What the plan depends on: the loss's program (`_program.Trace`), the
        types of what it reads and the values of its scalars among them (a
        constant scale between a leaf and its use is part of the use), the
        arguments' structure and non-array values, the mesh. (Computed once: a
        loss adopted later has the same key.)"""
        if self._key is None:
            self._key = self._computed_key()
        return self._key

    def _computed_key(self) -> Hashable:
        trace = _program.Trace.of(self.closed)
        return (
            trace.key,
            tuple(jax.typeof(c) for c in trace.consts),
            tuple(_scalar(c) for c in trace.consts if np.ndim(c) == 0),
            tuple(self._avals),
            tuple(_equivalence.Held(x) for x in self._static),
            tuple((tree, tuple(arr)) for tree, arr in self.arg_defs),
            self.diff,
            self.batch_args,
            self.keep_batch_dim,
            tuple(self._example_positions),
            jax.sharding.get_abstract_mesh(),
        )

    def adopt(self, other: Traced) -> None:
        """Evaluate `other`'s loss (a later call's, of the same `key`) with this
        plan: its jaxpr (the arrays it reads) and its function."""
        self.closed = other.closed
        self._one = other._one
        self._exact = None
        here = jax.sharding.get_abstract_mesh()
        self._plans = {(here, tuple(self._leaf_types(self._avals))): (self.plan, None)}

    def release(self) -> None:
        """Let go of the arrays of the call that made or adopted this loss (its
        jaxprs' constants, the closure of its function and the call's arguments):
        kept with the plan between calls, they would outlive the user's. The next
        call `adopt`s its own."""
        self.closed = None  # pyright: ignore[reportAttributeAccessIssue]
        self._one = None  # pyright: ignore[reportAttributeAccessIssue]
        self._exact = None
        if self._plan is not None:
            here = next(k for k, (v, _) in self._plans.items() if v is self._plan)
            self._plans = {here: (self._plan, None)}

    def _flatten(self, args, kwargs, mapped, strip) -> tuple[list, ...]:
        """The types of one example's array leaves (the jaxpr's inputs), the
        positions and key paths of the differentiated ones among them, and the
        positions of the examples' leaves; notes each argument's structure
        (`arg_defs`) and which of its array leaves are differentiated
        (`diff_masks`)."""
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
        return avals, positions, paths, example_positions

    def _leaf_types(self, values: Sequence[Any]) -> list[Any]:
        # (the plan's `diff_positions`, known before the plan is made)
        return [jax.typeof(values[i]) for i in self._plan_args[0]]

    def plan_here(self, values: Sequence[Any]) -> tuple[Plan, Any]:
        """The plan for one example's `values` in the current mesh context, and
        the call's program it evaluates (`Plan.backward`). A jaxpr carries the mesh
        and the shardings it was traced with; inside a `shard_map` (some axes
        manual) the loss is traced again, on `values` there, with the same plan's
        rules (checked)."""
        key = self._here(values)
        mesh = key[0]
        found = self._plans.get(key)
        if found is not None:
            plan, closed = found
            return plan, self.closed if closed is None else closed
        closed = jax.make_jaxpr(self._one)(list(values))
        plan = Plan(closed, *self._plan_args, key=(self.key(), *key))
        if [(x.rule, [u.key for u in x.uses]) for x in plan.leaves] != [
            (x.rule, [u.key for u in x.uses]) for x in self.plan.leaves
        ]:
            raise RuntimeError(
                "ghost clipping: the loss traces differently under the mesh "
                f"{mesh}; use method='vmap' here."
            )
        self._plans[key] = (plan, closed)
        return plan, closed

    def record(
        self, values: Sequence[Any], per_example: Sequence[int], taps=()
    ) -> tuple[Record, Any]:
        """One example's ghost evaluation at its array leaves `values` (`arrays`),
        by its plan in the current mesh context (`plan_here`): its `Record` (the
        gradients of the leaves `per_example` formed as they are, the norms of
        the leaves `taps` taken in the backward pass), and the loss's
        `(value, aux)`. Every quantity's examples are evaluated here."""
        plan, closed = self.plan_here(values)
        record, outs = plan.backward(closed, values, per_example, taps)
        return record, self.out_tree.unflatten(outs)

    def evaluated(self, quantity: Any, values: list, extra: Sequence[Any]) -> Any:
        """`quantity.evaluate(self, values, *extra)`: traced once per quantity
        (`program_key`: its loss's plan and what it was made with), exact loss
        program (`_program.exact_key`: its rules and nested constants) and mesh,
        and reused by every transform, the loss's constants its arguments (an
        eager call traces the instrumented example again only where something it
        reads changed). A quantity that is not `reusable`, a key that cannot be
        kept (`_equivalence.weakly`), or a mesh context with a plan of its own
        (inside `shard_map`): traced as it is called."""
        plan = self._plans.get(self._here(values))
        if not quantity.reusable or plan is None or plan[1] is not None:
            return quantity.evaluate(self, values, *extra)
        exact = self._exact_key()  # (walked and its JVP rules traced: last)
        made = None if exact is None else _equivalence.weakly(quantity.program_key())
        if made is None:
            return quantity.evaluate(self, values, *extra)
        key = (made, exact, jax.sharding.get_abstract_mesh())
        run, calling = _EVALUATIONS.get_or_build(key, _reusable)
        calling.append((self, quantity))  # (read by a trace, let go after it)
        try:
            return run(list(self.closed.consts), list(values), tuple(extra))
        finally:
            calling.pop()

    def _exact_key(self) -> Hashable | None:
        """`_program.exact_key` of this call's loss (computed once per jaxpr);
        to be kept (`_equivalence.weakly`), or None where it cannot be (it holds an
        array, a nested jaxpr's constant or in a rule's closure, or a custom VJP
        rule's function, which each trace makes anew)."""
        if self._exact is None or self._exact[0] is not self.closed:
            key = _program.exact_key(self.closed.jaxpr)
            self._exact = (self.closed, _equivalence.weakly(key))
        return self._exact[1]

    def _here(self, values: Sequence[Any]) -> Hashable:
        """The key of the current mesh context's plan (`plan_here`)."""
        return (jax.sharding.get_abstract_mesh(), tuple(self._leaf_types(values)))

    def at_leaves(self, values: Sequence[Any], leaves: Sequence[Any]) -> list:
        """The array leaves `values` with the differentiated ones replaced by
        `leaves` (in the plan's order)."""
        return _axes.combine(values, self.plan.diff_positions, leaves)

    def loss(self, values: Sequence[Any]) -> Any:
        """One example's loss at its array leaves `values`: `fun` called on them, as
        a function mapped by the transform is (its jaxpr, traced with this call's
        types, would carry their shardings into the devices' shares)."""
        return self._one(list(values))[0]

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


# The reused evaluations (`Traced.evaluated`), by what they compute: each a jitted
# function and the stack of the `(traced, quantity)` a call of it evaluates.
_EVALUATIONS = _program.LRU(32)


def _reusable() -> tuple[Callable[..., Any], list]:
    """A quantity's `evaluate` as a jitted function of the loss's constants, the
    example's array leaves and the extras, with the `(traced, quantity)` it
    evaluates read at its trace from the list returned beside it (the caller's,
    pushed for the call: the function keeps none). The loss is evaluated from its
    jaxpr at those constants; its own function, whose closure holds the call's
    arrays, is not called."""
    calling: list = []

    def evaluate(consts: list, values: list, extra: tuple) -> Any:
        traced, quantity = calling[-1]
        closed, one = traced.closed, traced._one
        traced.closed = closed.replace(consts=list(consts))
        traced._one = _not_called
        try:
            return quantity.evaluate(traced, values, *extra)
        finally:
            traced.closed, traced._one = closed, one

    return jax.jit(evaluate), calling


def _not_called(values: list) -> Any:
    raise AssertionError("a reused evaluation called the loss's own function")


def traced_loss(
    memo: Callable[[Hashable, Callable[[], Any]], Any],
    name: str,
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict,
    diff: Sequence[int],
    *,
    in_axes: Sequence[Any],
    has_aux: bool = False,
    keep_batch_dim: bool = False,
    expand: Sequence[int] | None = None,
    check: Callable[[str, Traced], None] = check_scalar_loss,
) -> Traced:
    """The ghost evaluation's set-up, for every quantity made from it (clipped
    sums, norms, moments, dot products, curvature): one example's loss traced
    (`Traced`: the arguments `in_axes` maps are the examples', their examples' axis
    stripped), checked, and the plan of an earlier call with the same loss program
    (`Traced.key`) kept by `memo(key, build)` (a transform's) and made to evaluate
    this call's loss, so that an eager call plans once. A quantity built from it is
    kept with it (`Traced.memo`). `check` checks what `fun` returns (a real scalar
    loss, by default); `has_aux`, `keep_batch_dim` and `expand` are `Traced`'s."""
    mapped = [i for i, a in enumerate(in_axes) if a is not None]
    traced = Traced(
        fun, list(args), kwargs, diff, mapped, strip=True, has_aux=has_aux,
        keep_batch_dim=keep_batch_dim, expand=expand,
    )  # fmt: skip
    check(name, traced)
    key = traced.key()
    kept = memo(("ghost loss", key), lambda: traced)
    if kept is not traced:
        kept.adopt(traced)
    return kept
