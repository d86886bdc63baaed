"""What an eager call costs: chunkvmap called outside `jax.jit`, against `jax.vmap`
called eagerly and against the same chunkvmap transform under `jax.jit` (a compiled
program reused with no trace: what an eager cache keyed only by the arguments' types
costs, and what a call inside the user's own `jax.jit` costs).

An eager chunkvmap call traces its program on every call (so that it sees the
function's closure as it is now, as `jax.vmap` does) and reuses the compiled program
when the traced program is the same; the closed-over arrays are its arguments. Each
row checks the result against `jax.vmap`, then reports the median time per call.

    python benchmarks/bench_eager.py --out benchmarks/results/eager.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from _common import init_mlp, machine, mlp, run_seconds  # noqa: E402

from chunkvmap import batch_vmap, clipped_grad_sum, per_example_grads  # noqa: E402


def cases(quick: bool):
    n = 64 if quick else 1024
    key = jax.random.key(0)
    params = init_mlp(key, [64, 256, 256, 10])
    x = jax.random.normal(jax.random.key(1), (n, 64))
    y = jnp.arange(n) % 10
    teacher = {"params": params}  # a closure the calls read, as a distillation's

    def loss(p, x, y):
        logits = mlp(p, x)
        soft = jax.nn.softmax(mlp(teacher["params"], x))
        return -jax.nn.log_softmax(logits)[y] + jnp.sum(soft * logits) * 0.0

    yield (
        "elementwise (sin, 16 features)",
        batch_vmap(lambda v: jnp.sin(v) * 2.0, batch_size=128),
        jax.vmap(lambda v: jnp.sin(v) * 2.0),
        (x[:, :16],),
    )
    yield (
        "MLP 64-256-256-10 forward",
        batch_vmap(mlp, (None, 0), batch_size=128),
        jax.vmap(mlp, (None, 0)),
        (params, x),
    )
    yield (
        "per_example_grads, MLP with a closed-over teacher",
        per_example_grads(loss, batch_size=128),
        jax.vmap(jax.grad(loss), (None, 0, 0)),
        (params, x, y),
    )
    summed = clipped_grad_sum(loss, 1.0, batch_size=128)

    def clipped_by_vmap(p, x, y):
        g = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y)
        sq = sum(
            jnp.sum(t**2, axis=tuple(range(1, t.ndim))) for t in jax.tree.leaves(g)
        )
        factor = jnp.minimum(1.0, 1.0 / jnp.maximum(jnp.sqrt(sq), 1e-30))
        return jax.tree.map(lambda t: jnp.tensordot(factor, t, 1), g), x.shape[0]

    yield (
        "clipped_grad_sum, MLP with a closed-over teacher",
        summed,
        clipped_by_vmap,
        (params, x, y),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    rows = []
    for name, chunked, vmapped, inputs in cases(args.quick):
        want = vmapped(*inputs)
        got = chunked(*inputs)
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
        assert err < 1e-4, (name, err)
        t_vmap = run_seconds(vmapped, inputs, args.repeats)
        t_eager = run_seconds(chunked, inputs, args.repeats)
        t_jit = run_seconds(jax.jit(chunked), inputs, args.repeats)
        rows.append((name, t_vmap, t_eager, t_jit, err))
    lines = [
        "# Eager calls: chunkvmap outside jax.jit",
        "",
        f"Machine: {machine()}. Median of {args.repeats} calls after two warm-ups, "
        f"N = {64 if args.quick else 1024}, chunks of 128. `eager`: the chunkvmap "
        "transform called outside `jax.jit` (it traces its program every call, so a "
        "changed closure is seen, and reuses the compiled program); `jit`: the same "
        "transform under `jax.jit` (the compiled program alone, no trace).",
        "",
        "| function | jax.vmap eager ms | chunkvmap eager ms | chunkvmap under jit ms "
        "| eager / jax.vmap | eager - jit ms | max rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t_vmap, t_eager, t_jit, err in rows:
        lines.append(
            f"| {name} | {t_vmap * 1e3:.2f} | {t_eager * 1e3:.2f} | {t_jit * 1e3:.2f} "
            f"| {t_eager / t_vmap:.2f}x | {(t_eager - t_jit) * 1e3:.2f} | {err:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
