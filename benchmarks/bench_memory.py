"""Memory you can promise: gradients through a chunked map, and the cost of a remainder.

Two tables, each measured side by side in one run, as ratios:

1. Gradient through a chunked forward pass: XLA's compiled temp memory of
   `jit(grad(lambda p: chunked(model)(p, x).sum()))` for N from 512 to 16384, with
   `batch_vmap(remat=True)` (the default), `batch_vmap(remat=False)`,
   `lax.map(batch_size=B)` and plain `jax.vmap`; and the run time of remat on vs off
   (the price of recomputing the forward pass).
2. Compile time with and without a remainder (N % B != 0 vs == 0): median of cold
   compiles (`jax.clear_caches()` before each) of `batch_vmap`, `batch_map`,
   `lax.map(batch_size=B)` and `jax.vmap` on the same function, as ratios against
   `lax.map`.

    python benchmarks/bench_memory.py [--batch-size 32] [--out results.md]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
from _common import (
    cold_compile_seconds,
    init_mlp,
    machine,
    mlp,
    netket_vmap_chunked,
    plot_lines,
    run_seconds,
)

from chunkvmap import batch_map, batch_vmap


vmap_chunked = netket_vmap_chunked()


def forward_methods(batch):
    out = {
        "batch_vmap": lambda p, x: batch_vmap(mlp, (None, 0), batch_size=batch)(p, x),
        "batch_vmap(remat=False)": lambda p, x: batch_vmap(
            mlp, (None, 0), batch_size=batch, remat=False
        )(p, x),
        "batch_map": lambda p, x: batch_map(
            lambda c: jax.vmap(mlp, (None, 0))(p, c), x, batch
        ),
        "lax.map": lambda p, x: jax.lax.map(lambda xi: mlp(p, xi), x, batch_size=batch),
        "jax.vmap": lambda p, x: jax.vmap(mlp, (None, 0))(p, x),
    }
    if vmap_chunked is not None:
        out["netket.vmap_chunked"] = lambda p, x: vmap_chunked(
            mlp, (None, 0), chunk_size=batch
        )(p, x)
    return out


def grad_of_sum(forward):
    return jax.grad(lambda p, x: forward(p, x).sum())


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 16384])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 256, 256, 10])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the tables to this markdown file")
    parser.add_argument("--plots", help="write the memory plot to this folder")
    args = parser.parse_args()
    b = args.batch_size
    params = init_mlp(jax.random.key(0), args.layers)
    lines = [
        "# chunkvmap memory benchmark",
        "",
        f"{machine()}. MLP {args.layers}, batch size {b}. NetKet "
        + ("`vmap_chunked` is included." if vmap_chunked else "is not installed."),
        "",
        "## Gradient through a chunked forward pass: compiled temp memory",
        "",
        "`jit(grad(lambda p: chunked(mlp)(p, x).sum()))`; ratio = temp at N / temp at "
        f"N={args.sizes[0]} for the same method.",
        "",
        "| N | method | temp KiB | growth vs smallest N | vs lax.map |",
        "|---|---|---|---|---|",
    ]

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    for line in lines:
        print(line)
    first: dict[str, int] = {}
    series: dict[str, tuple[list, list]] = {}
    for n in args.sizes:
        x = jnp.linspace(-1, 1, n * args.layers[0], dtype=jnp.float32).reshape(n, -1)
        temps = {}
        for name, fwd in forward_methods(b).items():
            temps[name] = compiled(grad_of_sum(fwd), params, x).memory_analysis()
            temps[name] = temps[name].temp_size_in_bytes
            first.setdefault(name, temps[name])
            xs, ys = series.setdefault(name, ([], []))
            xs.append(n)
            ys.append(temps[name] / 1024)
        for name, t in temps.items():
            emit(
                f"| {n} | {name} | {t / 1024:.0f} | {t / first[name]:.2f}x | "
                f"{t / temps['lax.map']:.3f} |"
            )

    if args.plots:
        path = pathlib.Path(args.plots) / "memory_grad_through_map.png"
        plot_lines(
            path,
            f"grad through a chunked forward pass, B={b} ({jax.default_backend()})",
            "examples N",
            "XLA compiled temp memory (KiB)",
            series,
        )
        emit("")
        emit(f"![grad through map]({path.name})")
    emit("")
    emit("## Gradient run time: the price of remat")
    emit("")
    emit("| N | remat=True ms | remat=False ms | ratio | lax.map ms | jax.vmap ms |")
    emit("|---|---|---|---|---|---|")
    for n in args.sizes:
        x = jnp.linspace(-1, 1, n * args.layers[0], dtype=jnp.float32).reshape(n, -1)
        ms = {}
        methods = forward_methods(b)
        for name in ("batch_vmap", "batch_vmap(remat=False)", "lax.map", "jax.vmap"):
            exe = compiled(grad_of_sum(methods[name]), params, x)
            ms[name] = 1e3 * run_seconds(exe, (params, x), args.repeats)
        emit(
            f"| {n} | {ms['batch_vmap']:.2f} | {ms['batch_vmap(remat=False)']:.2f} | "
            f"{ms['batch_vmap'] / ms['batch_vmap(remat=False)']:.2f} | "
            f"{ms['lax.map']:.2f} | {ms['jax.vmap']:.2f} |"
        )

    emit("")
    emit("## Compile time with and without a remainder (forward, cold compiles)")
    emit("")
    emit("| N | N % B | method | compile s | vs lax.map |")
    emit("|---|---|---|---|---|")
    base_n = args.sizes[0]
    for n in (base_n, base_n + b // 2 + 1):
        x = jnp.linspace(-1, 1, n * args.layers[0], dtype=jnp.float32).reshape(n, -1)
        secs = {
            name: cold_compile_seconds(fwd, (params, x), args.repeats)
            for name, fwd in forward_methods(b).items()
        }
        for name, s in secs.items():
            emit(f"| {n} | {n % b} | {name} | {s:.3f} | {s / secs['lax.map']:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
