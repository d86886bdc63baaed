"""What an eager call costs: chunkvmap called outside `jax.jit`, against its
reference called eagerly (`jax.vmap`, `eqx.filter_vmap`, or `method="vmap"` for
ghost clipping) and against the same chunkvmap transform under `jax.jit` (the
compiled program alone, no trace: what a call inside the user's own `jax.jit`
costs).

An eager chunkvmap call traces its program on every call (so that it sees the
function's closure as it is now, as `jax.vmap` does) and reuses the compiled
program when the traced program is the same; the closed-over arrays are its
arguments. Each row checks the result against its reference, then reports the
median time per call over interleaved rounds (chunkvmap eager, the reference, the
jitted transform, back to back, so that the machine's load shifts all three
alike). Rows with a target say how far eager chunkvmap may be from its reference.

    python benchmarks/bench_eager.py --out benchmarks/results/eager.md

The chunkvmap measured is the one in the folder above this script's (`_common`
puts it first on the path; `PYTHONPATH` does not override it): to measure another
checkout, copy this script and `_common.py` into a folder of that checkout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, str(Path(__file__).parent))
from _common import init_mlp, machine, mlp  # noqa: E402

from chunkvmap import batch_vmap, clipped_grad_sum, per_example_grads  # noqa: E402


def _xent(p, x, y):
    return -jax.nn.log_softmax(mlp(p, x))[y]


def _relu_xent(p, x, y):
    return -jax.nn.log_softmax(mlp(p, x, jax.nn.relu))[y]


def cases(quick: bool):
    """(name, chunkvmap's function, its reference, inputs, target ratio or None)."""
    n = 64 if quick else 256
    params = init_mlp(jax.random.key(0), [64, 256, 256, 10])
    x = jax.random.normal(jax.random.key(1), (n, 64))
    y = jnp.arange(n) % 10
    teacher = {"params": params}  # a closure the calls read, as a distillation's

    def loss(p, x, y):
        logits = mlp(p, x)
        soft = jax.nn.softmax(mlp(teacher["params"], x))
        return -jax.nn.log_softmax(logits)[y] + jnp.sum(soft * logits) * 0.0

    yield (
        "elementwise (sin, 16 features)",
        batch_vmap(lambda v: jnp.sin(v) * 2.0, batch_size=64),
        jax.vmap(lambda v: jnp.sin(v) * 2.0),
        (x[:, :16],),
        None,
    )
    for size in (n, 4):
        yield (
            f"batch_vmap, MLP 64-256-256-10 forward, N={size}",
            batch_vmap(mlp, (None, 0), batch_size=64),
            jax.vmap(mlp, (None, 0)),
            (params, x[:size]),
            2.0,
        )
    yield from _ensemble(quick)
    yield (
        "per_example_grads, MLP with a closed-over teacher",
        per_example_grads(loss, batch_size=64),
        jax.vmap(jax.grad(loss), (None, 0, 0)),
        (params, x, y),
        None,
    )
    yield (
        "per_example_grads built anew at every call (as written inside a loop)",
        lambda *a: per_example_grads(loss, batch_size=64)(*a),
        jax.vmap(jax.grad(loss), (None, 0, 0)),
        (params, x, y),
        2.0,
    )
    ghost = clipped_grad_sum(_xent, 1.0, batch_size=64, method="ghost")
    vmap = clipped_grad_sum(_xent, 1.0, batch_size=64, method="vmap")
    yield (
        'clipped_grad_sum, method="ghost" (reference: method="vmap"), MLP',
        ghost,
        vmap,
        (params, x, y),
        1.5,
    )
    yield (
        'clipped_grad_sum, method="ghost" built anew at every call (reference: '
        'method="vmap" held), MLP',
        lambda *a: clipped_grad_sum(_xent, 1.0, batch_size=64, method="ghost")(*a),
        vmap,
        (params, x, y),
        1.5,
    )
    deep = init_mlp(jax.random.key(2), [64] + [64] * (4 if quick else 30) + [10])
    for loss, kind in ((_xent, ""), (_relu_xent, " ReLU")):
        yield (
            f'clipped_grad_sum, method="ghost" (reference: method="vmap"), '
            f"{len(deep)}-layer{kind} MLP"
            + (" (a custom JVP rule per layer)" if kind else ""),
            clipped_grad_sum(loss, 1.0, batch_size=64, method="ghost"),
            clipped_grad_sum(loss, 1.0, batch_size=64, method="vmap"),
            (deep, x, y),
            1.5,
        )


def _ensemble(quick: bool):
    try:
        import equinox as eqx

        from chunkvmap.eqx import filter_batch_vmap
    except ImportError:
        return
    members = 4 if quick else 16
    keys = jax.random.split(jax.random.key(3), members)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.MLP(64, 10, 256, 2, key=k))(keys)
    x = jax.random.normal(jax.random.key(4), (64,))

    def apply(model, v):
        return model(v)

    spec = (eqx.if_array(0), None)
    yield (
        f"filter_batch_vmap, {members}-member Equinox MLP ensemble "
        "(reference: eqx.filter_vmap)",
        filter_batch_vmap(apply, in_axes=spec, batch_size=4),
        eqx.filter_vmap(apply, in_axes=spec),
        (ensemble, x),
        2.0,
    )


def interleaved(fns, args, repeats):
    """Median time per call of each function, over interleaved rounds (two
    untimed calls each first)."""
    for fn in fns:
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _jitted(fn):
    """`fn` under `jax.jit`, Equinox modules among its arguments (their functions
    static) when Equinox is installed."""
    try:
        import equinox as eqx
    except ImportError:
        return jax.jit(fn)
    return eqx.filter_jit(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    rows = []
    for name, chunked, reference, inputs, target in cases(args.quick):
        want, got = reference(*inputs), chunked(*inputs)
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
        assert err < 1e-4, (name, err)
        fns = (chunked, reference, _jitted(chunked))
        t_eager, t_ref, t_jit = interleaved(fns, inputs, args.repeats)
        rows.append((name, t_ref, t_eager, t_jit, err, target))
        print(name, f"{t_eager / t_ref:.2f}x", flush=True)
    lines = [
        "# Eager calls: chunkvmap outside jax.jit",
        "",
        f"Machine: {machine()}. Median of {args.repeats} interleaved calls after two "
        "warm-ups, chunks of 64 (4 ensemble members). `eager`: the chunkvmap "
        "transform called outside `jax.jit` (it traces its program every call, so a "
        "changed closure is seen, and reuses the compiled program; a transform "
        "built anew at every call reuses the program of an earlier one that "
        "computes the same); `jit`: the same "
        "transform under `jax.jit` (the compiled program alone, no trace); the "
        "reference is called eagerly.",
        "",
        "| function | reference eager ms | chunkvmap eager ms | chunkvmap under jit ms "
        "| eager / reference | target | max rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t_ref, t_eager, t_jit, err, target in rows:
        goal = "" if target is None else f"<= {target:.1f}x"
        lines.append(
            f"| {name} | {t_ref * 1e3:.2f} | {t_eager * 1e3:.2f} | {t_jit * 1e3:.2f} "
            f"| {t_eager / t_ref:.2f}x | {goal} | {err:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
