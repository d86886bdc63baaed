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
