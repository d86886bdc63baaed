"""The linear datamodeling score (LDS) of chunkvmap's attribution methods on the
digits.

Setup (one command, a 2-core CPU in a few minutes): scikit-learn's digits, an
MLP 64-32-10 (tanh) trained by full-batch gradient descent with momentum and
weight decay. `--models` models (100 by default) are retrained from the same
initialisation on random halves of the training set, all together by
`chunkvmap.batch_vmap` over the subsets' masks (an ensemble of training runs, in
chunks of 16 models); each model's margin on every held-out digit is recorded
(the correct logit less the log-sum-exp of the others). Each method scores every
(test, train) pair at the model trained on the whole set; a subset's predicted
margin change is the sum of its examples' scores, and a test digit's LDS is the
Spearman correlation, over the subsets, of the predicted sums with the margins
(averaged over the test digits).

Methods (the score of train example `i` on test digit `z`: minus the test
margin's gradient against the train loss's, in some metric):

* `grad dot`: exact gradients (`per_example_grads`), inner product (TracIn at
  the final checkpoint);
* `grad cosine`: the same over both norms;
* `TRAK-style projected (dim d)`: `per_example_grad_projections(dim=d)` rows,
  inner product;
* `KFAC influence (dim d)`: the rows whitened by `kfac_factors` (`precondition=`);
* `EK-FAC influence (dim d)`: the rows whitened by `ekfac_factors`;
* `KFAC influence (exact)`, `EK-FAC influence (exact)`: `multiply_inverse` of
  the factors applied to the test gradient, against the exact per-example
  gradients.

    python benchmarks/bench_lds.py --out benchmarks/results/lds.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402

import chunkvmap as cv  # noqa: E402


HIDDEN, CLASSES = 32, 10


def model(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss(p, x, y):
    return -jax.nn.log_softmax(model(p, x))[y]


def margin(p, x, y):
    """The correct logit less the log-sum-exp of the others."""
    f = model(p, x)
    others = jnp.where(jnp.arange(CLASSES) == y, -jnp.inf, f)
    return f[y] - jax.nn.logsumexp(others)


def init(key) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (64, HIDDEN)) / 8.0,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(CLASSES),
    }


def train(p0, weights, x, y, steps: int, lr=0.5, decay=1e-3):
    """Full-batch gradient descent with momentum on the examples' `weights` (a
    subset's mask), from `p0`."""

    def objective(p):
        per = jax.vmap(loss, (None, 0, 0))(p, x, y)
        reg = sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
        return jnp.sum(weights * per) / jnp.sum(weights) + decay * reg

    def step(state, _):
        p, v = state
        g = jax.grad(objective)(p)
        v = jax.tree.map(lambda v, g: 0.9 * v + g, v, g)
        return (jax.tree.map(lambda p, v: p - lr * v, p, v), v), None

    zeros = jax.tree.map(jnp.zeros_like, p0)
    (p, _), _ = jax.lax.scan(step, (p0, zeros), None, length=steps)
    return p


def data(n_train: int, n_test: int, seed: int = 0):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x / 16.0).astype(np.float32)[order], y.astype(np.int32)[order]
    tr, te = slice(0, n_train), slice(n_train, n_train + n_test)
    return (
        jnp.asarray(x[tr]),
        jnp.asarray(y[tr]),
        jnp.asarray(x[te]),
        jnp.asarray(y[te]),
    )


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / np.sqrt((ra @ ra) * (rb @ rb)))


def lds(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray) -> float:
    """Mean over test digits of the Spearman correlation over subsets of the
    predicted sums (`masks @ scores`) with the margins."""
    predicted = masks @ scores  # (subsets, test)
    return float(np.mean([spearman(predicted[:, t], margins[:, t])
                          for t in range(margins.shape[1])]))  # fmt: skip


def methods(p, x, y, xt, yt, dims, damping):
    """Each method's `(test, train)` scores at the parameters `p`."""
    out = {}
    g_train = cv.per_example_grads(loss, batch_size=128)(p, x, y)
    g_test = cv.per_example_grads(margin, batch_size=128)(p, xt, yt)
    flat = lambda g: np.concatenate(  # noqa: E731
        [np.asarray(a).reshape(a.shape[0], -1) for a in jax.tree.leaves(g)], 1
    )
    tr, te = flat(g_train), flat(g_test)
    out["grad dot"] = -te @ tr.T
    norms = np.linalg.norm(te, axis=1)[:, None] * np.linalg.norm(tr, axis=1)[None]
    out["grad cosine"] = -(te @ tr.T) / np.maximum(norms, 1e-30)
    kfac = cv.kfac_factors(model, likelihood="categorical", batch_size=128)(p, x)
    ekfac = cv.ekfac_factors(model, likelihood="categorical", batch_size=128)(p, x)
    for name, factors in (("KFAC", kfac), ("EK-FAC", ekfac)):
        solve = lambda g, f=factors: cv.multiply_inverse(f, g, damping=damping)  # noqa: E731
        out[f"{name} influence (exact)"] = -flat(jax.vmap(solve)(g_test)) @ tr.T
    for d in dims:
        rows = lambda f, *a, **kw: np.asarray(  # noqa: E731
            cv.per_example_grad_projections(f, dim=d, batch_size=128)(p, *a, **kw)
        )
        out[f"TRAK-style projected (dim {d})"] = (
            -rows(margin, xt, yt) @ rows(loss, x, y).T
        )
        for name, factors in (("KFAC", kfac), ("EK-FAC", ekfac)):
            kw = dict(precondition=factors, damping=damping)
            out[f"{name} influence (dim {d})"] = (
                -rows(margin, xt, yt, **kw) @ rows(loss, x, y, **kw).T
            )
    return out


def run(args) -> str:
    start = time.perf_counter()
    x, y, xt, yt = data(args.train, args.test)
    p0 = init(jax.random.key(0))
    rng = np.random.default_rng(1)
    masks = (rng.random((args.models, args.train)) < 0.5).astype(np.float32)
    full = train(p0, jnp.ones(args.train), x, y, args.steps)
    fit = cv.batch_vmap(
        lambda w: train(p0, w, x, y, args.steps), batch_size=args.ensemble_batch
    )
    t0 = time.perf_counter()
    ensemble = jax.block_until_ready(fit(jnp.asarray(masks)))
    trained = time.perf_counter() - t0
    margins = np.asarray(
        jax.vmap(lambda p: jax.vmap(margin, (None, 0, 0))(p, xt, yt))(ensemble)
    )
    accuracy = float(
        jnp.mean(jnp.argmax(jax.vmap(model, (None, 0))(full, xt), 1) == yt)
    )
    rows = []
    for name, scores in methods(full, x, y, xt, yt, args.dims, args.damping).items():
        rows.append((name, lds(np.asarray(scores).T, masks, margins)))
    lines = [
        "# Linear datamodeling score on the digits",
        "",
        f"Machine: {machine()}. `python benchmarks/bench_lds.py` "
        f"({time.perf_counter() - start:.0f} s in all; the {args.models} models "
        f"trained together by `batch_vmap` in {trained:.1f} s).",
        "",
        f"Digits: {args.train} training and {args.test} held-out images; MLP "
        f"64-{HIDDEN}-10 (tanh), full-batch gradient descent with momentum "
        f"({args.steps} steps, learning rate 0.5, weight decay 1e-3), held-out "
        f"accuracy {accuracy:.3f} on the whole training set. {args.models} models "
        f"retrained from the same initialisation on random halves; LDS: the mean "
        f"over the held-out digits of the Spearman correlation, over the subsets, "
        f"of each method's predicted sum with the model's margin. Damping "
        f"{args.damping} (times the mean eigenvalue for the projected whitening; "
        f"added to the eigenvalues for the exact solves).",
        "",
        "| method | LDS |",
        "|---|---|",
        *[f"| {name} | {value:.3f} |" for name, value in rows],
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ensemble-batch", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
