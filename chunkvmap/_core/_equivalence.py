"""When one Python object can stand for another in a compiled program: the
equivalence by which the eager cache's keys (`Held`) and the ghost engine's kept
evaluations compare the objects a program holds (host callbacks, a loss's
closure, a quantity's settings).

`interchangeable(a, b)` accepts these kinds of objects, each beside its test
(`tests/test_equivalence.py`, `KINDS`, by its id: kind (id): when); anything
else only by identity:

* any object (`same-object`): it is the same object;
* ints, bools, strings, bytes, None, Ellipsis, dtypes, code
  (`immutable-values`): equal, of one type;
* floats, complex numbers, NumPy scalars (`floats-by-bits`): their bits are
  equal (0.0 is not -0.0);
* tuples, and chunkvmap's named tuples (`tuples`): their items are, pairwise;
* plain functions (`plain-functions`): the same code, globals, defaults and
  closure (each item compared this way);
* functions that rebind their closure, `nonlocal` (`functions-rebinding-closure`):
  never (once either has run, they differ);
* `functools.partial` (`partials`): their functions, arguments and keywords are;
* bound methods (`bound-methods`): of the same object (or of chunkvmap objects
  computing alike), their functions interchangeable;
* built-in methods, `some_list.append` (`builtin-methods`): of the same object,
  by name;
* chunkvmap's objects that say what they compute (`chunkvmap-keyed`): their
  `program_key`s are equal;
* frozen dataclasses of JAX and chunkvmap (`frozen-dataclasses`): their fields
  are (a dataclass that is not frozen: by identity);
* JAX's own values: meshes, shardings, partition specs (`jax-values`): equal;
* arrays, JAX's and NumPy's (`arrays-by-identity`): by identity only;
* anything else, a user's object even with `__eq__`
  (`other-objects-by-identity`): by identity only.

`weakly(key)` makes a key to keep between calls: the objects it holds referenced
weakly, or None where one may hold an array (`may_hold_arrays`) that a kept key
would keep alive.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools as ft
import struct
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


# Immutable values compared by value (floats by their bits: 0.0 is not -0.0).
VALUES = (int, bool, str, bytes, type(None), type(Ellipsis), np.dtype, types.CodeType)


def may_hold_arrays(value: Any, depth: int) -> bool:
    """Whether `value` (an object a key holds) is or may hold an array (kept, the
    key would keep that array alive after the user let it go), or is made anew at
    each trace (no later key would equal it)."""
    if depth > 8 or is_array(value):
        return True
    if value is None or isinstance(value, (*VALUES, float, complex, type)):
        return False
    if isinstance(value, (tuple, list)):
        return any(may_hold_arrays(x, depth + 1) for x in value)
    if isinstance(value, dict):
        return any(may_hold_arrays(x, depth + 1) for x in value.values())
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents for c in value.__closure__ or () if _filled(c)]
        return may_hold_arrays([*cells, *(value.__defaults__ or ())], depth + 1)
    if isinstance(value, ft.partial):
        parts = [value.func, value.args, value.keywords]
        return may_hold_arrays(parts, depth + 1)
    if isinstance(value, types.BuiltinFunctionType | types.ModuleType | enum.Enum):
        return False
    if _keyed(value):  # (a quantity: what it computes)
        return may_hold_arrays(value.program_key(), depth + 1)
    if dataclasses.is_dataclass(value) and module_of(value) == "chunkvmap":
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
        return may_hold_arrays(fields, depth + 1)
    if isinstance(value, Held):
        return may_hold_arrays(value.value, depth + 1)
    # JAX's own values (meshes, shardings, dimension numbers), but not the
    # functions it wraps at each trace (`f`: a custom rule's)
    return not jax_value(value) or hasattr(value, "f")


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # (an empty cell)
        return False
    return True


def is_array(c: Any) -> bool:
    return isinstance(c, (jax.Array, np.ndarray))


def opaque(value: Any) -> bool:
    """Whether a parameter is a Python object the program's text does not show
    completely (a callable, an object of the user's)."""
    if isinstance(value, (tuple, list)):
        return any(opaque(v) for v in value)
    if isinstance(value, type):
        return False
    if callable(value):
        return True
    return not isinstance(value, VALUES + (float, complex)) and not jax_value(value)


def jax_value(value: Any) -> bool:
    """A value of JAX's or NumPy's own types (meshes, shardings, dimension
    numbers, avals): immutable, and shown by the text."""
    return module_of(value) in ("jax", "jaxlib", "numpy", "ml_dtypes")


def module_of(value: Any) -> str:
    return type(value).__module__.split(".")[0]


class Held:
    """A key part for a Python object a program holds: equal to another while the
    two are interchangeable (`interchangeable`), compared when a key is looked up,
    so that a callable's state is read as it is then."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any):
        self.value = value
        code = getattr(_function(value), "__code__", None)
        self._hash = hash((type(value), code))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Held) and interchangeable(self.value, other.value)

    def __hash__(self) -> int:
        return self._hash


class WeakHeld:
    """`Held` of an object referenced weakly, for a key kept longer than the call
    that made it: equal to another while both objects live and are
    interchangeable."""

    __slots__ = ("ref", "_hash")

    def __init__(self, value: Any):
        self.ref = weakref.ref(value)
        code = getattr(_function(value), "__code__", None)
        self._hash = hash((type(value), code))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeakHeld):
            return False
        a, b = self.ref(), other.ref()
        return a is not None and b is not None and interchangeable(a, b)

    def __hash__(self) -> int:
        return self._hash


def weakly(key: Any) -> Any:
    """`key` to be kept between calls: the objects it holds (`Held`) referenced
    weakly where they can be (`WeakHeld`), so that it keeps none of them alive;
    None where it holds an object that cannot be kept (`may_hold_arrays`)."""
    try:
        return _weakly(key)
    except _NotKeepable:
        return None


class _NotKeepable(Exception):
    pass


def _weakly(key: Any) -> Any:
    if isinstance(key, Held):
        if may_hold_arrays(key.value, 0):
            raise _NotKeepable
        try:
            return WeakHeld(key.value)
        except TypeError:  # (not weakly referable: kept as it is)
            return key
    if type(key) is tuple:
        return tuple(_weakly(x) for x in key)
    return key


def _function(value: Any) -> Any:
    """The plain function a partial or a bound method wraps (itself otherwise)."""
    while isinstance(value, (ft.partial, types.MethodType)):
        value = value.func if isinstance(value, ft.partial) else value.__func__
    return value


def interchangeable(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether `a` can stand for `b` in a compiled program: the same object; equal
    immutable values of one type (floats by their bits); plain functions with the
    same code, globals, defaults and closure (each compared this way; the dicts
    and lists in the closure of JAX's own functions by their items), that never
    rebind their closure (`nonlocal`); partials and bound methods of
    interchangeable functions (a method of the same object, a built-in one by its
    name); JAX's own frozen dataclasses (and chunkvmap's, and its named tuples)
    with interchangeable fields; chunkvmap's objects that say what they compute
    (`program_key`, as a ghost quantity does) by that. Anything else only by
    identity."""
    if a is b:
        return True
    if type(a) is not type(b) or depth > 8:
        return False
    if isinstance(a, VALUES):
        return a == b
    if isinstance(a, (float, complex, np.generic)):
        return bits(a) == bits(b)
    if type(a) is tuple or (isinstance(a, tuple) and module_of(a) == "chunkvmap"):
        return len(a) == len(b) and _all(a, b, depth)  # (chunkvmap's named tuples)
    if isinstance(a, types.FunctionType):
        return _same_function(a, b, depth)
    if isinstance(a, ft.partial):
        return (
            interchangeable(a.func, b.func, depth + 1)
            and _all(a.args, b.args, depth)
            and _same_dict(a.keywords, b.keywords, depth)
        )
    if isinstance(a, types.BuiltinMethodType):  # `some_list.append`, `max`
        return a.__self__ is b.__self__ and a.__name__ == b.__name__
    if isinstance(a, types.MethodType):
        return _same_owner(a.__self__, b.__self__) and interchangeable(
            a.__func__, b.__func__, depth + 1
        )
    if _keyed(a):
        return _same_owner(a, b)
    if dataclasses.is_dataclass(a) and module_of(a) in ("jax", "chunkvmap"):
        frozen = type(a).__dataclass_params__.frozen  # pyright: ignore
        fields = [f.name for f in dataclasses.fields(a)]
        return frozen and _all(
            [getattr(a, f) for f in fields], [getattr(b, f) for f in fields], depth
        )
    if jax_value(a) and not is_array(a):  # arrays: only by identity
        try:
            return bool(a == b) and not callable(a)
        except Exception:  # noqa: BLE001 (an array's elementwise ==)
            return False
    return False


def _keyed(value: Any) -> bool:
    """Whether `value` is one of chunkvmap's objects that says what it computes
    (`program_key`: a ghost quantity, `_records.Quantity`)."""
    return module_of(value) == "chunkvmap" and callable(
        getattr(type(value), "program_key", None)
    )


def _same_owner(a: Any, b: Any) -> bool:
    """Whether the methods of `a` and `b` are interchangeable: the same object, or
    two of chunkvmap's objects of one type that say they compute alike."""
    if a is b:
        return True
    return type(a) is type(b) and _keyed(a) and a.program_key() == b.program_key()


def _all(a: Sequence[Any], b: Sequence[Any], depth: int) -> bool:
    return len(a) == len(b) and all(
        interchangeable(x, y, depth + 1) for x, y in zip(a, b)
    )


def _same_dict(a: dict | None, b: dict | None, depth: int) -> bool:
    a, b = a or {}, b or {}
    return a.keys() == b.keys() and _all(list(a.values()), [b[k] for k in a], depth)


def bits(x: Any) -> bytes:
    if isinstance(x, np.generic):
        return x.dtype.str.encode() + x.tobytes()
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return struct.pack("<d", x)


def _same_function(a: types.FunctionType, b: types.FunctionType, depth: int) -> bool:
    if (
        a.__code__ != b.__code__
        or a.__globals__ is not b.__globals__
        or _rebinds_closure(a.__code__)
        or not _all(a.__defaults__ or (), b.__defaults__ or (), depth)
        or not _same_dict(a.__kwdefaults__, b.__kwdefaults__, depth)
        or a.__dict__ != b.__dict__
    ):
        return False
    cells_a, cells_b = _cells(a), _cells(b)
    if a.__module__.split(".")[0] == "jax":
        # JAX's own callbacks' wrappers: made anew at every trace, and never
        # changing the dicts and lists they hold (a callback's static arguments)
        cells_a, cells_b = _frozen(cells_a), _frozen(cells_b)
    return _all(cells_a, cells_b, depth)


def _frozen(values: list[Any]) -> list[Any]:
    """Lists and dicts as tuples of their items (keys sorted by their text)."""
    return [
        tuple(sorted(v.items(), key=lambda kv: repr(kv[0])))
        if type(v) is dict
        else tuple(v)
        if type(v) is list
        else v
        for v in values
    ]


_EMPTY = object()


def _cells(f: types.FunctionType) -> list[Any]:
    out = []
    for cell in f.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(_EMPTY)
    return out


@ft.lru_cache(maxsize=1024)
def _rebinds_closure(code: types.CodeType) -> bool:
    """Whether a function of `code` rebinds a variable of its closure
    (`nonlocal x; x = ...`): two such functions differ once either has run."""
    return any(
        ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in code.co_freevars
        for ins in dis.get_instructions(code)
    )
