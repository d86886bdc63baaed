"""`_equivalence.interchangeable`, kind by kind: each kind of object its module's
table lists, with one object that may stand for it and one that may not; the
table and these cases name the same kinds."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap._core import _equivalence


def _adder(c):
    return lambda x: x + c


def _counter(start):
    count = start

    def step():
        nonlocal count
        count += 1
        return count

    return step


class _Owner:
    def __init__(self, scale):
        self.scale = scale

    def apply(self, x):
        return x * self.scale


class _Keyed:
    """Stands for one of chunkvmap's quantities: says what it computes."""

    __module__ = "chunkvmap.stand_in"

    def __init__(self, clip):
        self.clip = clip

    def program_key(self):
        return ("clip", self.clip)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    scale: float
    fun: Any


@dataclasses.dataclass
class _Open:
    scale: float


# (as chunkvmap's own: set once the dataclasses are made)
_Frozen.__module__ = _Open.__module__ = "chunkvmap.stand_in"


class _Pair(NamedTuple):
    a: Any
    b: Any


_Pair.__module__ = "chunkvmap.stand_in"


class _Equal:
    """A user's object whose `==` says every instance is equal."""

    def __eq__(self, other):
        return isinstance(other, _Equal)

    __hash__ = object.__hash__


def _cases():
    shared = _Owner(2.0)
    one = [1]
    f = functools.partial(np.add, 1, out=None)
    same_array = jnp.ones(3)
    anything = _Equal()
    return {
        # id: (a, an object that may stand for it, one that may not)
        "same-object": (anything, anything, _Equal()),
        "immutable-values": ("relu", "relu", "gelu"),
        "floats-by-bits": (0.0, 0.0, -0.0),
        "tuples": ((1, 0.5, "x"), (1, 0.5, "x"), (1, 0.5, "y")),
        "plain-functions": (_adder(1.0), _adder(1.0), _adder(2.0)),
        "functions-rebinding-closure": (_counter(0), _counter(0), _counter(1)),
        "partials": (f, functools.partial(np.add, 1, out=None),
                     functools.partial(np.add, 1, out=np.zeros(1))),
        "bound-methods": (shared.apply, shared.apply, _Owner(2.0).apply),
        "builtin-methods": (one.append, one.append, [1].append),
        "chunkvmap-keyed": (_Keyed(1.0), _Keyed(1.0), _Keyed(2.0)),
        "frozen-dataclasses": (_Frozen(1.0, _adder(1.0)), _Frozen(1.0, _adder(1.0)),
                               _Frozen(1.0, _adder(3.0))),
        "jax-values": (jax.sharding.PartitionSpec("x", None),
                       jax.sharding.PartitionSpec("x", None),
                       jax.sharding.PartitionSpec(None, "x")),
        "arrays-by-identity": (same_array, same_array, jnp.ones(3)),
        "other-objects-by-identity": (anything, anything, _Equal()),
    }  # fmt: skip


KINDS = list(_cases())


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_stands_for_its_like_and_not_for_another(kind):
    a, like, other = _cases()[kind]
    same = _equivalence.interchangeable
    assert same(a, a)
    if kind == "functions-rebinding-closure":  # never, even made alike
        assert not same(a, like)
    else:
        assert same(a, like) and same(like, a)
    assert not same(a, other) and not same(other, a)
    if kind in ("bound-methods", "other-objects-by-identity", "same-object"):
        assert a is like or kind == "bound-methods"


def test_a_dataclass_that_is_not_frozen_stands_only_for_itself():
    a = _Open(1.0)
    assert _equivalence.interchangeable(a, a)
    assert not _equivalence.interchangeable(a, _Open(1.0))


def test_chunkvmap_named_tuples_compare_their_items():
    same = _equivalence.interchangeable
    assert same(_Pair(1, _adder(1.0)), _Pair(1, _adder(1.0)))
    assert not same(_Pair(1, _adder(1.0)), _Pair(1, _adder(2.0)))


def test_the_modules_table_names_these_kinds():
    """The module's table lists exactly the kinds tested here, in this order."""
    listed = re.findall(r"\(`([a-z-]+)`\)", _equivalence.__doc__)
    assert listed == KINDS
