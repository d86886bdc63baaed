"""`python -m chunkvmap.demo`: DP-SGD with memory-bounded per-example gradients.

The main job of chunkvmap, end to end on a laptop-sized problem:

1. Train an MLP on scikit-learn's bundled digits with DP-SGD: every step sums the
   per-example gradients of a batch of examples, each clipped to L2 norm `--clip`, with
   `chunkvmap.clipped_grad_sum` (chunks of `--batch-size`, so never more than that many
   gradients in memory), adds Gaussian noise of standard deviation `--noise x --clip`,
   and feeds the mean to an optax optimizer. A progress bar per epoch advances with the
   chunks (chunkvmap's `progress=`). Test accuracy is printed at the end.
2. Compare, for a growing number of examples N up to `--examples`, XLA's compiled
   peak memory and the step time of the same clipped sum computed the usual way
   (`jax.vmap` of per-example gradients, then clip and sum) and with chunkvmap, and
   write the memory plot to `--plot` (`demo_memory.png`).

It needs the demo extras (`pip install chunkvmap[demo]`: optax, scikit-learn, tqdm,
matplotlib); `make demo` installs them. Importing `chunkvmap` never imports this module.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from chunkvmap import clipped_grad_sum


HIDDEN = (256, 256)


# --------------------------------------------------------------------------------------
# Command line.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and np.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m chunkvmap.demo",
        description=(
            "Train an MLP on scikit-learn's digits with DP-SGD (clipped per-example "
            "gradients summed by chunkvmap, Gaussian noise, optax), then compare the "
            "memory and step time of jax.vmap and chunkvmap as the number of examples "
            "grows."
        ),
    )
    parser.add_argument(
        "--examples",
        type=_positive_int,
        default=4096,
        help="largest number of examples N in the memory comparison; N runs over "
        "256, 1024, 4096, ... up to it (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="chunkvmap's chunk size: per-example gradients in memory at once "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=20,
        help="training epochs over the digits training set (default: %(default)s)",
    )
    parser.add_argument(
        "--lot-size",
        type=_positive_int,
        default=256,
        help="examples per DP-SGD step (default: %(default)s)",
    )
    parser.add_argument(
        "--clip",
        type=_positive_float,
        default=1.0,
        help="L2 clipping norm of each per-example gradient (default: %(default)s)",
    )
    parser.add_argument(
        "--noise",
        type=_non_negative_float,
        default=1.0,
        help="noise multiplier: noise std = noise x clip (default: %(default)s)",
    )
    parser.add_argument(
        "--learning-rate",
        type=_positive_float,
        default=3e-3,
        help="Adam learning rate (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--plot",
        default="demo_memory.png",
        help="where to write the memory plot; '' to skip it (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed runs per step-time measurement (median) (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.examples < 256:
        parser.error(f"--examples must be at least 256, got {args.examples}")
    return args


# --------------------------------------------------------------------------------------
# Model and data.


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> list[tuple[jax.Array, ...]]:
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b)))
    return params


def logits(params: Any, x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of one example (`x`: features, `y`: its label)."""
    return -jax.nn.log_softmax(logits(params, x))[y]


def load_digits(seed: int) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return tuple(
        train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed)
    )


# --------------------------------------------------------------------------------------
# 1. DP-SGD training.


class _EpochBar:
    """Forwards chunkvmap's per-chunk progress callback to the current epoch's bar."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(1)


def train(args: argparse.Namespace) -> float:
    import optax
    from tqdm.auto import tqdm

    x_train, x_test, y_train, y_test = load_digits(args.seed)
    lot = min(args.lot_size, len(x_train))
    steps = len(x_train) // lot
    chunks = -(-lot // args.batch_size)
    key = jax.random.key(args.seed)
    key, init_key = jax.random.split(key)
    params = init_mlp(init_key, (x_train.shape[1], *HIDDEN, 10))
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)
    epoch_bar = _EpochBar()
    clipped_sum = clipped_grad_sum(
        loss,
        args.clip,
        batch_argnums=(1, 2),
        batch_size=args.batch_size,
        progress=epoch_bar,
    )

    @jax.jit
    def step(params, opt_state, x, y, key):
        total, count = clipped_sum(params, x, y)
        leaves, treedef = jax.tree.flatten(total)
        keys = jax.random.split(key, len(leaves))
        std = args.noise * args.clip
        noisy = [
            g + std * jax.random.normal(k, g.shape, g.dtype)
            for g, k in zip(leaves, keys)
        ]
        mean = jax.tree.unflatten(treedef, [g / count.astype(g.dtype) for g in noisy])
        updates, opt_state = optimizer.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(jax.vmap(logits, (None, 0))(params, x), -1) == y)

    print(
        f"DP-SGD on digits: {len(x_train)} train / {len(x_test)} test examples, MLP "
        f"{x_train.shape[1]}-{'-'.join(map(str, HIDDEN))}-10, {steps} steps of {lot} "
        f"examples per epoch, clip {args.clip}, noise multiplier {args.noise}, "
        f"chunks of {args.batch_size} ({chunks} per step)"
    )
    rng = np.random.default_rng(args.seed)
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        with tqdm(total=steps * chunks, desc=f"epoch {epoch:>2}", unit="chunk") as bar:
            epoch_bar.bar = bar
            for s in range(steps):
                idx = order[s * lot : (s + 1) * lot]
                key, noise_key = jax.random.split(key)
                params, opt_state = step(
                    params, opt_state, x_train[idx], y_train[idx], noise_key
                )
            jax.effects_barrier()
            acc = float(accuracy(params, x_test, y_test))
            bar.set_postfix(test_accuracy=f"{acc:.3f}")
        epoch_bar.bar = None
    acc = float(accuracy(params, x_test, y_test))
    print(f"test accuracy after {args.epochs} epochs: {acc:.3f}")
    return acc


# --------------------------------------------------------------------------------------
# 2. Memory and step time, jax.vmap vs chunkvmap.


def _with_vmap(clip: float):
    def clipped_sum(params, x, y):
        grads = jax.vmap(jax.grad(loss), (None, 0, 0))(params, x, y)
        sq = sum(
            jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in jax.tree.leaves(grads)
        )
        scale = clip / jnp.maximum(jnp.sqrt(sq), clip)
        return jax.tree.map(lambda g: jnp.einsum("n,n...->...", scale, g), grads)

    return clipped_sum


def _measure(fn: Any, args: tuple, repeats: int) -> tuple[float, float, Any]:
    """(peak MiB, median step seconds, result) of `jax.jit(fn)(*args)`.

    The peak is XLA's compiled estimate for the whole program: its arguments, outputs
    and temporaries (less aliased buffers), all live at once. Exact and deterministic.
    (`peak_memory_in_bytes` itself is not filled in by every backend, e.g. CPU.)
    """
    compiled = jax.jit(fn).lower(*args).compile()
    stats = compiled.memory_analysis()
    peak = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    ) / 2**20
    out = jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times), out


def compare(args: argparse.Namespace) -> list[dict[str, float]]:
    sizes = []
    n = 256
    while n <= args.examples:
        sizes.append(n)
        n *= 4
    if sizes[-1] != args.examples:
        sizes.append(args.examples)
    params = init_mlp(jax.random.key(args.seed), (64, *HIDDEN, 10))
    rng = np.random.default_rng(args.seed)
    ours_fn = clipped_grad_sum(
        loss, args.clip, batch_argnums=(1, 2), batch_size=args.batch_size
    )

    def ours(params, x, y):
        return ours_fn(params, x, y)[0]

    theirs = _with_vmap(args.clip)
    rows = []
    print(
        f"\nSum of clipped per-example gradients, MLP "
        f"64-{'-'.join(map(str, HIDDEN))}-10 "
        f"({jax.default_backend()} backend; XLA compiled peak memory, median of "
        f"{args.repeats} step times)"
    )
    header = (
        f"{'N':>7} | {'jax.vmap MiB':>12} | {'chunkvmap MiB':>13} | {'memory':>7} | "
        f"{'jax.vmap ms':>11} | {'chunkvmap ms':>12} | {'time':>5} | max rel err"
    )
    print(header)
    print("-" * len(header))
    for n in sizes:
        x = jnp.asarray(rng.normal(size=(n, 64)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, size=(n,)), jnp.int32)
        ref_mem, ref_t, ref = _measure(theirs, (params, x, y), args.repeats)
        our_mem, our_t, out = _measure(ours, (params, x, y), args.repeats)
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
        )
        rows.append(
            dict(n=n, vmap_mib=ref_mem, ours_mib=our_mem, vmap_s=ref_t, ours_s=our_t)
        )
        print(
            f"{n:>7} | {ref_mem:>12.1f} | {our_mem:>13.1f} | "
            f"{ref_mem / max(our_mem, 2**-20):>6.1f}x | {ref_t * 1e3:>11.1f} | "
            f"{our_t * 1e3:>12.1f} | {our_t / ref_t:>4.2f}x | {err:.1e}"
        )
        # Chunks and the full batch run matmuls of different shapes: float rounding
        # differs, more so where f32 matmuls use reduced-precision passes (GPU/TPU).
        tolerance = 1e-4 if jax.default_backend() == "cpu" else 1e-2
        if err > tolerance:
            raise RuntimeError(f"chunkvmap disagrees with jax.vmap at N={n}: {err}")
    print(
        f"memory: jax.vmap / chunkvmap; time: chunkvmap / jax.vmap. chunkvmap holds "
        f"{args.batch_size} per-example gradients at a time, jax.vmap all N."
    )
    return rows


def plot(rows: list[dict[str, float]], path: str, batch_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(n, [r["vmap_mib"] for r in rows], "o-", label="jax.vmap + clip + sum")
    ax.loglog(
        n,
        [r["ours_mib"] for r in rows],
        "s-",
        label=f"chunkvmap.clipped_grad_sum (batch_size={batch_size})",
    )
    ax.set_xticks(n, [str(v) for v in n])
    ax.minorticks_off()
    ax.set_xlabel("examples N")
    ax.set_ylabel("XLA compiled peak memory (MiB)")
    ax.set_title(f"Clipped per-example gradient sum ({jax.default_backend()})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    train(args)
    rows = compare(args)
    if args.plot:
        plot(rows, args.plot, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
