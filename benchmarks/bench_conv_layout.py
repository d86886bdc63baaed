"""Convolutions inside the chunk loop: chunkvmap's layout choice against the rewrite
forced on and switched off, on XLA:CPU.

Inside a while loop XLA:CPU runs a convolution fast only in its canonical layout,
which chunkvmap's rewrite gives it (`chunkvmap/_core/_conv.py`); a kernel with few
channels runs faster on XLA's own path, so the rewrite applies from 64 (input x
output) channels on. Each row is one convolution (1-D, 2-D, 3-D; channels in ->
out; SAME padding, 3-wide kernel) in `batch_vmap` over N=32 examples in chunks of
8, under `jax.jit`: the forward pass and the gradient of the summed loss. Times are
medians of interleaved rounds (chosen, forced on, switched off, back to back); the
ratios divide by the time with the rewrite switched off, so 1.00 is XLA's own
path and below 1 is faster.

    python benchmarks/bench_conv_layout.py [--quick] \
        [--out benchmarks/results/conv_layout.md]
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
from jax import lax


sys.path.insert(0, str(Path(__file__).parent))

from _common import machine  # noqa: E402

import chunkvmap as cv  # noqa: E402
from chunkvmap._core import _conv  # noqa: E402


# (spatial dimensions, size, channels in, channels out)
CASES = [
    (1, 256, 2, 4), (1, 256, 8, 8), (1, 64, 64, 64),
    (2, 32, 2, 4), (2, 32, 2, 16), (2, 32, 3, 32), (2, 16, 32, 64),
    (3, 12, 2, 4), (3, 12, 4, 8), (3, 12, 8, 16), (3, 12, 32, 32),
]  # fmt: skip
QUICK = [(1, 32, 2, 4), (2, 8, 8, 8), (3, 6, 2, 4)]
N, B = 32, 8


def programs(nd, size, cin, cout):
    rng = np.random.default_rng(0)
    sp = "DHW"[-nd:]
    dn = ("NC" + sp, "OI" + sp, "NC" + sp)
    w = jnp.asarray(rng.normal(size=(cout, cin) + (3,) * nd) / 5, jnp.float32)
    x = jnp.asarray(rng.normal(size=(N, cin) + (size,) * nd), jnp.float32)

    def loss(w, v):
        h = lax.conv_general_dilated(
            v[None], w, (1,) * nd, "SAME", dimension_numbers=dn
        )
        return jnp.sum(jnp.tanh(h) ** 2)

    chunked = cv.batch_vmap(loss, (None, 0), batch_size=B)
    forward = jax.jit(chunked)
    grad = jax.jit(jax.grad(lambda w, x: chunked(w, x).sum()))
    return (w, x), forward, grad


def compiled(rewrite, case):
    """The forward and gradient programs, compiled with the rewrite as chosen
    (None), forced on (True) or switched off (False)."""
    original = _conv._MIN_CHANNELS
    try:
        if rewrite is True:
            _conv._MIN_CHANNELS = 0
        elif rewrite is False:
            _conv._MIN_CHANNELS = float("inf")
        args, forward, grad = programs(*case)
        exes = [f.lower(*args).compile() for f in (forward, grad)]
    finally:
        _conv._MIN_CHANNELS = original
    return args, exes


def measure(case, rounds):
    setups = {r: compiled(r, case) for r in (None, True, False)}
    times = {(r, k): [] for r in setups for k in (0, 1)}
    for _ in range(rounds):
        for r, (args, exes) in setups.items():
            for k, exe in enumerate(exes):
                jax.block_until_ready(exe(*args))
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*args))
                times[r, k].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) for key, v in times.items()}
    nd, size, cin, cout = case
    laid_out = cin * cout >= _conv._MIN_CHANNELS
    return [
        (nd, size, cin, cout, laid_out, what, med[None, k] * 1e3,
         med[None, k] / med[False, k], med[True, k] / med[False, k])
        for k, what in enumerate(("forward", "grad"))
    ]  # fmt: skip


def table(rows, rounds) -> str:
    lines = [
        "# Convolutions in the chunk loop: the layout chunkvmap chooses",
        "",
        f"{machine()}.",
        f"N={N} examples in chunks of {B}, under `jax.jit`; medians of {rounds} "
        "interleaved rounds. Ratios divide by the time with the rewrite switched "
        "off (XLA:CPU's own path inside the loop): `chosen` is what chunkvmap runs "
        f"(the rewrite from {_conv._MIN_CHANNELS} input x output channels on), "
        "`forced on` the rewrite for every kernel.",
        "",
        "| conv | size | channels | laid out | program | chosen (ms) | chosen / off "
        "| forced on / off |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for nd, size, cin, cout, laid, what, ms, chosen, forced in rows:
        lines.append(
            f"| {nd}-D | {size} | {cin} -> {cout} | {'yes' if laid else 'no'} "
            f"| {what} | {ms:.1f} | {chosen:.2f} | {forced:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    rows = []
    for case in QUICK if args.quick else CASES:
        rows += measure(case, rounds)
        print(table(rows[-2:], rounds).splitlines()[-2:], flush=True)
    text = table(rows, rounds)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
