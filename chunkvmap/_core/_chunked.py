"""Chunked evaluation: run one `Body` over the inputs, choosing how.

A front end validates its inputs and asks here where the examples run (`layout`),
before it traces one chunk of the user's function: at the length the loop's chunks
have (`chunk_length`), in the context they run in (`tracing`), into a `_loop.Body`
(its outputs known, its chunk function reusing that trace). Then the evaluation is
chosen: one vmap (the chunk is everything), stacked or folded chunks (`_loop`),
per-device chunks (`_sharding`), after a `batch_size="auto"` search (`_memory`)
when asked. Progress hooks are attached here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import (
    _accumulators,
    _axes,
    _conv,
    _equivalence,
    _loop,
    _memory,
    _program,
    _progress,
    _sharding,
)
from ._axes import Inputs
from ._options import ChunkOptions, identity


def body(
    options: ChunkOptions,
    accumulator: Any,
    chunk_fn: _loop.ChunkFn,
    axes: Sequence[int | None],
    signature: _loop.Signature,
    *,
    length: int,
    convolutions: bool,
    traced: _program.Retraced,
) -> _loop.Body:
    """The `_loop.Body` of a traced chunk function (traced for chunks of `length`),
    combined as `options` say (stacked, or folded by the user's reduction), or by a
    front end's own `accumulator` (None: the options'); a composed one
    (`_accumulators.compose`) is resolved here against this signature, once, before
    any loop is built (a user's reduction is checked then: `_accumulators.Fold`).
    `convolutions`: whether the traced chunk has a convolution
    (`_conv.has_convolution`). `chunk_fn` takes the arrays the chunk's trace reads
    (`traced.params`) first, then the chunk's leaves mapped along `axes`: the
    body's `params`, unmapped."""
    own = accumulator
    accumulator = _resolved(options, accumulator, signature, length)
    post = options.chunk_reduction if accumulator is None else identity
    # Every chunk's convolutions in the layout XLA:CPU runs fast inside a loop (a
    # chunk without one is left as it is: re-evaluating it would cost a trace).
    if convolutions:
        chunk_fn = _conv.canonical(chunk_fn)
    params = traced.params
    key = _body_key(options, own, traced, signature, (length, convolutions, axes))
    return _loop.Body(
        options.name, chunk_fn, (*[None] * len(params), *axes), signature,
        accumulator, post, options.remat, params, key, lambda: traced.kept,
    )  # fmt: skip


def _resolved(
    options: ChunkOptions, accumulator: Any, signature: _loop.Signature, length: int
) -> Any:
    """The accumulator that combines the chunks: a front end's own, else the
    user's reduction (`_accumulators.Fold`), else None (stacked); a composed one
    resolved against `signature` for chunks of `length`."""
    if accumulator is None and options.reduction is not None:
        accumulator = _accumulators.compose(
            _accumulators.Fold(
                options.reduction, options.chunk_reduction, name=options.name
            )
        )
    if isinstance(accumulator, _accumulators.Composed):
        accumulator = accumulator.resolve(signature, length)
    return accumulator


def _body_key(
    options: ChunkOptions,
    own: Any,
    traced: _program.Retraced,
    signature: _loop.Signature,
    shape: tuple,
) -> Any:
    """The body's program key (`_loop.Body.key`), `shape` its `(length,
    convolutions, axes)`: known by its chunk's trace where nothing else runs the
    user's code (no reduction of the user's, folding or post-processing; no front
    end's accumulator `own` that computes from more than the chunks' outputs), else
    None."""
    known = (
        traced.kept
        and options.reduction is None
        and options.chunk_reduction is identity
        and (own is None or own.pure)
    )
    if not known:
        return None
    length, convolutions, axes = shape
    out_tree, out_avals, out_axes = signature
    return (
        traced.first.key, length, convolutions, tuple(axes), out_tree,
        tuple(out_avals), tuple(out_axes),
        _equivalence.Held(options), _equivalence.Held(own),
    )  # fmt: skip


def zero_examples(name: str) -> ValueError:
    return ValueError(
        f"{name} cannot reduce over zero examples: the mapped axis has size 0 and the "
        f"reduction has no identity element to return. Check for empty inputs before "
        f"calling, or drop reduction."
    )


def layout(
    options: ChunkOptions, inputs: Inputs, axes: Sequence[int | None]
) -> _sharding.Layout | None:
    """Where the examples run (`_sharding.layout`), decided before the chunk is
    traced: None for one device's loop."""
    if not inputs.size:
        return None
    return _sharding.layout(
        options.name,
        options.shard,
        options.mesh,
        inputs.paths,
        inputs.leaves,
        axes,
        known=inputs.known,
    )


def chunk_types(
    options: ChunkOptions, inputs: Inputs, axes: Sequence[int | None], lay: Any
) -> tuple[int, list[Any]]:
    """The length of the loop's chunks (`chunk_length`) and the types of a chunk's
    `inputs.dyn` leaves as the loop gives them to the chunk function
    (`_sharding.chunk_type`): what the chunk is first traced at."""
    length = chunk_length(options, inputs.size, lay)
    types = [
        _sharding.chunk_type(
            options.name, lay, inputs.paths[i], inputs.leaves[i], axes[i], length
        )
        for i in inputs.dyn
    ]
    return length, types


def chunk_length(options: ChunkOptions, size: int, lay: Any) -> int:
    """The length of the loop's chunks over `size` examples laid out by `lay`
    (each device's share when split; the options' size, or all of them): the
    length a chunk is traced at (a size "auto" chooses is not known yet)."""
    batch = options.batch_size
    batch = batch if isinstance(batch, int) and batch > 0 else None
    return _loop.share_length(size, 1 if lay is None else lay.size, batch)


def tracing(lay: _sharding.Layout | None) -> Any:
    """The context the chunk is first traced in: that of the loop's chunks. Over a
    layout `shard_map` runs, its mesh with the layout's axes Manual, so that the
    trace is the one the loop runs (a trace there may depend on the mesh); else the
    caller's."""
    if lay is None or lay.size <= 1:
        return contextlib.nullcontext()
    mesh = getattr(lay.mesh, "abstract_mesh", lay.mesh)
    if lay.explicit:  # (the loop runs under the layout's mesh: `_sharding._typed`)
        if not jax.sharding.get_abstract_mesh().empty:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(mesh)
    manual = dict.fromkeys(lay.axes, jax.sharding.AxisType.Manual)
    return jax.sharding.use_abstract_mesh(mesh.update_axis_types(manual))


def evaluate(
    body: _loop.Body,
    inputs: Inputs,
    options: ChunkOptions,
    auto: _memory.AutoBatch | None,
    lay: _sharding.Layout | None,
    axis_name: Any = None,
) -> Any:
    """The user's output (stacked, or the folded summary) of `body` over `inputs`,
    laid out by `lay` (`layout`).

    The chunk size is decided first; then, when every input is a concrete array (an
    eager call), the program is compiled once per distinct body and input types
    and kept by the transform (`auto.programs`): the arrays the chunk reads are
    among its inputs (`Body.params`), so a new one compiles nothing."""
    name = options.name
    if options.reduction is not None and inputs.size == 0:
        raise zero_examples(name)  # (the library's own accumulators sum no chunk)
    inputs = _with_params(inputs, body.params)
    one_device = lay is not None and lay.size == 1 and lay.explicit
    if one_device:
        # The examples' axis is sharded over one device: the plain loop runs on the
        # inputs without that (trivial) sharding, unmapped inputs sharded over it
        # included (where jax.vmap refuses them); stacked outputs get it back.
        leaves = _sharding.unlaid(lay, inputs.leaves)
        inputs = dataclasses.replace(inputs, leaves=leaves)
    if lay is not None and lay.size > 1:
        batch, run = _split_run(body, inputs, options, auto, lay, axis_name)
    else:
        batch = _batch_size(body, inputs, options, auto, inputs.size, None)
        plan = _loop.make_plan(inputs.size, batch)
        run = _loop_run(body, inputs, options, plan, lay if one_device else None)
        if axis_name is not None and not plan.single:
            raise ValueError(
                f"{name} got axis_name={axis_name!r} with {options.batch_arg}="
                f"{plan.batch} < {inputs.size} examples: collectives over "
                f"{axis_name!r} inside f would only see one chunk of "
                f"examples. Use {options.batch_arg}=None (or >= {inputs.size}) with "
                f"axis_name."
            )
    programs = None if auto is None else auto.programs
    key = (lay, batch, axis_name, inputs.padding)
    return _compiled(body, inputs, programs, key, lambda xs: body.finish(run(xs)))


def _split_run(body, inputs, options, auto, lay, axis_name) -> tuple[Any, Any]:
    """`evaluate` over a layout of several devices: the chunk size of each
    device's share and the run of the laid-out leaves."""
    if axis_name is not None:
        raise ValueError(
            f"{options.name} got axis_name={axis_name!r} with examples split over "
            f"the mesh axes {lay.axes}: collectives over {axis_name!r} inside f "
            f"would only see one device's examples. Drop axis_name, or gather the "
            f"inputs first."
        )
    local = inputs.size // lay.size or inputs.size
    batch = _batch_size(body, inputs, options, auto, local, lay)

    def run(leaves: list[Any]) -> Any:
        laid = dataclasses.replace(inputs, leaves=leaves)
        return _sharding.evaluate(body, laid, lay, batch, options.reporter)

    return batch, run


def _loop_run(body, inputs, options, plan, one_device) -> Callable[..., Any]:
    """`evaluate` on one device: the loop of `plan` (a padded buffer's chunks of
    padding alone skipped); `one_device`: the one-device layout whose sharding
    stacked outputs get back (None: none)."""

    def run(leaves: list[Any]) -> Any:
        report = _progress.hook(options.reporter, plan.num_chunks)
        here = plan
        if inputs.padding is not None:
            here = plan.padded(leaves[inputs.padding], inputs.padding)
        result = body.run(leaves, here, report)
        if one_device is None:
            return result
        return _sharding.laid_result(one_device, body, result)

    return run


def _with_params(inputs: Inputs, params: Sequence[Any]) -> Inputs:
    """`inputs` with the body's `params` before its leaves (unmapped arrays)."""
    if not params:
        return inputs
    k = len(params)
    return dataclasses.replace(
        inputs,
        leaves=[*params, *inputs.leaves],
        paths=[*["the function's closure"] * k, *inputs.paths],
        dyn=[*range(k), *(i + k for i in inputs.dyn)],
        key=(inputs.key, tuple(jax.typeof(p) for p in params)),
        padding=None if inputs.padding is None else inputs.padding + k,
    )


def _compiled(
    body: _loop.Body,
    inputs: Inputs,
    programs: Any,
    decided: Any,
    run: Callable[[list[Any]], Any],
) -> Any:
    """`run(inputs.leaves)`; for an eager call (every input a concrete array), by
    one compiled program per body, input types and shardings, mesh and `decided`
    (the layout and chunk size), kept in `programs`. A body known by its chunk's
    trace (`Body.key`) is looked up before the program is traced; any other, by the
    program it traces to (`_program.run_traced`)."""
    values = [inputs.leaves[i] for i in inputs.dyn]
    eager = programs is not None and all(
        isinstance(v, np.ndarray)
        or (isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer))
        for v in values
    )
    if not eager:
        return run(inputs.leaves)

    def program(*values: Any) -> Any:
        return run(_axes.combine(inputs.leaves, inputs.dyn, values))

    key = (
        inputs.key,
        tuple(getattr(v, "sharding", None) for v in values),
        jax.sharding.get_abstract_mesh(),
        decided,
    )
    if body.key is None:
        return _program.run_traced(program, values, programs, key)
    key = (body.key, *key)
    if key in programs:
        programs.move_to_end(key)
        return programs[key](*values)
    compiled = jax.jit(program).lower(*values).compile()
    if body.kept():  # (else a trace compiled its own arrays in)
        programs.get_or_build(key, lambda: compiled)
    return compiled(*values)


def _batch_size(
    body: _loop.Body,
    inputs: Inputs,
    options: ChunkOptions,
    auto: _memory.AutoBatch | None,
    size: int,
    lay: Any,
) -> int | None:
    """The chunk size: the options', or for "auto" the fewest chunks whose program
    (over `size` examples: each device's share when laid out) fits the budget."""
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
            return body.run(_axes.combine(inputs.leaves, inputs.dyn, values), plan)

        return _memory.temp_bytes(body.name, program, abstract)

    return measure
