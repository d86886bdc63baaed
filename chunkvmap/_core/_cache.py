"""Eager calls: run under the call's mesh, compiled once per program, never stale.

Every call first resolves its mesh and runs under it (`_mesh.run_under`). Called
eagerly (no argument is a tracer), a transform's front end then runs eagerly, and the
chunked evaluation it reaches compiles once per distinct program
(`_chunked.evaluate`): the chunk is traced once per call (so the call sees the
function's closure as it is now, as `jax.vmap` does), the arrays that trace reads are
inputs of the compiled program (`_program.Trace`), and the program is looked up by
that trace and the inputs' types. A new array in the closure compiles nothing, and
no array of any call is kept. A front end that computes before the chunked
evaluation (the Jacobians' linearisation) traces the whole call instead
(`EagerCache(whole=True)`, `_program.run_traced`). Under an outer `jax.jit` the
caller's cache does all this, and the call goes straight through.

Caches that outlive one transform (`batch_map`'s, keyed by the user's `fun`; the
adapters', keyed by their options) hold their keys weakly and by identity (`memo`), so
they never keep a user's function alive, disappear with it, and never serve another
function that merely compares equal.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from . import _axes, _memory, _mesh, _program
from ._program import LRU


# A call: (positional arguments, keyword arguments, known shardings) -> result. The
# known shardings are those of an eager call's array arguments (`_axes.Known`), by the
# tracers that stand for them in the traced program (a layout visible on concrete
# arrays stays visible inside, where a tracer's type shows only Explicit axes); empty
# for a call under an outer `jax.jit`, where the types say all there is to see.
Known = _axes.Known
Call = Callable[[tuple, dict, Known], Any]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a transform's calls run: its `shard=` and `mesh=` options."""

    shard: Any = False
    mesh: Any = None


class EagerCache:
    """`call(args, kwargs, known)` under the call's mesh (`_mesh.run_under`).

    The call itself runs eagerly: the chunked evaluation it reaches compiles once
    per distinct program (`_chunked.evaluate`). With `whole`, an eager call (no
    argument a tracer) is traced whole instead and compiled once per distinct traced
    program (`_program.run_traced`): for front ends that compute before the chunked
    evaluation (a linearisation), so that their work is compiled too. A call with an
    unhashable non-array argument is evaluated directly.
    """

    def __init__(
        self, call: Call, *, placement: Placement = Placement(), whole: bool = False
    ):
        self.call = call
        self.placement = placement
        self.whole = whole
        self.entries = LRU()

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return _mesh.run_under(
            self.placement.shard, self.placement.mesh, self._run, args, kwargs
        )

    def _run(self, args: tuple, kwargs: dict, resolved: Any) -> Any:
        direct = _axes.Known(mesh=resolved)  # what a call run as it is knows
        if not self.whole:
            return self.call(args, kwargs, direct)
        flat, treedef = jax.tree.flatten((args, kwargs))
        dyn, static = [], []
        for i, x in enumerate(flat):
            if isinstance(x, jax.core.Tracer):
                return self.call(args, kwargs, direct)
            if isinstance(x, (jax.Array, np.ndarray)):
                dyn.append(i)
                continue
            try:
                hash(x)
            except TypeError:
                return self.call(args, kwargs, direct)
            static.append((i, type(x), x))
        values = [flat[i] for i in dyn]
        shardings = tuple(getattr(v, "sharding", None) for v in values)
        outs: list[Any] = []  # the output's structure and leaves that are not traced

        def program(*values: Any) -> Any:
            args, kwargs = jax.tree.unflatten(treedef, _axes.combine(flat, dyn, values))
            known = _axes.Known(list(zip(values, shardings)), resolved)
            leaves, tree = jax.tree.flatten(self.call(args, kwargs, known))
            outs[:] = [tree, leaves]
            return [x for x in leaves if isinstance(x, jax.core.Tracer)]

        key = (treedef, tuple(static), shardings, jax.sharding.get_abstract_mesh())
        traced = iter(_program.run_traced(program, values, self.entries, key))
        tree, leaves = outs
        leaves = [next(traced) if isinstance(x, jax.core.Tracer) else x for x in leaves]
        return tree.unflatten(leaves)


# Each owner's entries, by the owner's identity (never by its `==`: two callables
# that compare equal may compute different things), held while the owner lives.
_MEMO: dict[int, tuple[weakref.ref, LRU]] = {}


def _entries_of(owner: Any, make: bool) -> LRU | None:
    """`owner`'s entries (made where missing and `make`); None for an owner that
    cannot be weakly referenced."""
    held = _MEMO.get(id(owner))
    if held is not None and held[0]() is owner:
        return held[1]
    if not make:
        return None
    key = id(owner)

    def forget(ref: weakref.ref, memo: dict = _MEMO) -> None:
        # (`memo` bound now: at interpreter exit the module's globals may be gone)
        if memo.get(key, (None,))[0] is ref:
            del memo[key]

    try:
        ref = weakref.ref(owner, forget)
    except TypeError:
        return None
    entries = LRU()
    _MEMO[key] = (ref, entries)
    return entries


def memo(owner: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()`, remembered for `(owner, key)` while `owner` lives (at most
    `MAX_ENTRIES` keys per owner; the owner by identity). An owner that cannot be
    weakly referenced, or an unhashable key, is not remembered."""
    try:
        hash(key)
    except TypeError:
        return build()
    entries = _entries_of(owner, make=True)
    if entries is None:
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
        entries = _entries_of(fn, make=False)
        holder = None if entries is None else entries.get(_AUTO_KEY)
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
