"""Writes and executes examples/ensembles_nnx.ipynb (saved with its outputs).

python examples/build_ensembles_nnx.py
"""

import pathlib

from _notebooks import execute_and_write


HERE = pathlib.Path(__file__).parent

CELLS = [
    (
        "md",
        """# Ensembles of Flax NNX models with `chunkvmap.nnx.batch_vmap`

We train an ensemble of small MLPs on scikit-learn's bundled digits dataset (no
download). The members live in one NNX Module whose state carries a leading "member"
axis: it is created with `nnx.split_rngs` and a transform, exactly as with `nnx.vmap`.
`chunkvmap.nnx.batch_vmap` is a drop-in for `nnx.vmap` that evaluates the members a few
at a time (a `jax.vmap` inside a `lax.scan`), so memory is set by `batch_size`, not by
the number of members. Module state flows as with `nnx.vmap`: each member's dropout RNG
counter advances inside the chunked calls, and the optimizer updates the members in
place. Then we compare each member's test accuracy with the ensemble's, and look at the
ensemble's predictive uncertainty.""",
    ),
    (
        "code",
        """import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from chunkvmap.nnx import batch_vmap

FAST = os.environ.get("CHUNKVMAP_NOTEBOOK_FAST") == "1"  # small run for the test suite
if FAST:  # the classic threefry compiles several times faster on CPU (other keys)
    jax.config.update("jax_threefry_partitionable", False)
N_MEMBERS = 16
MEMBERS_PER_CHUNK = 4
STEPS = 30 if FAST else 300
print(f"{N_MEMBERS} members, {STEPS} steps, {MEMBERS_PER_CHUNK} members per chunk")""",
    ),
    (
        "code",
        """digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int32)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=0)
x_train, x_test = jnp.asarray(x_train), jnp.asarray(x_test)
y_train, y_test = jnp.asarray(y_train), jnp.asarray(y_test)
print(x_train.shape, x_test.shape)""",
    ),
    (
        "md",
        """## The ensemble

`nnx.split_rngs(splits=N_MEMBERS)` gives every member its own keys (for the parameters
and for dropout); the transform then builds one member per key. With `batch_vmap` the
members are built `MEMBERS_PER_CHUNK` at a time, and the result is the one `nnx.vmap`
builds: the keys are split before chunking, so no draw depends on the chunk size.""",
    ),
    (
        "code",
        """class Member(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def create_ensemble(vmap, **chunking):
    @nnx.jit
    @nnx.split_rngs(splits=N_MEMBERS)
    @vmap(in_axes=(0,), **chunking)
    def members(rngs):
        return Member(rngs)

    return members(nnx.Rngs(params=0, dropout=1))


ensemble = create_ensemble(batch_vmap, batch_size=MEMBERS_PER_CHUNK)
reference = create_ensemble(nnx.vmap)
same = all(
    bool(jnp.array_equal(a, b))
    for a, b in zip(
        jax.tree.leaves(nnx.state(ensemble, nnx.Param)),
        jax.tree.leaves(nnx.state(reference, nnx.Param)),
    )
)
print("chunked construction equals nnx.vmap:", same)
print("hidden kernel:", ensemble.hidden.kernel.shape)""",
    ),
    (
        "md",
        """## Training

The loss of the ensemble is the sum of the members' mean cross-entropies. With
`reduction=jnp.add` the members' losses are summed chunk by chunk: the logits of all
members are never held at once, and under `nnx.value_and_grad` each chunk is
recomputed during the backward pass (`remat=True`, the default), so the gradient's
working memory is that of `MEMBERS_PER_CHUNK` members. Dropout draws from each member's
own stream; its counter is part of the member state that `batch_vmap` hands back.""",
    ),
    (
        "code",
        """def member_loss(member, xs, ys):
    logits = member(xs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()


# Members mapped (their state over axis 0), data shared by all of them.
summed_loss = batch_vmap(
    member_loss,
    in_axes=(0, None, None),
    batch_size=MEMBERS_PER_CHUNK,
    reduction=jnp.add,
    chunk_reduction=lambda losses: losses.sum(0),
)
optimizer = nnx.Optimizer(ensemble, optax.adam(3e-3), wrt=nnx.Param)


@nnx.jit
def train_step(ensemble, optimizer, xs, ys):
    loss, grads = nnx.value_and_grad(summed_loss)(ensemble, xs, ys)
    optimizer.update(ensemble, grads)
    return loss


losses = []
for step in range(STEPS):
    losses.append(float(train_step(ensemble, optimizer, x_train, y_train)) / N_MEMBERS)
print(f"mean member loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")
print(
    "dropout calls per member:", np.asarray(ensemble.dropout.rngs.count[...])[:4], "..."
)""",
    ),
    (
        "md",
        """### What the chunks save

XLA's own estimate of the temporary memory of one gradient, compiled for the chunked
sum and for `nnx.vmap` followed by a sum (the same numbers, the same gradient):""",
    ),
    (
        "code",
        """graphdef, state = nnx.split(ensemble)


def grad_temp_bytes(loss):
    def grad(state, xs, ys):
        return nnx.grad(loss)(nnx.merge(graphdef, state), xs, ys)

    compiled = jax.jit(grad).lower(state, x_train, y_train).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def stacked_loss(ensemble, xs, ys):
    return nnx.vmap(member_loss, in_axes=(0, None, None))(ensemble, xs, ys).sum()


chunked_bytes, stacked_bytes = (
    grad_temp_bytes(summed_loss),
    grad_temp_bytes(stacked_loss),
)
print(
    f"gradient temp memory: nnx.vmap {stacked_bytes / 2**20:.2f} MiB, "
    f"batch_vmap {chunked_bytes / 2**20:.2f} MiB ({stacked_bytes / chunked_bytes:.1f}x less)"
)""",
    ),
    (
        "md",
        """## Members vs the ensemble

The ensemble averages the members' predicted probabilities. In evaluation mode the
logits come back stacked, `(members, examples, classes)`.""",
    ),
    (
        "code",
        """ensemble.eval()
ensemble_logits = batch_vmap(
    lambda member, xs: member(xs), in_axes=(0, None), batch_size=MEMBERS_PER_CHUNK
)
probs = jax.nn.softmax(ensemble_logits(ensemble, x_test), axis=-1)  # (M, N, 10)
member_acc = (probs.argmax(-1) == y_test[None, :]).mean(axis=1)
mean_probs = probs.mean(axis=0)
ensemble_acc = float((mean_probs.argmax(-1) == y_test).mean())
print("member accuracies:", np.round(np.asarray(member_acc), 3))
print(
    f"best member {float(member_acc.max()):.3f}, mean member {float(member_acc.mean()):.3f}"
)
print(f"ensemble accuracy {ensemble_acc:.3f}")""",
    ),
    (
        "md",
        """## Predictive uncertainty

The entropy of the averaged prediction is the ensemble's total uncertainty; the mean
entropy of the members is the part each member already expresses, and the difference
(the members' disagreement) is the epistemic part. Misclassified test digits should
sit at high uncertainty.""",
    ),
    (
        "code",
        """def entropy(p):
    return -(p * jnp.log(jnp.clip(p, 1e-12))).sum(-1)


total = entropy(mean_probs)
aleatoric = entropy(probs).mean(axis=0)
epistemic = total - aleatoric
correct = np.asarray(mean_probs.argmax(-1) == y_test)

fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
bins = np.linspace(0, float(total.max()) + 1e-6, 30)
axes[0].hist(
    np.asarray(total)[correct], bins=bins, alpha=0.7, label="correct", density=True
)
axes[0].hist(
    np.asarray(total)[~correct], bins=bins, alpha=0.7, label="wrong", density=True
)
axes[0].set_xlabel("predictive entropy (nats)")
axes[0].set_title("ensemble uncertainty")
axes[0].legend()
for mask, label, colour in (
    (correct, "correct", "tab:blue"), (~correct, "wrong", "tab:red")
):
    axes[1].scatter(
        np.asarray(aleatoric)[mask], np.asarray(epistemic)[mask], s=8, color=colour,
        label=label,
    )
axes[1].legend(title="prediction")
axes[1].set_xlabel("mean member entropy")
axes[1].set_ylabel("disagreement (epistemic)")
axes[1].set_title("where the uncertainty comes from")
axes[2].bar(np.arange(N_MEMBERS), np.asarray(member_acc), color="gray", label="members")
axes[2].axhline(ensemble_acc, color="crimson", label=f"ensemble {ensemble_acc:.3f}")
axes[2].set_ylim(float(member_acc.min()) - 0.05, 1.0)
axes[2].set_xlabel("member")
axes[2].set_ylabel("test accuracy")
axes[2].legend(loc="lower right")
fig.tight_layout()
plt.show()
print(
    f"mean entropy: correct {float(total[correct].mean()):.3f}, "
    f"wrong {float(total[~correct].mean()) if (~correct).any() else float('nan'):.3f}"
)""",
    ),
]


if __name__ == "__main__":
    execute_and_write(CELLS, HERE / "ensembles_nnx.ipynb")
