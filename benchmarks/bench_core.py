"""Core benchmark: batch_vmap vs jax.vmap, lax.map(batch_size=...) and optax micro_vmap.

Two workloads on a 3-layer MLP:
  (a) the sum of per-example gradients, each clipped to L2 norm 1 (DP-SGD's sum);
  (b) plain per-example gradients, stacked (N x params).

For each N and batch size, every method is compiled, checked against jax.vmap, then
timed. Reported: XLA's compiled temp memory (`memory_analysis()`), compile time (trace +
lower + compile, median of 3 cold compiles) and steady-state run time (median after
warm-up), with ratios against `lax.map(batch_size=B)` measured in the same run.

    python benchmarks/bench_core.py [--sizes 256 1024 4096] [--batch-sizes 32 128]
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from _common import cold_compile_seconds, init_mlp, mlp, run_seconds

from chunkvmap import batch_vmap


try:
    import optax.microbatching as optax_mb
except ImportError:  # optax is optional for this script
    optax_mb = None


def loss(params, x, y):
    return -jax.nn.log_softmax(mlp(params, x, jax.nn.relu))[y]


grad = jax.grad(loss)


def clipped_grad(params, x, y, clip=1.0):
    g = grad(params, x, y)
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    scale = jnp.minimum(1.0, clip / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda leaf: leaf * scale, g)


def tree_sum0(tree):
    return jax.tree.map(lambda leaf: leaf.sum(0), tree)


def methods(task: str, batch: int):
    """name -> function (params, x, y) -> result."""
    per_ex = clipped_grad if task == "clipped_sum" else grad
    post = tree_sum0 if task == "clipped_sum" else (lambda t: t)
    out = {
        "jax.vmap": lambda p, x, y: post(jax.vmap(per_ex, (None, 0, 0))(p, x, y)),
        "lax.map": lambda p, x, y: post(
            jax.lax.map(lambda xy: per_ex(p, *xy), (x, y), batch_size=batch)
        ),
    }
    if task == "clipped_sum":
        out["batch_vmap"] = batch_vmap(
            per_ex,
            (None, 0, 0),
            batch_size=batch,
            reduction=jnp.add,
            chunk_reduction=tree_sum0,
        )
    else:
        out["batch_vmap"] = batch_vmap(per_ex, (None, 0, 0), batch_size=batch)
    if optax_mb is not None:
        acc = (
            optax_mb.AccumulationType.SUM
            if task == "clipped_sum"
            else optax_mb.AccumulationType.CONCAT
        )

        def micro(p, x, y):
            return optax_mb.micro_vmap(
                lambda xi, yi: per_ex(p, xi, yi),
                in_axes=(0, 0),
                microbatch_size=batch,
                accumulator=acc,
            )(x, y)

        out["optax.micro_vmap"] = micro
    return out


def measure(fn, args, repeats, compiles=3):
    compile_s = cold_compile_seconds(fn, args, compiles)
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    result = jax.block_until_ready(compiled(*args))
    return result, temp, compile_s, run_seconds(compiled, args, repeats)


def max_rel_err(a, b):
    errs = [
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ]
    return max(errs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--layers", type=int, nargs="+", default=[64, 256, 256, 10])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tasks", nargs="+", default=["clipped_sum", "per_example"])
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    lines: list[str] = []

    def emit(line=""):
        lines.append(line)
        print(line, flush=True)

    emit("# chunkvmap core benchmark")
    emit()
    emit(
        f"jax {jax.__version__}, backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {platform.machine()}, MLP {args.layers}. "
        "Ratios are against `lax.map(batch_size=B)` in the same run; `optax."
        "micro_vmap` needs N divisible by B and is skipped otherwise."
    )
    params = init_mlp(jax.random.key(0), args.layers)
    rng = np.random.default_rng(0)
    for task in args.tasks:
        emit()
        emit(f"## {task}")
        emit()
        emit(
            "| N | B | method | temp MiB | temp / lax.map | compile s "
            "| compile / lax.map | run ms | run / lax.map | max rel err vs vmap |"
        )
        emit("|---|---|---|---|---|---|---|---|---|---|")
        for n in args.sizes:
            x = jnp.asarray(rng.normal(size=(n, args.layers[0])), jnp.float32)
            y = jnp.asarray(rng.integers(0, args.layers[-1], size=(n,)), jnp.int32)
            for b in args.batch_sizes:
                rows = {}
                for name, fn in methods(task, b).items():
                    if name == "optax.micro_vmap" and n % b:
                        continue  # needs N divisible by the microbatch size
                    rows[name] = measure(fn, (params, x, y), args.repeats)
                ref = rows["jax.vmap"][0]
                base = rows["lax.map"]
                for name, (res, temp, comp, run) in rows.items():
                    emit(
                        f"| {n} | {b} | {name} | {temp / 2**20:.2f} | "
                        f"{temp / max(base[1], 1):.3f} | {comp:.2f} | "
                        f"{comp / base[2]:.2f} | {run * 1e3:.2f} | "
                        f"{run / base[3]:.2f} | "
                        f"{max_rel_err(res, ref):.1e} |"
                    )
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
