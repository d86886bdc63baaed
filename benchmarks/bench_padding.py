"""Poisson lots in one program: `clipped_grad` on a padded buffer against the program
compiled for exactly the real examples.

A DP-SGD lot drawn by Poisson sampling changes size at every step. Padded to a fixed
capacity and marked with `is_padding_example=`, every lot runs the same compiled
program; chunks holding only padding are skipped at run time, so a lot of n real
examples should cost about what n examples cost. For each n, both methods and the
padding at the end or shuffled through the buffer, the table gives the median time
of one call of the padded program (capacity C) and of the program compiled for
exactly the n real examples, measured interleaved, and their ratio; the values of
the two agree (checked before timing).

    python benchmarks/bench_padding.py --out benchmarks/results/padding.md

The chunkvmap measured is the one in the folder above this script's (`_common` puts
it first on the path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from _common import init_mlp, machine, mlp  # noqa: E402

from chunkvmap import clipped_grad  # noqa: E402


def _xent(p, x, y):
    return -jax.nn.log_softmax(mlp(p, x))[y]


def _interleaved(fns, args, repeats):
    """Median seconds per call of each function, calls interleaved."""
    for f, a in zip(fns, args):
        jax.block_until_ready(f(*a))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, f, a in zip(times, fns, args):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _max_rel_err(a, b):
    errs = [
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ]
    return max(errs)


def rows(capacity, batch, sizes, widths, repeats, rng):
    params = init_mlp(jax.random.key(0), widths)
    x = jnp.asarray(rng.normal(size=(capacity, widths[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, widths[-1], capacity), jnp.int32)
    for method in ("vmap", "ghost"):
        grad = clipped_grad(
            _xent, l2_clip_norm=1.0, batch_argnums=(1, 2), keep_batch_dim=False,
            batch_size=batch, method=method,
        )  # fmt: skip
        # (its own function: jit's cache of it counts its programs alone)
        padded = jax.jit(lambda p, x, y, m: grad(p, x, y, is_padding_example=m))
        for n in sizes:
            exact = jax.jit(grad)
            for where in ("end", "shuffled"):
                pad = np.arange(capacity) >= n
                if where == "shuffled":
                    pad = rng.permutation(pad)
                real = np.nonzero(~pad)[0]
                mask = jnp.asarray(pad)
                a_args = (params, x, y)
                e_args = (params, x[real], y[real])
                got = padded(*a_args, mask)
                err = _max_rel_err(got, exact(*e_args))
                assert err < 1e-4, (method, n, where, err)  # the same values
                t_pad, t_exact = _interleaved(
                    [lambda *a: padded(*a, mask), exact],
                    [a_args, e_args],
                    repeats,
                )
                yield method, n, where, t_pad, t_exact, err
        yield method, None, padded._cache_size(), None, None, None  # programs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 200, 700])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 512, 10])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    widths = "-".join(map(str, args.widths))
    lines = [
        "# Poisson lots in one program: padded over exact",
        "",
        f"Machine: {machine()}. `clipped_grad` on an MLP {widths} (cross-entropy), "
        f"capacity {args.capacity}, chunks of {args.batch_size}; median of "
        f"{args.repeats} interleaved calls, each program jitted. `padded`: one "
        "program for every lot, the padding marked with `is_padding_example=` "
        "(at the end of the buffer, or shuffled through it); `exact`: the program "
        "compiled for exactly the n real examples.",
        "",
        "| method | real examples n | padding | padded ms | exact ms | padded / exact "
        "| max rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    programs = []
    for method, n, where, t_pad, t_exact, err in rows(
        args.capacity, args.batch_size, args.sizes, args.widths, args.repeats, rng
    ):
        if n is None:
            programs.append(f"`method={method!r}`: {where} padded program(s) compiled")
            continue
        line = (
            f"| {method} | {n} | {where} | {t_pad * 1e3:.2f} | {t_exact * 1e3:.2f} "
            f"| {t_pad / t_exact:.2f}x | {err:.1e} |"
        )
        lines.append(line)
        print(line, flush=True)
    lines += ["", "Programs: " + "; ".join(programs) + "."]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
