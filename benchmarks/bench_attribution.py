"""Projected per-example gradients (data attribution's features): memory and time.

For each model, `per_example_grad_projections(loss, dim=16)` by both methods, in
chunks of 32, against forming every per-example gradient with
`jax.vmap(jax.grad(loss))` and projecting it by the same projection (the oracle's
way), and against the non-private step (`jax.grad` of the mean loss) as the
reference cost. The models: the MLP, the DP benchmarks' language models and
convnet (NHWC), and `bench_families`' NCHW convnet, GRU, Equinox and Flax linen
convnets.

* memory: XLA's compiled temporary memory for N = 64 and N = 4096 examples (only
  compiled, never run: flat in N is the claim);
* time: the median of interleaved calls at N = 64, as a ratio against the
  non-private step; the values of the three projections agree (checked first).

    python benchmarks/bench_attribution.py --out benchmarks/results/attribution.md

The chunkvmap measured is the one in the folder above this script's (`_common` puts
it first on the path).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
import bench_families as families  # noqa: E402
from _common import init_mlp, interleaved, machine, mlp, temp_bytes  # noqa: E402
from _dp_models import family_outputs, models  # noqa: E402

from chunkvmap import per_example_grad_projections  # noqa: E402
from chunkvmap._quantities._projections import leaf_matrices, project  # noqa: E402


DIM, CHUNK = 16, 32


def _xent(p, x, y):
    return -jax.nn.log_softmax(mlp(p, x))[y]


def _mlp_model():
    return (
        lambda rng: init_mlp(jax.random.key(0), [256, 512, 512, 10]),
        _xent,
        lambda rng, n: (
            jnp.asarray(rng.normal(size=(n, 256)), jnp.float32),
            jnp.asarray(rng.integers(0, 10, n), jnp.int32),
        ),
    )


def _with_labels(case):
    """An output model's case (`family_outputs`) as a loss of `(x, label)`, as
    `bench_families` scores it."""
    make, model, inputs = case

    def batch(rng, n):
        return inputs(rng, n), jnp.asarray(rng.integers(0, 10, n), jnp.int32)

    return make, families._loss_of(model), batch


def _formed_and_projected(loss):
    """Every per-example gradient at once, then the projection (the oracle's way)."""

    def run(params, *batch):
        grads = jax.vmap(jax.grad(loss), (None, *[0] * len(batch)))(params, *batch)
        leaves = jax.tree.leaves(grads)
        mats = leaf_matrices([g.shape[1:] for g in leaves], DIM, seed=0)
        parts = [
            jax.vmap(lambda x, m=m: project(x, m))(g) for g, m in zip(leaves, mats)
        ]
        return jnp.concatenate(parts, 1)

    return run


def _step(loss):
    def run(params, *batch):
        mean = lambda p: jnp.mean(  # noqa: E731
            jax.vmap(loss, (None, *[0] * len(batch)))(p, *batch)
        )
        return jax.grad(mean)(params)

    return run


def rows(quick: bool, sizes, repeats, rng):
    families = {k: _with_labels(c) for k, c in family_outputs(quick).items()}
    cases = {"MLP 256-512-512-10": _mlp_model(), **models(quick), **families}
    for name, (make, loss, batch) in cases.items():
        params = make(rng)
        methods = {
            "jax.vmap(jax.grad) + projection": _formed_and_projected(loss),
            'chunkvmap method="vmap"': per_example_grad_projections(
                loss, dim=DIM, batch_size=CHUNK, method="vmap"
            ),
            'chunkvmap method="ghost"': per_example_grad_projections(
                loss, dim=DIM, batch_size=CHUNK, method="ghost"
            ),
            "non-private step": _step(loss),
        }
        memory = {
            m: [temp_bytes(f, params, *batch(rng, n)) for n in sizes]
            for m, f in methods.items()
        }
        data = batch(rng, sizes[0])
        times, values = interleaved(list(methods.values()), (params, *data), repeats)
        ref = np.asarray(values[0])
        for v in values[1:]:
            err = np.max(np.abs(np.asarray(v) - ref)) / (np.max(np.abs(ref)) + 1e-30)
            assert err < 1e-4, (name, err)
        for (m, mem), t in zip(memory.items(), times):
            yield name, m, mem, t, t / times[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--sizes", type=int, nargs=2, default=[64, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    a, b = args.sizes
    lines = [
        "# Projected per-example gradients: memory and time",
        "",
        f"Machine: {machine()}. `per_example_grad_projections(loss, dim={DIM})` in "
        f"chunks of {CHUNK}, against `jax.vmap(jax.grad)` of all N examples followed "
        "by the same projection, and the non-private step (`jax.grad` of the mean "
        f"loss). Memory: XLA's compiled temporary bytes at N = {a} and N = {b}. Time: "
        f"median of {args.repeats} interleaved calls at N = {a}, and its ratio to the "
        "non-private step's; the three projections' values agree to 1e-4 (checked).",
        "",
        f"| model | method | temp MB, N={a} | temp MB, N={b} | ms, N={a} | x step |",
        "|---|---|---|---|---|---|",
    ]
    for name, method, mem, t, ratio in rows(args.quick, args.sizes, args.repeats, rng):
        line = (
            f"| {name} | {method} | {mem[0] / 2**20:.2f} | {mem[1] / 2**20:.2f} "
            f"| {t * 1e3:.2f} | {ratio:.2f} |"
        )
        lines.append(line)
        print(line, flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
