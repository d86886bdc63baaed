"""One eager cache for every entry point: compile once per program, never stale.

Called eagerly (no argument is a tracer), a chunkvmap transform traces its whole
evaluation to a jaxpr (`jax.make_jaxpr`: the user's function and the chunked loop,
no compilation) and runs it through one compiled program per distinct program, kept
in a small LRU. Two calls share a compiled program when their programs compute the
same function of the same arguments (`_program.Program`: the jaxpr's text, every
Python object it holds, where its nested constants sit) and their arguments have the
same types and shardings. Every array that can change between calls is an argument
of the compiled program, passed anew at every call: the arrays the trace closed over
(a closure's arrays, a model's weights held in a global) and those a nested
`jax.jit` closed over. So an eager call returns what `jax.vmap` would return for the
function as it is now, a repeated call costs a trace, not a compilation, and the
cache keeps no array of any call alive. A function closing over a tracer (`jax.grad`
with respect to a value it closes over) is evaluated as traced, under that
transformation, and nothing is kept. Under an outer `jax.jit` the caller's cache
does that, and the call goes straight through.

Every call first resolves its mesh and runs under it (`_mesh.run_under`).

Caches that outlive one transform (`batch_map`'s, keyed by the user's `fun`; the
adapters', keyed by their options) hold their keys weakly (`memo`), so they never keep
a user's function alive and disappear with it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools as ft
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from . import _axes, _memory, _mesh, _program


MAX_ENTRIES = 32

# A call: (positional arguments, keyword arguments, known shardings) -> result. The
# known shardings are those of an eager call's array arguments (`_axes.Known`), by the
# tracers that stand for them in the traced program (a layout visible on concrete
# arrays stays visible inside, where a tracer's type shows only Explicit axes); empty
# for a call under an outer `jax.jit`, where the types say all there is to see.
Known = _axes.Known
Call = Callable[[tuple, dict, Known], Any]


class LRU(collections.OrderedDict):
    """A bounded mapping that forgets its least recently used entry."""

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of `key` (built when missing)."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = build()
        self[key] = value
        if len(self) > MAX_ENTRIES:
            self.popitem(last=False)
        return value


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a transform's calls run: its `shard=` and `mesh=` options."""

    shard: Any = False
    mesh: Any = None


class EagerCache:
    """`call(args, kwargs, known)` under the call's mesh, through one compiled
    program per traced program (see the module docstring).

    A call with a tracer, an unhashable non-array leaf, or (unless `numpy_arrays`) a
    NumPy array is evaluated directly. `numpy_arrays=True` is for entry points that
    convert NumPy inputs to JAX arrays anyway (so they can be arguments of the
    compiled program).
    """

    def __init__(
        self,
        call: Call,
        *,
        numpy_arrays: bool = False,
        placement: Placement = Placement(),
        cached: bool = True,
    ):
        self.call = call
        self.arrays = (jax.Array, np.ndarray) if numpy_arrays else (jax.Array,)
        self.placement = placement
        self.cached = cached
        self.entries = LRU()

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return _mesh.run_under(
            self.placement.shard, self.placement.mesh, self._run, args, kwargs
        )

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if not self.cached:
            return self.call(args, kwargs, _axes.NOTHING_KNOWN)
        flat, treedef = jax.tree.flatten((args, kwargs))
        dyn, static = [], []
        for i, x in enumerate(flat):
            if isinstance(x, jax.core.Tracer):
                return self.call(args, kwargs, _axes.NOTHING_KNOWN)
            if isinstance(x, self.arrays):
                dyn.append(i)
                continue
            if isinstance(x, np.ndarray):
                return self.call(args, kwargs, _axes.NOTHING_KNOWN)
            try:
                hash(x)
            except TypeError:
                return self.call(args, kwargs, _axes.NOTHING_KNOWN)
            static.append((i, type(x), x))
        values = [flat[i] for i in dyn]
        # The arrays' shardings decide how the call is chunked (and the call is told
        # them, see `Call`).
        shardings = tuple(getattr(v, "sharding", None) for v in values)

        def traced(*values: Any) -> Any:
            full = list(flat)
            for i, v in zip(dyn, values):
                full[i] = v
            args, kwargs = jax.tree.unflatten(treedef, full)
            known = _axes.Known(list(zip(values, shardings)))
            return self.call(args, kwargs, known)

        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*values)
        consts = list(closed.consts)
        out_tree = jax.tree.structure(out_shape)
        if any(isinstance(c, jax.core.Tracer) for c in consts):
            # The function closes over a value that an outer transformation traces
            # (`jax.grad` with respect to it, say): the program is evaluated as
            # traced, under that transformation (its derivative rules with it),
            # and not kept.
            out = jax.core.eval_jaxpr(closed.jaxpr, consts, *values)
            return jax.tree.unflatten(out_tree, out)
        program = _program.Program.of(closed.jaxpr)
        key = (
            treedef,
            tuple(static),
            shardings,
            jax.sharding.get_abstract_mesh(),
            tuple(_const_type(c) for c in consts),
            tuple(_const_type(c) for c in program.hoisted),
            program.key,
        )
        args = (consts, program.hoisted, *values)
        run = self.entries.get_or_build(
            key, lambda: program.compiled().lower(*args).compile()
        )
        out = run(*args)
        return jax.tree.unflatten(out_tree, out)


def _const_type(c: Any) -> Any:
    """A constant's type, with its sharding (an argument of the compiled
    program)."""
    return (jax.typeof(c), getattr(c, "sharding", None))


_MEMO: weakref.WeakKeyDictionary[Any, LRU] = weakref.WeakKeyDictionary()


def memo(owner: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()`, remembered for `(owner, key)` while `owner` lives (at most
    `MAX_ENTRIES` keys per owner). An owner that cannot be weakly referenced, or an
    unhashable key, is not remembered."""
    try:
        hash(key)
        entries = _MEMO.get(owner)
        if entries is None:
            entries = _MEMO[owner] = LRU()
    except TypeError:
        return build()
    return entries.get_or_build(key, build)


_AUTO_KEY = "chunkvmap: batch_size state"


def auto_state_of(fun: Any, name: str, limit: int | None, search: bool) -> Any:
    """The chunk-size state of `batch_map(fun, ...)` calls with budget `limit`,
    remembered with `fun`'s caches (a new one when the budget changes)."""
    holder = memo(fun, _AUTO_KEY, lambda: [None])
    state = holder[0]
    if state is None or (state.limit, state.search) != (limit, search):
        state = holder[0] = _memory.AutoBatch(name, limit, search)
    return state


def last_batch_size(fn: Callable[..., Any] | None = None) -> int | None:
    """The chunk size that `batch_size="auto"` chose most recently.

    Args:
      fn: a function returned by a chunkvmap transform built with `batch_size="auto"`
        (`batch_vmap`, `per_example_grads`, `clipped_grad_sum`, `batch_jacfwd`,
        `batch_jacrev`, `batch_vectorize`, the adapters), or the `fun` given to
        `batch_map(fun, xs, "auto")`. None (the default) means the most recent choice
        made by any call.

    Returns:
      The batch size chosen by the most recent call (of `fn`, when given), or None if
      no such call has happened yet.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import batch_vmap, last_batch_size
      >>> f = batch_vmap(jnp.sin, batch_size="auto", memory_limit="1MiB")
      >>> y = f(jnp.ones((1000, 100)))
      >>> 1 <= last_batch_size(f) <= 1000
      True
    """
    if fn is None:
        return _memory.most_recent()
    state = _memory.state_of(fn)
    if state is None:  # batch_map's `fun`: its state is remembered with its caches
        try:
            holder = _MEMO.get(fn, {}).get(_AUTO_KEY)
        except TypeError:  # not weak-referenceable: never remembered
            holder = None
        state = holder[0] if holder else None
    return None if state is None else state.last


def function_name(f: Any) -> str:
    """The user's function as messages name it: its qualified name, a partial's
    function, or the type of a callable object (an Equinox Module, say)."""
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    if isinstance(name, str):
        return name
    if isinstance(f, ft.partial):
        return f"partial({function_name(f.func)})"
    return type(f).__qualname__


def wraps(fun: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """`functools.wraps` without copying `fun.__dict__` (an Equinox Module's fields);
    a wrapper of a function without a name of its own (a partial, a callable object)
    takes `function_name(fun)`, so that messages never name the wrapper."""

    def decorate(wrapper: Callable[..., Any]) -> Any:
        wrapper = ft.wraps(fun, updated=())(wrapper)
        if not isinstance(getattr(fun, "__qualname__", None), str):
            wrapper.__name__ = wrapper.__qualname__ = function_name(fun)
        return wrapper

    return decorate
