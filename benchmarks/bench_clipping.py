"""Clipping benchmark: `chunkvmap.clipped_grad` (per-example and ghost) vs jax-privacy.

Three tables, every number of one table measured in the same run:
  (a) `chunkvmap.clipped_grad` (`method="vmap"` and `method="ghost"`) vs
      `jax_privacy.clipping.clipped_grad` at the same microbatch size, on an MLP
      (cross-entropy loss). jax-privacy needs N divisible by its microbatch size; its
      rows say "n/a" otherwise.
  (b) ghost clipping vs per-example clipping (`method="vmap"`) vs the
      non-private `jax.grad` of the mean loss, on the MLP and on a transformer block
      (multi-head attention, layer norms, an MLP, the embedding tied to the output).
  (c) the models DP is trained on, written the ordinary way (`_dp_models.py`: a
      GPT-style LM with gathered embeddings, untied, tied and with a scanned,
      rematerialised block stack; a CIFAR-style convnet): `clipped_grad_sum`'s
      ghost vs `method="vmap"` vs the non-private step vs jax-privacy, with the
      share of the parameters each ghost rule covers (`ghost_report`).

Each method is compiled once (XLA's compiled temp memory, `memory_analysis()`), run
once to warm up, then timed: the best of `--repeats` runs (the machine may be shared;
the best run is the least disturbed). With `--quick`, a tiny MLP only (seconds: the
compiles are its time; `--with-block` adds a tiny transformer block).

    python benchmarks/bench_clipping.py [--quick] [--out benchmarks/results/clipping.md]

The default sizes (MLP 256-256-256-10; block T=16, d=32; table (c) at N=64, chunks of
16) take ~5 minutes on a 2-core CPU. The larger MLP 784-512-512-10 (`--layers 784 512
512 10`) takes far longer: there `method="vmap"` at N=1024, chunks of 64, measured
36.6 s a run (jax-privacy: 4.0 s; N=1000: 4.7 s), because of `nan_safe=True` (the
default) at that size: 8.5 s with `nan_safe=False`, 8.1 s for `clipped_grad_sum`.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine
from _dp_models import models as dp_models

import chunkvmap


try:
    from jax_privacy import clipping as jax_privacy_clipping
except ImportError:  # jax-privacy is optional for this script
    jax_privacy_clipping = None


# -- models -------------------------------------------------------------------------


def mlp_params(rng, sizes):
    return [
        (
            jnp.asarray(rng.normal(size=(a, b)) / a**0.5, jnp.float32),
            jnp.zeros(b, jnp.float32),
        )
        for a, b in zip(sizes[:-1], sizes[1:])
    ]


def mlp_loss(params, x, y):
    """Cross-entropy of a ReLU MLP on the examples of `x` (a batch, or one example
    with a leading axis of size 1)."""
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    logp = jax.nn.log_softmax(x @ w + b)
    return -jnp.sum(jnp.take_along_axis(logp, y[..., None], -1))


def block_params(rng, t, d, heads, vocab):
    def n(*shape):
        return jnp.asarray(rng.normal(size=shape) / shape[0] ** 0.5, jnp.float32)

    return {
        "embed": n(vocab, d),  # gather + tied output layer: per-example gradients
        "pos": 0.1 * n(t, d),
        "qkv": n(d, 3 * d),
        "out": n(d, d),
        "up": n(d, 4 * d),
        "up_b": jnp.zeros(4 * d),
        "down": n(4 * d, d),
        "ln1": jnp.ones(d),
        "ln2": jnp.ones(d),
    }


def layer_norm(x, scale):
    x = x - jnp.mean(x, -1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-5) * scale


def block_loss(p, tokens, targets, heads):
    """Next-token cross-entropy of one pre-norm transformer block, summed over the
    examples of `tokens` (batch, positions)."""
    h = p["embed"][tokens] + p["pos"]
    b, t, d = h.shape
    x = layer_norm(h, p["ln1"])
    q, k, v = jnp.split((x @ p["qkv"]).reshape(b, t, 3 * heads, d // heads), 3, 2)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / (d // heads) ** 0.5
    att = jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)
    o = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d)
    h = h + o @ p["out"]
    x = layer_norm(h, p["ln2"])
    h = h + jax.nn.gelu(x @ p["up"] + p["up_b"]) @ p["down"]
    logp = jax.nn.log_softmax(h @ p["embed"].T)  # tied output layer
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1))


# -- methods ------------------------------------------------------------------------


def methods(loss, n, mb, with_jax_privacy):
    """name -> function of (params, batch) returning the gradient (sum or mean),
    or a string saying why the method cannot run this configuration."""

    def fun(p, b):  # jax-privacy's form: the examples in one argument
        return loss(p, *b)

    def private(**kw):
        return chunkvmap.clipped_grad(
            fun, l2_clip_norm=1.0, batch_argnums=1, microbatch_size=mb, **kw
        )

    out = {
        "chunkvmap vmap": private(),
        "chunkvmap ghost": private(method="ghost"),
    }
    if with_jax_privacy:
        if jax_privacy_clipping is None:
            out["jax-privacy"] = "n/a (not installed)"
        elif n % mb:
            out["jax-privacy"] = f"n/a ({n} % {mb} != 0)"
        else:
            out["jax-privacy"] = jax_privacy_clipping.clipped_grad(
                fun,
                l2_clip_norm=1.0,
                batch_argnums=1,
                microbatch_size=mb,
            )
    return out


def nonprivate(loss):
    """The non-private gradient of the mean loss (the whole batch at once)."""
    return jax.grad(lambda p, b: loss(p, *b) / b[0].shape[0])


def measure(fn, args, repeats):
    """(compiled temp bytes, best run seconds, result)."""
    with warnings.catch_warnings():  # jax-privacy calls deprecated optax functions
        warnings.simplefilter("ignore", DeprecationWarning)
        exe = jax.jit(fn).lower(*args).compile()
        temp = exe.memory_analysis().temp_size_in_bytes
        result = jax.block_until_ready(exe(*args))  # the warm-up run
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            best = min(best, time.perf_counter() - t0)
    return temp, best, result


def rel_err(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
        for x, y in zip(la, lb)
    )


# -- main ---------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny MLP (seconds)")
    parser.add_argument(
        "--with-block", action="store_true", help="with --quick: the block too"
    )
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--microbatches", type=int, nargs="+")
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument(
        "--block",
        type=int,
        nargs=4,
        metavar=("T", "D", "HEADS", "VOCAB"),
        help="the transformer block's sequence length, width, heads, vocabulary",
    )
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--dp-models", type=int, nargs=2, metavar=("N", "B"),
        help="table (c): examples and chunk size (default 64 16; --quick 8 4)",
    )  # fmt: skip
    parser.add_argument(
        "--only-dp-models", action="store_true", help="run table (c) alone"
    )
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    if args.quick:
        defaults = dict(
            sizes=[16], microbatches=[8], layers=[16, 32, 32, 4],
            block=[4, 8, 2, 16], repeats=1, dp_models=[8, 4],
        )  # fmt: skip
    else:
        defaults = dict(
            sizes=[1000, 1024, 4096], microbatches=[64, 256],
            layers=[256, 256, 256, 10], block=[16, 32, 4, 128], repeats=2,
            dp_models=[64, 16],
        )  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    t, d, heads, vocab = args.block
    rng = np.random.default_rng(0)
    lines: list[str] = []

    def emit(line=""):
        lines.append(line)
        print(line, flush=True)

    mlp = mlp_params(rng, args.layers)
    block = block_params(rng, t, d, heads, vocab)
    models = {
        f"MLP {'-'.join(map(str, args.layers))}": (mlp, mlp_loss, "mlp"),
        f"transformer block T={t} d={d} heads={heads} vocab={vocab}": (
            block,
            lambda p, tokens, targets: block_loss(p, tokens, targets, heads),
            "block",
        ),
    }
    if args.quick and not args.with_block:  # its three compiles double --quick's time
        del models[next(reversed(models))]
    if args.only_dp_models:
        models = {}

    def batch(kind, n):
        if kind == "mlp":
            x = jnp.asarray(rng.normal(size=(n, args.layers[0])), jnp.float32)
            return x, jnp.asarray(rng.integers(0, args.layers[-1], n), jnp.int32)
        tokens = jnp.asarray(rng.integers(0, vocab, (n, t)), jnp.int32)
        return tokens, jnp.roll(tokens, -1, 1)

    results = {}  # (model, n, mb, method) -> (temp, seconds, rel err) or str
    t_start = time.perf_counter()
    for model, (params, loss, kind) in models.items():
        for n in args.sizes:
            if kind == "block" and n % min(args.microbatches) and not args.quick:
                continue  # table (b) has N = 1024 and 4096 only
            data = batch(kind, n)
            call = (params, data)
            ref_temp, ref_s, ref = measure(nonprivate(loss), call, args.repeats)
            results[(model, n, None, "non-private jax.grad")] = (ref_temp, ref_s, None)
            for mb in args.microbatches:
                ms = methods(loss, n, mb, with_jax_privacy=kind == "mlp")
                base = None
                for name, fn in ms.items():
                    if isinstance(fn, str):
                        results[(model, n, mb, name)] = fn
                        continue
                    temp, s, out = measure(fn, call, args.repeats)
                    print(f"  {model}, N={n}, B={mb}, {name}: {s * 1e3:.1f} ms, "
                          f"{temp / 2**20:.2f} MiB", file=sys.stderr)  # fmt: skip
                    base = out if base is None else base
                    results[(model, n, mb, name)] = (temp, s, rel_err(out, base))
    dp_rows = dp_models_table(args.dp_models, args.repeats, args.quick)
    elapsed = time.perf_counter() - t_start
    argv, command = sys.argv[1:], []
    while argv:  # the command line, without --out
        if argv[0] == "--out" or argv[0].startswith("--out="):
            argv = argv[2:] if argv[0] == "--out" else argv[1:]
        else:
            command.append(argv.pop(0))
    command = " ".join(command)

    emit("# Clipped per-example gradients: chunkvmap, ghost clipping, jax-privacy")
    emit()
    emit(
        f"{machine()}. `python benchmarks/bench_clipping.py {command}` "
        f"({elapsed:.0f} s). Time: best of "
        f"{args.repeats} runs after a warm-up run, each method compiled once; "
        "memory: XLA's compiled temp bytes. Gradients of `l2_clip_norm=1` clipped "
        "sums; the non-private reference is `jax.grad` of the mean loss over the "
        "whole batch. 'max rel err' compares each method's gradient with "
        'chunkvmap\'s `method="vmap"` (largest abs difference / largest abs entry, '
        "per leaf)."
    )

    if not models:
        emit_dp_models(emit, dp_rows, args.dp_models)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
        return
    mlp_name = next(iter(models))
    emit()
    emit(f"## (a) chunkvmap.clipped_grad vs jax_privacy.clipping.clipped_grad: "
         f"{mlp_name}")  # fmt: skip
    emit()
    emit("| N | microbatch | method | time ms | time / jax-privacy | temp MiB "
         "| temp / jax-privacy | max rel err |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        for mb in args.microbatches:
            jp = results[(mlp_name, n, mb, "jax-privacy")]
            for name in ("jax-privacy", "chunkvmap vmap", "chunkvmap ghost"):
                r = results[(mlp_name, n, mb, name)]
                if isinstance(r, str):
                    emit(f"| {n} | {mb} | {name} | {r} | | | | |")
                    continue
                temp, s, err = r
                if isinstance(jp, str):
                    rt = rm = "n/a"
                else:
                    rt, rm = f"{s / jp[1]:.2f}", f"{temp / max(jp[0], 1):.3f}"
                emit(f"| {n} | {mb} | {name} | {s * 1e3:.1f} | {rt} | "
                     f"{temp / 2**20:.2f} | {rm} | {err:.1e} |")  # fmt: skip

    emit()
    emit("## (b) ghost clipping vs per-example clipping vs non-private training")
    emit()
    emit("| model | N | microbatch | method | time ms | time / non-private "
         "| time / vmap | temp MiB | temp / non-private | temp / vmap |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for n in args.sizes:
            if (model, n, None, "non-private jax.grad") not in results:
                continue
            if n % min(args.microbatches) and not args.quick:
                continue
            ref_temp, ref_s, _ = results[(model, n, None, "non-private jax.grad")]
            emit(f"| {model} | {n} | whole batch | non-private jax.grad | "
                 f"{ref_s * 1e3:.1f} | 1.00 | | {ref_temp / 2**20:.2f} "
                 "| 1.00 | |")  # fmt: skip
            for mb in args.microbatches:
                vm_temp, vm_s, _ = results[(model, n, mb, "chunkvmap vmap")]
                for name, label in (
                    ("chunkvmap vmap", 'method="vmap"'),
                    ("chunkvmap ghost", 'method="ghost"'),
                ):
                    temp, s, _ = results[(model, n, mb, name)]
                    emit(f"| {model} | {n} | {mb} | {label} | {s * 1e3:.1f} | "
                         f"{s / ref_s:.2f} | {s / vm_s:.3f} | {temp / 2**20:.2f} | "
                         f"{temp / max(ref_temp, 1):.3f} | "
                         f"{temp / max(vm_temp, 1):.4f} |")  # fmt: skip
    emit_dp_models(emit, dp_rows, args.dp_models)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


def dp_models_table(sizes, repeats, quick):
    """Table (c): per model, (name, shares, {method: (temp, seconds, rel err)})."""
    n, mb = sizes
    rng = np.random.default_rng(1)
    rows = []
    chosen = dp_models(quick)
    if quick:  # one model: its four compiles are --quick's time
        chosen = dict([next(iter(chosen.items()))])
    for name, (make_params, loss, make_batch) in chosen.items():
        params, data = make_params(rng), make_batch(rng, n)
        report = chunkvmap.ghost_report(loss, params, *(d[0] for d in data))
        shares = report.shares()
        results = {}
        ref_temp, ref_s, _ = measure(
            jax.grad(lambda p, *d: jnp.mean(jax.vmap(loss, (None, 0, 0))(p, *d))),
            (params, *data),
            repeats,
        )
        results["non-private jax.grad"] = (ref_temp, ref_s, None)
        base = None
        for method in ("vmap", "ghost"):
            fn = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=mb, method=method)
            temp, s, out = measure(fn, (params, *data), repeats)
            base = out[0] if base is None else base
            results[f'method="{method}"'] = (temp, s, rel_err(out[0], base))
            print(f"  {name}: {method} {s * 1e3:.1f} ms, {temp / 2**20:.2f} MiB",
                  file=sys.stderr)  # fmt: skip
        if jax_privacy_clipping is None:
            results["jax-privacy"] = "n/a (not installed)"
        elif n % mb:
            results["jax-privacy"] = f"n/a ({n} % {mb} != 0)"
        else:
            fn = jax_privacy_clipping.clipped_grad(
                lambda p, b: loss(p, b[0][0], b[1][0]),
                l2_clip_norm=1.0,
                batch_argnums=1,
                microbatch_size=mb,
            )
            temp, s, out = measure(fn, (params, data), repeats)
            results["jax-privacy"] = (temp, s, rel_err(out, base))
        rows.append((name, shares, results))
    return rows


def emit_dp_models(emit, rows, sizes):
    n, mb = sizes
    emit()
    emit(f"## (c) The models DP is trained on: ghost vs per-example vs non-private "
         f"(N={n}, chunks of {mb})")  # fmt: skip
    emit()
    emit("`clipped_grad_sum(loss, 1.0, batch_size=B, method=...)`; jax-privacy's "
         "`clipped_grad` at the same microbatch size. Ghost rules: the share of the "
         "parameters under each rule (`ghost_report(...).shares()`).")  # fmt: skip
    emit()
    emit("| model | method | time ms | time / vmap | time / non-private | temp MiB "
         "| temp / vmap | temp / non-private | max rel err |")  # fmt: skip
    emit("|---|---|---|---|---|---|---|---|---|")
    for name, shares, results in rows:
        ref_temp, ref_s, _ = results["non-private jax.grad"]
        vm_temp, vm_s, _ = results['method="vmap"']
        for method, r in results.items():
            if isinstance(r, str):
                emit(f"| {name} | {method} | {r} | | | | | | |")
                continue
            temp, s, err = r
            emit(f"| {name} | {method} | {s * 1e3:.1f} | {s / vm_s:.2f} | "
                 f"{s / ref_s:.2f} | {temp / 2**20:.2f} | "
                 f"{temp / max(vm_temp, 1):.2f} | "
                 f"{temp / max(ref_temp, 1):.2f} | "
                 f"{'' if err is None else f'{err:.1e}'} |")  # fmt: skip
    emit()
    emit("| model | ghost | instantiated | per-example | by use |")
    emit("|---|---|---|---|---|")
    for name, shares, _ in rows:
        kinds = ", ".join(
            f"{k[5:]} {100 * v:.1f}%" for k, v in sorted(shares.items())
            if k.startswith("kind:")
        )  # fmt: skip
        emit(f"| {name} | {100 * shares.get('ghost', 0):.1f}% | "
             f"{100 * shares.get('instantiated', 0):.1f}% | "
             f"{100 * shares.get('per-example', 0):.1f}% | {kinds} |")  # fmt: skip


if __name__ == "__main__":
    main()
