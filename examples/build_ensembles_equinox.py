"""Writes and executes examples/ensembles_equinox.ipynb (saved with its outputs).

python examples/build_ensembles_equinox.py
"""

import pathlib

from _notebooks import execute_and_write


HERE = pathlib.Path(__file__).parent

CELLS = [
    (
        "md",
        """# Ensembles of Equinox MLPs with `chunkvmap.eqx.filter_batch_vmap`

We train an ensemble of small MLPs on scikit-learn's bundled digits dataset (no
download). The members live in one Equinox module whose arrays carry a leading
"member" axis, built with `eqx.filter_vmap`. Every forward pass and every gradient goes
through `filter_batch_vmap`, which evaluates the members a few at a time (a `jax.vmap`
inside a `lax.scan`), so memory is set by `batch_size`, not by the number of members.
Then we compare each member's test accuracy with the ensemble's, and look at the
ensemble's predictive uncertainty.""",
    ),
    (
        "code",
        """import os

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from chunkvmap.eqx import filter_batch_vmap

FAST = os.environ.get("CHUNKVMAP_NOTEBOOK_FAST") == "1"  # small run for the test suite
N_MEMBERS = 16
MEMBERS_PER_CHUNK = 4
STEPS = 60 if FAST else 400
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

`eqx.filter_vmap` over keys builds all members at once (equivalently, and in chunks,
`filter_batch_vmap(make_member, batch_size=...)(keys)`).""",
    ),
    (
        "code",
        """def make_member(key):
    return eqx.nn.MLP(64, 10, width_size=32, depth=2, activation=jax.nn.relu, key=key)


keys = jax.random.split(jax.random.key(0), N_MEMBERS)
ensemble = filter_batch_vmap(make_member, batch_size=MEMBERS_PER_CHUNK)(keys)
reference = eqx.filter_vmap(make_member)(keys)
same = all(
    bool(jnp.array_equal(a, b))
    for a, b in zip(jax.tree.leaves(eqx.filter(ensemble, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(reference, eqx.is_array)))
)
print("chunked construction equals eqx.filter_vmap:", same)
print("first layer weight:", ensemble.layers[0].weight.shape)""",
    ),
    (
        "code",
        """def member_logits(member, xs):
    return jax.vmap(member)(xs)


# Members mapped (their arrays over axis 0), data shared: logits (members, examples, 10).
ensemble_logits = filter_batch_vmap(
    member_logits, in_axes=(eqx.if_array(0), None), batch_size=MEMBERS_PER_CHUNK
)


def loss_fn(ensemble, xs, ys):
    logits = ensemble_logits(ensemble, xs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, ys[None, :])
    return losses.mean(axis=1).sum()  # members are independent: sum their mean losses


optimizer = optax.adam(3e-3)
opt_state = optimizer.init(eqx.filter(ensemble, eqx.is_array))


@eqx.filter_jit
def train_step(ensemble, opt_state, xs, ys):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(ensemble, xs, ys)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(ensemble, eqx.is_array))
    return eqx.apply_updates(ensemble, updates), opt_state, loss


losses = []
for step in range(STEPS):
    ensemble, opt_state, loss = train_step(ensemble, opt_state, x_train, y_train)
    losses.append(float(loss) / N_MEMBERS)
print(f"mean member loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")""",
    ),
    (
        "md",
        """## Members vs the ensemble

The ensemble averages the members' predicted probabilities.""",
    ),
    (
        "code",
        """probs = jax.nn.softmax(ensemble_logits(ensemble, x_test), axis=-1)  # (M, N, 10)
member_acc = (probs.argmax(-1) == y_test[None, :]).mean(axis=1)
mean_probs = probs.mean(axis=0)
ensemble_acc = float((mean_probs.argmax(-1) == y_test).mean())
print("member accuracies:", np.round(np.asarray(member_acc), 3))
print(f"best member {float(member_acc.max()):.3f}, mean member {float(member_acc.mean()):.3f}")
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
axes[0].hist(np.asarray(total)[correct], bins=bins, alpha=0.7, label="correct", density=True)
axes[0].hist(np.asarray(total)[~correct], bins=bins, alpha=0.7, label="wrong", density=True)
axes[0].set_xlabel("predictive entropy (nats)")
axes[0].set_title("ensemble uncertainty")
axes[0].legend()
for mask, label, colour in ((correct, "correct", "tab:blue"), (~correct, "wrong", "tab:red")):
    axes[1].scatter(np.asarray(aleatoric)[mask], np.asarray(epistemic)[mask], s=8, color=colour, label=label)
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
print(f"mean entropy: correct {float(total[correct].mean()):.3f}, "
      f"wrong {float(total[~correct].mean()) if (~correct).any() else float('nan'):.3f}")""",
    ),
]


if __name__ == "__main__":
    execute_and_write(CELLS, HERE / "ensembles_equinox.ipynb")
