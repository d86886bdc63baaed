"""A Laplace approximation on scikit-learn's digits: predictive uncertainty from the
diagonal of the generalised Gauss-Newton matrix.

A small Equinox CNN is trained to its MAP estimate on 200 digits (the weight
decay is a Gaussian prior), which leaves it overconfident on held-out digits.
`ggn_diagonal` (the exact GGN of the softmax cross-entropy, chunked: no
per-example gradient of the whole training set is held) gives the curvature of
the training loss at the MAP, and the diagonal Laplace posterior is
`N(theta_MAP, 1 / (GGN + prior precision))`. The predictive distribution averages
the softmax over samples of that posterior. The prior precision is chosen on a
validation split by negative log-likelihood (the grid includes a precision so
large that the posterior is the MAP itself).

Printed for the MAP and the Laplace predictive on the test split: accuracy,
negative log-likelihood and the expected calibration error (ECE, 10 bins); with
`--plot FILE`, a reliability diagram (calibration plot) of both.

    python examples/laplace.py [--train 200] [--steps 1000] [--plot laplace.png]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkvmap import ggn_diagonal
from chunkvmap.demo import load_digits


PRIORS = (1.0, 10.0, 100.0, 1e3, 1e4, 1e8)


class CNN(eqx.Module):
    """Two 3x3 convolutions (the second of stride 2) and a linear read-out, on
    one 8x8 digit."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear
    activation: object = eqx.field(static=True, default=jax.nn.relu)

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(16, 16, 3, padding=1, stride=2, key=k2)
        self.head = eqx.nn.Linear(16 * 4 * 4, 10, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.activation(self.conv1(x.reshape(1, 8, 8)))
        h = self.activation(self.conv2(h))
        return self.head(h.reshape(-1))


def logits(model: CNN, x: jax.Array) -> jax.Array:
    """The model's logits of one digit (what `ggn_diagonal` differentiates)."""
    return model(x)


def train(model: CNN, x, y, steps: int, prior: float, seed: int) -> CNN:
    """The MAP: Adam on the mean cross-entropy plus the prior's `prior / (2 N)
    ||theta||^2`, full batch."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = optax.adam(1e-2)
    state = opt.init(params)
    n = len(x)

    def objective(p):
        out = jax.vmap(logits, (None, 0))(eqx.combine(p, static), x)
        nll = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        decay = sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
        return nll + prior / (2 * n) * decay

    @jax.jit
    def step(p, s):
        grads = jax.grad(objective)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    del seed
    for _ in range(steps):
        params, state = step(params, state)
    return eqx.combine(params, static)


@eqx.filter_jit
def predictive(model: CNN, precision, x, samples: int, key) -> jax.Array:
    """The class probabilities averaged over `samples` draws of the diagonal
    Laplace posterior `N(model, 1 / precision)` (the MAP's when `samples` is 0)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    if samples == 0:
        return jax.nn.softmax(jax.vmap(logits, (None, 0))(model, x))
    leaves, treedef = jax.tree.flatten(params)
    precisions = jax.tree.leaves(precision)
    keys = jax.random.split(key, samples)

    def one(k):
        ks = jax.random.split(k, len(leaves))
        drawn = [
            w + jax.random.normal(kk, w.shape) / jnp.sqrt(p)
            for w, p, kk in zip(leaves, precisions, ks)
        ]
        m = eqx.combine(jax.tree.unflatten(treedef, drawn), static)
        return jax.nn.softmax(jax.vmap(logits, (None, 0))(m, x))

    return jax.lax.map(one, keys).mean(0)


def metrics(probs, y, bins: int = 10) -> dict:
    """Accuracy, negative log-likelihood and the expected calibration error, with
    the reliability diagram's bins (confidence, accuracy, count)."""
    probs, y = np.asarray(probs, np.float64), np.asarray(y)
    confidence, predicted = probs.max(1), probs.argmax(1)
    correct = predicted == y
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(confidence, edges) - 1, 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            conf, acc = confidence[in_bin].mean(), correct[in_bin].mean()
            ece += in_bin.mean() * abs(conf - acc)
            table.append((conf, acc, int(in_bin.sum())))
    nll = -np.mean(np.log(probs[np.arange(len(y)), y] + 1e-12))
    return {"accuracy": correct.mean(), "nll": nll, "ece": ece, "bins": table}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, counts) = plt.subplots(
        2, 1, figsize=(4.8, 6.0), sharex=True, height_ratios=(3, 1.2)
    )
    ax.plot([0, 1], [0, 1], "k:", label="perfectly calibrated")
    width = 0.018
    for k, (name, style) in enumerate((("map", "o-"), ("laplace", "s-"))):
        conf, acc, n = zip(*results[name]["bins"])
        label = f"{name.upper() if name == 'map' else 'Laplace'} (ECE "
        (line,) = ax.plot(
            conf, acc, style, label=label + f"{results[name]['ece']:.3f})"
        )
        # each bin's number of held-out examples, beside its point and below
        for c, a, m in zip(conf, acc, n):
            ax.annotate(
                str(m), (c, a), textcoords="offset points", xytext=(4, -10 + 16 * k),
                fontsize=7, color=line.get_color(),
            )  # fmt: skip
        offset = (k - 0.5) * width
        bars = counts.bar(
            [c + offset for c in conf], n, width=width, color=line.get_color()
        )
        counts.bar_label(bars, fontsize=6, padding=1)
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability on held-out digits")
    ax.legend(loc="upper left")
    counts.set_xlabel("confidence (bin mean)")
    counts.set_ylabel("examples per bin")
    counts.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--prior", type=float, default=0.01, help="MAP weight decay")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    x, x_rest, y, y_rest = load_digits(args.seed)
    x, y = jnp.asarray(x[: args.train]), jnp.asarray(y[: args.train])
    half = len(x_rest) // 2
    x_val, y_val = jnp.asarray(x_rest[:half]), y_rest[:half]
    x_test, y_test = jnp.asarray(x_rest[half:]), y_rest[half:]

    model = train(CNN(jax.random.key(args.seed)), x, y, args.steps, args.prior, 0)
    ggn = ggn_diagonal(logits, likelihood="categorical", batch_size=64)(model, x)
    ggn = eqx.filter(ggn, eqx.is_inexact_array)
    key = jax.random.key(args.seed + 1)

    def posterior(prior: float):
        return jax.tree.map(lambda g: g + prior, ggn)

    def val_nll(prior: float) -> float:
        probs = predictive(model, posterior(prior), x_val, args.samples, key)
        return metrics(probs, y_val)["nll"]

    scores = {prior: val_nll(prior) for prior in PRIORS}
    chosen = min(scores, key=scores.get)
    results = {
        "map": metrics(predictive(model, None, x_test, 0, key), y_test),
        "laplace": metrics(
            predictive(model, posterior(chosen), x_test, args.samples, key), y_test
        ),
        "prior": chosen,
        "val_nll": scores,
        "val_nll_map": metrics(predictive(model, None, x_val, 0, key), y_val)["nll"],
        "model": model,
        "ggn": ggn,
        "train": (x, y),
    }
    print(f"prior precision chosen on the validation split: {chosen:g}")
    print("            accuracy    NLL     ECE")
    for name in ("map", "laplace"):
        m = results[name]
        label = "MAP" if name == "map" else "Laplace"
        print(f"{label:<10} {m['accuracy']:9.3f} {m['nll']:7.3f} {m['ece']:7.3f}")
    if args.plot:
        plot(results, args.plot)
        print(f"reliability diagram: {args.plot}")
    return results


if __name__ == "__main__":
    main()
