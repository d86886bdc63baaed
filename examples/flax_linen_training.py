"""Train a Flax linen classifier whose forward pass over the batch is chunked.

The model is written for one example (an image in, 10 logits out) and lifted over the
batch with `chunkvmap.linen.batch_vmap`, a drop-in for `nn.vmap`: the parameters are
shared (`variable_axes={"params": None}`), the dropout stream is split per example
(`split_rngs={"dropout": True}`), and the examples are evaluated `--chunk` at a time.
The training loss is not even stacked: `reduction=jnp.add` sums the per-example losses
chunk by chunk, so activations and losses never take memory proportional to the batch.

Data: scikit-learn's bundled digits (8x8 images, no download). Before training, the
script checks that the chunked loss and gradients equal those of `nn.vmap` with the same
arguments; then it trains with optax's Adam and reports the test accuracy.

    python examples/flax_linen_training.py [--epochs 30] [--batch 256] [--chunk 32]
    python examples/flax_linen_training.py --fast   # a few epochs, for the test suite
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from chunkvmap.linen import batch_vmap


class Classifier(nn.Module):
    """An MLP on one flattened 8x8 image."""

    hidden: int = 128

    @nn.compact
    def __call__(self, image, train: bool = False):
        h = nn.relu(nn.Dense(self.hidden)(image))
        h = nn.Dropout(0.2, deterministic=not train)(h)
        h = nn.relu(nn.Dense(self.hidden)(h))
        return nn.Dense(10)(h)


class ExampleLoss(nn.Module):
    """Cross-entropy of one example."""

    @nn.compact
    def __call__(self, image, label):
        logits = Classifier(name="classifier")(image, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)


def lifted(target, vmap=batch_vmap, **chunking):
    """`target` over a batch: shared parameters, one dropout key per example."""
    return vmap(
        target,
        variable_axes={"params": None},
        split_rngs={"params": False, "dropout": True},
        **chunking,
    )


def load(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed
    )
    return tuple(jnp.asarray(a) for a in (x_train, x_test, y_train, y_test))


def main(epochs: int = 30, batch: int = 256, chunk: int = 32, seed: int = 0) -> float:
    x_train, x_test, y_train, y_test = load(seed)
    # Summed losses, `chunk` examples at a time; logits for evaluation, stacked.
    summed_loss = lifted(
        ExampleLoss,
        batch_size=chunk,
        reduction=jnp.add,
        chunk_reduction=lambda losses: losses.sum(0),
    )()
    batch_logits = lifted(Classifier, batch_size=chunk)()

    key = jax.random.key(seed)
    params = jax.jit(summed_loss.init)(key, x_train[:batch], y_train[:batch])["params"]
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(f"{x_train.shape[0]} training images, {n_params} parameters, ", end="")
    print(f"batches of {batch} evaluated {chunk} at a time")

    def loss_fn(params, images, labels, dropout_key):
        total = summed_loss.apply(
            {"params": params}, images, labels, rngs={"dropout": dropout_key}
        )
        return total / images.shape[0]

    # The chunked loss is nn.vmap's loss (same dropout masks), gradients included.
    reference = lifted(ExampleLoss, vmap=nn.vmap)()

    def reference_loss(params, images, labels, dropout_key):
        losses = reference.apply(
            {"params": params}, images, labels, rngs={"dropout": dropout_key}
        )
        return losses.mean()

    args = (params, x_train[:batch], y_train[:batch], jax.random.key(1))
    value, grads = jax.jit(jax.value_and_grad(loss_fn))(*args)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(reference_loss))(*args)
    same = np.allclose(value, ref_value, rtol=1e-5) and all(
        np.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    )
    print(f"chunked loss and gradients equal nn.vmap's: {same}")

    optimizer = optax.adam(2e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, images, labels, dropout_key):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels, dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, images, labels):
        logits = batch_logits.apply({"params": params["classifier"]}, images)
        return (logits.argmax(-1) == labels).mean()

    steps = x_train.shape[0] // batch
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        key, perm_key = jax.random.split(key)
        order = jax.random.permutation(perm_key, x_train.shape[0])
        losses = []
        for step in range(steps):
            idx = order[step * batch : (step + 1) * batch]
            key, dropout_key = jax.random.split(key)
            params, opt_state, loss = train_step(
                params, opt_state, x_train[idx], y_train[idx], dropout_key
            )
            losses.append(float(loss))
        if epoch == 1 or epoch % max(1, epochs // 6) == 0 or epoch == epochs:
            print(f"epoch {epoch:3d}  train loss {np.mean(losses):.4f}")
    test_accuracy = float(accuracy(params, x_test, y_test))
    print(f"trained in {time.perf_counter() - start:.1f}s")
    print(f"test accuracy {test_accuracy:.3f}")
    return test_accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast", action="store_true", help="5 epochs, for tests")
    cli = parser.parse_args()
    main(5 if cli.fast else cli.epochs, cli.batch, cli.chunk, cli.seed)
