"""`batch_size="auto"`: the fewest chunks whose compiled memory fits a budget, each
as short as they allow.

The estimate is XLA's own: `jax.jit(program).lower(...).compile().memory_analysis()`
of the very program that will run, for the actual argument shapes: on CPU its
temporary memory, elsewhere its peak less its arguments (`program_bytes`). Memory
is close to affine in the chunk size (a fixed part plus a per-example part), so two
probes (one example, then a few) give a first guess, which is then checked by compiling
it and corrected until it fits; one step up is tried when the guess left room. The
largest size that fits gives the fewest chunks; the shortest size that gives as few
evaluates the fewest examples (the last chunk's window included).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _program


logger = logging.getLogger("chunkvmap")

# Without memory_limit, the budget is this share of the device's free memory
# (`bytes_limit` less `bytes_in_use`, where the backend reports them).
DEFAULT_DEVICE_FRACTION = 0.9
_MAX_PROBES = 8

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory(name: str, value: Any) -> int:
    """Bytes from an int/float or a string such as `"2GiB"`, `"512 MB"`, `"1e9"`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{name} memory_limit must be a number of bytes or a string such as "
            f"'2GiB' or '512MB', but got memory_limit={value!r} of type "
            f"{type(value).__name__}."
        )
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(
                    f"{name} memory_limit={value!r} is not a memory size: expected a "
                    f"number followed by one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB "
                    f"(e.g. '2GiB')."
                ) from None
        else:
            number = float(match.group(1)) * _UNITS[unit]
    else:
        number = float(value)
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(
            f"{name} memory_limit must be a positive, finite number of bytes, but got "
            f"memory_limit={value!r}."
        )
    return int(number)


# On CPU, `method="ghost"`'s choice takes this share of the machine's memory as what
# a chunk of the vmap program may hold (`host_budget`).
HOST_FRACTION = 0.25


def host_budget() -> int | None:
    """`HOST_FRACTION` of the machine's physical memory, in bytes (None where the
    system does not say)."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # (no sysconf, or no such name)
        return None
    if pages <= 0 or size <= 0:
        return None
    return int(pages * size * HOST_FRACTION)


def default_limit(name: str) -> int:
    """A share of the default device's free memory, where the backend reports
    it."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        raise ValueError(
            f"{name} batch_size='auto' needs a memory budget, and the "
            f"{device.platform} backend does not report its device memory "
            f"(device.memory_stats() has no 'bytes_limit'). Pass memory_limit=..., "
            f"e.g. memory_limit='2GiB'."
        )
    free = limit - int((stats or {}).get("bytes_in_use", 0))
    return int(max(free, 0) * DEFAULT_DEVICE_FRACTION)


def temp_bytes(name: str, program: Callable[..., Any], abstract_args: list[Any]) -> int:
    """XLA's compiled memory of `jax.jit(program)(*abstract_args)` beyond its
    arguments (`program_bytes`)."""
    try:
        compiled = jax.jit(program).lower(*abstract_args).compile()
    except jax.errors.UnexpectedTracerError as e:
        raise ValueError(
            f"{name} batch_size='auto' compiles the chunked program on its own to "
            f"measure it, which fails when the function closes over a traced value "
            f"(from an enclosing jit, grad or vmap). Pass that value as an argument "
            f"(with in_axes=None) or give an explicit batch_size. JAX reported: {e}"
        ) from None
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError(
            f"{name} batch_size='auto' needs XLA's memory analysis, which the "
            f"{platform_of(compiled)} backend does not provide; pass an explicit "
            f"batch_size."
        )
    return program_bytes(analysis, platform_of(compiled))


def default_platform() -> str:
    """The platform a call without placed arguments runs on: the default device's
    (`jax.default_device`, as a device or a platform name) where one is set, else
    the default backend's."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def call_platform(mesh: Any = None) -> str:
    """The platform a call runs on: that of `mesh` (a call's own) or of the mesh the
    caller entered (`jax.set_mesh`), else the default device's."""
    if mesh is not None and hasattr(mesh, "devices"):
        return np.asarray(mesh.devices).flat[0].platform
    entered = jax.sharding.get_abstract_mesh()
    device = None if entered.empty else getattr(entered, "abstract_device", None)
    if getattr(device, "platform", None):
        return device.platform
    return default_platform()


def platform_of(compiled: Any) -> str:
    """The platform a compiled program runs on (its outputs' devices, else its
    arguments'; the default backend's where it shows none): the CPU's on a machine
    with an accelerator when the call's arrays are on the CPU."""
    for part in ("output_shardings", "input_shardings"):
        try:  # (a program of unusual arguments may not show its shardings)
            shardings = jax.tree.leaves(getattr(compiled, part))
        except Exception:  # noqa: BLE001
            continue
        for sharding in shardings:
            devices = getattr(sharding, "device_set", None)
            if devices:
                return next(iter(devices)).platform
    return default_platform()


def program_bytes(analysis: Any, platform: str | None = None) -> int:
    """What a compiled program holds beyond its arguments, by XLA's estimate
    (`memory_analysis()`): on CPU its temporary memory (`temp_size_in_bytes`);
    on an accelerator its peak less its arguments (its outputs and temporaries
    at their most), where the backend reports a peak. (XLA:TPU's temporary figure
    reads 0 for programs whose outputs and temporaries take gigabytes, and more
    than the device holds for programs that run.) `platform`: the program's
    (`platform_of`; by default `default_platform()`)."""
    temp = int(analysis.temp_size_in_bytes)
    if (platform or default_platform()) == "cpu":
        return temp
    peak = int(getattr(analysis, "peak_memory_in_bytes", 0) or 0)
    if peak <= 0:
        return temp
    return max(peak - int(analysis.argument_size_in_bytes), 0)


def choose_batch_size(
    name: str, measure: Callable[[int], int], size: int, limit: int
) -> int:
    """The batch size for `size` examples under `limit` bytes: the fewest chunks
    that fit, each as short as they allow.

    `measure(B)` is the compiled temporary memory with chunks of `B`. The largest
    `B` with `measure(B) <= limit` (by the estimate) gives the fewest chunks,
    `ceil(size / B)`; of the sizes that give as few, the smallest evaluates the
    fewest examples (`ceil(size / B) * B`, the last chunk's window included): 128
    rather than 255 for 256 examples. It is measured too (the estimate is not
    monotone in `B`: the last window's length changes with it), and where it does
    not fit, the largest size is taken. A budget that does not fit one example is
    an error.
    """
    if size <= 1:
        return max(size, 1)
    seen: dict[int, int] = {}

    def probe(b: int) -> int:
        if b not in seen:
            seen[b] = measure(b)
        return seen[b]

    one = probe(1)
    if one > limit:
        raise ValueError(
            f"{name} batch_size='auto' cannot fit even one example in "
            f"memory_limit={limit} bytes: by XLA's compiled estimate a chunk of one "
            f"example needs {one} bytes of temporary memory. Raise memory_limit, or "
            f"reduce the per-example cost."
        )
    best = _largest_fitting(probe, seen, size, limit)
    chunks = -(-size // best)
    balanced = -(-size // chunks)
    if probe(balanced) > limit:  # the estimate is not monotone in B
        balanced = best
    logger.info(
        "%s batch_size='auto': chose %d of %d examples (%d chunks; up to %d fit) "
        "for a budget of %d bytes (probes: %s)",
        name,
        balanced,
        size,
        chunks,
        best,
        limit,
        dict(sorted(seen.items())),
    )
    return balanced


def _largest_fitting(
    probe: Callable[[int], int], seen: dict[int, int], size: int, limit: int
) -> int:
    """The largest chunk size found to fit `limit` (`probe(b)`: its measured
    memory, memoised in `seen`, which holds `probe(1)`), searched by extrapolating
    the probes' slope, at most `_MAX_PROBES` probes."""
    one = seen[1]
    second = min(size, 16)
    # The answer lies in [best, fail): `best` fits, `fail` (or anything larger) did not.
    best, fail = (second, size + 1) if probe(second) <= limit else (1, second)
    slope = (seen[second] - one) / (second - 1)
    if slope <= 0:
        guess = size
    else:
        guess = 1 + int((limit - one) / slope)
    while len(seen) < _MAX_PROBES and best + 1 < fail:
        # Never beyond a size known not to fit: the estimate is not linear in B (one
        # chunk of all N examples drops the loop), so an extrapolation can overshoot.
        guess = max(best + 1, min(fail - 1, guess))
        used = probe(guess)
        if used <= limit:
            best = guess
            if used >= 0.95 * limit:
                break
            local = (used - one) / (guess - 1)
            step = int((limit - used) / local) if local > 0 else size
            guess = guess + max(1, step)
        else:
            # Interpolate between the largest size that fits and this one.
            fail = guess
            fits = seen[best]
            local = (used - fits) / (guess - best)
            guess = best + int((limit - fits) / local)
    return best


# --------------------------------------------------------------------------------------
# The state of `batch_size="auto"`: one per transform, searched once per shapes.


PROGRAMS = _program.LRU(limit=256)


class AutoBatch:
    """The chunk sizes of one transform: with `search` (`batch_size="auto"`) its
    budget and the sizes chosen per call shapes; for a fixed size, the sizes used."""

    def __init__(self, name: str, limit: int | None, search: bool = True):
        self.name = name
        self.limit = limit  # bytes, or None for the device's default
        self.search = search
        self.cache: dict[Any, int] = {}
        self.last: int | None = None
        # The eager programs (`_chunked.evaluate`): shared by every transform, as
        # their keys tell apart any two programs that compute different things,
        # so that a transform built inline (anew at every call) compiles once.
        self.programs = PROGRAMS

    def choose(self, key: Any, measure: Callable[[int], int], size: int) -> int:
        """The batch size for the call described by `key` (searched on first use)."""
        limit = self.limit if self.limit is not None else default_limit(self.name)
        key = (key, limit)
        if key not in self.cache:
            self.cache[key] = choose_batch_size(self.name, measure, size, limit)
        self.last = self.cache[key]
        _LAST[0] = self.last
        return self.last

    def used(self, batch_size: int | None, size: int) -> None:
        """Record a fixed `batch_size` used over `size` examples (the chunks have
        `min(batch_size, size)` of them)."""
        self.last = size if batch_size is None else min(batch_size, size)


# The most recent choice of any transform, for `last_batch_size()` (its documented
# meaning without an argument); every other state is owned by its transform.
_LAST: list[int | None] = [None]

# The attribute under which a transform's public function holds its state.
ATTRIBUTE = "__chunkvmap_auto__"


def attach(fn: Any, state: AutoBatch) -> Any:
    """`fn` (a transform's public function) holding `state`, for `last_batch_size`."""
    setattr(fn, ATTRIBUTE, state)
    return fn


def most_recent() -> int | None:
    """The most recent choice of any transform (`last_batch_size()`)."""
    return _LAST[0]


def state_of(fn: Any) -> AutoBatch | None:
    """The state a transform's public function holds (None for any other object)."""
    state = getattr(fn, ATTRIBUTE, None)
    return state if isinstance(state, AutoBatch) else None
