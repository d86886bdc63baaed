"""Does `batch_size="auto"` (its default budget) pick a size that runs, and at least
half the largest that runs? Three workloads on the default device.

  lm clipped sum    `clipped_grad_sum(method="ghost")` of the GPT-style LM;
  mlp per-example   `per_example_grads` of the 784-1024x3-10 MLP (the N x params
                    output stays; the chunk sets the temporaries);
  ensemble          `batch_vmap` of 64 stacked MLPs on one shared batch.

For each: the size `auto` chose runs (one call), then twice that size is tried, and
twice again while it runs: the largest size known to run, and the first known not
to (out of memory), bound the largest that runs. `auto` is within 2x of it where
twice its size does not run.

    python benchmarks/bench_auto.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import _dp_models as models
import jax
import jax.numpy as jnp
import numpy as np
from _common import Table, is_oom

import chunkvmap


def workloads(quick: bool) -> dict:
    """name -> (make(batch_size) -> function, arguments, N)."""
    rng = np.random.default_rng(0)
    lm = dict(models.LM, vocab=64, width=16, positions=4) if quick else models.LM
    mlp = {"widths": (32, 64, 64, 10)} if quick else models.MLP
    n_lm, n_mlp, members, shared = (
        (64, 32, 8, 64) if quick else (65536, 1024, 64, 65536)
    )
    lm_p = models.lm_params(rng, lm)
    lm_data = models.lm_batch(rng, n_lm, lm)
    mlp_p = models.mlp_params(rng, mlp)
    mlp_data = models.mlp_batch(rng, n_mlp, mlp)
    stacked = jax.tree.map(
        lambda *a: jnp.stack(a), *[models.mlp_params(rng, mlp) for _ in range(members)]
    )
    x = jnp.asarray(rng.normal(size=(shared, mlp["widths"][0])), jnp.float32)

    def member(p, x):
        for layer in p[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return (x @ p[-1]["w"]).mean(0)

    def lm_loss(p, tokens, targets):
        return models.lm_loss(p, tokens, targets, lm["heads"])

    return {
        "lm clipped sum (ghost)": (
            lambda b, limit: chunkvmap.clipped_grad_sum(
                lm_loss, 1.0, method="ghost", batch_size=b, **_budget(b, limit)
            ),
            (lm_p, *lm_data),
            n_lm,
        ),
        "mlp per-example gradients": (
            lambda b, limit: chunkvmap.per_example_grads(
                models.mlp_loss, batch_size=b, **_budget(b, limit)
            ),
            (mlp_p, *mlp_data),
            n_mlp,
        ),
        f"ensemble of {members} MLPs": (
            lambda b, limit: chunkvmap.batch_vmap(
                member, (0, None), batch_size=b, **_budget(b, limit)
            ),
            (stacked, x),
            members,
        ),
    }


def _budget(b, limit) -> dict:
    return {"memory_limit": limit} if b == "auto" and limit is not None else {}


def runs(f, args) -> bool | str:
    """Whether `f(*args)` runs (False where the device runs out of memory)."""
    try:
        jax.block_until_ready(jax.jit(f)(*args))
        return True
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            print(f"    out of memory: {str(e).splitlines()[0][:200]}", flush=True)
            return False
        raise


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--memory-limit", default=None, help="for auto (default: the device's)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    stats = device.memory_stats() or {}
    table = Table(
        args.out,
        f"# batch_size='auto' on {kind} (bytes_limit "
        f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB, budget "
        f"{args.memory_limit or 'the default'})",
        "",
        "| workload | N | auto | runs | largest run | smallest OOM | auto / largest"
        " | seconds |",
        "|---|---|---|---|---|---|---|---|",
    )
    for name, (make, call, n) in workloads(args.quick).items():
        start = time.perf_counter()
        f = make("auto", args.memory_limit)
        ok = runs(f, call)
        chosen = chunkvmap.last_batch_size(f) or 0
        largest, failed, b = (chosen if ok else 0), None, chosen
        while ok and b < n:
            b = min(2 * b, n)
            if runs(make(b, None), call):
                largest = b
            else:
                failed = b
                break
        table.add(
            f"| {name} | {n} | {chosen} | {'yes' if ok else 'NO'} | {largest} | "
            f"{failed or '-'} | {chosen / max(largest, 1):.2f} | "
            f"{time.perf_counter() - start:.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
