"""Model-family benchmark: chunkvmap against `jax.vmap` on the models users chunk.

Nine families, each one example's loss `loss(params, x, y)` and its model output:
an MLP; a CNN in NCHW/OIHW (lax's default, PyTorch's layout); the same CNN in
NHWC/HWIO; a 3-D CNN on volumes (NCDHW/OIDHW); an Equinox `eqx.nn.Conv2d` CNN;
a Flax linen `nn.Conv` CNN; a GPT-style LM block (attention, layer norms, an
MLP); a GRU run by `lax.scan`; a GroupNorm ResNet block with a depthwise
convolution (NCHW).

Each family is measured five ways, chunkvmap beside its reference in the same run:

* forward: `batch_vmap(model)` / `jax.vmap(model)`;
* the gradient of the summed loss through the chunk loop: `jax.grad` of
  `batch_vmap(loss).sum()` / the same through `jax.vmap`;
* `per_example_grads` / `jax.vmap(jax.grad(loss))`;
* `clipped_grad_sum` with `method="vmap"` and `method="ghost"` / the clipped sum
  written with `jax.vmap(jax.grad(loss))`, and / the non-private step (`jax.grad`
  of the summed loss through `jax.vmap`).

Times are medians of `--rounds` interleaved rounds (every program of a family in
each round, run back to back for at least 20 ms and averaged, after one untimed
call), so machine load shifts numerator and denominator alike. Memory is XLA's
compiled temporary memory (`memory_analysis()`), chunkvmap's / the reference's.
With `--quick`, tiny sizes and two rounds (a smoke run: the test suite runs it).

    python benchmarks/bench_families.py [--quick] [--out benchmarks/results/families.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


sys.path.insert(0, str(Path(__file__).parent))

from _common import clipped_sum, init_mlp, machine, mlp  # noqa: E402
from _dp_models import LM, lm_loss, lm_params  # noqa: E402

import chunkvmap as cv  # noqa: E402


def _normal(rng, *shape, fan):
    return jnp.asarray(rng.normal(size=shape) * fan**-0.5, jnp.float32)


def _xent(logits, y):
    return -jax.nn.log_softmax(logits)[y]


# --- the families: (params, model(params, x), loss(params, x, y), inputs, labels) ---


def mlp_family(rng, n, quick):
    d, h = (16, 8) if quick else (784, 512)
    params = init_mlp(jax.random.key(int(rng.integers(1 << 30))), [d, h, h, 10])
    return params, mlp, jnp.asarray(rng.normal(size=(n, d)), jnp.float32)


def _cnn(rng, n, quick, layout):
    chans, s = ((3, 4, 8), 8) if quick else ((3, 32, 64), 32)
    nchw = layout == "NCHW"
    dn = ("NCHW", "OIHW", "NCHW") if nchw else ("NHWC", "HWIO", "NHWC")
    p = {}
    for i, (a, b) in enumerate(zip(chans[:-1], chans[1:])):
        shape = (b, a, 3, 3) if nchw else (3, 3, a, b)
        p[f"conv{i}"] = _normal(rng, *shape, fan=9 * a)
        p[f"bias{i}"] = jnp.zeros(b)
    p["head"] = _normal(rng, chans[-1], 10, fan=chans[-1])

    def model(p, image):
        h = image[None]
        for i in range(len(chans) - 1):
            stride = (1, 1) if i == 0 else (2, 2)
            h = lax.conv_general_dilated(
                h, p[f"conv{i}"], stride, "SAME", dimension_numbers=dn
            )
            bias = p[f"bias{i}"]
            h = jax.nn.relu(h + (bias[:, None, None] if nchw else bias))
        pooled = h.mean((2, 3) if nchw else (1, 2))[0]
        return pooled @ p["head"]

    shape = (n, 3, s, s) if nchw else (n, s, s, 3)
    return p, model, jnp.asarray(rng.normal(size=shape), jnp.float32)


def cnn_nchw(rng, n, quick):
    return _cnn(rng, n, quick, "NCHW")


def cnn_nhwc(rng, n, quick):
    return _cnn(rng, n, quick, "NHWC")


def cnn3d(rng, n, quick):
    """A 3-D CNN on volumes, NCDHW/OIDHW: two channels to four (a kernel XLA:CPU
    runs faster on its own path, left as it is), then four to sixteen (laid out)."""
    chans, s = (2, 4, 16), (6 if quick else 12)
    dn = ("NCDHW", "OIDHW", "NCDHW")
    p = {}
    for i, (a, b) in enumerate(zip(chans[:-1], chans[1:])):
        p[f"conv{i}"] = _normal(rng, b, a, 3, 3, 3, fan=27 * a)
    p["head"] = _normal(rng, chans[-1], 10, fan=chans[-1])

    def model(p, volume):
        h = volume[None]
        for i in range(len(chans) - 1):
            h = lax.conv_general_dilated(
                h, p[f"conv{i}"], (1, 1, 1), "SAME", dimension_numbers=dn
            )
            h = jax.nn.relu(h)
        return h.mean((2, 3, 4))[0] @ p["head"]

    volumes = rng.normal(size=(n, chans[0], s, s, s))
    return p, model, jnp.asarray(volumes, jnp.float32)


def eqx_cnn(rng, n, quick):
    import equinox as eqx

    chans, s = ((3, 4, 8), 8) if quick else ((3, 32, 64), 32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    net = [
        eqx.nn.Conv2d(chans[0], chans[1], 3, padding=1, key=keys[0]),
        eqx.nn.Conv2d(chans[1], chans[2], 3, stride=2, padding=1, key=keys[1]),
        eqx.nn.Linear(chans[2], 10, key=keys[2]),
    ]
    params, static = eqx.partition(net, eqx.is_array)

    def model(p, image):
        c1, c2, head = eqx.combine(p, static)
        h = jax.nn.relu(c2(jax.nn.relu(c1(image))))
        return head(h.mean((1, 2)))

    return params, model, jnp.asarray(rng.normal(size=(n, 3, s, s)), jnp.float32)


def linen_cnn(rng, n, quick):
    import flax.linen as nn

    chans, s = ((4, 8), 8) if quick else ((32, 64), 32)

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(chans[0], (3, 3))(x))
            x = nn.relu(nn.Conv(chans[1], (3, 3), strides=2)(x))
            return nn.Dense(10)(x.mean((0, 1)))

    net = CNN()
    x = jnp.asarray(rng.normal(size=(n, s, s, 3)), jnp.float32)
    params = net.init(jax.random.key(0), x[0])
    return params, net.apply, x


def gpt_block(rng, n, quick):
    cfg = (
        dict(LM, vocab=64, width=16, positions=4, blocks=1, heads=2)
        if quick
        else dict(LM, vocab=512, width=128, positions=32, blocks=1, heads=4)
    )
    p = lm_params(rng, cfg)

    def model(p, tokens):  # the loss of next-token prediction is the model here
        return lm_loss(p, tokens, jnp.roll(tokens, -1), cfg["heads"])

    tokens = jnp.asarray(rng.integers(0, cfg["vocab"], (n, cfg["positions"])), "i4")
    return p, model, tokens


def gru(rng, n, quick):
    d, h, t = (4, 8, 5) if quick else (32, 128, 32)
    p = {
        "wx": _normal(rng, d, 3 * h, fan=d),
        "wh": _normal(rng, h, 3 * h, fan=h),
        "b": jnp.zeros(3 * h),
        "head": _normal(rng, h, 10, fan=h),
    }

    def model(p, seq):
        def step(state, x):
            zr = x @ p["wx"] + p["b"]
            hz = state @ p["wh"]
            z = jax.nn.sigmoid(zr[:h] + hz[:h])
            r = jax.nn.sigmoid(zr[h : 2 * h] + hz[h : 2 * h])
            cand = jnp.tanh(zr[2 * h :] + r * hz[2 * h :])
            state = (1 - z) * state + z * cand
            return state, None

        state, _ = lax.scan(step, jnp.zeros(h), seq)
        return state @ p["head"]

    return p, model, jnp.asarray(rng.normal(size=(n, t, d)), jnp.float32)


def groupnorm_resnet(rng, n, quick):
    c, s, groups = (8, 8, 2) if quick else (32, 32, 8)
    dn = ("NCHW", "OIHW", "NCHW")
    p = {
        "stem": _normal(rng, c, 3, 3, 3, fan=27),
        "dw": _normal(rng, c, 1, 3, 3, fan=9),
        "pw": _normal(rng, c, c, 1, 1, fan=c),
        "g1": jnp.ones(c),
        "g2": jnp.ones(c),
        "head": _normal(rng, c, 10, fan=c),
    }

    def group_norm(h, scale):
        g = h.reshape(groups, c // groups, *h.shape[1:])
        g = (g - g.mean((1, 2, 3), keepdims=True)) * lax.rsqrt(
            g.var((1, 2, 3), keepdims=True) + 1e-5
        )
        return g.reshape(h.shape) * scale[:, None, None]

    def conv(h, w, groups=1):
        return lax.conv_general_dilated(
            h[None], w, (1, 1), "SAME", dimension_numbers=dn,
            feature_group_count=groups,
        )[0]  # fmt: skip

    def model(p, image):
        h = jax.nn.relu(conv(image, p["stem"]))
        r = jax.nn.relu(group_norm(conv(h, p["dw"], groups=c), p["g1"]))
        r = group_norm(conv(r, p["pw"]), p["g2"])
        h = jax.nn.relu(h + r)
        return h.mean((1, 2)) @ p["head"]

    return p, model, jnp.asarray(rng.normal(size=(n, 3, s, s)), jnp.float32)


FAMILIES = {
    "MLP": mlp_family,
    "CNN, NCHW/OIHW": cnn_nchw,
    "CNN, NHWC/HWIO": cnn_nhwc,
    "3-D CNN, NCDHW/OIDHW": cnn3d,
    "Equinox Conv2d CNN": eqx_cnn,
    "Flax linen nn.Conv CNN": linen_cnn,
    "GPT-style LM block": gpt_block,
    "GRU by lax.scan": gru,
    "GroupNorm ResNet, NCHW, depthwise conv": groupnorm_resnet,
}


GHOST, VMAP = 'clipped_grad_sum, method="ghost"', 'clipped_grad_sum, method="vmap"'


def _loss_of(model):
    def loss(p, x, y):
        out = model(p, x)
        return out if out.ndim == 0 else _xent(out, y)

    return loss


def programs(model, batch: int, clip: float = 1.0) -> dict:
    """name -> (chunkvmap's function of (p, x, y), its reference's, and the same
    program as `lax.map` over the same chunks, or None)."""

    loss = _loss_of(model)
    v_loss = jax.vmap(loss, (None, 0, 0))
    c_loss = cv.batch_vmap(loss, (None, 0, 0), batch_size=batch)

    def vmap_clipped(p, x, y):
        return clipped_sum(loss, clip, (p, x, y))[0]

    def non_private(p, x, y):
        return jax.grad(lambda p: v_loss(p, x, y).sum())(p)

    def chunks(fn, x, y):  # `lax.map` over the same chunks: any chunk loop's cost
        return lax.map(lambda a: fn(*a), (x, y), batch_size=batch)

    return {
        "forward": (
            lambda p, x, y: cv.batch_vmap(model, (None, 0), batch_size=batch)(p, x),
            lambda p, x, y: jax.vmap(model, (None, 0))(p, x),
            lambda p, x, y: chunks(lambda x, y: model(p, x), x, y),
        ),
        "grad of the summed loss": (
            lambda p, x, y: jax.grad(lambda p: c_loss(p, x, y).sum())(p),
            non_private,
            lambda p, x, y: jax.grad(
                lambda p: chunks(lambda x, y: loss(p, x, y), x, y).sum()
            )(p),
        ),
        "per_example_grads": (
            cv.per_example_grads(loss, batch_size=batch),
            jax.vmap(jax.grad(loss), (None, 0, 0)),
            lambda p, x, y: chunks(lambda x, y: jax.grad(loss)(p, x, y), x, y),
        ),
        'clipped_grad_sum, method="vmap"': (
            cv.clipped_grad_sum(loss, clip, batch_size=batch, method="vmap"),
            vmap_clipped,
            None,
        ),
        'clipped_grad_sum, method="ghost"': (
            cv.clipped_grad_sum(loss, clip, batch_size=batch, method="ghost"),
            vmap_clipped,
            None,
        ),
    }


def _temp(fn, args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _close(a, b) -> bool:
    return all(
        np.allclose(x, y, rtol=2e-3, atol=2e-4 * (1 + float(jnp.max(jnp.abs(y)))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def measure(name, family, n, batch, rounds, quick, rng):
    p, model, x = family(rng, n, quick)
    y = jnp.asarray(rng.integers(0, 10, n), "i4")
    args = (p, x, y)
    progs = programs(model, batch)
    compiled, mem, said = {}, {}, []
    for what, (mine, ref, loop) in progs.items():
        for who, fn in (("cv", mine), ("ref", ref), ("loop", loop)):
            if fn is None:
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compiled[what, who] = jax.jit(fn)
                mem[what, who] = _temp(fn, args)
                out = jax.block_until_ready(compiled[what, who](*args))
            if what == GHOST:
                said += [
                    w.message for w in caught if w.category is cv.GhostFallbackWarning
                ]
            if who != "ref":
                ref_out = jax.block_until_ready(jax.jit(ref)(*args))
                if not _close(out, ref_out):
                    raise AssertionError(f"{name}, {what}: {who} != reference")
    step = jax.jit(progs["grad of the summed loss"][1])
    exes = [*compiled.items(), ("step", step)]
    # Each program runs back to back for at least 20 ms a round (its mean is the
    # round's time): a millisecond program timed once right after a large one
    # measures the caches, not the program.
    reps = {}
    for k, exe in exes:
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        reps[k] = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
    times = {k: [] for k, _ in exes}
    for _ in range(rounds):
        for k, exe in exes:
            jax.block_until_ready(exe(*args))
            t0 = time.perf_counter()
            for _ in range(reps[k]):
                out = exe(*args)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / reps[k])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for what in progs:
        dp = what.startswith("clipped")
        rows.append(
            (
                name, what, med[what, "cv"] * 1e3, med[what, "ref"] * 1e3,
                med[what, "cv"] / med[what, "ref"],
                med[what, "cv"] / med["step"] if dp else None,
                med[what, "cv"] / med[what, "loop"] if (what, "loop") in med else None,
                mem[what, "cv"] / 2**10,
                mem[what, "ref"] / 2**10,
            )
        )  # fmt: skip
    ex = jax.tree.map(lambda a: a[0], (x, y))
    report = cv.ghost_report(_loss_of(model), p, *ex)
    if report.runs == "vmap":
        verdict = "runs the vmap program"
    else:
        verdict = "ghost, warns: predicted slower" if report.slower else "ghost"
    assert bool(said) == (report.runs == "vmap" or report.slower), said
    ghost = (
        name,
        verdict,
        med[GHOST, "cv"] / med[VMAP, "cv"],
        mem[GHOST, "cv"] / mem[VMAP, "cv"],
        mem[GHOST, "cv"] / mem["grad of the summed loss", "cv"],
        (mem[GHOST, "cv"] - 1.5 * mem["grad of the summed loss", "cv"])
        / sum(a.nbytes for a in jax.tree.leaves(p)),
    )
    return rows, ghost


def ghost_table(rows) -> str:
    lines = [
        "",
        '## `method="ghost"` against `method="vmap"`, per family',
        "",
        "Time: the ghost row's median over the vmap row's, from the interleaved rounds "
        "above. Memory against the vmap program's, and against the non-private step "
        "on the same chunks (`jax.grad` of the summed loss through `batch_vmap`, the "
        "`grad of the summed loss` row); the last column is the memory above 1.5x "
        "the non-private step, in parameter copies (negative: under it). What "
        '`method="ghost"` chose (`ghost_report(...)`): the ghost program, the ghost '
        "program with a `GhostFallbackWarning` saying it is predicted slower (it runs "
        "for its memory), or the vmap program itself (also with the warning).",
        "",
        "| family | what runs | time / vmap | memory / vmap | memory / non-private "
        "| over 1.5x non-private (parameter copies) |",
        "|---|---|---|---|---|---|",
    ]
    for fam, verdict, t, m, np_, copies in rows:
        lines.append(
            f"| {fam} | {verdict} | {t:.2f} | {m:.2f} | {np_:.2f} | {copies:.1f} |"
        )
    return "\n".join(lines) + "\n"


def table(rows, n, batch, rounds) -> str:
    lines = [
        "# Model families: chunkvmap / `jax.vmap`",
        "",
        f"{machine()}.",
        f"N={n} examples in chunks of {batch}, under `jax.jit`; times are medians of "
        f"{rounds} interleaved rounds (each program run back to back for at least "
        "20 ms a round, after an untimed call).",
        "",
        "A ratio is chunkvmap's time divided by its reference's, measured in the same "
        "run: 1.00 is `jax.vmap`'s speed, below 1 faster. The reference of a "
        "`clipped_grad_sum` row is the clipped sum written with "
        "`jax.vmap(jax.grad(loss))`; its last time column divides by the non-private "
        "step (`jax.grad` of the summed loss through `jax.vmap`). Memory is XLA's "
        f"compiled temporary memory: chunks hold {batch} of the {n} examples at a "
        "time.",
        "",
        "The `/ lax.map` column divides by the same program written with "
        f"`lax.map(..., batch_size={batch})`, a loop over the same chunks: what any "
        "chunk loop costs on this machine (small chunks run smaller matrix products, "
        "and a gradient adds each chunk's parameter gradient into its sum).",
        "",
        "| family | program | chunkvmap (ms) | reference (ms) | / reference "
        "| / non-private step | / lax.map | memory (KiB) | reference memory (KiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam, what, mine, ref, ratio, step, loop, mem, ref_mem in rows:
        step_s = "" if step is None else f"{step:.2f}"
        loop_s = "" if loop is None else f"{loop:.2f}"
        lines.append(
            f"| {fam} | {what} | {mine:.1f} | {ref:.1f} | {ratio:.2f} | {step_s} "
            f"| {loop_s} | {mem:.0f} | {ref_mem:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--only", help="run the families whose name contains this")
    args = ap.parse_args(argv)
    n, batch = (12, 5) if args.quick else (64, 16)
    rounds = args.rounds or (2 if args.quick else 7)
    rng = np.random.default_rng(0)
    rows, ghosts = [], []
    for name, family in FAMILIES.items():
        if args.only and args.only.lower() not in name.lower():
            continue
        more, ghost = measure(name, family, n, batch, rounds, args.quick, rng)
        rows += more
        ghosts.append(ghost)
        lines = table(rows[-5:], n, batch, rounds).splitlines()[-5:]
        print("\n".join(lines), ghost_table([ghost]).splitlines()[-1], flush=True)
    text = table(rows, n, batch, rounds) + ghost_table(ghosts)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
