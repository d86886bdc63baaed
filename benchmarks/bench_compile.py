"""Compile cost: trace, lower and XLA compile, measured separately, on a large `f`.

`jax.jit(fn).trace(*args)`, `.lower()` and `.compile()` are timed one after the other,
cold (`jax.clear_caches()` before each measurement), for `jax.vmap`,
`lax.map(batch_size=B)` and `chunkvmap.batch_vmap(batch_size=B)` on a deep per-example
function (a tanh MLP of `--layers` layers of width `--width`), with N a multiple of B
(no remainder) and not (a remainder), forward and under `jax.grad` (of the mean output
with respect to the parameters). Reported: the best of `--repeats` cold
measurements of each stage (the methods take turns), and ratios against `lax.map`
measured in the same run (the targets: trace + lower of chunkvmap within 1.1x of
lax.map's without a remainder; trace + lower + compile with a remainder <= 0.7x).

    python benchmarks/bench_compile.py [--out benchmarks/results/compile.md]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from _common import init_mlp, machine, mlp

from chunkvmap import batch_vmap


def methods(batch: int):
    """name -> per-example-function transform: f -> (params, x) -> outputs."""
    return {
        "jax.vmap": lambda f: jax.vmap(f, (None, 0)),
        "lax.map": lambda f: (
            lambda p, x: jax.lax.map(lambda xi: f(p, xi), x, batch_size=batch)
        ),
        "batch_vmap": lambda f: batch_vmap(f, (None, 0), batch_size=batch),
        # Without the per-chunk checkpoint (which keeps gradient memory flat in N):
        # what that checkpoint costs to trace and lower.
        "batch_vmap(remat=False)": lambda f: batch_vmap(
            f, (None, 0), batch_size=batch, remat=False
        ),
    }


def program(transform, mode: str):
    """The function to compile: the mapped MLP, or the gradient of its mean."""
    mapped = transform(mlp)
    if mode == "forward":
        return mapped
    return jax.grad(lambda p, x: jnp.mean(mapped(p, x)))


def stages(fn, args) -> tuple[float, float, float]:
    """Seconds of trace, lower and compile, measured cold."""
    jax.clear_caches()
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def best(fns: dict, args, repeats: int) -> dict:
    """name -> the fastest of `repeats` cold measurements of each stage; the methods
    take turns within each repeat, so that a slow spell of a shared machine does not
    fall on one of them only."""
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(stages(fn, args))
    return {
        name: tuple(min(t[k] for t in ts) for k in range(3))
        for name, ts in times.items()
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=150)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 1000])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["forward", "grad"])
    parser.add_argument("--methods", nargs="+", help="a subset of the methods")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def emit(line=""):
        lines.append(line)
        print(line, flush=True)

    b = args.batch_size
    emit("# Compile cost: trace, lower, XLA compile")
    emit()
    emit(
        f"{machine()}. A tanh MLP of {args.layers} layers of width {args.width} per "
        f"example, B = {b}; seconds are the best of {args.repeats} cold "
        "measurements, the methods taking turns, (`jax.clear_caches()` before each) of "
        "`jax.jit(fn).trace(*args)`, `.lower()` and `.compile()`; ratios are against "
        "`lax.map(batch_size=B)` in the same run. grad: `jax.grad` of the mean "
        "output with respect to the parameters."
    )
    emit()
    emit(
        "| mode | N | N % B | method | trace s | lower s | compile s | total s "
        "| trace+lower / lax.map | compile / lax.map | total / lax.map |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    params = init_mlp(jax.random.key(0), [args.width] * (args.layers + 1))
    table = methods(b)
    names = args.methods or list(table)
    if "lax.map" not in names:
        names = ["lax.map", *names]
    for mode in args.modes:
        for n in args.sizes:
            x = jax.random.normal(jax.random.key(1), (n, args.width))
            fns = {name: program(table[name], mode) for name in names}
            rows = best(fns, (params, x), args.repeats)
            base = rows["lax.map"]
            for name, (tr, lo, co) in rows.items():
                emit(
                    f"| {mode} | {n} | {n % b} | {name} | {tr:.3f} | {lo:.3f} | "
                    f"{co:.3f} | {tr + lo + co:.3f} | "
                    f"{(tr + lo) / (base[0] + base[1]):.2f} | {co / base[2]:.2f} | "
                    f"{(tr + lo + co) / sum(base):.2f} |"
                )
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
