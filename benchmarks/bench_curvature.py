"""Curvature (the GGN diagonal and KFAC factors): memory and time.

For each model, `ggn_diagonal` and `kfac_factors` in chunks of 32, against the
same diagonal of all N examples at once (`batch_size=None`: one `jax.vmap` of
every example's backward passes) and the non-private step (`jax.grad` of the
mean loss) as the reference cost. The MLP and the convnet (10 classes) use the
exact Fisher (10 backward passes per example); the language models the
Monte-Carlo Fisher with one sampled label per position (an exact one would take
T x V backward passes per sequence):

The models: the MLP, the DP benchmarks' language models and convnet (NHWC), and
`bench_families`' NCHW convnet, GRU, Equinox and Flax linen convnets.

* memory: XLA's compiled temporary memory for N = 64 and N = 4096 examples (only
  compiled, never run: flat in N is the claim);
* time: the median of interleaved calls at N = 64, as a ratio against the
  non-private step; the three diagonals (all at once, chunked, `method="ghost"`)
  agree (checked).

    python benchmarks/bench_curvature.py --out benchmarks/results/curvature.md

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
from _common import init_mlp, interleaved, machine, mlp, temp_bytes  # noqa: E402
from _dp_models import family_outputs, output_models  # noqa: E402

from chunkvmap import ggn_diagonal, kfac_factors  # noqa: E402


CHUNK = 32


def _cases(quick: bool) -> dict:
    sizes = [32, 64, 10] if quick else [256, 512, 512, 10]
    mlp_case = (
        lambda rng: init_mlp(jax.random.key(0), sizes),
        mlp,
        lambda rng, n: jnp.asarray(rng.normal(size=(n, sizes[0])), jnp.float32),
    )
    name = f"MLP {'-'.join(map(str, sizes))}"
    return {name: mlp_case, **output_models(quick), **family_outputs(quick)}


def _step(model):
    """`jax.grad` of the mean cross-entropy at the model's own argmax labels."""

    def run(params, x, key):
        del key

        def mean(p):
            logits = jax.vmap(model, (None, 0))(p, x)
            labels = jnp.argmax(logits, -1)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))

        return jax.grad(mean)(params)

    return run


def _with_key(fn, mc: bool):
    return (lambda p, x, key: fn(p, x, key=key)) if mc else (lambda p, x, key: fn(p, x))


def rows(quick: bool, sizes, repeats, rng):
    key = jax.random.key(1)
    for name, (make, model, inputs) in _cases(quick).items():
        params = make(rng)
        mc = name.startswith(("GPT", "same"))
        opts = dict(likelihood="categorical", fisher="mc" if mc else "exact")
        methods = {
            "ggn_diagonal, all N at once": ggn_diagonal(model, **opts),
            f"ggn_diagonal, chunks of {CHUNK}": ggn_diagonal(
                model, batch_size=CHUNK, **opts
            ),
            f'ggn_diagonal method="ghost", chunks of {CHUNK}': ggn_diagonal(
                model, batch_size=CHUNK, method="ghost", **opts
            ),
            f"kfac_factors, chunks of {CHUNK}": kfac_factors(
                model, batch_size=CHUNK, **opts
            ),
        }
        fns = [_with_key(f, mc) for f in methods.values()] + [_step(model)]
        labels = [*methods, "non-private step"]
        memory = [
            [temp_bytes(f, params, inputs(rng, n), key) for n in sizes] for f in fns
        ]
        data = inputs(rng, sizes[0])
        times, values = interleaved(fns, (params, data, key), repeats)
        for other in values[1:]:
            for a, b in zip(jax.tree.leaves(values[0]), jax.tree.leaves(other)):
                scale = float(jnp.max(jnp.abs(a))) + 1e-30
                assert float(jnp.max(jnp.abs(a - b))) / scale < 1e-4, name
        labels = [f"{x} ({opts['fisher']})" for x in labels[:-1]] + labels[-1:]
        for label, mem, t in zip(labels, memory, times):
            yield name, label, mem, t, t / times[-1]


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
        "# Curvature: memory and time",
        "",
        f"Machine: {machine()}. `ggn_diagonal` and `kfac_factors` in chunks of "
        f"{CHUNK} and the diagonal of all N examples at once, against the "
        "non-private step (`jax.grad` of the mean loss). Exact Fisher for the MLP "
        "and the convnet, Monte-Carlo (one label per position) for the language "
        f"models. Memory: XLA's compiled temporary bytes at N = {a} and N = {b}. "
        f"Time: median of {args.repeats} interleaved calls at N = {a}, and its "
        "ratio to the non-private step's; the three diagonals agree to 1e-4 "
        "(checked).",
        "",
        f"| model | quantity | temp MB, N={a} | temp MB, N={b} | ms, N={a} | x step |",
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
