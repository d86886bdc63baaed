"""Which program `method="ghost"` runs on an accelerator: measured, not predicted.

The plan's cost model (`Plan.verdict`: floating-point operations and per-example
gradient entries moved) was fitted on CPU, where a matrix product costs what its
operations cost. On an accelerator the ghost program's contractions run near the
device's peak while forming and moving per-example gradients is bound by memory
bandwidth, and no count of operations says which wins. So off CPU both programs
are measured as they run: the very program the call would run for one chunk of its
examples (the call's transform and options, its loss, each argument's shape and
type; stand-in values, as the values never decide the time), compiled and run by
each method, and the faster one runs (the ghost program where it takes at most
`_TIE` of the vmap program's time: it keeps less memory). A program that does not
fit the device is never chosen. The choice is made once per transform, loss
program, example shapes, chunk size and device, and kept with the loss's plan.

Where the call cannot be measured (a loss closing over a value traced by an
enclosing `jax.grad`, a call spread over a mesh, keys of an extended type it cannot
stand in for) or on CPU, the cost model decides. On CPU it decides by the same rule,
the faster program that fits: a ghost program it predicts slower runs only where
the vmap program's chunk does not fit the memory budget (XLA's compiled estimate of
the program as the call runs it, against the call's `memory_limit`, else a quarter
of the machine's memory, `_memory.host_budget`) and the ghost program's keeps at
most `1 - _MEMORY_GAIN` of it.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _axes, _memory, _program
from .._core._options import check_choice, identity
from .._transforms._batch_vmap import Transform, function_name
from . import ghost
from .ghost import _plan


logger = logging.getLogger("chunkvmap")

# The ghost program runs where it takes at most this share of the vmap program's
# time (it keeps less memory); `_RUNS` timed runs each, after one to warm up (one
# only, where a run takes longer than `_LONG` seconds).
_TIE = 1.05
_RUNS = 3
_LONG = 0.5

# On CPU, a ghost program predicted slower runs for its memory where the vmap
# program's chunk does not fit the budget and XLA's compiled estimate shows the
# ghost program keeping at most `1 - _MEMORY_GAIN` of the vmap program's.
_MEMORY_GAIN = _plan._MEMORY_GAIN

# Platforms whose choice is measured (the tests add "cpu" to measure there).
MEASURED_PLATFORMS = frozenset({"tpu", "gpu", "cuda", "rocm"})


class Timing(NamedTuple):
    """One chunk of `chunk` examples on `device`: each program's seconds (None
    where it does not fit the device, with the reason in `failed`)."""

    chunk: int
    device: str
    seconds: dict
    failed: dict


def platform() -> str:
    """The platform a call runs on (the default device's)."""
    return _memory.default_platform()


def measurable(transform: Transform | None = None) -> bool:
    """Whether the choice is measured for calls of `transform` (or of a transform
    with no mesh of its own): on an accelerator, unspread, in a single process (a
    mesh's calls, and a job of several processes, keep the model's choice: timings
    would differ between them)."""
    options = None if transform is None else transform.options
    spread = options is not None and (options.shard or options.mesh is not None)
    return (
        platform() in MEASURED_PLATFORMS
        and not spread
        and jax.sharding.get_abstract_mesh().empty
        # every process must run the same program: no timing may decide it
        and jax.process_count() == 1
    )


def chunk_size(transform: Transform, size: int) -> int:
    """The examples in one chunk of a call of `size` examples (an `"auto"` size is
    not known before the call: its measurement takes chunks of at most 64)."""
    b = transform.options.batch_size
    if b is None:
        return size
    return min(size, b if isinstance(b, int) else 64)


def stand_in(leaf: Any, axis: int | None, chunk: int) -> Any:
    """A concrete array of `leaf`'s type with `chunk` examples on `axis`: small
    finite values for floats (a loss of zero parameters may divide by zero), zeros
    otherwise (valid indices), keys of the leaf's implementation."""
    shape = list(np.shape(leaf))
    if axis is not None:
        shape[axis] = chunk
    dtype = jnp.result_type(leaf)
    with jax.ensure_compile_time_eval():
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(leaf)
            data = jax.random.key_data(jax.random.key(0, impl=impl))
            zeros = np.zeros((*shape, *np.shape(data)), np.asarray(data).dtype)
            return jax.random.wrap_key_data(zeros, impl=impl)
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.full(shape, 0.01, dtype)
        return jnp.zeros(shape, dtype)


def stand_ins(
    name: str, args: tuple, kwargs: dict, in_axes: tuple, chunk: int
) -> tuple:
    """`(args, kwargs)` of a call of `chunk` examples, each array stood in for."""

    def one(root: str, arg: Any, axis: Any) -> Any:
        def leaf(path: Any, x: Any) -> Any:
            if not _axes.is_array(x):
                return x
            if axis is not None:
                where = root + jax.tree_util.keystr(path)
                axis_here = _axes.canonical_in_axis(axis, x, where, transform=name)
                return stand_in(x, axis_here, chunk)
            return stand_in(x, None, chunk)

        return jax.tree_util.tree_map_with_path(leaf, arg)

    new_args = tuple(
        one(f"args[{i}]", a, x) for i, (a, x) in enumerate(zip(args, in_axes))
    )
    new_kwargs = {k: one(f"kwargs[{k!r}]", v, 0) for k, v in kwargs.items()}
    return new_args, new_kwargs


def mapped_leaves(
    name: str, args: tuple, in_axes: tuple, kwargs: dict
) -> tuple[list[str], list, list]:
    """Key paths, leaves and axes of the mapped arguments (for the size check)."""
    paths, leaves, axes = [], [], []
    named = [(f"args[{i}]", a, x) for i, (a, x) in enumerate(zip(args, in_axes))]
    named += [(f"kwargs[{k!r}]", v, 0) for k, v in kwargs.items()]
    for root, arg, axis in named:
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            paths.append(root + jax.tree_util.keystr(path))
            leaves.append(leaf)
            axes.append(
                _axes.canonical_in_axis(
                    axis, leaf, paths[-1], transform=name, arg="batch_argnums"
                )
            )
    return paths, leaves, axes


def examples(transform: Transform, args: tuple, in_axes: tuple, kwargs: dict) -> int:
    """The number of examples of a call (its mapped arguments' leading size)."""
    mapped = mapped_leaves(transform.name, args, in_axes, kwargs)
    return _axes.mapped_size(*mapped, None, transform=transform.name)


def measuring(transform: Transform, chunk: int) -> Transform:
    """A twin of `transform` that runs one chunk of `chunk` examples: its own
    state (no `"auto"` search, no progress, no warning given in its name)."""
    options = transform.options.replace(
        batch_size=chunk, memory_limit=None, progress=False, reporter=None
    )
    return dataclasses.replace(transform, options=options)


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "OOM" in text


def _seconds(compiled: Any, inputs: tuple) -> float:
    """The median time of `compiled(*inputs)`, after one run to warm up."""
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    first = time.perf_counter() - start
    if first > _LONG:
        return first
    times = []
    for _ in range(_RUNS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _of_arrays(programs: dict, call: tuple) -> tuple[dict, list]:
    """`programs` (method -> function of `(args, kwargs)`) as functions of the
    list of `call`'s arrays (its other leaves fixed), and that list."""
    leaves, tree = jax.tree.flatten(call)
    arrays = [i for i, x in enumerate(leaves) if _axes.is_array(x)]

    def of_arrays(program: Callable[..., Any]) -> Callable[..., Any]:
        def run(values: list) -> Any:
            return program(
                *jax.tree.unflatten(tree, _axes.combine(leaves, arrays, values))
            )

        return run

    return {m: of_arrays(f) for m, f in programs.items()}, [leaves[i] for i in arrays]


def time_programs(programs: dict, call: tuple, chunk: int) -> Timing | None:
    """Each of `programs` (method -> function of `(args, kwargs)`) compiled and
    timed on one chunk of stand-ins for `call`'s arrays; None where one cannot be
    compiled on its own (it closes over a traced value) for a reason other than
    memory."""
    programs, values = _of_arrays(programs, call)
    seconds, failed = {}, {}
    for method, program in programs.items():
        try:
            compiled = jax.jit(program).lower(values).compile()
            seconds[method] = _seconds(compiled, (values,))
        except Exception as e:  # noqa: BLE001 (out of memory: not chosen)
            if not _is_out_of_memory(e):
                logger.info("the %s program could not be measured: %s", method, e)
                return None
            seconds[method], failed[method] = None, str(e).splitlines()[0][:200]
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    return Timing(chunk, kind, seconds, failed)


def compiled_memory(programs: dict, call: tuple) -> dict | None:
    """XLA's compiled memory of each of `programs` on `call`'s arrays beyond the
    arrays (`_memory.program_bytes`; abstract: nothing runs); None where one
    cannot be compiled on its own."""
    programs, values = _of_arrays(programs, call)
    abstract = [jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)) for v in values]
    try:
        compiled = {
            m: jax.jit(f).lower(abstract).compile() for m, f in programs.items()
        }
        return {
            m: _memory.program_bytes(c.memory_analysis(), _memory.platform_of(c))
            for m, c in compiled.items()
        }
    except Exception:  # noqa: BLE001 (a loss closing over a traced value)
        return None


def _ms(seconds: float | None) -> str:
    return "does not fit" if seconds is None else f"{1e3 * seconds:.3g} ms"


def measured_report(report: ghost.GhostReport, timing: Timing) -> ghost.GhostReport:
    """`report` with the verdict of `timing`: the faster program runs, the ghost
    program where it is within `_TIE` of the vmap program's time."""
    g, v = timing.seconds[ghost.Method.GHOST], timing.seconds[ghost.Method.VMAP]
    if g is None and v is None:
        return report  # neither fits one chunk: the call itself says so
    runs = (
        ghost.Method.GHOST
        if v is None or (g is not None and g <= _TIE * v)
        else (ghost.Method.VMAP)
    )
    why = (
        f"measured on {timing.device} for a chunk of {timing.chunk} examples: the "
        f"ghost program {_ms(g)}, the vmap program {_ms(v)}"
    )
    return report.replace(runs=runs, slower=False, why=why, timing=timing)


def memory_checked(
    report: ghost.GhostReport, figures: dict, chunk: int, budget: int | None
) -> ghost.GhostReport:
    """`report`, whose ghost program is predicted slower (it would run for its
    memory), decided by XLA's estimates `figures` (bytes by method, for one chunk
    of `chunk` examples) as on an accelerator, the faster program that fits: the
    vmap program runs where its chunk fits `budget` (bytes; None: not known);
    else the ghost program runs where it keeps at most `1 - _MEMORY_GAIN` of the
    vmap program's memory, and the vmap program where it saves less (an estimate
    of zero bytes for the vmap program shows nothing saved)."""
    g, v = figures[ghost.Method.GHOST], figures[ghost.Method.VMAP]
    sizes = (
        f"XLA's estimate for chunks of {chunk} examples is {g / 2**20:.3g} MiB "
        f"against the vmap program's {v / 2**20:.3g} MiB"
    )
    limit = "no memory budget known" if budget is None else (
        f"a budget of {budget / 2**20:.3g} MiB"
    )  # fmt: skip
    counts = report.verdict.counts if report.verdict is not None else ""
    if budget is not None and v <= budget:
        return report.replace(
            runs=ghost.Method.VMAP,
            slower=False,
            why=f"the ghost program is predicted slower ({counts}), and the vmap "
            f"program's chunk fits in memory ({sizes}; {limit})",
        )
    if v > 0 and g <= (1 - _MEMORY_GAIN) * v:
        return report.replace(why=f"{report.why} ({sizes}; {limit})")
    return report.replace(
        runs=ghost.Method.VMAP,
        slower=False,
        why=f"the ghost program is predicted no faster ({counts}) and saves little "
        f"memory ({sizes})",
    )


def budget(transform: Transform) -> int | None:
    """What a chunk of a call of `transform` on CPU may hold: its `memory_limit`,
    else `_memory.host_budget`."""
    limit = transform.options.memory_limit
    return limit if limit is not None else _memory.host_budget()


def _unmeasured(report: ghost.GhostReport) -> ghost.GhostReport:
    """An accelerator's call the choice cannot measure (spread over a mesh, or
    closing over a traced value) keeps the model's program, but not its "slower":
    the model is the CPU's, and on an accelerator the ghost program it calls
    slower is mostly the faster (no warning says otherwise)."""
    if not report.slower:
        return report
    return report.replace(
        slower=False,
        why=f"{report.why} (predicted by the CPU's cost model; on this "
        f"{platform()} backend the call is not measured)",
    )


def _needs_memory(report: ghost.GhostReport) -> bool:
    """Whether the model's verdict runs a ghost program predicted slower for the
    memory it saves (then the programs' memory decides: `memory_checked`)."""
    return report.slower and report.verdict is not None


def _nothing_to_gain(report: ghost.GhostReport) -> bool:
    """Whether the ghost program helps no leaf: for a quantity's own rule
    (`ruled`, no verdict) its `runs`; else no leaf has a ghost norm."""
    if report.verdict is None:
        return report.runs is ghost.Method.VMAP
    return not any(rule == ghost.GHOST for _, _, rule, _ in report.rows)


def settled_report(report: ghost.GhostReport, timed: bool) -> Any:
    """The report `choose` gives without measuring anything (no leaf has a ghost
    norm; on CPU a verdict other than a ghost program predicted slower; an
    accelerator's call it cannot measure), or None where it measures (`timed`: the
    call can be timed)."""
    if _nothing_to_gain(report):
        return report  # the ghost program helps no leaf: nothing to measure
    if timed:
        return None
    if platform() != "cpu":
        report = _unmeasured(report)
    return None if _needs_memory(report) else report


# The measurements of the programs of `choose`, by what the programs compute (the
# ghost quantity's `program_key`) and how they were measured: a transform built
# anew at every call measures once.
MEASURED = _program.LRU()


def choose(
    transform: Transform,
    report: ghost.GhostReport,
    quantity: Any,
    program: Callable[[Transform, ghost.Method], Callable[..., Any]],
    call: tuple,
    size: int,
    *,
    chunk: int | None = None,
) -> ghost.GhostReport:
    """The report whose `runs` a call of `size` examples follows: on an accelerator,
    the two programs measured on one chunk (of `chunk` examples where given);
    on CPU the model's `report`, where it runs a ghost program predicted slower
    the programs' memory for one chunk checked against the budget
    (`memory_checked`). `program(twin, method)` is the call's program for `method`,
    `call` its `(args, kwargs, in_axes)`; the measurements are kept (`MEASURED`)
    by `quantity`'s `program_key` (the ghost program's quantity)."""
    if size == 0:
        return report
    timed = measurable(transform)
    settled = settled_report(report, timed)
    if settled is not None:
        return settled
    if chunk is None:
        chunk = chunk_size(transform, size)
    device = jax.devices()[0]

    def measure() -> Any:
        twin = measuring(transform, chunk)
        try:
            inputs = stand_ins(transform.name, *call, chunk)
        except Exception as e:  # noqa: BLE001 (a leaf it cannot stand in for)
            logger.info(
                "%s: no stand-in for the call's arguments: %s", transform.name, e
            )
            return None
        methods = (ghost.Method.GHOST, ghost.Method.VMAP)
        programs = {m: program(twin, m) for m in methods}
        if timed:
            return time_programs(programs, inputs, chunk)
        return compiled_memory(programs, inputs)

    key = ("timed" if timed else "memory", chunk, device.id, device.platform)
    with warnings.catch_warnings():  # the twin's own (its stand-ins are not N)
        warnings.simplefilter("ignore")
        measured = MEASURED.get_or_build((quantity.program_key(), key), measure)
    if not timed:
        if measured is None:
            return report
        return memory_checked(report, measured, chunk, budget(transform))
    chosen = report if measured is None else measured_report(report, measured)
    if chosen is report:  # nothing measured: the model's program, not its "slower"
        return _unmeasured(report)
    logger.info(
        "%s method='ghost' runs %s: %s", transform.name, chosen.runs, chosen.why
    )
    return chosen


def ruled(report: ghost.GhostReport, helped: bool, quantity: str) -> ghost.GhostReport:
    """The model's verdict for a quantity with no cost model of its own
    (projections, curvature: their ghost programs share clipping's analysis, not
    its costs): the ghost program where it `helped` some parameter (a leaf whose
    share it takes without forming the leaf's per-example gradient), else the vmap
    program, the same result; never predicted slower. On an accelerator `choose`
    measures it as any other."""
    if not helped:
        return report.replace(
            runs=ghost.Method.VMAP, slower=False, verdict=None,
            why=f"the ghost program takes no parameter's {quantity} from its "
            f"operands (each gradient is formed per example, as method='vmap' "
            f"forms it)",
        )  # fmt: skip
    return report.replace(
        runs=ghost.Method.GHOST, slower=False, verdict=None,
        why=f"the ghost program takes some parameters' {quantity} without their "
        f"per-example gradients",
    )  # fmt: skip


def ruled_report(traced: ghost.Traced, helped: bool, quantity: str) -> Any:
    """`ruled` of the report of `traced`'s plan, made once per loss (kept with its
    plan, `Traced.memo`)."""
    return traced.memo(
        ("ruled", quantity, helped),
        lambda: ruled(ghost.report_of(traced.plan), helped, quantity),
    )


def decided(
    transform: Transform,
    fun: Any,
    report: ghost.GhostReport,
    quantity: Any,
    program: Callable[[Transform, ghost.Method], Callable[..., Any]],
    *,
    call: tuple,
    size: int,
    chunk: int | None = None,
) -> ghost.Method:
    """The program a `method="ghost"` call runs, by the one policy of every ghost
    quantity: the quantity's model `report` checked as `choose` checks it
    (measured on an accelerator; on CPU the memory of a ghost program predicted
    slower), then warned (`warn_fallback`) where the vmap program runs in its
    place, where many parameters fall back to per-example gradients, or where a
    program predicted slower runs. `program`, `call` and `chunk` are `choose`'s."""
    report = choose(transform, report, quantity, program, call, size, chunk=chunk)
    warn_fallback(transform, fun, report)
    return report.runs


class GhostFallbackWarning(UserWarning):
    """`method="ghost"` forms per-example gradients for a sizeable share of the
    parameters, runs as `method="vmap"`, or is predicted slower than it.

    Issued once per function of a ghost quantity (clipped sums and norms,
    statistics, projections, curvature), at its first call:

    * when the ghost program is predicted slower than `method="vmap"`'s and the
      vmap program's chunk fits in memory, or it is predicted no faster and saves
      little memory, or no parameter has a ghost norm (for projections, the Gram
      matrix and curvature: the ghost program takes no parameter's share from its
      operands), or on an accelerator the vmap program was measured faster: the
      per-example path of `method="vmap"` then runs itself (the same result), and
      the message says why, with the predicted or measured costs;
    * when more than 5% of the parameters have a use no ghost rule covers (they get
      exact per-example gradients, as with `method="vmap"`), naming those leaves;
    * when the ghost program runs though it is predicted slower than
      `method="vmap"`'s, because the vmap program's chunk does not fit in memory
      and the ghost program's keeps much less.

    `chunkvmap.ghost_report` shows each leaf's rule and why, and the same verdict.

    Attributes:
      args: the message, as for any `Warning`.

    Examples:
      >>> import warnings
      >>> import chunkvmap
      >>> with warnings.catch_warnings():  # once ghost_report has been read
      ...     warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
    """


_FALLBACK_SHARE = 0.05


def warn_fallback(transform: Transform, fun: Any, report: ghost.GhostReport) -> None:
    """Once per function of a ghost quantity: say when the vmap program runs in
    ghost's place, when more than 5% of the parameters fall back to per-example
    gradients, or when the ghost program runs though it is predicted slower
    (`report`'s verdict)."""
    if transform.warned("ghost fallback"):
        return
    shares = report.shares()
    share = shares.get(ghost.PER_EXAMPLE, 0.0)
    fallback = report.fallback()
    if report.runs is ghost.Method.VMAP:
        message = (
            f"{transform.name} method='ghost' runs as method='vmap' for "
            f"{function_name(fun)} (the same result): {report.why}."
        )
    elif share > _FALLBACK_SHARE:
        message = (
            f"{transform.name} method='ghost': {100 * share:.0f}% of the parameters of "
            f"{function_name(fun)} use per-example gradients (no rule covers one of "
            f"their uses): {', '.join(fallback)}."
        )
    elif report.slower:
        message = (
            f"{transform.name} method='ghost' is predicted slower than method='vmap' "
            f"for {function_name(fun)}: {report.why}. method='vmap' is faster where "
            "its per-example gradients fit in memory."
        )
    else:
        return
    transform.warn_once(
        "ghost fallback",
        message + " chunkvmap.ghost_report(fun, *one_example) shows each leaf's rule "
        "and why.",
        GhostFallbackWarning,
        stacklevel=4,
    )


def check_method(
    name: str, method: Any, pre_clipping_transform: Any = identity
) -> ghost.Method:
    """The `method` a user passed (`"vmap"` or `"ghost"`), checked."""
    method = check_choice(name, "method", method, ghost.Method)
    if method is ghost.Method.GHOST and pre_clipping_transform is not identity:
        raise ValueError(
            f"{name} method='ghost' cannot apply pre_clipping_transform="
            f"{pre_clipping_transform!r}: ghost clipping never forms the per-example "
            f"gradients a transform would act on. Use method='vmap' (the default) "
            f"with a pre-clipping transform."
        )
    return method
