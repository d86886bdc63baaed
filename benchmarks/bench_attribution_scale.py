"""Attribution at scale: EK-FAC factors and a gradient store of a GPT-style LM
(10M+ parameters by default), memory against N and time per example against the
non-private step.

The LM of `_dp_models.py` (token and position embeddings, pre-norm blocks, an
untied head) at vocabulary 4096, width 384, 4 blocks, 32 positions. For each
method, in chunks of `--batch` sequences:

* `non-private step`: `jax.grad` of the mean next-token loss over the N
  sequences, chunked by `batch_vmap` (the reference cost per example);
* `ekfac_factors` (Monte-Carlo Fisher, one label per position, `method="ghost"`):
  both passes, the eigendecompositions included;
* `ekfac_factors` with `factors=`: `kfac_factors` of the first N/8 sequences
  (`--subset`), then one pass over the N for the eigenvalues (the bases
  fitted on a subset, as Kronfluence allows);
* `ekfac_factors` with `factors=` an EK-FAC result: its bases kept, one pass
  over the N for the eigenvalues (the second pass alone: no eigendecomposition);
* `build_store` (`dim=16`, `method="ghost"`, whitened by those factors): the
  rows written to a memmap.

Memory: XLA's compiled temporaries of the jitted EK-FAC call (lowered and
compiled, not run) at N and 4N: flat in N is the claim. Time: the median of
`--repeats` interleaved runs after a warm-up, per example, and its ratio to the
non-private step's.

    python benchmarks/bench_attribution_scale.py --n 256 --batch 16 --repeats 2 \
        --out benchmarks/results/attribution_scale.md
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402
from _dp_models import lm_batch, lm_logits, lm_loss, lm_params  # noqa: E402

import chunkvmap as cv  # noqa: E402


FULL = {"vocab": 4096, "width": 384, "positions": 32, "blocks": 4, "heads": 6}
QUICK = {"vocab": 64, "width": 16, "positions": 4, "blocks": 1, "heads": 2}


def _kronecker(f) -> bool:
    return isinstance(f, cv.Kronecker)


def temp_mib(f, *args) -> float:
    compiled = jax.jit(f).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def peak_mib() -> float | None:
    """The device's peak bytes in use so far (None where the backend keeps none)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def flop_counts(step, second, args: tuple, factors, n: int) -> list[str]:
    """The lines of XLA's flop count per sequence of the non-private step and of
    the second pass (`factors` given) over `args`' `n` sequences in one chunk,
    compiled for the CPU (counted, not run: the counts are the program's own on
    every backend, and a loop's body would be counted once)."""
    params, tokens, targets = args
    with jax.default_device(jax.devices("cpu")[0]):
        moved = jax.device_put((args, factors), jax.devices("cpu")[0])
        (params, tokens, targets), factors = moved
        counts = [
            _flops(step, params, tokens, targets) / n,
            _flops(second, params, tokens, factors) / n,
        ]
    return [
        f"XLA's flop count per sequence (one chunk of {n}, compiled for the CPU): "
        f"non-private step {counts[0] / 1e9:.2f} GFLOP, the second pass "
        f"{counts[1] / 1e9:.2f} GFLOP ({counts[1] / counts[0]:.2f}x).",
        "",
    ]


def _flops(f, *args) -> float:
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


SECOND = "ekfac_factors, bases given (`factors=` an EK-FAC result: the second pass)"


def say(text: str) -> None:  # progress on stderr, so a cut run still tells
    print(text, file=sys.stderr, flush=True)


def run(args) -> str:
    cfg = dict(QUICK if args.quick else FULL)
    if getattr(args, "positions", None):
        cfg["positions"] = args.positions
    rng = np.random.default_rng(0)
    params = lm_params(rng, cfg)
    count = sum(x.size for x in jax.tree.leaves(params))
    heads = cfg["heads"]
    logits = lambda p, t: lm_logits(p, t, heads)  # noqa: E731
    loss = lambda p, t, y: lm_loss(p, t, y, heads)  # noqa: E731
    n, b = args.n, args.batch
    tokens, targets = lm_batch(rng, n, cfg)
    key = jax.random.key(1)

    chunked = cv.batch_vmap(loss, (None, 0, 0), batch_size=b)
    step = jax.jit(jax.grad(lambda p, t, y: chunked(p, t, y).mean()))
    ekfac = jax.jit(
        cv.ekfac_factors(
            logits, likelihood="categorical", fisher="mc", batch_size=b, method="ghost"
        )  # fmt: skip
    )
    folder = Path(tempfile.mkdtemp())

    def store(factors):
        shutil.rmtree(folder, ignore_errors=True)
        s = cv.build_store(folder, loss, params, tokens, targets, dim=16,
                           method="ghost", precondition=factors, damping=0.1,
                           batch_size=b, write_size=max(b, n // 2))  # fmt: skip
        return s.rows

    kfac = jax.jit(
        cv.kfac_factors(logits, likelihood="categorical", fisher="mc", batch_size=b)
    )
    sub = max(b, n // args.subset)

    def fitted_on_a_subset():  # the bases of the first N/subset sequences
        given = kfac(params, tokens[:sub], key=key)
        return ekfac(params, tokens, key=key, factors=given)

    full = jax.block_until_ready(kfac(params, tokens, key=key))
    blocks = [f for f in jax.tree.leaves(full, is_leaf=_kronecker) if _kronecker(f)]
    # (the eigendecompositions `ekfac_factors` makes of each leaf's factors, by
    # its own function: on the host on a TPU, an embedding's counts left diagonal)
    from chunkvmap._quantities._ekfac import _eigh

    bases = jax.jit(lambda fs: [_eigh(f) for f in fs])
    t0 = time.perf_counter()
    factors = jax.block_until_ready(ekfac(params, tokens, key=key))
    say(f"ekfac_factors compiled and run: {time.perf_counter() - t0:.1f} s")
    runs = {
        "non-private step": lambda: step(params, tokens, targets),
        "ekfac_factors (ghost, both passes)": lambda: ekfac(params, tokens, key=key),
        f"ekfac_factors (ghost), bases fitted on N/{args.subset} (`factors=`)": (
            fitted_on_a_subset
        ),
        SECOND: lambda: ekfac(params, tokens, key=key, factors=factors),
        "build_store (dim 16, ghost, EK-FAC-whitened)": lambda: store(factors),
    }
    if not args.no_parts:
        runs.update({
            "part: kfac_factors (the first pass)": (
                lambda: kfac(params, tokens, key=key)
            ),
            "part: the eigendecompositions of its factors": lambda: bases(blocks),
            "part: ekfac_factors given those factors (eigendecompositions, "
            "second pass)": lambda: ekfac(params, tokens, key=key, factors=full),
        })  # fmt: skip
    times = {name: [] for name in runs}
    for name, f in runs.items():  # warm-up (compiles)
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        say(f"warm-up {name}: {time.perf_counter() - t0:.1f} s")
    for r in range(args.repeats):
        for name, f in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t0)
            say(f"round {r} {name}: {1e3 * times[name][-1] / n:.2f} ms per example")
    peaks = {n: peak_mib()}  # the device's peak after every program ran at N
    shutil.rmtree(folder, ignore_errors=True)
    base = np.median(times["non-private step"])
    big_tokens = jnp.concatenate([tokens] * 4)
    sizes = () if args.no_memory else ((n, tokens), (4 * n, big_tokens))
    mem = {m: temp_mib(lambda p, t: ekfac(p, t, key=key), params, x) for m, x in sizes}
    step_mem = {m: temp_mib(step, params, x, jnp.roll(x, -1, 1)) for m, x in sizes}
    further = {}
    if args.peak:  # then ekfac and the store at 4N
        factors = jax.block_until_ready(ekfac(params, big_tokens, key=key))
        big = (params, big_tokens, jnp.roll(big_tokens, -1, 1))
        jax.block_until_ready(step(*big))
        given = factors
        jax.block_until_ready(ekfac(params, big_tokens, key=key, factors=given))
        for name, f in (("non-private step", lambda: step(*big)),
                        ("ekfac_factors (ghost, both passes)",
                         lambda: ekfac(params, big_tokens, key=key)),
                        (SECOND, lambda: ekfac(params, big_tokens, key=key,
                                               factors=given))):  # fmt: skip
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            at_n = np.median(times[name])
            further[name] = (time.perf_counter() - t0 - at_n) / (3 * n)
            say(f"{name}: {1e3 * further[name]:.3f} ms per further example")

        def big_store():  # (two blocks, as at N)
            shutil.rmtree(folder, ignore_errors=True)
            cv.build_store(folder, loss, params, big_tokens,
                           jnp.roll(big_tokens, -1, 1), dim=16, method="ghost",
                           precondition=factors, damping=0.1, batch_size=b,
                           write_size=max(b, 2 * n))  # fmt: skip

        big_store()  # (its blocks' program compiled: their size is new)
        t0 = time.perf_counter()
        big_store()
        name = "build_store (dim 16, ghost, EK-FAC-whitened)"
        at_n = np.median(times[name])
        further[name] = (time.perf_counter() - t0 - at_n) / (3 * n)
        say(f"{name}: {1e3 * further[name]:.3f} ms per further example")
        shutil.rmtree(folder, ignore_errors=True)
        if peaks[n] is not None:
            peaks[4 * n] = peak_mib()
            say(f"device peaks (MiB): {peaks}")
    lines = [
        "# Attribution at scale: EK-FAC factors and a gradient store of an LM",
        "",
        f"Machine: {machine()}. `python benchmarks/bench_attribution_scale.py`.",
        "",
        f"GPT-style LM ({count / 1e6:.2f}M parameters: vocabulary {cfg['vocab']}, "
        f"width {cfg['width']}, {cfg['blocks']} blocks, {cfg['positions']} "
        f"positions), N = {n} sequences in chunks of {b}; median of {args.repeats} "
        f"interleaved runs after a warm-up.",
        "",
        "| method | ms per example | / non-private step |",
        "|---|---|---|",
        *[
            f"| {name} | {1e3 * np.median(t) / n:.2f} | {np.median(t) / base:.2f} |"
            for name, t in times.items()
        ],
        "",
    ]
    if not args.no_memory:
        lines += [
            "XLA's compiled temporaries (MiB), jitted, at N and 4N:",
            "",
            f"| program | N = {n} | N = {4 * n} |",
            "|---|---|---|",
            f"| ekfac_factors (ghost) | {mem[n]:.1f} | {mem[4 * n]:.1f} |",
            f"| non-private step | {step_mem[n]:.1f} | {step_mem[4 * n]:.1f} |",
            "",
        ]
    if further:
        step_further = further["non-private step"]
        lines += [
            f"Per further example, from N = {n} to N = {4 * n} (the fixed costs, as "
            "the eigendecompositions, left out):",
            "",
            "| method | ms per further example | / non-private step |",
            "|---|---|---|",
            *[
                f"| {k} | {1e3 * v:.3f} | {v / step_further:.2f} |"
                for k, v in further.items()
            ],
            "",
        ]
    if args.flops:
        whole = cv.ekfac_factors(
            logits, likelihood="categorical", fisher="mc", method="ghost"
        )  # (one chunk of b sequences)
        lines += flop_counts(
            lambda p, t, y: jax.grad(lambda q: jax.vmap(loss, (None, 0, 0))(q, t, y)
                                     .mean())(p),
            lambda p, t, f: whole(p, t, key=key, factors=f),
            (params, tokens[:b], targets[:b]), factors, b,
        )  # fmt: skip
    if len(peaks) == 2:
        lines += [
            "The device's peak bytes in use (`memory_stats()`, MiB), after every "
            f"program ran at N = {n}, then after `ekfac_factors` and `build_store` "
            f"at N = {4 * n}:",
            "",
            f"| N = {n} | N = {4 * n} |",
            "|---|---|",
            f"| {peaks[n]:.1f} | {peaks[4 * n]:.1f} |",
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--subset", type=int, default=8,
        help="the bases' row fits KFAC on N / this many sequences",
    )  # fmt: skip
    parser.add_argument(
        "--no-memory", action="store_true",
        help="leave out the compiled temporaries (an accelerator's are not reliable)",
    )  # fmt: skip
    parser.add_argument(
        "--peak", action="store_true",
        help="then run ekfac_factors and build_store at 4N: the time per further "
        "example, and the device's peak bytes in use at N and at 4N (backends "
        "that keep memory_stats)",
    )  # fmt: skip
    parser.add_argument(
        "--no-parts", action="store_true",
        help="leave out the rows of EK-FAC's parts (the first pass, the "
        "eigendecompositions, the second pass given KFAC factors)",
    )  # fmt: skip
    parser.add_argument(
        "--positions", type=int, default=None,
        help="the sequences' length (default 32; LMs train at 256 and more)",
    )  # fmt: skip
    parser.add_argument(
        "--flops", action="store_true",
        help="also XLA's flop count of the step and the second pass (one chunk)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
