"""Quantities of per-example gradients made from ghost records, chunk by chunk.

Every quantity of the examples' gradients that `method="ghost"` computes (the
clipped sums and norms, the moments, the Gram matrix's parts) reads one record per
example: `ghost.Traced.record` evaluates the example's loss once with probes, and
its `ghost.Record` holds each use's activations and cotangents and the gradients
formed per example. A quantity is an accumulator on that record:

* `keep(record, out, *extra)`, per example (under `jax.vmap`): what the chunk keeps
  of the record (a `Record` narrowed to what it needs, or values made from it)
  and anything else it needs of the example (`out` is the loss's
  `(value, aux)`, `extra` the per-example inputs the caller added);
* `chunk(kept)`, per chunk (the chunk's examples stacked along axis 0, records
  with the plan that made them): `(summary, rows)`, as `_loop.Accumulator.summarise`;
* `combine(a, b)` folds two chunks' summaries (None: they are added leaf by leaf);
* `uncount(kept, fresh)`, where given: the chunk's kept outputs with only the
  examples `fresh` marks counted (`_loop.Accumulator.uncount`).

`evaluate(traced, values, *extra)` makes one example's record and keeps it: by
default one backward pass (`Traced.record`); a quantity of several cotangents per
example (the curvature's) pulls them back through one linearised evaluation
(`Plan.pullback`).

`over_chunks` runs one over a call's examples. Adding a quantity is writing one
such class, with `made_with()`: what it was made with besides its loss (its
options), so that two transforms built alike (one built anew at every call) share
one compiled program (`program_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .._core import _equivalence
from .._core._loop import Accumulator
from . import ghost


class Quantity:
    """An accumulator on the ghost record (see the module). `per_example`: the
    leaves whose gradients each record forms as they are (those no rule covers)."""

    per_example: Sequence[int] = ()
    taps: Sequence[int] = ()  # the leaves whose norms are taken in the backward pass
    combine: Callable[[Any, Any], Any] | None = None  # None: summaries are added
    uncount: Callable[[Any, Any], Any] | None = None

    traced: ghost.Traced

    # Whether `evaluate` reads nothing but its arguments, its loss (`traced`) and
    # what the quantity was `made_with`: its trace is then kept and reused
    # (`Traced.evaluated`) by an eager call whose loss and quantity are the same.
    reusable: bool = True

    def made_with(self) -> tuple:
        """What the quantity was made with besides its loss (`traced`): every value
        its methods read that the loss's plan does not determine."""
        raise NotImplementedError

    def program_key(self) -> Hashable:
        """What the quantity computes: its type, its loss's plan (`Traced.key`) and
        what it was `made_with` (held: each compared as
        `_equivalence.interchangeable` does).
        Two quantities of equal keys compute alike, so an eager program of either
        serves both (`_equivalence.interchangeable` compares them by it)."""
        made = tuple(_equivalence.Held(x) for x in self.made_with())
        return (type(self), self.traced.key(), made)

    def keep(self, record: ghost.Record, out: Any, *extra: Any) -> Any:
        raise NotImplementedError

    def evaluate(self, traced: ghost.Traced, values: list, *extra: Any) -> Any:
        """What the chunk keeps of one example at its array leaves `values`."""
        record, out = traced.record(values, self.per_example, self.taps)
        return self.keep(record, out, *extra)

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        raise NotImplementedError


def over_chunks(
    transform: Any, traced: ghost.Traced, quantity: Quantity, args: tuple,
    in_axes: tuple, kwargs: dict, *, known: Any, padding: Any = None,
    extra: Sequence[Any] = (), extra_axes: Sequence[Any] | None = None,
) -> Any:  # fmt: skip
    """`quantity`'s `(summary, rows)` over a call's examples (`args` mapped along
    `in_axes`), chunked by `transform`; `extra` are more per-example inputs (each
    mapped along `extra_axes`, by default axis 0) that `keep` takes after the
    record; `padding` (a boolean
    vector, or None) marks examples of a padded buffer as padding: `keep` then
    takes each example's flag last, and chunks of padding alone are skipped."""
    n = len(args)
    axes = [*([0] * len(extra) if extra_axes is None else extra_axes)]
    extra = [*extra, *([] if padding is None else [padding])]
    axes += [0] * (len(extra) - len(axes))

    def example(*inputs: Any, **kw: Any) -> Any:
        values = traced.arrays(list(inputs[:n]), kw)
        return traced.evaluated(quantity, values, inputs[n:])

    # (known by its chunk's trace: computes from the chunks' outputs alone, by the
    # plan their structure holds)
    accumulator = Accumulator(
        quantity.chunk, quantity.combine, uncount=quantity.uncount, pure=True
    )
    return transform.map(
        example, (*args, *extra), kwargs, (*in_axes, *axes), 0,
        known=known, accumulator=accumulator,
        padding=None if padding is None else n + len(extra) - 1,
    )  # fmt: skip
