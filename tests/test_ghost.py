"""`method="ghost"` of `clipped_grad` / `clipped_grad_sum` against `method="vmap"`
(and a hand-written `jax.vmap(jax.grad)` reference), `ghost_report`'s rules, and the
memory it saves. https://github.com/ (issue 14)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap
from chunkvmap import clipped_grad, clipped_grad_sum, ghost_report

from .helpers import temp_bytes, tree_allclose


# Test data from NumPy: eager jax.random compiles one kernel per shape, which is most
# of a small test's time on CPU.
def normal(seed, *shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, "f4")


def integers(seed, high, *shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), "i4")


def filled(tree, seed):
    """`tree` (from `jax.eval_shape`) with random floats (scaled by 1/sqrt(fan-in))
    in place of its ShapeDtypeStructs: a model initialised without running its
    initialisers op by op."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, jax.ShapeDtypeStruct):
            fan = x.shape[0] if x.shape else 1
            x = normal(1000 * seed + i, *x.shape, scale=fan**-0.5).astype(x.dtype)
        out.append(x)
    return treedef.unflatten(out)


# -- models ----------------------------------------------------------------------------


def mlp_params(sizes=(5, 8, 3), seed=0):
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = normal(10 * seed + i, a, b, scale=a**-0.5)
        p[f"b{i}"] = 0.1 * jnp.ones(b)
    return p


def mlp_loss(p, x, y):
    n = len(p) // 2
    h = x
    for i in range(n):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        h = jax.nn.relu(h) if i < n - 1 else h
    return jnp.sum((h - y) ** 2)


T, D, V = 4, 6, 5


def seq_params():
    return {
        "E": normal(1, V, D),  # gather + tied output layer
        "wide": normal(2, D, 3 * D, scale=1 / 3),  # T^2 = 16 <= 108: ghost
        "small": normal(3, 3 * D, 2, scale=1 / 3),  # 16 > 36? no: ghost
        "tiny": normal(4, 2, 2),  # T^2 = 16 > 4: instantiated
        "tied": normal(5, D, D, scale=1 / 2),  # x @ W and h @ W.T
        "scale": jnp.ones(D),  # elementwise: per-example
    }


def seq_loss(p, tokens, target):
    h = p["E"][tokens] * p["scale"][None]  # (T, D)
    h = jnp.tanh(jnp.einsum("td,de->te", h, p["tied"]))
    h = h + jnp.tanh(h @ p["tied"].T)
    u = jax.nn.gelu(jnp.dot(h, p["wide"]))
    z = jnp.tanh(u @ p["small"]) @ p["tiny"]
    logits = h @ p["E"].T  # tied embedding as output layer
    return jnp.mean(jax.nn.log_softmax(logits)[:, target]) + jnp.sum(z**2)


def seq_batch(n, seed=2):
    return integers(seed, V, n, T), integers(seed + 1, V, n)


# -- exactness -------------------------------------------------------------------------


def test_mlp_against_hand_written_reference():
    """jax.vmap(jax.grad) + clip + sum by hand, N = 9, chunks of 4 (not a divisor),
    under jax.jit."""
    p = mlp_params()
    x, y = normal(30, 9, 5), normal(31, 9, 3)
    grads = jax.jit(jax.vmap(jax.grad(mlp_loss), (None, 0, 0)))(p, x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(9, -1) ** 2, 1) for g in grads.values()))
    factor = jnp.minimum(1.0, 0.5 / norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(factor, g, 1), grads)
    total, count, got_norms = jax.jit(
        clipped_grad_sum(mlp_loss, 0.5, batch_size=4, return_norms=True, method="ghost")
    )(p, x, y)
    tree_allclose((total, got_norms), (expected, norms), rtol=1e-5, atol=1e-6)
    assert int(count) == 9


def test_report_rules():
    tokens, target = seq_batch(1)
    report = ghost_report(seq_loss, seq_params(), tokens[0], target[0])
    assert report.as_dict() == {
        "args[0]['E']": "per-example",  # gather
        "args[0]['scale']": "per-example",  # elementwise
        "args[0]['small']": "ghost",
        "args[0]['tiny']": "instantiated",
        "args[0]['tied']": "instantiated",  # 2 uses, 8 positions: 64 > 36
        "args[0]['wide']": "ghost",
    }
    assert "gather" in str(report) and "T^2" in str(report)
    # dense-only leaves are ghost; a dot with a parameter-only operand falls back
    report = ghost_report(
        lambda p, x: jnp.sum((x @ p["a"]) @ (p["b"] @ p["c"])),
        {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 2))},
        jnp.ones(3),
    )
    assert report.rule("args[0]['a']") == "ghost"
    assert report.rule("args[0]['b']") == "per-example"
    assert "does not depend on the example" in str(report)


# One example's loss summed over five small models of the families in issue 14, so
# that they share one compile of each method (these compiles are the test's time).
TT, DD, VV, HH = 5, 8, 8, 2  # positions, width, vocabulary, heads


def layer_norm(x, scale):
    x = x - jnp.mean(x, -1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-5) * scale


def block_params(seed=6):
    def n(i, shape, fan):
        return normal(10 * seed + i, *shape, scale=fan**-0.5)

    return {
        "E": n(0, (VV, DD), 1),  # embedding by gather, tied to the output: per-example
        "pos": n(1, (TT, DD), 10),
        "qkv": n(2, (DD, 3 * DD), DD),  # reshaped output: ghost
        "o": n(3, (HH, DD // HH, DD), DD),  # a dot with a batch axis (heads): ghost
        "w1": n(4, (DD, 2 * DD), DD),  # tied MLP: h @ w1, then @ w1.T: 2 uses, ghost
        "b1": jnp.zeros(2 * DD),
        "proj": n(5, (DD, 2), DD),  # T^2 = 25 > size 16: instantiated
        "ln1": jnp.ones(DD),
        "ln2": jnp.ones(DD),
    }


def block_loss(p, tok, tgt):
    """A pre-norm transformer block: multi-head attention, an MLP, layer norms."""
    h = p["E"][tok] + p["pos"]
    x = layer_norm(h, p["ln1"][None])
    q, k, v = jnp.split((x @ p["qkv"]).reshape(TT, 3 * HH, DD // HH), 3, axis=1)
    att = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k) / 2.0, -1)
    o = jnp.einsum("hts,shd->hsd", att, v)  # (heads, positions, head width)
    h = h + jnp.einsum("htk,hkd->htd", o, p["o"]).sum(0)
    x = layer_norm(h, p["ln2"][None])
    h = h + jax.nn.gelu(x @ p["w1"] + p["b1"][None]) @ p["w1"].T
    logp = jax.nn.log_softmax(h @ p["E"].T)
    aside = jnp.sum(jnp.tanh(h @ p["proj"]) ** 2)
    return aside - jnp.mean(jnp.take_along_axis(logp, tgt[:, None], 1))


def conv_loss(p, img, label):
    """A CNN: convolution kernels fall back to per-example gradients."""
    h = jax.lax.conv_general_dilated(
        img[None], p["c"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.tanh(h + p["cb"][None, None, None]).reshape(-1)
    return -jax.nn.log_softmax(h @ p["w"])[label]


def families():
    """Parameters and a per-example loss with aux: the block above, a CNN, Equinox
    (`eqx.nn.MLP` + `eqx.nn.MultiheadAttention`), linen (`nn.Dense`, `nn.LayerNorm`,
    `nn.Embed` with `attend`) and NNX (`nnx.Linear` through `nnx.split`/`merge`)."""
    eqx = pytest.importorskip("equinox")
    nn = pytest.importorskip("flax.linen")
    from flax import nnx

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, tok):
            embed = nn.Embed(VV, DD)
            h = embed(tok)
            x = nn.LayerNorm()(h)
            h = h + nn.Dense(DD)(nn.gelu(nn.Dense(2 * DD)(x)))
            return embed.attend(nn.LayerNorm()(h))

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(DD, DD, rngs=rngs)
            self.l2 = nnx.Linear(DD, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    linen = Linen()
    nnx_def, nnx_state = nnx.split(nnx.eval_shape(lambda: Nnx(nnx.Rngs(0))))
    key = jax.random.key(0)
    params = {
        "block": block_params(),
        "conv": {
            "c": normal(70, 3, 3, 1, 4, scale=1 / 3),
            "cb": jnp.zeros(4),
            "w": normal(71, 4 * 6 * 6, 3, scale=1 / 12),
        },
        "eqx": filled(
            (
                eqx.filter_eval_shape(eqx.nn.MultiheadAttention, HH, DD, key=key),
                eqx.filter_eval_shape(eqx.nn.MLP, DD, 3, 12, depth=2, key=key),
            ),
            72,
        ),
        "linen": filled(jax.eval_shape(linen.init, key, jnp.zeros(TT, "i4")), 73),
        "nnx": filled(nnx_state, 74),
    }

    def loss(p, ex):
        att, mlp = p["eqx"]
        h = ex["x"] + att(ex["x"], ex["x"], ex["x"])
        logp = jax.nn.log_softmax(linen.apply(p["linen"], ex["tok"]))
        nnx_out = nnx.merge(nnx_def, p["nnx"])(ex["x"][0])
        return (
            block_loss(p["block"], ex["tok"], ex["tgt"])
            + conv_loss(p["conv"], ex["img"], ex["tgt"][0])
            + jnp.sum((jax.vmap(mlp)(h).mean(0) - ex["y"]) ** 2)
            - jnp.mean(jnp.take_along_axis(logp, ex["tgt"][:, None], 1))
            + jnp.sum(nnx_out**2)
        ), {"first": ex["tok"][0]}

    return params, loss


def family_batch(n, seed=9):
    return {
        "tok": integers(seed, VV, n, TT),
        "tgt": integers(seed + 1, VV, n, TT),
        "img": normal(seed + 2, n, 6, 6, 1),
        "x": normal(seed + 3, n, TT, DD),
        "y": normal(seed + 4, n, 3),
    }


def test_model_families():
    """Ghost = vmap (sum, norms, values, aux) on the five models at once, N = 10 in
    chunks of 5, single examples (keep_batch_dim=False), under `eqx.filter_jit` (the
    Equinox modules' non-array leaves get None); and the rules `ghost_report` gives
    their leaves. The compiles are this test's time: chunks that divide N (a
    remainder chunk, tested on the MLP above, compiles the body twice) and
    nan_safe=False (NaN handling is tested on the Equinox MLP below)."""
    eqx = pytest.importorskip("equinox")
    params, loss = families()
    batch = family_batch(10)
    opts = dict(
        l2_clip_norm=2.0,
        has_aux=True,
        nan_safe=False,
        keep_batch_dim=False,
        return_values=True,
        return_grad_norms=True,
        microbatch_size=5,
    )
    expected = eqx.filter_jit(clipped_grad(loss, **opts))(params, batch)
    actual = eqx.filter_jit(clipped_grad(loss, **opts, method="ghost"))(params, batch)
    tree_allclose(actual, expected, rtol=1e-5, atol=1e-6)

    one = jax.tree.map(lambda x: x[0], family_batch(1))
    rules = ghost_report(loss, params, one, has_aux=True).as_dict()
    block = {k[len("args[0]['block']") :]: r for k, r in rules.items() if "block" in k}
    assert block == {
        "['E']": "per-example",  # gather (and the tied output dot)
        "['pos']": "per-example",
        "['qkv']": "ghost",
        "['o']": "ghost",
        "['w1']": "ghost",  # two uses (once transposed): cross terms
        "['b1']": "per-example",
        "['proj']": "instantiated",
        "['ln1']": "per-example",
        "['ln2']": "per-example",
    }
    conv = {k: r for k, r in rules.items() if "conv" in k}
    assert conv == {
        "args[0]['conv']['c']": "per-example",  # convolution kernels fall back
        "args[0]['conv']['cb']": "per-example",
        "args[0]['conv']['w']": "ghost",
    }
    for path, rule in rules.items():
        if path.endswith(("weight", "['kernel'].value", "['kernel']")):
            assert rule == "ghost", (path, rule)  # eqx, NNX, linen dense weights
        if path.endswith("bias") or "LayerNorm" in path or "Embed" in path:
            assert rule == "per-example", (path, rule)
    assert sum(r == "ghost" for r in rules.values()) == 3 + 1 + 7 + 2 + 2


def test_equinox_jax_privacy_defaults_nan_and_prng():
    """An Equinox MLP as the parameter (non-float leaves get None), with jax-privacy's
    defaults (a batch of one, nan_safe=True), a NaN example and a PRNG key per
    example (`prng_argnum`), N = 8 in chunks of 4 (a divisor), under jit.

    Regression (prng_argnum): the key argument is split into one key per example
    (mapped) but passed to `fun` without a batch axis; ghost traced it with all N
    keys ("normal accepts a single key, but was given a key array of shape (8,)")."""
    eqx = pytest.importorskip("equinox")
    model = filled(
        eqx.filter_eval_shape(eqx.nn.MLP, 4, 2, 8, 2, key=jax.random.key(0)), 4
    )
    x, y = normal(40, 8, 4), normal(41, 8, 2)
    x = x.at[2, 1].set(jnp.nan)

    def loss(m, xy, key):
        noise = 0.1 * jax.random.normal(key, xy[0].shape)
        return jnp.sum((jax.vmap(m)(xy[0] + noise) - xy[1]) ** 2)

    opts = dict(
        l2_clip_norm=0.5, return_grad_norms=True, microbatch_size=4, prng_argnum=2
    )
    key = jax.random.key(5)
    expected = eqx.filter_jit(clipped_grad(loss, **opts))(model, (x, y), key)
    ghost = eqx.filter_jit(clipped_grad(loss, **opts, method="ghost"))
    actual = ghost(model, (x, y), key)
    tree_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(actual[0]))
    assert bool(jnp.isnan(actual[1].grad_norms[2]))
    report = ghost_report(loss, model, (x[:1], y[:1]), key, batch_argnums=(1, 2))
    assert set(report.as_dict().values()) == {"ghost", "per-example"}


# -- memory ----------------------------------------------------------------------------


def test_memory_mlp_784():
    """Issue 14's memory check: MLP 784-512-512-10, N = 1024, chunks of 64. XLA's
    compiled temp bytes: ghost 2.81 MiB, method="vmap" 163.8 MiB (58x; asserted
    20x), the non-private `jax.grad` of the mean loss over the whole batch 10.0 MiB
    (ghost / non-private = 0.28: it holds one chunk's activations, not N's)."""
    p = mlp_params((784, 512, 512, 10))
    x, y = jnp.ones((1024, 784)), jnp.ones((1024, 10))
    vmap = temp_bytes(clipped_grad_sum(mlp_loss, 1.0, batch_size=64), p, x, y)
    ghost = temp_bytes(
        clipped_grad_sum(mlp_loss, 1.0, batch_size=64, method="ghost"), p, x, y
    )
    mean = jax.grad(lambda p, x, y: jnp.mean(jax.vmap(mlp_loss, (None, 0, 0))(p, x, y)))
    nonprivate = temp_bytes(mean, p, x, y)
    assert 20 * ghost < vmap, (ghost, vmap)
    assert ghost < 2 * nonprivate, (ghost, nonprivate)


def test_bfloat16_parameters():
    """bf16 parameters and examples: a dot accumulating in f32
    (`preferred_element_type`), an f32 leaf cast to bf16 before its dot, a
    sequence; ghost = vmap to bf16 precision (norms accumulate in f32)."""

    def loss(p, xy):
        x, y = xy[0][0], xy[1][0]  # (T, D) bf16, (T,) f32
        h = jnp.dot(x, p["w"], preferred_element_type=jnp.float32)
        h2 = jnp.dot(x, p["w32"].astype(jnp.bfloat16)).astype(jnp.float32)
        out = jnp.tanh(h) @ p["v"].astype(jnp.float32) + jnp.sum(h2, -1)
        out = out + p["b"].astype(jnp.float32)
        return jnp.sum((out - y) ** 2)

    bf = jnp.bfloat16
    p = {
        "w": normal(60, 6, 5, scale=0.4).astype(bf),  # T^2 = 16 <= 30: ghost
        "w32": normal(61, 6, 5, scale=0.4),  # through a convert: ghost
        "v": normal(62, 5).astype(bf),  # T^2 > 5: instantiated
        "b": jnp.zeros((), bf),
    }
    xy = (normal(63, 6, 4, 6).astype(bf), normal(64, 6, 4))
    opts = dict(
        l2_clip_norm=1.0, return_grad_norms=True, microbatch_size=3, nan_safe=False
    )
    expected = jax.jit(clipped_grad(loss, **opts))(p, xy)
    actual = jax.jit(clipped_grad(loss, **opts, method="ghost"))(p, xy)
    tree_allclose(actual, expected, rtol=2e-2, atol=2e-2)
    assert ghost_report(loss, p, (xy[0][:1], xy[1][:1])).as_dict() == {
        "args[0]['b']": "per-example",
        "args[0]['v']": "instantiated",
        "args[0]['w']": "ghost",
        "args[0]['w32']": "ghost",
    }


# -- bad input -------------------------------------------------------------------------


def test_bad_method():
    with pytest.raises(ValueError, match="method must be one of 'vmap', 'ghost'"):
        clipped_grad(mlp_loss, l2_clip_norm=1.0, method="ghosts")
    with pytest.raises(ValueError, match="clipped_grad_sum method"):
        clipped_grad_sum(mlp_loss, 1.0, method=None)
    with pytest.raises(ValueError, match="pre_clipping_transform"):
        clipped_grad(
            mlp_loss, l2_clip_norm=1.0, method="ghost", pre_clipping_transform=abs
        )
    assert "ghost_report" in chunkvmap.__all__


def test_options_as_with_vmap():
    """method="ghost" under the pipeline's options: "auto", progress, remat=False,
    an Explicit data axis, shard=True on an Auto mesh, and jax.grad through the
    clipped sum (all against method="vmap")."""
    rng = np.random.default_rng(0)
    p = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.normal(size=(16, 3)).astype(np.float32),
    }

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    x = rng.normal(size=(24, 8)).astype(np.float32)
    y = rng.normal(size=(24, 3)).astype(np.float32)

    def clipped(method, **opts):
        return chunkvmap.clipped_grad_sum(
            loss, 0.5, return_norms=True, method=method, **opts
        )

    expected = clipped("vmap", batch_size=5)(p, x, y)
    calls = []

    def report(done, total):
        calls.append((done, total))

    auto = clipped("ghost", batch_size="auto", memory_limit="64KiB")
    tree_allclose(auto(p, x, y), expected, rtol=1e-5, atol=1e-5)
    assert 1 <= chunkvmap.last_batch_size(auto) <= 24
    reported = clipped("ghost", batch_size=5, remat=False, progress=report)
    tree_allclose(jax.jit(reported)(p, x, y), expected, rtol=1e-5, atol=1e-5)
    assert calls[-1] == (5, 5)
    explicit = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(explicit):
        data = jax.sharding.NamedSharding(explicit, jax.P("data"))
        xs, ys = jax.device_put((x, y), data)
        out = jax.jit(clipped("ghost", batch_size=2))(p, xs, ys)
    tree_allclose(out, expected, rtol=1e-5, atol=1e-5)
    auto_mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
    out = clipped("ghost", batch_size=2, shard=True, mesh=auto_mesh)(p, x, y)
    tree_allclose(out, expected, rtol=1e-5, atol=1e-5)

    def outer(method):
        def f(x):
            total = clipped(method, batch_size=5)(p, x, y)[0]
            return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(total))

        return jax.grad(f)(x)

    tree_allclose(outer("ghost"), outer("vmap"), rtol=1e-4, atol=1e-5)
