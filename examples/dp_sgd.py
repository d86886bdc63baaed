"""DP-SGD on scikit-learn's digits: chunkvmap's `clipped_grad` next to optax's.

Two ways to take the same DP-SGD step on a Poisson-sampled lot (each training example
joins it independently with probability q = lot-size / N, so its size varies from step
to step): clip each per-example gradient to L2 norm C, sum, add
Gaussian noise of standard deviation sigma * C, divide by the lot's size, optax update:

* optax only: `jax.vmap(jax.grad(loss))` builds all the lot's per-example gradients,
  then `optax.contrib.differentially_private_aggregate` clips, sums and noises them
  (and divides by the lot's size, as below);
* chunkvmap: `clipped_grad` (jax-privacy's signature, `fun(params, batch)`) computes,
  clips and sums them `batch_size` at a time, then the same noise is added by hand.

Both are trained from the same initialisation on the same lots with the same noise (the
noise key of the optax transform is reproduced), so the accuracies agree; the printout
puts XLA's compiled temporary memory of the two steps side by side (XLA:CPU's figure,
also on an accelerator, whose compiler reports another figure under that name).

Lot sizes vary, and `jax.jit` compiles one program per shape. optax's transform needs
all the lot's per-example gradients in one array, so its step is compiled once per lot
size. chunkvmap's step pads every lot to one capacity (`chunkvmap.demo.lot_capacity`,
`padded_buffers`) and marks the padding with `is_padding_example=`: it compiles one
program whatever the lot sizes, and skips the chunks of padding alone at run time.

    python examples/dp_sgd.py [--epochs 8] [--lot-size 512] [--batch-size 64]
        [--learning-rate 1e-2]

It takes about a minute on a 2-core CPU (64 s measured), most of it compiling optax's
step once per lot size (15 sizes in 16 steps); more epochs take longer.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkvmap import clipped_grad
from chunkvmap.demo import (
    batch_loss,
    init_mlp,
    load_digits,
    logits,
    lot_capacity,
    padded_buffers,
    poisson_lot,
)


CLIP, NOISE = 1.0, 1.0


def make_steps(optimizer, batch_size: int, capacity: int):
    # optax only: every per-example gradient of the lot in memory at once.
    dp = optax.contrib.differentially_private_aggregate(CLIP, NOISE, key=0)

    def per_example_grads(params, x, y):
        one = (x[:, None], y[:, None])  # batches of one example, as clipped_grad's
        return jax.vmap(jax.grad(batch_loss), (None, 0))(params, one)

    @jax.jit
    def optax_step(params, opt_state, dp_state, x, y):
        mean, dp_state = dp.update(per_example_grads(params, x, y), dp_state)
        updates, opt_state = optimizer.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dp_state

    # chunkvmap: batch_size clipped gradients at a time, summed as they are made.
    clipped = clipped_grad(batch_loss, l2_clip_norm=CLIP, batch_size=batch_size)

    @jax.jit
    def add_buffer(total, params, x, y, pad):
        step = clipped(params, (x, y), is_padding_example=pad)
        return jax.tree.map(jnp.add, total, step)

    @jax.jit
    def update(params, opt_state, dp_state, total, lot_size):
        # The same noise as optax's transform: one key per leaf from its state's key.
        leaves, treedef = jax.tree.flatten(total)
        new_key, *keys = jax.random.split(dp_state.rng_key, len(leaves) + 1)
        noisy = [
            (g + NOISE * CLIP * jax.random.normal(k, g.shape, g.dtype)) / lot_size
            for g, k in zip(leaves, keys)
        ]
        mean = jax.tree.unflatten(treedef, noisy)
        updates, opt_state = optimizer.update(mean, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            dp_state._replace(rng_key=new_key),
        )

    def chunkvmap_step(params, opt_state, dp_state, x, y):
        total = jax.tree.map(jnp.zeros_like, params)
        for rows, pad in padded_buffers(np.arange(len(x)), capacity):
            total = add_buffer(total, params, x[rows], y[rows], pad)
        return update(params, opt_state, dp_state, total, jnp.float32(len(x)))

    def chunkvmap_whole_lot(params, opt_state, dp_state, x, y):
        # One program for a whole lot (for its memory): clipped_grad takes any size.
        total = clipped(params, (x, y))
        return update(params, opt_state, dp_state, total, jnp.float32(len(x)))

    return dp, optax_step, chunkvmap_step, jax.jit(chunkvmap_whole_lot)


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lot-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    args = parser.parse_args(argv)

    x_train, x_test, y_train, y_test = load_digits(seed=0)
    lot = min(args.lot_size, len(x_train))
    q = lot / len(x_train)
    optimizer = optax.adam(args.learning_rate)
    capacity = lot_capacity(len(x_train), q, args.batch_size)
    dp, optax_step, chunkvmap_step, whole_lot = make_steps(
        optimizer, args.batch_size, capacity
    )
    params = init_mlp(jax.random.key(0), (64, 256, 256, 10))
    x0, y0 = jnp.asarray(x_train[:lot]), jnp.asarray(y_train[:lot])
    state0 = (params, optimizer.init(params), dp.init(params))

    memory = {}  # for a lot of the expected size, as XLA:CPU compiles the step
    cpu = jax.devices("cpu")[0]  # (an accelerator's compiler reports another figure)
    with jax.default_device(cpu):
        on_cpu = jax.device_put((*state0, x0, y0), cpu)
        for name, step in (("optax only", optax_step), ("chunkvmap", whole_lot)):
            compiled = step.lower(*on_cpu).compile()
            memory[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20

    rng = np.random.default_rng(0)
    lots = [
        poisson_lot(rng, len(x_train), q)
        for _ in range(args.epochs * max(1, len(x_train) // lot))
    ]
    accuracy = {}
    for name, step in (("optax only", optax_step), ("chunkvmap", chunkvmap_step)):
        state = state0
        for idx in lots:
            state = step(*state, x_train[idx], y_train[idx])
        predictions = jnp.argmax(jax.vmap(logits, (None, 0))(state[0], x_test), -1)
        accuracy[name] = float(jnp.mean(predictions == y_test))

    sizes = [len(idx) for idx in lots]
    print(
        f"DP-SGD on digits, clip {CLIP}, noise multiplier {NOISE}, {len(lots)} steps "
        f"on Poisson-sampled lots of {min(sizes)}-{max(sizes)} examples ({lot} "
        f"expected; chunkvmap's padded to {capacity}: one program), chunkvmap "
        f"batch_size={args.batch_size}"
    )
    print(f"{'':>11} | {'test accuracy':>13} | {'step temp memory (MiB)':>22}")
    for name in memory:
        print(f"{name:>11} | {accuracy[name]:>13.3f} | {memory[name]:>22.1f}")
    ratio = memory["optax only"] / memory["chunkvmap"]
    print(
        f"chunkvmap needs {ratio:.1f}x less temporary memory for the same step (at "
        f"{lot} examples); optax's step compiled once per lot size "
        f"({len(set(sizes))} sizes)."
    )
    return {"memory_ratio": ratio, **{f"acc_{k}": v for k, v in accuracy.items()}}


if __name__ == "__main__":
    main()
