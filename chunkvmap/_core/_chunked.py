"""Chunked evaluation: run one `Body` over the inputs, choosing how.

A front end has validated its inputs and traced one chunk of the user's function into
a `_loop.Body` (its outputs known, its chunk function reusing that trace); here the
evaluation is chosen: one vmap (the chunk is everything), stacked or folded chunks
(`_loop`), per-device chunks (`_sharding`), after a `batch_size="auto"` search
(`_memory`) when asked. Progress hooks are attached here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _axes, _conv, _loop, _memory, _progress, _sharding
from ._axes import Inputs
from ._options import ChunkOptions, identity


def body(
    options: ChunkOptions,
    chunk_fn: _loop.ChunkFn,
    axes: Sequence[int | None],
    signature: _loop.Signature,
    length: int,
) -> _loop.Body:
    """The `_loop.Body` of a traced chunk function (traced for chunks of `length`),
    combined as `options` say: stacked, folded by the user's reduction (checked here,
    once, before any loop is built: `summary_avals`), or accumulated by a front end's
    own `_loop.Accumulator` (prepared here for this signature, when it asks)."""
    accumulator = options.accumulator
    if accumulator is not None and accumulator.prepare is not None:
        accumulator = accumulator.prepare(signature, length)
    if accumulator is None and options.reduction is not None:
        summary = summary_avals(
            options.name, options.reduction, options.chunk_reduction,
            *signature, [length or 1],
        )  # fmt: skip
        accumulator = _loop.Accumulator.folding(
            options.reduction, options.chunk_reduction, summary
        )
    post = options.chunk_reduction if accumulator is None else identity
    # Every chunk's convolutions in the layout XLA:CPU runs fast inside a loop.
    chunk_fn = _conv.canonical(chunk_fn)
    return _loop.Body(
        options.name, chunk_fn, axes, signature, accumulator, post, options.remat
    )


def _aval_str(tree: Any) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def summary_avals(
    name: str,
    reduction: Callable[[Any, Any], Any],
    chunk_reduction: Callable[[Any], Any],
    out_tree: Any,
    out_avals: Sequence[Any],
    out_axes: Sequence[int | None],
    lengths: Sequence[int],
) -> Any:
    """Check that `chunk_reduction` removes the mapped axis and `reduction` is a fold.

    `chunk_reduction` is evaluated abstractly on chunks of every length that will occur
    (plus one more when only one does). If its output shapes depend on the chunk length,
    it did not reduce over the mapped axis, and folding such results would be wrong (or
    silently broadcast), so this is an error. `reduction(a, a)` must return `a`'s exact
    structure, shapes and dtypes, as a fold carry must.
    """
    lengths = sorted(set(lengths))
    if len(lengths) == 1:
        lengths.append(lengths[0] + 1)
    summaries = []
    for length in lengths:
        chunk = out_tree.unflatten(
            [_axes.stacked(a, ax, length) for a, ax in zip(out_avals, out_axes)]
        )
        summaries.append(jax.eval_shape(chunk_reduction, chunk))
    first = summaries[0]
    for length, other in zip(lengths[1:], summaries[1:]):
        same = jax.tree.structure(first) == jax.tree.structure(other) and all(
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other))
        )
        if not same:
            hint = (
                " chunk_reduction is the identity (the default): pass one that sums up "
                "a chunk along the mapped axis, e.g. chunk_reduction=lambda y: "
                "y.sum(0) with reduction=jnp.add, or drop reduction."
                if chunk_reduction is identity
                else " It must reduce over the mapped axis, e.g. lambda y: y.sum(0)."
            )
            raise ValueError(
                f"{name} with a reduction needs a chunk_reduction whose output does "
                f"not depend on the chunk length, but its output still has the mapped "
                f"axis: for a chunk of {lengths[0]} examples it returns "
                f"{_aval_str(first)}, for {length} examples {_aval_str(other)}.{hint}"
            )

    def combine(a: Any, b: Any) -> Any:
        out = _loop.fold(reduction, a, b)
        for leaf in jax.tree.leaves(out):
            if not isinstance(leaf, jax.Array):
                raise TypeError(f"it returned a value of type {type(leaf).__name__}")
        return out

    try:
        folded = jax.eval_shape(combine, first, first)
    except Exception as e:  # not traceable (np.add, max), or not array-valued
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TypeError(
            f"{name} reduction={reduction!r} must be a JAX-traceable function of two "
            f"chunk summaries returning one of the same structure (e.g. jnp.add, "
            f"jnp.maximum), but applying it to two summaries of {_aval_str(first)} "
            f"failed: {type(e).__name__}: {first_line}"
        ) from None
    same = jax.tree.structure(first) == jax.tree.structure(folded) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(folded))
    )
    if not same:
        raise ValueError(
            f"{name} reduction must combine two chunk summaries into one of the same "
            f"structure, shapes and dtypes (it is applied leaf by leaf), but on "
            f"{_aval_str(first)} it returns {_aval_str(folded)}."
        )
    return first


def zero_examples(name: str) -> ValueError:
    return ValueError(
        f"{name} cannot reduce over zero examples: the mapped axis has size 0 and the "
        f"reduction has no identity element to return. Check for empty inputs before "
        f"calling, or drop reduction."
    )


def evaluate(
    body: _loop.Body,
    inputs: Inputs,
    options: ChunkOptions,
    auto: _memory.AutoBatch | None,
    axis_name: Any = None,
) -> Any:
    """The user's output (stacked, or the folded summary) of `body` over `inputs`."""
    name = options.name
    if body.accumulator is not None and inputs.size == 0:
        raise zero_examples(name)
    lay = None
    if inputs.size:
        lay = _sharding.layout(
            name, options.shard, options.mesh, inputs.paths, inputs.leaves,
            body.axes, inputs.known,
        )  # fmt: skip
    one_device = lay is not None and lay.size == 1 and lay.explicit
    if one_device:
        # The examples' axis is sharded over one device: the plain loop runs on the
        # inputs without that (trivial) sharding, unmapped inputs sharded over it
        # included (where jax.vmap refuses them); stacked outputs get it back.
        leaves = _sharding.unlaid(lay, inputs.leaves)
        inputs = dataclasses.replace(inputs, leaves=leaves)
    if lay is not None and lay.size > 1:
        if axis_name is not None:
            raise ValueError(
                f"{name} got axis_name={axis_name!r} with examples split over the "
                f"mesh axes {lay.axes}: collectives over {axis_name!r} inside f would "
                f"only see one device's examples. Drop axis_name, or gather the "
                f"inputs first."
            )
        local = inputs.size // lay.size or inputs.size
        batch = _batch_size(body, inputs, options, auto, local, lay)
        result = _sharding.evaluate(body, inputs, lay, batch, options.reporter)
    else:
        batch = _batch_size(body, inputs, options, auto, inputs.size, None)
        plan = _loop.make_plan(inputs.size, batch)
        if axis_name is not None and not plan.single:
            raise ValueError(
                f"{name} got axis_name={axis_name!r} with {options.batch_arg}="
                f"{plan.batch} < {inputs.size} examples: collectives over "
                f"{axis_name!r} inside f would only see one chunk of "
                f"examples. Use {options.batch_arg}=None (or >= {inputs.size}) with "
                f"axis_name."
            )
        report = _progress.hook(options.reporter, plan.num_chunks)
        result = body.run(inputs.leaves, plan, report)
        if one_device:
            result = _sharding.laid_result(lay, body, result)
    return body.finish(result)


def _batch_size(
    body: _loop.Body,
    inputs: Inputs,
    options: ChunkOptions,
    auto: _memory.AutoBatch | None,
    size: int,
    lay: Any,
) -> int | None:
    """The chunk size: the options', or for "auto" the largest whose program (over
    `size` examples: each device's share when laid out) fits the budget."""
    if auto is None or not auto.search:
        if auto is not None:
            auto.used(options.batch_size, size)  # pyright: ignore[reportArgumentType]
        return options.batch_size  # pyright: ignore[reportReturnType]
    key = (inputs.key, lay, size)
    return auto.choose(key, _measure(body, inputs, size), size)


def _measure(body: _loop.Body, inputs: Inputs, size: int):
    """`B -> compiled temp bytes` of the chunked program over `size` examples (one
    device's program when `size` is its share), on abstract inputs."""
    abstract = [_axes.sized(inputs.leaves[i], body.axes[i], size) for i in inputs.dyn]

    def measure(batch: int) -> int:
        plan = _loop.make_plan(size, batch)

        def program(*values):
            full = list(inputs.leaves)
            for i, v in zip(inputs.dyn, values):
                full[i] = v
            return body.run(full, plan)

        return _memory.temp_bytes(body.name, program, abstract)

    return measure
