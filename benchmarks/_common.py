"""Shared pieces of the benchmark scripts: the timers, and the test suite's MLP and
clipped-sum oracle."""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import jax


# The models and oracles are the test suite's (one definition of each).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.helpers import clipped_sum, init_mlp, mlp  # noqa: E402, F401


def cold_compile_seconds(fn, args, repeats):
    """Median wall time of trace + lower + compile, caches cleared before each."""
    times = []
    for _ in range(repeats):
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.jit(lambda *a: fn(*a)).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_seconds(exe, args, repeats):
    """Median steady-state run time of a compiled executable, after two warm-ups."""
    jax.block_until_ready(exe(*args))
    jax.block_until_ready(exe(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def is_oom(error: BaseException) -> bool:
    """Whether `error` says the device (or the host) ran out of memory."""
    text = f"{type(error).__name__} {error}"
    return any(
        s in text
        for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")
    ) or isinstance(error, MemoryError)


def temp_bytes(fn, *args) -> int:
    """XLA's compiled temporary memory of `jax.jit(fn)(*args)` (compiled, not run)."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def interleaved(fns, args, repeats, values=3, jit=True):
    """Median seconds per call of each function (jitted, unless `jit=False`: they
    already are) on `args`, the calls interleaved, and the outputs of the first
    `values` of them. Each timed call follows an untimed call of the same function:
    a call made right after one that allocated much (`jax.vmap`'s per-example
    gradients) pays for the memory that one gave back (on CPU, measured: 100 ms
    against 64 for the same compiled program), which a fixed order of calls would
    charge to the same function every round. The rounds run the functions in
    turn forwards and backwards, so that what a function's place in the round
    still costs or spares it falls on every function alike (measured on CPU: two
    programs of equal counts read 1.08x in a fixed order, 0.95x alternated)."""
    jitted = [jax.jit(f) if jit else f for f in fns]
    times = [[] for _ in fns]
    pairs = list(zip(times, jitted))
    for r in range(repeats):
        for t, f in pairs if r % 2 == 0 else pairs[::-1]:
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times], [f(*args) for f in jitted[:values]]


class Table:
    """A results page: each line printed as soon as it is added (a run cut short
    still shows what it measured) and the page rewritten to `out`, where given."""

    def __init__(self, out: str | None, *lines: str) -> None:
        self.out, self.lines = out, []
        self.add(*lines)

    def add(self, *lines: str) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        if self.out:
            with open(self.out, "w") as fh:
                fh.write("\n".join(self.lines) + "\n")


def machine() -> str:
    """One line naming the software and hardware the numbers come from, with the
    machine's load (its 1-minute average) when it is asked."""
    import os
    import platform

    device = jax.devices()[0]
    return (
        f"jax {jax.__version__}, backend {jax.default_backend()} "
        f"({device.device_kind}, {jax.device_count()} device(s)), "
        f"{platform.machine()} host with {os.cpu_count()} CPU core(s), "
        f"load {os.getloadavg()[0]:.1f}"
    )


def netket_vmap_chunked():
    """NetKet's `vmap_chunked` when NetKet is installed, else None.

    Importing NetKet turns on `jax_enable_x64`; it is turned off again so that every
    method runs in float32 on the same inputs.
    """
    try:
        import netket.jax as nkjax
    except ImportError:
        return None
    jax.config.update("jax_enable_x64", False)
    return nkjax.vmap_chunked


def _ours(label: str) -> bool:
    """Whether a plotted series is chunkvmap's own."""
    return label.startswith(("batch_", "chunkvmap", "clipped_grad", "per_example"))


def plot_lines(path, title, xlabel, ylabel, series, *, logy=True):
    """Write a log-log line plot: `series` maps a label to (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = "osD^v<>px*"
    styles = ["-", "--", "-.", ":"]
    xs_all = sorted({x for xs, _ in series.values() for x in xs})
    # A series is drawn only where it was measured (a gap where it did not run,
    # never a line across it); chunkvmap's own series last, on top, so that a
    # series measuring the same values never hides it.
    order = sorted(series, key=lambda label: _ours(label))
    for k, label in enumerate(order):
        xs, ys = series[label]
        at = dict(zip(xs, ys))
        ours = _ours(label)
        ax.plot(
            xs_all, [at.get(x, float("nan")) for x in xs_all],
            marker=markers[k % len(markers)], linestyle=styles[k % len(styles)],
            markersize=9 if ours else 6, linewidth=2.4 if ours else 1.4,
            markerfacecolor="none" if not ours else None, label=label,
            zorder=3 if ours else 2,
        )  # fmt: skip
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ticks = xs_all
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
