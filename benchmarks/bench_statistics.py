"""Per-example gradient statistics: chunkvmap against `jax.vmap(jax.grad)` then reduce.

For each model, in one run and on the same inputs: the reference (all N per-example
gradients formed by `jax.vmap(jax.grad(loss))`, then the statistic), the plain
gradient of the mean loss (`jax.grad`, the cost of one training step's backward
pass), and chunkvmap's `per_example_grad_norms` (vmap and ghost),
`per_example_grad_stats` and `per_example_grad_gram` (vmap and ghost) in chunks of B.
Memory is XLA's compiled temporary-memory estimate; time is the best of `--repeats`
runs after a warm-up; ratios are against the reference and the plain gradient of the
same run; the error is the largest difference from the reference, relative to the
reference's largest entry.

    python benchmarks/bench_statistics.py --out benchmarks/results/statistics.md
    python benchmarks/bench_statistics.py --quick          # tiny models, seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))

import _dp_models  # noqa: E402
from _common import init_mlp, machine, mlp  # noqa: E402

import chunkvmap  # noqa: E402


def mlp_model(sizes):
    def make_params(rng):
        return init_mlp(jax.random.key(int(rng.integers(1 << 30))), sizes)

    def loss(p, x, y):
        return -jax.nn.log_softmax(mlp(p, x))[y]

    def batch(rng, n):
        x = jnp.asarray(rng.normal(size=(n, sizes[0])), jnp.float32)
        return x, jnp.asarray(rng.integers(0, sizes[-1], n), jnp.int32)

    return make_params, loss, batch


def models(quick):
    sizes = (16, 32, 10) if quick else (784, 256, 10)
    lm_name, lm = next(iter(_dp_models.models(quick).items()))
    return {f"MLP {'-'.join(map(str, sizes))}": mlp_model(sizes), lm_name: lm}


def flat_grads(loss, params, batch):
    grads = jax.vmap(jax.grad(loss), in_axes=(None, *[0] * len(batch)))(params, *batch)
    n = batch[0].shape[0]
    return jnp.concatenate([g.reshape(n, -1) for g in jax.tree.leaves(grads)], 1)


def methods(loss, batch_size):
    """statistic -> [(method, fn(params, *batch) -> comparable array)]; the first of
    each is the reference."""

    def stats_vector(s):
        leaves = jax.tree.leaves((s.mean, s.variance, s.sum_sq))
        return jnp.concatenate([x.ravel() for x in leaves] + [s.sq_norms])

    def reference_stats(p, *b):
        g = jax.vmap(jax.grad(loss), in_axes=(None, *[0] * len(b)))(p, *b)
        mean = jax.tree.map(lambda x: x.mean(0), g)
        var = jax.tree.map(lambda x: x.var(0), g)
        sum_sq = jax.tree.map(lambda x: (x**2).sum(0), g)
        sq_norms = sum(
            jnp.sum(x**2, axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(g)
        )
        leaves = jax.tree.leaves((mean, var, sum_sq))
        return jnp.concatenate([x.ravel() for x in leaves] + [sq_norms])

    def norms(method):
        fn = chunkvmap.per_example_grad_norms(
            loss, batch_size=batch_size, method=method
        )
        return lambda p, *b: fn(p, *b)

    def gram(method):
        fn = chunkvmap.per_example_grad_gram(loss, batch_size=batch_size, method=method)
        return lambda p, *b: fn(p, *b)

    def stats(method):
        fn = chunkvmap.per_example_grad_stats(
            loss, batch_size=batch_size, method=method
        )
        return lambda p, *b: stats_vector(fn(p, *b))

    def reference_norms(p, *b):
        return jnp.linalg.norm(flat_grads(loss, p, b), axis=1)

    def reference_gram(p, *b):
        f = flat_grads(loss, p, b)
        return f @ f.T

    return {
        "norms": [
            ("vmap(grad), then norms", reference_norms),
            ("per_example_grad_norms vmap", norms("vmap")),
            ("per_example_grad_norms ghost", norms("ghost")),
        ],
        "mean, variance, sum of squares, squared norms": [
            ("vmap(grad), then moments", reference_stats),
            ("per_example_grad_stats vmap", stats("vmap")),
            ("per_example_grad_stats ghost", stats("ghost")),
        ],
        "Gram matrix (N x N)": [
            ("vmap(grad), then G G^T", reference_gram),
            ("per_example_grad_gram vmap", gram("vmap")),
            ("per_example_grad_gram ghost", gram("ghost")),
        ],
    }  # fmt: skip


def measure(fn, args, repeats):
    """(compiled temp bytes, best run seconds, result)."""
    exe = jax.jit(fn).lower(*args).compile()
    temp = exe.memory_analysis().temp_size_in_bytes
    result = jax.block_until_ready(exe(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        best = min(best, time.perf_counter() - t0)
    return temp, best, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (seconds)")
    parser.add_argument("--examples", type=int, help="N (default 256; quick 12)")
    parser.add_argument("--batch-size", type=int, help="B (default 32; quick 5)")
    parser.add_argument("--repeats", type=int, help="timed runs (default 3; quick 1)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    n = args.examples or (12 if args.quick else 256)
    b = args.batch_size or (5 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)

    lines = [
        "# Per-example gradient statistics",
        "",
        f"{machine()}. N = {n} examples in chunks of B = {b}. temp: XLA's compiled "
        f"temporary memory; time: best of {repeats} runs; ratios against the "
        f"reference (`jax.vmap(jax.grad)`, then the statistic) and the plain gradient "
        f"of the mean loss, in the same run; error: max |difference| from the "
        f"reference / max |reference|.",
    ]
    rng = np.random.default_rng(0)
    for name, (make_params, loss, make_batch) in models(args.quick).items():
        params, batch = make_params(rng), make_batch(rng, n)
        size = sum(x.size for x in jax.tree.leaves(params))
        plain = jax.grad(
            lambda p, *bt: jnp.mean(
                jax.vmap(loss, in_axes=(None, *[0] * len(bt)))(p, *bt)
            )
        )
        plain_temp, plain_time, _ = measure(plain, (params, *batch), repeats)
        lines += [
            "",
            f"## {name} ({size:,} parameters)",
            "",
            f"Plain gradient of the mean loss: temp {plain_temp / 2**20:.1f} MiB, "
            f"{plain_time * 1e3:.1f} ms.",
            "",
            "| statistic | method | temp MiB | ms | memory / reference "
            "| time / reference | time / plain gradient | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for statistic, rows in methods(loss, b).items():
            ref_temp = ref_time = ref = None
            for method, fn in rows:
                temp, seconds, result = measure(fn, (params, *batch), repeats)
                if ref is None:
                    ref_temp, ref_time, ref = temp, seconds, result
                error = float(jnp.max(jnp.abs(result - ref)) / jnp.max(jnp.abs(ref)))
                lines.append(
                    f"| {statistic} | {method} | {temp / 2**20:.1f} | "
                    f"{seconds * 1e3:.1f} | {temp / max(ref_temp, 1):.2f} | "
                    f"{seconds / ref_time:.2f} | {seconds / plain_time:.1f} | "
                    f"{error:.1e} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
