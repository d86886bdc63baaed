"""The chunk loop against `jax.vmap`: throughput ratios on the default device.

  forward           `batch_vmap(model, batch_size=N/16)` against `jax.vmap(model)`,
                    for an MLP, the GPT-style LM and the CIFAR-style convnet (NHWC);
  per-example       `per_example_grads(loss, batch_size=N/16)` against
                    `jax.vmap(jax.grad(loss))` (the MLP);
  clipped           `clipped_grad(method="vmap")` against
                    `clipped_grad_sum(method="vmap")`, same chunks (the MLP).

Each pair is jitted, compiled, then timed interleaved (median of `--repeats`
rounds). With `--hlo DIR` the optimised HLO of each chunked program is written
there, to find where the loop's time goes (copies of each chunk's slice, the
stacking of its outputs, fusion boundaries at the loop's edge).

    python benchmarks/bench_loop.py [--quick] [--n N] [--hlo DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import _dp_models as models
import jax
import jax.numpy as jnp
import numpy as np
from _common import Table, interleaved, is_oom

import chunkvmap


def fitting(n: int, example_bytes: int) -> int:
    """`n` halved until the outputs of one program (`example_bytes` an example) take
    at most 40% of the device's memory (unchanged where none is reported)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    while limit and n > 16 and n * example_bytes > 0.4 * limit:
        n //= 2
    return n


def pairs(quick: bool, n: int) -> dict:
    """name -> (ours, reference, args), each workload at the largest N <= `n` whose
    outputs fit (its N is `args`' leading dimension), in chunks of N/16."""
    rng = np.random.default_rng(0)
    mlp = {"widths": (32, 64, 64, 10)} if quick else models.MLP
    lm = dict(models.LM, vocab=64, width=16, positions=4) if quick else models.LM
    cnn = dict(models.CNN, channels=(3, 4, 8), image=8) if quick else models.CNN
    mp, lp, cp = (
        models.mlp_params(rng, mlp),
        models.lm_params(rng, lm),
        models.cnn_params(rng, cnn),
    )
    mlp_size = sum(x.size for x in jax.tree.leaves(mp))

    def mlp_forward(p, x):
        for layer in p[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x @ p[-1]["w"] + p[-1]["b"]

    def lm_forward(p, tokens):
        return models.lm_logits(p, tokens, lm["heads"])

    def mlp_data(k):
        return models.mlp_batch(rng, fitting(n, k), mlp)

    grad = jax.grad(models.mlp_loss)
    clip = dict(l2_clip_norm=1.0, batch_argnums=(1, 2), keep_batch_dim=False)
    mx, my = mlp_data(4 * mlp["widths"][-1])
    lt, _ = models.lm_batch(rng, fitting(n, 4 * lm["positions"] * lm["vocab"]), lm)
    ci, _ = models.cnn_batch(rng, n, cnn)
    gx, gy = mlp_data(4 * mlp_size)
    return {
        "MLP forward": (
            chunkvmap.batch_vmap(mlp_forward, (None, 0), batch_size=len(mx) // 16),
            jax.vmap(mlp_forward, (None, 0)),
            (mp, mx),
        ),
        "LM forward": (
            chunkvmap.batch_vmap(lm_forward, (None, 0), batch_size=len(lt) // 16),
            jax.vmap(lm_forward, (None, 0)),
            (lp, lt),
        ),
        "CNN forward (NHWC)": (
            chunkvmap.batch_vmap(
                models.cnn_logits, (None, 0), batch_size=len(ci) // 16
            ),
            jax.vmap(models.cnn_logits, (None, 0)),
            (cp, ci),
        ),
        "MLP per_example_grads": (
            chunkvmap.per_example_grads(models.mlp_loss, batch_size=len(gx) // 16),
            jax.vmap(grad, (None, 0, 0)),
            (mp, gx, gy),
        ),
        "MLP clipped_grad vs clipped_grad_sum": (
            chunkvmap.clipped_grad(models.mlp_loss, batch_size=len(mx) // 16, **clip),
            lambda p, x, y: chunkvmap.clipped_grad_sum(
                models.mlp_loss, 1.0, batch_size=len(mx) // 16
            )(p, x, y)[0],
            (mp, mx, my),
        ),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hlo", default=None, help="write each chunked program's HLO")
    parser.add_argument("--only", nargs="+", default=None, help="workloads naming")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = args.n or (64 if args.quick else 65536)
    device = jax.devices()[0]
    table = Table(
        args.out,
        f"# The chunk loop on {getattr(device, 'device_kind', device.platform)}: "
        f"N <= {n} (the largest whose outputs fit), B=N/16, median of "
        f"{args.repeats} interleaved rounds",
        "",
        "| workload | N | ours ms | reference ms | throughput / reference |",
        "|---|---|---|---|---|",
    )
    for name, (ours, ref, call) in pairs(args.quick, n).items():
        if args.only and not any(w in name for w in args.only):
            continue
        size = len(jax.tree.leaves(call[1])[0])
        try:
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                path = os.path.join(args.hlo, name.replace(" ", "_") + ".txt")
                with open(path, "w") as fh:
                    fh.write(jax.jit(ours).lower(*call).compile().as_text())
            (t_ours, t_ref), _ = interleaved([ours, ref], call, args.repeats, values=0)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            table.add(f"| {name} | {size} | out of memory | | |")
            continue
        table.add(
            f"| {name} | {size} | {1e3 * t_ours:.2f} | {1e3 * t_ref:.2f} | "
            f"{t_ref / t_ours:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
