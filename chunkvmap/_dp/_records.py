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
* `combine(a, b)` folds two chunks' summaries (None: they are added leaf by leaf).

`over_chunks` runs one over a call's examples. Adding a quantity is writing one
such class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._core._loop import Accumulator
from . import ghost


class Quantity:
    """An accumulator on the ghost record (see the module). `per_example`: the
    leaves whose gradients each record forms as they are (those no rule covers)."""

    per_example: Sequence[int] = ()
    combine: Callable[[Any, Any], Any] | None = None  # None: summaries are added

    def keep(self, record: ghost.Record, out: Any, *extra: Any) -> Any:
        raise NotImplementedError

    def chunk(self, kept: Any) -> tuple[Any, Any]:
        raise NotImplementedError


def over_chunks(
    transform: Any, traced: ghost.Traced, quantity: Quantity, args: tuple,
    in_axes: tuple, kwargs: dict, known: Any, padding: Any = None,
) -> Any:  # fmt: skip
    """`quantity`'s `(summary, rows)` over a call's examples (`args` mapped along
    `in_axes`), chunked by `transform`; `padding` (a boolean vector, or None)
    marks examples of a padded buffer as padding: `keep` then takes each
    example's flag, and chunks of padding alone are skipped."""
    n = len(args)
    extra = [] if padding is None else [padding]

    def example(*inputs: Any, **kw: Any) -> Any:
        values = traced.arrays(list(inputs[:n]), kw)
        record, out = traced.record(values, quantity.per_example)
        return quantity.keep(record, out, *inputs[n:])

    # (known by its chunk's trace: computes from the chunks' outputs alone, by the
    # plan their structure holds)
    accumulator = Accumulator(quantity.chunk, quantity.combine, pure=True)
    return transform.map(
        example, (*args, *extra), kwargs, (*in_axes, *[0] * len(extra)), 0,
        known=known, accumulator=accumulator, padding=None if padding is None else n,
    )  # fmt: skip
