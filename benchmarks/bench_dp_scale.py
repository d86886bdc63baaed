"""DP-SGD at scale: one step of a GPT-2-small-class LM and of a ViT-B/16-class model,
private (ghost clipping) against the non-private step, and the largest lot each
program reaches.

Models (`_dp_models.py`, bf16 compute: float32 parameters cast inside the loss):

  gpt2    V=50257, d=768, 12 blocks, 12 heads, T=256, the head tied to the
          embedding (124M parameters);
  vit     224x224 images in 16x16 patches (196 tokens), d=768, 12 blocks, 12
          heads, 1000 classes (86M parameters).

Programs, each one jitted step over a lot of N examples:

  non-private   `jax.grad` of the mean loss over the lot (one batch);
  ghost         `clipped_grad(method="ghost", batch_size=B)`: the clipped sum;
  vmap          `clipped_grad(method="vmap", batch_size=B)`;
  jax.vmap      per-example gradients of the whole lot, clipped and summed;
  jax-privacy   `jax_privacy.clipping.clipped_grad(microbatch_size=B)` (where
                importable).

Table 1: time per step and throughput against the non-private step at each N
(interleaved rounds, median). Table 2: the largest lot each program runs (the lots of
`--lots` in turn, or N doubled, until the device runs out of memory or `--budget`
seconds are spent), with XLA's compiled peak memory (arguments, outputs and
temporaries) at each N: flat in N for the chunked programs. (The TPU's
`memory_stats()` peak leaves a program's temporaries out: 1,128 MiB for a step whose
compiled peak, 12,892 MiB, ran; it is not shown.)

    python benchmarks/bench_dp_scale.py --model gpt2 [--quick] [--profile DIR]
                                        [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
import warnings

import _dp_models as models
import jax
import jax.numpy as jnp
import numpy as np
from _common import Table, is_oom

import chunkvmap


GPT2 = {"vocab": 50257, "width": 768, "positions": 256, "blocks": 12, "heads": 12}
VIT_B16 = {
    "image": 224, "patch": 16, "width": 768, "blocks": 12, "heads": 12,
    "classes": 1000,
}  # fmt: skip
QUICK_LM = {"vocab": 64, "width": 16, "positions": 8, "blocks": 1, "heads": 2}
QUICK_VIT = dict(VIT_B16, image=16, patch=8, width=16, blocks=1, heads=2, classes=4)


def _bf16(p):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)


def model(name: str, quick: bool):
    """(params, loss of one example, batch maker)."""
    rng = np.random.default_rng(0)
    if name == "gpt2":
        cfg = QUICK_LM if quick else GPT2

        def loss(p, tokens, targets):
            logits = models.lm_logits(_bf16(p), tokens, cfg["heads"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], 1))

        return (
            models.lm_params(rng, cfg, tied=True),
            loss,
            lambda n: models.lm_batch(rng, n, cfg),
        )
    cfg = QUICK_VIT if quick else VIT_B16

    def vit_loss(p, image, label):
        logits = models.vit_logits(_bf16(p), image.astype(jnp.bfloat16), cfg)
        return -jax.nn.log_softmax(logits.astype(jnp.float32))[label]

    return (
        models.vit_params(rng, cfg),
        vit_loss,
        lambda n: models.vit_batch(rng, n, cfg),
    )


def programs(loss, b: int) -> dict:
    """name -> step(params, *lot)."""

    def non_private(p, *lot):
        def mean(p):
            return jnp.mean(jax.vmap(loss, (None, 0, 0))(p, *lot))

        return jax.grad(mean)(p)

    def jax_vmap(p, *lot):
        grads = jax.vmap(jax.grad(loss), (None, 0, 0))(p, *lot)
        sq = sum(
            jnp.sum(g.reshape(g.shape[0], -1).astype(jnp.float32) ** 2, 1)
            for g in jax.tree.leaves(grads)
        )
        scale = jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
        return jax.tree.map(lambda g: jnp.tensordot(scale, g, 1), grads)

    kw = dict(l2_clip_norm=1.0, batch_argnums=(1, 2), keep_batch_dim=False)
    out = {
        "non-private": non_private,
        "ghost": chunkvmap.clipped_grad(loss, method="ghost", batch_size=b, **kw),
        "vmap": chunkvmap.clipped_grad(loss, method="vmap", batch_size=b, **kw),
        "jax.vmap": jax_vmap,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax_privacy import clipping
    except Exception:  # noqa: BLE001 (not installed here)
        return out
    private = clipping.clipped_grad(
        loss, l2_clip_norm=1.0, batch_argnums=(1, 2), keep_batch_dim=False,
        microbatch_size=b,
    )  # fmt: skip

    def jax_privacy(p, *lot):
        with jax.numpy_dtype_promotion("standard"):
            return private(p, *lot)

    out["jax-privacy"] = jax_privacy
    return out


def compiled(step, params, lot):
    """The compiled step and XLA's peak memory figure (None where it cannot
    compile for memory)."""
    try:
        c = jax.jit(step).lower(params, *lot).compile()
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            return None, None
        raise
    return c, getattr(c.memory_analysis(), "peak_memory_in_bytes", None)


def timed(steps: dict, params, lot, rounds: int) -> dict:
    """Median seconds per step, interleaved; None for a program out of memory."""
    times: dict = {k: [] for k in steps}
    for _ in range(rounds + 1):  # the first round warms up
        for k, c in steps.items():
            if c is None or times[k] is None:
                continue
            try:
                start = time.perf_counter()
                jax.block_until_ready(c(params, *lot))
                times[k].append(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
                times[k] = None
    return {k: statistics.median(v[1:]) if v else None for k, v in times.items()}


def profile(folder: str, built: dict, params, lot) -> None:
    """Two runs of each compiled step under the profiler, one trace per program
    (`folder/<program>.trace.json.gz`, out of the profiler's nested folders),
    beside its optimised HLO (`folder/<program>.hlo.txt`: the trace's events are
    named by its instructions)."""
    import glob
    import os
    import shutil
    import tempfile

    os.makedirs(folder, exist_ok=True)
    for k, (c, _) in built.items():
        if c is None:
            continue
        name = k.replace(" ", "_")
        with open(f"{folder}/{name}.hlo.txt", "w") as fh:
            fh.write(c.as_text())
        jax.block_until_ready(c(params, *lot))
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(2):
                    jax.block_until_ready(c(params, *lot))
            (trace,) = glob.glob(f"{tmp}/plugins/profile/*/*.trace.json.gz")
            shutil.copy(trace, f"{folder}/{name}.trace.json.gz")


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")


def matmul_flops(hlo: str) -> dict:
    """The flops of a compiled program's products (`dot`s of its optimised HLO
    text), apart: those of the branches of a `cond` (ghost clipping's pass for the
    non-finite examples, skipped at run time where every example is finite) and
    the rest. Elementwise work is left out: this counts the matrix unit's work."""
    lines = hlo.splitlines()
    shapes = {}
    for line in lines:
        m = _DEF.match(line)
        if m:
            shapes[m.group(1)] = [int(x) for x in m.group(2).split(",") if x]
    out = {"main": 0.0, "cond branches": 0.0}
    for line in lines:
        operands = re.search(r" dot\(%([\w.\-]+), %[\w.\-]+\)", line)
        if operands is None:
            continue
        lhs = shapes[operands.group(1)]
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
        depth = math.prod(lhs[int(d)] for d in dims.split(",") if d)
        flops = 2.0 * math.prod(shapes[_DEF.match(line).group(1)]) * depth
        out["cond branches" if "/cond/branch" in line else "main"] += flops
    return out


def flop_table(name: str, n: int, quick: bool = False) -> list[str]:
    """The products' flops per example of the non-private step and of ghost
    clipping's program over `n` examples in one chunk, compiled for the CPU (the
    ghost program's, though the CPU's cost model would run the vmap program
    there: `_choice.choose` is held to the ghost program for the count)."""
    from chunkvmap._quantities import _choice, ghost

    params, loss, batch = model(name, quick)
    cpu = jax.devices("cpu")[0]
    choose = _choice.choose
    _choice.choose = lambda t, report, *a, **k: report.replace(
        runs=ghost.Method.GHOST, slower=False
    )
    try:
        with jax.default_device(cpu):
            lot, params = jax.device_put((batch(n), params), cpu)
            steps = programs(loss, n)
            counts = {
                k: matmul_flops(jax.jit(steps[k]).lower(params, *lot).compile()
                                .as_text())
                for k in ("non-private", "ghost")
            }  # fmt: skip
    finally:
        _choice.choose = choose
    base = counts["non-private"]["main"]
    rows = [
        f"| {k} | {c['main'] / n / 1e9:.2f} | {c['cond branches'] / n / 1e9:.2f} | "
        f"{c['main'] / base:.3f} | {base / c['main']:.3f} |"
        for k, c in counts.items()
    ]
    return [
        f"Products' flops per example ({name}, one chunk of {n}, compiled for the "
        "CPU):",
        "",
        "| program | GFLOP run | GFLOP in skipped branches | / non-private | "
        "throughput at the step's efficiency |",
        "|---|---|---|---|---|",
        *rows,
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "vit"], default="gpt2")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="chunk size B")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=500.0, help="seconds")
    parser.add_argument(
        "--programs", nargs="+", default=None, help="a subset of the programs"
    )
    parser.add_argument(
        "--profile", default=None, help="write a profile of each step to this folder"
    )
    parser.add_argument(
        "--flops", type=int, default=None, metavar="N",
        help="only count the products' flops of the non-private and ghost programs "
        "over N examples (compiled for the CPU, not run), and print them",
    )  # fmt: skip
    parser.add_argument(
        "--lots", type=int, nargs="+", default=None,
        help="the lots tried for the largest-lot table, ascending (default: doubling "
        "from the largest size measured while --budget lasts)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.flops:
        print("\n".join(flop_table(args.model, args.flops, args.quick)))
        return
    start = time.monotonic()
    b = args.batch or (4 if args.quick else 32)
    sizes = args.sizes or ([8, 16] if args.quick else [64, 256])
    params, loss, batch = model(args.model, args.quick)
    steps = programs(loss, b)
    if args.programs:
        unknown = set(args.programs) - set(steps)
        if unknown:
            parser.error(f"--programs: unknown {sorted(unknown)}; known {list(steps)}")
        steps = {k: f for k, f in steps.items() if k in args.programs}
    device = jax.devices()[0]
    size = sum(x.size for x in jax.tree.leaves(params))
    table = Table(
        args.out,
        f"# DP-SGD step, {args.model} ({size / 1e6:.1f}M parameters, bf16 compute) "
        f"on {getattr(device, 'device_kind', device.platform)}, B={b}",
        "",
        "| N | program | ms / step | throughput / non-private | compiled peak MiB |",
        "|---|---|---|---|---|",
    )
    largest = {k: 0 for k in steps}
    for n in sizes:
        lot = batch(n)
        built = {k: compiled(f, params, lot) for k, f in steps.items()}
        t = timed({k: c for k, (c, _) in built.items()}, params, lot, args.rounds)
        base = t.get("non-private")
        if args.profile and n == sizes[0]:
            profile(args.profile, built, params, lot)
        for k, (_, peak) in built.items():
            if t[k] is not None:
                largest[k] = max(largest[k], n)
            ratio = f"{base / t[k]:.2f}" if base and t[k] else "–"
            table.add(
                f"| {n} | {k} | {'OOM' if t[k] is None else f'{1e3 * t[k]:.1f}'} | "
                f"{ratio} | {'–' if peak is None else f'{peak / 2**20:.0f}'} |"
            )
    # The largest lot: the lots of --lots in turn, or doubling from the largest size
    # measured, while time lasts; each program stops at its first failure.
    table.add(
        "",
        "| program | lot | ms / step | compiled peak MiB |",
        "|---|---|---|---|",
    )
    for k, f in steps.items():
        lots = iter(args.lots or ())
        n = largest[k]
        while largest[k] and time.monotonic() - start < args.budget:
            n = next(lots, None) if args.lots else 2 * n
            if n is None:
                break
            c, peak = compiled(f, params, batch(n))
            t = timed({k: c}, params, batch(n), 1)[k] if c is not None else None
            table.add(
                f"| {k} | {n} | {'OOM' if t is None else f'{1e3 * t:.1f}'} | "
                f"{'–' if peak is None else f'{peak / 2**20:.0f}'} |"
            )
            if t is None:
                break
            largest[k] = n
        else:
            if largest[k]:
                table.add(f"| {k} | (time: {args.budget:.0f} s spent) | | |")


if __name__ == "__main__":
    sys.exit(main())
