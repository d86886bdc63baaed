"""Data- and model-parallel DP-SGD: per-example clipped gradients chunked per device.

A small Equinox MLP is trained on synthetic data over a (data=4, model=2) mesh of 8
devices (`jax.make_mesh`'s default `Explicit` axes):

* the batch is sharded over "data": each group of 2 devices holds a quarter of the
  examples;
* the hidden layer is sharded over "model" (Megatron style: `w1`'s columns, `b1` and
  `w2`'s rows), so each device holds half of the weights;
* `chunkvmap.clipped_grad_sum(loss, C, batch_size=B, method="ghost")` computes the
  per-example gradient norms (ghost norms: no per-example weight gradient is formed),
  clips and sums. It sees the batch's layout in its type and follows it: each device
  evaluates only its own examples, `B` at a time, and the devices' sums are added in
  device order. No argument says so, and the batch is never all-gathered; the
  "model" axis is left alone, so the gradients come out sharded like the weights.
  `--method vmap` forms the per-example gradients instead (the same result).

Each step adds Gaussian noise (DP-SGD) and applies an optax update, all in one
`jax.jit` under `jax.set_mesh(mesh)`. At the end the script checks that

(a) the clipped gradient sum equals `jax.vmap(jax.grad(loss))`, clipped and summed,
    for both methods;
(b) the parameters kept their sharding through the updates;
(c) the compiled step has no all-gather of the global batch.

It needs 8 devices; on the CPU it simulates them:

    python examples/data_parallel.py [--steps 40] [--lot-size 512] [--batch-size 32]
                                     [--method ghost]
"""

from __future__ import annotations

import argparse
import re

import jax


# 8 simulated devices when JAX runs on the CPU (set before JAX starts its backends).
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import chunkvmap  # noqa: E402


IN, HIDDEN, CLASSES = 32, 64, 8
CLIP, NOISE = 1.0, 0.5


class MLP(eqx.Module):
    """One hidden layer, split over the "model" axis (column- then row-parallel)."""

    w1: jax.Array  # (IN, HIDDEN), columns over "model"
    b1: jax.Array  # (HIDDEN,), over "model"
    w2: jax.Array  # (HIDDEN, CLASSES), rows over "model"
    b2: jax.Array  # (CLASSES,), replicated

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.gelu(x @ self.w1 + self.b1)  # each device: its half of the units
        # The contraction over the sharded hidden units is a sum over "model" devices;
        # with Explicit axes the output's sharding is said: replicated.
        return jnp.dot(h, self.w2, out_sharding=P()) + self.b2


def init(key: jax.Array, mesh: jax.sharding.Mesh) -> MLP:
    k1, k2 = jax.random.split(key)
    model = MLP(
        w1=jax.random.normal(k1, (IN, HIDDEN)) / IN**0.5,
        b1=jnp.zeros(HIDDEN),
        w2=jax.random.normal(k2, (HIDDEN, CLASSES)) / HIDDEN**0.5,
        b2=jnp.zeros(CLASSES),
    )
    specs = MLP(w1=P(None, "model"), b1=P("model"), w2=P("model", None), b2=P())
    return jax.device_put(model, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def loss(model: MLP, x: jax.Array, label: jax.Array) -> jax.Array:
    """Cross-entropy of one example."""
    return optax.softmax_cross_entropy_with_integer_labels(model(x), label)


def synthetic_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and the labels a random teacher network gives them (a learnable task)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    teacher = rng.normal(size=(IN, CLASSES)).astype(np.float32)
    return x, np.argmax(np.tanh(x) @ teacher, axis=-1).astype(np.int32)


def make_step(optimizer: optax.GradientTransformation, batch_size: int, method: str):
    # Nothing here names the mesh or the layout: both come from the inputs' types.
    clipped_sum = chunkvmap.clipped_grad_sum(
        loss, CLIP, batch_argnums=(1, 2), batch_size=batch_size, method=method
    )
    loss_sum = chunkvmap.batch_vmap(
        loss,
        in_axes=(None, 0, 0),
        batch_size=batch_size,
        reduction=jnp.add,
        chunk_reduction=lambda losses: losses.sum(0),
    )

    def step(model, opt_state, x, y, key):
        total, count = clipped_sum(model, x, y)
        leaves, treedef = jax.tree.flatten(total)
        keys = jax.random.split(key, len(leaves))
        noisy = [
            (g + NOISE * CLIP * jax.random.normal(k, g.shape, g.dtype)) / count
            for g, k in zip(leaves, keys)
        ]
        updates, opt_state = optimizer.update(
            jax.tree.unflatten(treedef, noisy), opt_state, model
        )
        mean_loss = loss_sum(model, x, y) / count
        return optax.apply_updates(model, updates), opt_state, mean_loss

    return jax.jit(step), jax.jit(clipped_sum)


def reference_clipped_sum(model: MLP, x: jax.Array, y: jax.Array) -> MLP:
    """`jax.vmap(jax.grad(loss))`: every per-example gradient at once, then clipped
    to global L2 norm CLIP and summed."""
    grads = jax.vmap(jax.grad(loss), (None, 0, 0))(model, x, y)
    leaves = jax.tree.leaves(grads)
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=tuple(range(1, g.ndim))) for g in leaves))
    scale = CLIP / jnp.maximum(norms, CLIP)
    return jax.tree.map(
        lambda g: jnp.sum(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), grads
    )


def all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of the all-gathers in an optimised (per-device) HLO module."""
    shapes = []
    for line in hlo.splitlines():
        if re.search(r"\ball-gather(-start)?\(", line):
            for dims in re.findall(r"=\s*\(?\w+\[([\d,]*)\]", line):
                shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lot-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--method", choices=("ghost", "vmap"), default="ghost")
    args = parser.parse_args(argv)

    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes, 8 devices
    batch = NamedSharding(mesh, P("data"))
    x_all, y_all = synthetic_data(32 * args.lot_size)
    optimizer = optax.adam(1e-2)
    rng = np.random.default_rng(0)

    with jax.set_mesh(mesh):
        model = init(jax.random.key(0), mesh)
        layout = jax.tree.map(lambda p: p.sharding, model)
        opt_state = optimizer.init(model)
        step, clipped_sum = make_step(optimizer, args.batch_size, args.method)
        other = "vmap" if args.method == "ghost" else "ghost"
        _, other_sum = make_step(optimizer, args.batch_size, other)

        def lot() -> tuple[jax.Array, jax.Array]:
            """A fresh lot of examples, sharded over "data"."""
            idx = rng.choice(len(x_all), args.lot_size, replace=False)
            return jax.device_put(x_all[idx], batch), jax.device_put(y_all[idx], batch)

        x, y = lot()
        key = jax.random.key(1)
        compiled = step.lower(model, opt_state, x, y, key).compile()
        print(
            f"mesh {dict(mesh.shape)}, lot {args.lot_size} (x {x.shape} over "
            f"{x.sharding.spec}): {args.lot_size // mesh.shape['data']} examples per "
            f"data shard, in chunks of batch_size={args.batch_size}, "
            f"method={args.method!r}"
        )
        report = chunkvmap.ghost_report(loss, model, x_all[0], y_all[0])
        print("ghost_report:", str(report).splitlines()[-1])
        losses = []
        for s in range(args.steps):
            key, sub = jax.random.split(key)
            model, opt_state, mean_loss = compiled(model, opt_state, x, y, sub)
            losses.append(float(mean_loss))
            if s % 5 == 0 or s == args.steps - 1:
                print(f"step {s:3d}  loss {losses[-1]:.4f}")
            x, y = lot()

        # (a) The chunked, per-device clipped sum equals vmap + clip + sum, with
        # either method.
        total, count = clipped_sum(model, x, y)
        expected = jax.jit(reference_clipped_sum)(model, x, y)
        for a, b in zip(
            jax.tree.leaves(other_sum(model, x, y)[0]), jax.tree.leaves(total)
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (
                a.sharding,
                b.sharding,
            )
        error = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(total), jax.tree.leaves(expected))
        )
        assert int(count) == args.lot_size, count
        for a, b in zip(jax.tree.leaves(total), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (
                a.sharding,
                b.sharding,
            )

    # (b) The parameters kept their sharding (and the gradient sums have it too).
    for before, after in zip(jax.tree.leaves(layout), jax.tree.leaves(model)):
        assert after.sharding.is_equivalent_to(before, after.ndim), (after, before)
    for g, p in zip(jax.tree.leaves(total), jax.tree.leaves(model)):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p)

    # (c) No all-gather produces the global batch (x or y).
    gathers = all_gather_shapes(compiled.as_text())
    assert not {x.shape, y.shape} & set(gathers), gathers
    memory = compiled.memory_analysis().temp_size_in_bytes

    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
    print(f"max |clipped_grad_sum - vmap/grad/clip/sum| = {error:.2e}")
    print(f"parameter shardings kept: {[str(s.spec) for s in jax.tree.leaves(layout)]}")
    print(
        f"all-gathers in the step: {len(gathers)} ({sorted(set(gathers))}), none of "
        f"the global batch {x.shape}; step temp memory per device {memory / 1024:.1f} "
        f"KiB"
    )
    assert losses[-1] < 0.8 * losses[0], losses
    print("OK: data_parallel example passed")
    return {"first_loss": losses[0], "last_loss": losses[-1], "error": error}


if __name__ == "__main__":
    main()
