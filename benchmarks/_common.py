"""Shared pieces of the benchmark scripts: the model and the timers."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def init_mlp(key, sizes):
    """Parameters of an MLP with layer widths `sizes`: a list of (w, b) pairs."""
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b)))
    return params


def mlp(params, x, activation=jnp.tanh):
    """The MLP's output for one example `x`."""
    for w, b in params[:-1]:
        x = activation(x @ w + b)
    w, b = params[-1]
    return x @ w + b


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


def machine() -> str:
    """One line naming the software and hardware the numbers come from."""
    import os
    import platform

    device = jax.devices()[0]
    return (
        f"jax {jax.__version__}, backend {jax.default_backend()} "
        f"({device.device_kind}, {jax.device_count()} device(s)), "
        f"{platform.machine()} host with {os.cpu_count()} CPU core(s)"
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


def plot_lines(path, title, xlabel, ylabel, series, *, logy=True):
    """Write a log-log line plot: `series` maps a label to (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = "osD^v<>px*"
    xs_all: set = set()
    for k, (label, (xs, ys)) in enumerate(series.items()):
        ax.plot(xs, ys, marker=markers[k % len(markers)], label=label)
        xs_all.update(xs)
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ticks = sorted(xs_all)
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
