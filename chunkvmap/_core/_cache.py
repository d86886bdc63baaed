"""One eager cache for every entry point: compile once per argument structure.

Called eagerly (no argument is a tracer), a chunkvmap transform runs through one
`jax.jit` per call structure, kept in a small LRU, so a second call with arguments of
the same structure, types and static values reuses the compiled program instead of
tracing the user's function and compiling the chunked loop again. Under an outer
`jax.jit` the caller's cache does that, and the call goes straight through.

Caches that outlive one transform (`batch_map`'s, keyed by the user's `fun`; the
adapters', keyed by their options) hold their keys weakly (`memo`), so they never keep
a user's function alive and disappear with it.
"""

from __future__ import annotations

import collections
import functools as ft
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import numpy as np

from . import _memory


MAX_ENTRIES = 32

# A call: (positional arguments, keyword arguments, known shardings) -> result. The
# known shardings are those of an eager call's array arguments, by the id of the
# tracers that stand for them in the compiled program (a layout visible on concrete
# arrays stays visible inside, where a tracer's type shows only Explicit axes); empty
# for a call under an outer `jax.jit`, where the types say all there is to see.
Known = Mapping[int, Any]
Call = Callable[[tuple, dict, Known], Any]


class _LRU(collections.OrderedDict):
    """A bounded mapping that forgets its least recently used entry."""

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = build()
        self[key] = value
        if len(self) > MAX_ENTRIES:
            self.popitem(last=False)
        return value


class EagerCache:
    """`call(args, kwargs, known)` through one cached `jax.jit` per call structure.

    The key is the pytree structure of `(args, kwargs)` and the values of its non-array
    leaves (hashable Python values, which become constants of the program, as static
    arguments of `jax.jit` do); the array leaves are the jitted function's arguments,
    so `jax.jit` keys them by type and sharding. A call with a tracer, an unhashable
    non-array leaf, or (unless `numpy_arrays`) a NumPy array is evaluated directly.
    `numpy_arrays=True` is for entry points that convert NumPy inputs to JAX arrays
    anyway (so they can be arguments of the compiled program).
    """

    def __init__(self, call: Call, *, numpy_arrays: bool = False):
        self.call = call
        self.arrays = (jax.Array, np.ndarray) if numpy_arrays else (jax.Array,)
        self.entries = _LRU()

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        flat, treedef = jax.tree.flatten((args, kwargs))
        dyn, static = [], []
        for i, x in enumerate(flat):
            if isinstance(x, jax.core.Tracer):
                return self.call(args, kwargs, {})
            if isinstance(x, self.arrays):
                dyn.append(i)
                continue
            if isinstance(x, np.ndarray):
                return self.call(args, kwargs, {})
            try:
                hash(x)
            except TypeError:
                return self.call(args, kwargs, {})
            static.append((i, type(x), x))
        # The arrays' shardings are part of the key: a layout visible on them decides
        # how the call is chunked (and the call is told them, see `Call`).
        shardings = tuple(getattr(flat[i], "sharding", None) for i in dyn)
        key = (treedef, tuple(static), shardings)
        run = self.entries.get_or_build(
            key, lambda: self._compile(treedef, flat, dyn, shardings)
        )
        return run(*[flat[i] for i in dyn])

    def _compile(
        self, treedef: Any, flat: list, dyn: list[int], shardings: tuple
    ) -> Callable:
        template = list(flat)
        for i in dyn:
            template[i] = None  # the arrays of this call are not kept alive

        @jax.jit
        def run(*values: Any) -> Any:
            full = list(template)
            for i, v in zip(dyn, values):
                full[i] = v
            args, kwargs = jax.tree.unflatten(treedef, full)
            known = {id(v): s for v, s in zip(values, shardings) if s is not None}
            return self.call(args, kwargs, known)

        return run


_MEMO: weakref.WeakKeyDictionary[Any, _LRU] = weakref.WeakKeyDictionary()


def memo(owner: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()`, remembered for `(owner, key)` while `owner` lives (at most
    `MAX_ENTRIES` keys per owner). An owner that cannot be weakly referenced, or an
    unhashable key, is not remembered."""
    try:
        hash(key)
        entries = _MEMO.get(owner)
        if entries is None:
            entries = _MEMO[owner] = _LRU()
    except TypeError:
        return build()
    return entries.get_or_build(key, build)


def uncached(call: Call) -> Callable[[tuple, dict], Any]:
    """`call` run directly, with no known shardings (the arguments show their own)."""
    return lambda args, kwargs: call(args, kwargs, {})


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


def transform(
    call: Call,
    *,
    wrapped: Callable[..., Any],
    auto: Any = None,
    cached: bool = True,
    numpy_arrays: bool = False,
) -> Callable[..., Any]:
    """The public function of a transform: `call` through an `EagerCache` (when
    `cached`), with `wrapped`'s name and docstring, holding its `"auto"` state (when
    it has one) for `last_batch_size`."""
    run = EagerCache(call, numpy_arrays=numpy_arrays) if cached else uncached(call)

    @wraps(wrapped)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        return run(args, kwargs)

    if auto is not None:
        _memory.attach(transformed, auto)
    return transformed
