"""What the ghost runner's per-example path costs: a clipped sum and gradient
statistics computed by the ghost program with every leaf forced per-example (the
path a single runner would take for `method="vmap"`), against today's vmap program
(`method="vmap"`, its own twin of each quantity) and `jax.vmap(jax.grad)`.

Measured before the vmap twins (`_formed_sums`, `_formed_moments`) can be deleted:
the forced path must cost what they cost. The forcing is this benchmark's alone (it
replaces the plan's leaf rule and verdict while the programs are traced).

    python benchmarks/bench_runner_paths.py [--quick] [--n N] [--batch B] [--only NAME]
                                            [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings

import _dp_models as models
import jax
import jax.numpy as jnp
import numpy as np
from _common import Table, interleaved, machine

import chunkvmap
from chunkvmap._quantities.ghost import _plan


@contextlib.contextmanager
def every_leaf_per_example():
    """While tracing: every leaf of a ghost plan per-example, the ghost program
    chosen whatever the cost model says."""
    choose, verdict = _plan.Plan._choose, _plan.Plan.verdict

    def forced(self, leaf):  # as a leaf the analysis leaves per-example: no uses
        self._flag(leaf, "forced per-example")
        leaf.uses = []

    _plan.Plan._choose = forced
    _plan.Plan.verdict = lambda self: _plan.Verdict(_plan.Method.GHOST, False, "forced")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _plan.Plan._choose, _plan.Plan.verdict = choose, verdict


def programs(loss, b: int) -> dict:
    """name -> (forced per-example ghost program, vmap program, jax.vmap program)."""

    def clipped(method):
        return lambda p, *lot: chunkvmap.clipped_grad_sum(
            loss, 1.0, batch_size=b, method=method
        )(p, *lot)[0]

    def stats(method):
        return lambda p, *lot: chunkvmap.per_example_grad_stats(
            loss, batch_size=b, method=method
        )(p, *lot)

    def reference_clipped(p, *lot):
        g = jax.vmap(jax.grad(loss), (None, *[0] * len(lot)))(p, *lot)
        sq = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, 1) for x in jax.tree.leaves(g))
        scale = jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
        return jax.tree.map(lambda x: jnp.tensordot(scale, x, 1), g)

    def reference_stats(p, *lot):
        g = jax.vmap(jax.grad(loss), (None, *[0] * len(lot)))(p, *lot)
        return jax.tree.map(lambda x: (x.mean(0), x.var(0)), g)

    return {
        "clipped sum": (clipped("ghost"), clipped("vmap"), reference_clipped),
        "statistics": (stats("ghost"), stats("vmap"), reference_stats),
    }


def _counts(compiled) -> tuple:
    """XLA's flop and byte counts of a compiled program."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], cost["bytes accessed"]


def cases(quick: bool, n: int) -> dict:
    rng = np.random.default_rng(0)
    mlp = {"widths": (32, 64, 10)} if quick else {"widths": (784, 256, 256, 10)}
    out = {
        f"MLP {'-'.join(map(str, mlp['widths']))}": (
            models.mlp_params(rng, mlp),
            models.mlp_loss,
            models.mlp_batch(rng, n, mlp),
        )
    }
    for name, (params, loss, batch) in models.models(quick).items():
        if name.startswith("same"):  # (the tied and scanned variants)
            continue
        out[name] = (params(rng), loss, batch(rng, n))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="models whose name holds this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = args.n or (16 if args.quick else 256)
    b = args.batch or (4 if args.quick else 32)
    table = Table(
        args.out,
        f"# The ghost runner's per-example path: N={n}, B={b}, median of "
        f"{args.repeats} interleaved rounds",
        "",
        machine(),
        "",
        "| model | quantity | forced per-example ms | method='vmap' ms "
        "| jax.vmap ms | forced / vmap | forced / jax.vmap "
        "| the same flops and bytes |",
        "|---|---|---|---|---|---|---|---|",
    )
    for model, (params, loss, batch) in cases(args.quick, n).items():
        if args.only and args.only not in model:
            continue
        for quantity, (forced, vmap, reference) in programs(loss, b).items():
            call = (params, *batch)
            with every_leaf_per_example():
                forced_exe = jax.jit(forced).lower(*call).compile()
            vmap_exe = jax.jit(vmap).lower(*call).compile()
            exes = [forced_exe, vmap_exe, jax.jit(reference)]
            (tf, tv, tr), outs = interleaved(exes, call, args.repeats, 2, jit=False)
            for a, e in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
                np.testing.assert_allclose(a, e, rtol=1e-3, atol=1e-4)
            same = "yes" if _counts(forced_exe) == _counts(vmap_exe) else "no"
            table.add(
                f"| {model} | {quantity} | {1e3 * tf:.1f} | {1e3 * tv:.1f} | "
                f"{1e3 * tr:.1f} | {tf / tv:.2f} | {tf / tr:.2f} | {same} |"
            )


if __name__ == "__main__":
    sys.exit(main())
