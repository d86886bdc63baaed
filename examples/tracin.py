"""TracIn on scikit-learn's digits: which training examples shaped a prediction.

TracIn (Pruthi et al., 2020) scores the influence of training example `z` on a test
example `z'` by the dot products of their loss gradients, summed over checkpoints of
the training run and weighted by the learning rate:
`TracIn(z, z') = sum_c lr_c <g_c(z), g_c(z')>`. Its self-influence
`sum_c lr_c ||g_c(z)||^2` is large for examples the model finds hard to fit, such as
mislabelled ones.

This script trains a small MLP with SGD on the digits, with 5% of the training labels
flipped at random, keeping a checkpoint per epoch; then, with chunkvmap:

* `per_example_grad_norms` (ghost norms: no per-example gradient is formed) gives every
  training example's self-influence, and the examples with the largest are checked
  against the flipped ones, beside the baseline of ranking by the final loss;
* `per_example_grad_gram` with `other=` (the cross-Gram of training against test
  examples, by ghost rules as well) gives the influence of every training example on
  a few test predictions; divided by both examples' gradient norms (the cosine form),
  the most influential ones (proponents) are shown with their labels and images, and
  how many of them are mislabelled is counted for both forms (raw dot products
  favour the large gradients of mislabelled examples).

* `per_example_grad_projections` (by ghost rules as well) gives the same scores from
  gradients projected to a few hundred dimensions (LoGra-style), plain and
  preconditioned by each checkpoint's `kfac_factors`, compared with the exact ones:
  their rank correlation, the flipped labels each finds, the proponents they share.

Memory holds a chunk of activations and cotangents, never the training set's
per-example gradients.

    python examples/tracin.py [--epochs 10] [--batch-size 128] [--test-examples 3]
                              [--dim 16] [--damping 0.1]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from chunkvmap import (
    kfac_factors,
    per_example_grad_gram,
    per_example_grad_norms,
    per_example_grad_projections,
)
from chunkvmap.demo import init_mlp, load_digits, logits, loss


SHADES = " .:-=+*#%@"


def flip_labels(
    y: np.ndarray, share: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """`y` with a random `share` of its labels changed to another class, and which."""
    rng = np.random.default_rng(seed)
    flipped = rng.random(len(y)) < share
    noisy = y.copy()
    noisy[flipped] = (y[flipped] + rng.integers(1, 10, flipped.sum())) % 10
    return noisy, flipped


def train(x, y, epochs: int, lr: float, seed: int) -> list:
    """SGD on mini-batches of 32; the parameters after every epoch."""
    params = init_mlp(jax.random.key(seed), [64, 32, 10])

    @jax.jit
    def step(params, xb, yb):
        grads = jax.grad(lambda p: jnp.mean(jax.vmap(loss, (None, 0, 0))(p, xb, yb)))(
            params
        )
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    rng = np.random.default_rng(seed)
    checkpoints = []
    usable = len(x) - len(x) % 32
    for _ in range(epochs):
        order = rng.permutation(len(x))[:usable].reshape(-1, 32)
        for idx in order:
            params = step(params, x[idx], y[idx])
        checkpoints.append(params)
    return checkpoints


def predict(params, x):
    """The logits of a batch of examples."""
    return jax.vmap(logits, (None, 0))(params, x)


def glyph(image: np.ndarray) -> list[str]:
    """An 8x8 digit as 8 lines of text."""
    levels = np.clip((image * (len(SHADES) - 1)).round().astype(int), 0, 9)
    return ["".join(SHADES[v] * 2 for v in row) for row in levels.reshape(8, 8)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--test-examples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=16, help="projected size per axis")
    parser.add_argument("--damping", type=float, default=0.1)
    args = parser.parse_args(argv)
    x_train, x_test, y_clean, y_test = load_digits(args.seed)
    y_train, flipped = flip_labels(y_clean, 0.05, args.seed)
    checkpoints = train(x_train, y_train, args.epochs, args.learning_rate, args.seed)
    accuracy = float(
        jnp.mean(jnp.argmax(predict(checkpoints[-1], x_test), -1) == y_test)
    )
    print(
        f"{len(x_train)} training examples ({flipped.sum()} labels flipped), "
        f"{args.epochs} epochs of SGD: test accuracy {accuracy:.3f}"
    )

    # Self-influence: sum_c lr ||g_c(z)||^2, by ghost norms; beside it, the
    # baseline it should beat or match: ranking by the final checkpoint's loss.
    norms = jax.jit(
        per_example_grad_norms(loss, batch_size=args.batch_size, method="ghost")
    )
    train_norms = [norms(p, x_train, y_train) for p in checkpoints]
    self_influence = sum(args.learning_rate * n**2 for n in train_norms)
    k = int(flipped.sum())
    precision = _precision(self_influence, flipped, k)
    final_loss = jax.vmap(loss, (None, 0, 0))(checkpoints[-1], x_train, y_train)
    loss_precision = _precision(final_loss, flipped, k)
    print(
        f"\nSelf-influence: of the {k} training examples with the largest, "
        f"{round(precision * k)} have a flipped label (precision {precision:.2f}; "
        f"ranking by the final loss: {loss_precision:.2f}; "
        f"{flipped.mean():.2f} by chance)."
    )

    # Influence on test predictions: sum_c lr <g_c(z), g_c(z')> by ghost rules, and
    # its cosine form, each checkpoint's dot products divided by both norms. Raw
    # dot products favour examples with large gradients, which are mostly the
    # mislabelled ones (their self-influence is large): proponents are then ranked
    # by the cosine form, which keeps the direction only.
    chosen = np.arange(args.test_examples)
    xs, ys = x_test[chosen], y_test[chosen]
    gram = jax.jit(
        per_example_grad_gram(loss, batch_size=args.batch_size, method="ghost")
    )
    scores, cosine = 0.0, 0.0
    for p, n_train in zip(checkpoints, train_norms):
        dots = args.learning_rate * gram(p, x_train, y_train, other=(p, xs, ys))
        n_test = norms(p, xs, ys)
        scores = scores + dots
        cosine = cosine + dots / (n_train[:, None] * n_test[None, :] + 1e-12)
    same, mislabelled = [], {"cosine": 0, "raw": 0}
    for j in range(len(chosen)):
        proponents = np.argsort(-np.asarray(cosine[:, j]))[:5]
        raw = np.argsort(-np.asarray(scores[:, j]))[:5]
        same.append(float(np.mean(y_train[proponents] == ys[j])))
        mislabelled["cosine"] += int(flipped[proponents].sum())
        mislabelled["raw"] += int(flipped[raw].sum())
        print(
            f"\nTest example {chosen[j]} (label {ys[j]}) and its 5 strongest "
            f"proponents (training label, cosine influence):"
        )
        columns = [glyph(xs[j])] + [glyph(x_train[i]) for i in proponents]
        for row in zip(*columns):
            print("  " + "   ".join(row))
        print(
            "  "
            + "   ".join(
                f"{'test ' + str(ys[j]):<16}"
                if c == 0
                else f"{str(y_train[i]) + f' {float(cosine[i, j]):.3f}':<16}"
                for c, i in enumerate([None, *proponents])
            )
        )
    share = float(np.mean(same))
    total = 5 * len(chosen)
    print(
        f"\nProponents sharing their test example's label: {share:.2f}. With a "
        f"flipped label: {mislabelled['cosine']} of {total} by cosine influence, "
        f"{mislabelled['raw']} of {total} by raw dot products."
    )
    projected = projected_tracin(args, checkpoints, x_train, y_train, xs, ys)
    agree = _spearman(projected["self"], self_influence)
    top = {  # the same 5 strongest proponents (cosine) as the exact scores'
        name: np.mean([
            len(set(np.argsort(-cosine[:, j])[:5]) & set(np.argsort(-c[:, j])[:5]))
            / 5 for j in range(len(chosen))
        ])
        for name, c in (("projected", projected["cosine"]),)
    }  # fmt: skip
    found = {
        name: _precision(projected[name], flipped, k)
        for name in ("self", "preconditioned")
    }
    print(
        f"\nProjected to {projected['columns']} dimensions (dim={args.dim} per "
        f"axis, by ghost rules: no per-example gradient formed), the self-influence "
        f"ranks as the exact one does (Spearman {agree:.3f}) and finds "
        f"{found['self']:.2f} flipped among its top {k}; preconditioned by each "
        f"checkpoint's KFAC factors (damping {args.damping}), "
        f"{found['preconditioned']:.2f}. The projected cosine influence shares "
        f"{top['projected']:.2f} of the exact one's 5 strongest proponents."
    )
    return {
        "accuracy": accuracy,
        "precision": precision,
        "loss_precision": loss_precision,
        "chance": float(flipped.mean()),
        "same_label": share,
        "mislabelled_proponents": mislabelled,
        "scores": np.asarray(scores),
        "cosine": np.asarray(cosine),
        "checkpoints": checkpoints,
        "train": (x_train, y_train),
        "test": (xs, ys),
        "projected": projected,
        "spearman": agree,
        "projected_precision": found,
        "projected_proponents": top["projected"],
    }


def projected_tracin(args, checkpoints, x, y, xs, ys) -> dict:
    """TracIn from projected gradients (`per_example_grad_projections`, by ghost
    rules): the self-influence `sum_c lr ||P g_c(z)||^2`, the cosine influence
    on the test examples, and the self-influence in the inverse KFAC curvature of
    each checkpoint, `sum_c lr ||(P^T F_c P + lambda)^(-1/2) P g_c(z)||^2`."""
    project = per_example_grad_projections(
        loss, dim=args.dim, batch_size=args.batch_size, method="ghost",
        similarity="cosine",
    )  # fmt: skip
    factors_of = kfac_factors(logits, likelihood="categorical", batch_size=256)
    found = {"self": 0.0, "preconditioned": 0.0, "cosine": 0.0}
    for p in checkpoints:
        rows = project(p, x, y)
        found["self"] += args.learning_rate * jnp.sum(rows**2, 1)
        found["cosine"] += project(p, x, y, other=(p, xs, ys))
        factors = factors_of(p, x)
        white = project(p, x, y, precondition=factors, damping=args.damping)
        found["preconditioned"] += args.learning_rate * jnp.sum(white**2, 1)
    found = {name: np.asarray(v) for name, v in found.items()}
    return {**found, "columns": rows.shape[1]}


def _spearman(a, b) -> float:
    """The rank correlation of two score vectors."""
    ranks = [np.argsort(np.argsort(np.asarray(v))) for v in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def _precision(ranking: jax.Array, flipped: np.ndarray, k: int) -> float:
    """The share of flipped labels among the `k` examples ranked highest."""
    return float(flipped[np.argsort(-np.asarray(ranking))[:k]].mean())


if __name__ == "__main__":
    main()
