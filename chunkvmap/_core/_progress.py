"""`progress=`: a host-side progress bar over the chunks of one evaluation.

The loop body emits one `jax.debug.callback` per chunk with the chunk index; the host
side turns those into bar updates. Nothing else crosses to the host, so the only cost is
the callback itself (no extra device synchronisation), and it works under `jax.jit`
because the callback is part of the compiled loop. Under `shard=True` only the device at
mesh index 0 reports (its own chunks), so a multi-process run shows one bar, printed by
the process that owns that device.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax import lax


# A host reporter: called with (chunk index, number of chunks) after each chunk.
Reporter = Callable[[int, int], None]


def check_progress(name: str, progress: Any) -> None:
    ok = isinstance(progress, bool) or callable(progress) or _is_bar(progress)
    if not ok:
        raise TypeError(
            f"{name} progress must be True, False, a callable (done, total), or a "
            f"tqdm-like bar with an update() method, but got progress={progress!r} of "
            f"type {type(progress).__name__}."
        )
    if callable(progress) and not _is_bar(progress) and not isinstance(progress, bool):
        try:
            inspect.signature(progress).bind(0, 0)
        except TypeError:
            raise TypeError(
                f"{name} progress must be called as progress(done, total), but "
                f"{getattr(progress, '__qualname__', progress)!s} cannot take two "
                f"positional arguments (its signature is "
                f"{inspect.signature(progress)})."
            ) from None
        except ValueError:  # no signature to inspect (some builtins): trusted
            pass


def _is_bar(x: Any) -> bool:
    return callable(getattr(x, "update", None)) and not isinstance(x, type)


def reporter(progress: Any) -> Reporter | None:
    """The host function for a validated `progress` value (None when it is off)."""
    if progress is False:
        return None
    if progress is True:
        return _OwnBar()
    if _is_bar(progress):
        return _UserBar(progress)
    return lambda index, total: progress(index + 1, total)


class _OwnBar:
    """`progress=True`: a tqdm bar per evaluation (a plain text line without tqdm)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, index: int, total: int) -> None:
        if index == 0 or self.bar is None:
            self.close()
            self.bar = _new_bar(total)
        self.bar.update(1)
        if index + 1 >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _new_bar(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _TextBar(total)
    return tqdm(total=total, desc="chunkvmap", unit="chunk")


class _TextBar:
    """A minimal stand-in for tqdm, written to stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0

    def update(self, n: int) -> None:
        self.n += n
        sys.stderr.write(f"\rchunkvmap: {self.n}/{self.total} chunks")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


class _UserBar:
    """A bar the user owns: it is advanced (and given a total if it has none)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, index: int, total: int) -> None:
        if getattr(self.bar, "total", 0) is None:
            self.bar.total = total
        self.bar.update(1)


@dataclasses.dataclass(frozen=True)
class _Host:
    """The host side of one loop's progress callback: equal for equal reporters and
    totals, so that an eager call's program is the same from call to call (see
    `_cache.EagerCache`)."""

    report: Any
    total: int

    def __call__(self, i: Any) -> None:
        self.report(int(i), self.total)


def tick(report: Reporter | None, index: Any, total: int, when: Any = None) -> None:
    """Emit one progress callback for chunk `index` (only where `when` holds)."""
    if report is None:
        return

    def emit() -> None:
        jax.debug.callback(_Host(report, total), index)

    if when is None:
        emit()
    else:
        lax.cond(when, emit, lambda: None)


def hook(
    report: Reporter | None, num_chunks: int, when: Callable[[], Any] | None = None
) -> Callable[[Any], None]:
    """The loop's per-chunk hook for a plan of `num_chunks` chunks: reports chunk `i`
    (only where `when()` holds, when given); a no-op without a reporter or chunks."""
    if report is None or num_chunks == 0:
        return lambda i: None
    return lambda i: tick(report, i, num_chunks, None if when is None else when())
