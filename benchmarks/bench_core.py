"""Core benchmark: chunkvmap vs jax.vmap, lax.map, optax microbatching and NetKet.

Three workloads, each with and without a remainder (N % B != 0):
  (a) per_example: per-example gradients of a 3-layer MLP, stacked (N x params);
  (b) clipped_sum: the sum of per-example gradients, each clipped to L2 norm 1
      (DP-SGD's aggregation);
  (c) elementwise: a memory-heavy per-example function (a d x d intermediate per
      example, summed away).

For each N and batch size B, every method is compiled, checked against jax.vmap, then
timed. Reported: XLA's compiled temp memory (`memory_analysis()`), compile time (trace +
lower + compile, median of cold compiles) and steady-state run time (median after
warm-up), as ratios against `lax.map(batch_size=B)` measured in the same run. Methods
that cannot run a configuration are left out of its rows (optax's microbatching needs N
divisible by B; NetKet is used only when installed). With `--plots DIR`, one PNG per
workload (temp memory vs N at the first B) is written there.

    python benchmarks/bench_core.py [--sizes 256 1000 4096] [--batch-sizes 32 128]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    cold_compile_seconds,
    init_mlp,
    machine,
    mlp,
    netket_vmap_chunked,
    plot_lines,
    run_seconds,
)

from chunkvmap import batch_vmap, clipped_grad_sum, per_example_grads


try:
    import optax
    import optax.microbatching as optax_mb
except ImportError:  # optax is optional for this script
    optax = optax_mb = None

vmap_chunked = netket_vmap_chunked()


def loss(params, x, y):
    return -jax.nn.log_softmax(mlp(params, x, jax.nn.relu))[y]


grad = jax.grad(loss)


def clip(g, norm_clip=1.0):
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    return jax.tree.map(
        lambda leaf: leaf * (norm_clip / jnp.maximum(norm, norm_clip)), g
    )


def clipped_grad(params, x, y):
    return clip(grad(params, x, y))


def tree_sum0(tree):
    return jax.tree.map(lambda leaf: leaf.sum(0), tree)


def heavy(w, x, y):
    """A per-example d x d intermediate (d = len(x)), reduced to a vector."""
    del y
    outer = jnp.tanh(x[:, None] * x[None, :] + w)
    return jnp.sum(jnp.sin(outer) ** 2, axis=1)


def methods(task: str, batch: int):
    """name -> function (params, x, y) -> result, for one workload and batch size."""
    sum_up = task == "clipped_sum"
    per_ex = {"clipped_sum": clipped_grad, "per_example": grad, "elementwise": heavy}[
        task
    ]
    post = tree_sum0 if sum_up else (lambda t: t)
    out = {
        "jax.vmap": lambda p, x, y: post(jax.vmap(per_ex, (None, 0, 0))(p, x, y)),
        "lax.map": lambda p, x, y: post(
            jax.lax.map(lambda xy: per_ex(p, *xy), (x, y), batch_size=batch)
        ),
    }
    if sum_up:
        out["batch_vmap"] = batch_vmap(
            per_ex,
            (None, 0, 0),
            batch_size=batch,
            reduction=jnp.add,
            chunk_reduction=tree_sum0,
        )
        summed = clipped_grad_sum(loss, 1.0, batch_argnums=(1, 2), batch_size=batch)
        out["clipped_grad_sum"] = lambda p, x, y: summed(p, x, y)[0]
    else:
        out["batch_vmap"] = batch_vmap(per_ex, (None, 0, 0), batch_size=batch)
    if task == "per_example":
        out["per_example_grads"] = per_example_grads(
            loss, batch_argnums=(1, 2), batch_size=batch
        )
    if optax_mb is not None:
        acc = (
            optax_mb.AccumulationType.SUM
            if sum_up
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
        if sum_up:
            micro_grad = optax_mb.micro_grad(
                loss,
                batch_argnums=(1, 2),
                keep_batch_dim=False,
                microbatch_size=batch,
                transform_fn=clip,
            )
            out["optax.micro_grad"] = lambda p, x, y: micro_grad(p, x, y)[0]
    if vmap_chunked is not None:
        chunked = vmap_chunked(per_ex, in_axes=(None, 0, 0), chunk_size=batch)
        out["netket.vmap_chunked"] = lambda p, x, y: post(chunked(p, x, y))
    return out


def measure(fn, args, repeats, compiles):
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


def inputs(task, n, layers, dim, rng):
    if task == "elementwise":
        params = jnp.float32(0.1)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
    else:
        params = init_mlp(jax.random.key(0), layers)
        x = jnp.asarray(rng.normal(size=(n, layers[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, layers[-1], size=(n,)), jnp.int32)
    return params, x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1000, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--layers", type=int, nargs="+", default=[64, 256, 256, 10])
    parser.add_argument("--dim", type=int, default=256, help="elementwise: d")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiles", type=int, default=3)
    parser.add_argument(
        "--tasks", nargs="+", default=["per_example", "clipped_sum", "elementwise"]
    )
    parser.add_argument("--out", help="also write the tables to this markdown file")
    parser.add_argument("--plots", help="write one PNG per workload to this folder")
    args = parser.parse_args()
    lines: list[str] = []

    def emit(line=""):
        lines.append(line)
        print(line, flush=True)

    emit("# chunkvmap core benchmark")
    emit()
    emit(
        f"{machine()}. MLP {args.layers}; elementwise d={args.dim}. Ratios are "
        "against `lax.map(batch_size=B)` in the same run. optax's microbatching needs "
        "N divisible by B and is left out otherwise; NetKet "
        + ("`vmap_chunked` is included." if vmap_chunked else "is not installed.")
    )
    rng = np.random.default_rng(0)
    for task in args.tasks:
        emit()
        emit(f"## {task}")
        emit()
        emit(
            "| N | B | N % B | method | temp MiB | temp / lax.map | compile s "
            "| compile / lax.map | run ms | run / lax.map | max rel err vs vmap |"
        )
        emit("|---|---|---|---|---|---|---|---|---|---|---|")
        series: dict[str, tuple[list, list]] = {}
        for n in args.sizes:
            params, x, y = inputs(task, n, args.layers, args.dim, rng)
            for b in args.batch_sizes:
                rows = {}
                for name, fn in methods(task, b).items():
                    if name.startswith("optax.") and n % b:
                        continue  # needs N divisible by the microbatch size
                    rows[name] = measure(
                        fn, (params, x, y), args.repeats, args.compiles
                    )
                ref = rows["jax.vmap"][0]
                base = rows["lax.map"]
                for name, (res, temp, comp, run) in rows.items():
                    emit(
                        f"| {n} | {b} | {n % b} | {name} | {temp / 2**20:.2f} | "
                        f"{temp / max(base[1], 1):.3f} | {comp:.2f} | "
                        f"{comp / base[2]:.2f} | {run * 1e3:.2f} | "
                        f"{run / base[3]:.2f} | {max_rel_err(res, ref):.1e} |"
                    )
                    if b == args.batch_sizes[0]:
                        xs, ys = series.setdefault(name, ([], []))
                        xs.append(n)
                        ys.append(max(temp, 1) / 2**20)
        if args.plots:
            path = pathlib.Path(args.plots) / f"core_{task}.png"
            plot_lines(
                path,
                f"{task}: XLA compiled temp memory, B={args.batch_sizes[0]} "
                f"({jax.default_backend()})",
                "examples N",
                "temp memory (MiB)",
                series,
            )
            emit()
            emit(f"![{task}]({path.name})")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
