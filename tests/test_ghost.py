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
        "wide": normal(2, D, 3 * D, scale=1 / 3),  # ghost 800 <= instantiated 972
        "small": normal(3, 3 * D, 2, scale=1 / 3),  # ghost 592 > instantiated 324
        "tiny": normal(4, 2, 2),
        "tied": normal(5, D, D, scale=1 / 2),  # x @ W and h @ W.T
        "scale": jnp.ones(D),  # elementwise: instantiated
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
    """The rule of each leaf, why, and the shares of the parameters by rule and by
    kind of use."""
    tokens, target = seq_batch(1)
    report = ghost_report(seq_loss, seq_params(), tokens[0], target[0])
    assert report.as_dict() == {
        "args[0]['E']": "instantiated",  # embedding + tied head: T small, V tiny
        "args[0]['scale']": "instantiated",  # elementwise
        "args[0]['small']": "instantiated",
        "args[0]['tiny']": "instantiated",
        "args[0]['tied']": "instantiated",  # 2 uses
        "args[0]['wide']": "ghost",
    }
    why = {p: r for p, _, _, r in report.rows}
    assert why["args[0]['E']"] == "embedding, dense: ghost 736 > instantiated 294 flops"
    assert why["args[0]['wide']"] == "dense: ghost 800 <= instantiated 972 flops"
    assert why["args[0]['scale']"] == (
        "elementwise: formed from its cotangents (no ghost norm for elementwise)"
    )
    assert why["args[0]['tied']"].startswith("dense x2: ")
    shares = report.shares()
    sizes = {"E": 30, "wide": 108, "small": 36, "tiny": 4, "tied": 36, "scale": 6}
    total = sum(sizes.values())
    assert shares["ghost"] == pytest.approx(108 / total)
    assert shares["instantiated"] == pytest.approx(1 - 108 / total)
    assert shares["kind:embedding"] == pytest.approx(30 / total)
    assert shares["kind:elementwise"] == pytest.approx(6 / total)
    assert report.runs == "ghost" and report.fallback() == []
    text = str(report)
    assert "parameters by rule: ghost 49.1%, instantiated 50.9%" in text
    assert "embedding 13.6%" in text
    # a dot with an operand that does not depend on the example falls back
    report = ghost_report(
        lambda p, x: jnp.sum((x @ p["a"]) @ (p["b"] @ p["c"])),
        {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 2))},
        jnp.ones(3),
    )
    assert report.rule("args[0]['a']") == "ghost"
    assert report.rule("args[0]['b']") == "per-example"
    assert "does not depend on the example" in str(report)
    assert report.fallback() == ["args[0]['b']", "args[0]['c']"]


# One example's loss summed over small models of each family, written as each
# framework's users write them, so that they share one compile of each method (these
# compiles are the test's time).
TT, DD, VV, HH = 5, 8, 8, 2  # positions, width, vocabulary, heads


def layer_norm(x, scale):
    x = x - jnp.mean(x, -1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-5) * scale


def block_params(seed=6):
    def n(i, shape, fan):
        return normal(10 * seed + i, *shape, scale=fan**-0.5)

    return {
        "E": n(0, (VV, DD), 1),  # embedding by gather, tied to the output
        "pos": n(1, (TT, DD), 10),  # a position table, added
        "qkv": n(2, (DD, 3 * DD), DD),  # reshaped output
        "o": n(3, (HH, DD // HH, DD), DD),  # a dot with a batch axis (heads)
        "w1": n(4, (DD, 2 * DD), DD),  # tied MLP: h @ w1, then @ w1.T: 2 uses
        "b1": jnp.zeros(2 * DD),
        "proj": n(5, (DD, 2), DD),
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
    """A CNN: a convolution, a bias, a dense head."""
    h = jax.lax.conv_general_dilated(
        img[None], p["c"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.tanh(h + p["cb"][None, None, None]).reshape(-1)
    return -jax.nn.log_softmax(h @ p["w"])[label]


def families():
    """Parameters and a per-example loss with aux: the block above, a CNN, Equinox
    (`eqx.nn.Embedding`, `eqx.nn.Conv2d`, `eqx.nn.MultiheadAttention`, `eqx.nn.MLP`,
    a layer stack made by `eqx.filter_vmap` and run by `lax.scan`), linen (`nn.Embed`
    with `attend`, `nn.Conv`, `nn.scan(nn.remat(Block))` over stacked parameters) and
    NNX (`nnx.Embed`, `nnx.Conv`, layers stacked with `nnx.vmap` and run with
    `nnx.scan`, through `nnx.split`/`merge`)."""
    eqx = pytest.importorskip("equinox")
    nn = pytest.importorskip("flax.linen")
    from flax import nnx

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            x = nn.LayerNorm()(h)
            return h + nn.Dense(DD)(nn.gelu(nn.Dense(2 * DD)(x))), None

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, tok, img):
            embed = nn.Embed(VV, DD)
            stack = nn.scan(
                nn.remat(Block),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=2,
            )
            h, _ = stack()(embed(tok), None)
            c = nn.Conv(3, (3, 3), strides=(2, 2))(img[None])
            return embed.attend(nn.LayerNorm()(h)), jnp.sum(c**2)

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(DD, DD, rngs=rngs)

        def __call__(self, h):
            return h + jnp.tanh(self.lin(h))

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VV, DD, rngs=rngs)
            self.conv = nnx.Conv(1, 2, (3, 3), rngs=rngs)

            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return NnxBlock(rngs)

            self.blocks = stack(rngs)
            self.out = nnx.Linear(DD, 2, rngs=rngs)

        def __call__(self, tok, img):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h, block):
                return block(h)

            h = run(self.embed(tok), self.blocks)
            return jnp.sum(self.out(h) ** 2) + jnp.sum(self.conv(img[None]) ** 2)

    linen = Linen()
    nnx_def, nnx_state = nnx.split(nnx.eval_shape(lambda: Nnx(nnx.Rngs(0))))
    key = jax.random.key(0)
    eqx_layers = eqx.filter_eval_shape(
        eqx.filter_vmap(lambda k: eqx.nn.Linear(DD, DD, key=k)), jax.random.split(key)
    )
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
                eqx.filter_eval_shape(eqx.nn.Embedding, VV, DD, key=key),
                eqx.filter_eval_shape(eqx.nn.Conv2d, 1, 2, 3, key=key),
                eqx_layers,
            ),
            72,
        ),
        "linen": filled(
            jax.eval_shape(linen.init, key, jnp.zeros(TT, "i4"), jnp.zeros((6, 6, 1))),
            73,
        ),
        "nnx": filled(nnx_state, 74),
    }

    def loss(p, ex):
        att, mlp, embedding, conv, layers = p["eqx"]
        h = jax.vmap(embedding)(ex["tok"]) + ex["x"]
        h = h + att(h, h, h)
        dynamic, static = eqx.partition(layers, eqx.is_array)

        def layer(h, dynamic):
            return jnp.tanh(jax.vmap(eqx.combine(dynamic, static))(h)), None

        h, _ = jax.lax.scan(layer, h, dynamic)
        eqx_conv = jnp.sum(conv(ex["img"].transpose(2, 0, 1)) ** 2)
        logits, linen_conv = linen.apply(p["linen"], ex["tok"], ex["img"])
        logp = jax.nn.log_softmax(logits)
        nnx_out = nnx.merge(nnx_def, p["nnx"])(ex["tok"], ex["img"])
        return (
            block_loss(p["block"], ex["tok"], ex["tgt"])
            + conv_loss(p["conv"], ex["img"], ex["tgt"][0])
            + jnp.sum((jax.vmap(mlp)(h).mean(0) - ex["y"]) ** 2)
            + eqx_conv
            - jnp.mean(jnp.take_along_axis(logp, ex["tgt"][:, None], 1))
            + linen_conv
            + nnx_out
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
    """Ghost = vmap (sum, norms, values, aux) on the models at once, N = 10 in
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
    report = ghost_report(loss, params, one, has_aux=True)
    rules = report.as_dict()
    assert report.fallback() == []  # every leaf of every family has a rule
    head = "args[0]['block']"
    block = {k[len(head) :]: r for k, r in rules.items() if k.startswith(head)}
    assert block == {
        "['E']": "instantiated",  # embedding + tied head: small here
        "['pos']": "instantiated",
        "['qkv']": "ghost",
        "['o']": "instantiated",
        "['w1']": "instantiated",  # two uses (once transposed): cross terms
        "['b1']": "instantiated",
        "['proj']": "instantiated",
        "['ln1']": "instantiated",
        "['ln2']": "instantiated",
    }
    kinds = {p[len("args[0]") :]: k for p, k in report.uses.items()}
    for path, uses in {
        "['block']['E']": ["dense", "embedding"],  # tied head
        "['linen']['params']['Embed_0']['embedding']": ["dense", "embedding"],
        "['eqx'][2].weight": ["embedding"],  # eqx.nn.Embedding
        "['nnx']['embed']['embedding'].value": ["embedding"],
        "['conv']['c']": ["conv"],
        "['eqx'][3].weight": ["conv"],  # eqx.nn.Conv2d
        "['linen']['params']['Conv_0']['kernel']": ["conv"],
        "['nnx']['conv']['kernel'].value": ["conv"],
        "['eqx'][4].weight": ["dense"],  # filter_vmap + lax.scan
        "['linen']['params']['ScanCheckpointBlock_0']['Dense_0']['kernel']": ["dense"],
        "['nnx']['blocks']['lin']['kernel'].value": ["dense"],  # nnx.vmap + nnx.scan
        "['block']['pos']": ["elementwise"],
        "['linen']['params']['ScanCheckpointBlock_0']['LayerNorm_0']['scale']": [
            "elementwise"
        ],
    }.items():
        assert kinds[path] == uses, (path, kinds[path])
    assert report.runs == "ghost"
    assert sum(r == "ghost" for r in rules.values()) >= 5


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
    assert set(report.as_dict().values()) == {"ghost", "instantiated"}


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
        "w": normal(60, 16, 12, scale=0.25).astype(bf),  # 2 positions: ghost
        "w32": normal(61, 16, 12, scale=0.25),  # through a convert: ghost
        "v": normal(62, 12).astype(bf),  # a vector: instantiated
        "b": jnp.zeros((), bf),  # elementwise
    }
    xy = (normal(63, 6, 2, 16).astype(bf), normal(64, 6, 2))
    opts = dict(
        l2_clip_norm=1.0, return_grad_norms=True, microbatch_size=3, nan_safe=False
    )
    expected = jax.jit(clipped_grad(loss, **opts))(p, xy)
    actual = jax.jit(clipped_grad(loss, **opts, method="ghost"))(p, xy)
    tree_allclose(actual, expected, rtol=2e-2, atol=2e-2)
    assert ghost_report(loss, p, (xy[0][:1], xy[1][:1])).as_dict() == {
        "args[0]['b']": "instantiated",
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


# -- the models DP is trained on, end to end -------------------------------------------

LV, LT, LD = 64, 4, 16  # vocabulary, positions, width: embedding rows >> positions^2


def lm_params(seed=20, tied=False, stacked=False):
    def n(i, *shape):
        return normal(seed * 10 + i, *shape, scale=shape[-2] ** -0.5 if len(shape) > 1 else 0.1)

    def block(i):
        return {
            "ln": jnp.ones(LD), "qkv": n(i, LD, 3 * LD), "o": n(i + 1, LD, LD),
            "up": n(i + 2, LD, 2 * LD), "up_b": jnp.zeros(2 * LD), "down": n(i + 3, 2 * LD, LD),
        }  # fmt: skip

    if stacked:
        blocks = jax.tree.map(lambda *x: jnp.stack(x), block(10), block(20))
    else:
        blocks = [block(10)]
    p = {"emb": n(1, LV, LD), "pos": n(2, LT, LD), "lnf": jnp.ones(LD), "blocks": blocks}
    if not tied:
        p["head"] = n(3, LD, LV)
    return p


def lm_block(b, h):
    x = layer_norm(h, b["ln"][None])
    q, k, v = (x @ w for w in jnp.split(b["qkv"], 3, -1))  # a fused QKV, split
    att = jnp.where(jnp.tril(jnp.ones((LT, LT), bool)), q @ k.T / 4.0, -1e9)
    h = h + jax.nn.softmax(att, -1) @ v @ b["o"]
    x = layer_norm(h, b["ln"][None])
    return h + jax.nn.gelu(x @ b["up"] + b["up_b"][None]) @ b["down"]


def lm_loss(p, tokens):
    """Next-token cross-entropy of a GPT-style model: token and position embeddings,
    pre-norm blocks (a Python loop, or `lax.scan` over a stacked, rematerialised
    block), an untied or tied output layer."""
    h = p["emb"][tokens] + p["pos"]
    if isinstance(p["blocks"], list):
        for b in p["blocks"]:
            h = lm_block(b, h)
    else:
        h, _ = jax.lax.scan(
            lambda h, b: (jax.checkpoint(lm_block)(b, h), None), h, p["blocks"]
        )
    h = layer_norm(h, p["lnf"][None])
    logits = h @ (p["head"] if "head" in p else p["emb"].T)
    logp = jax.nn.log_softmax(logits)[:-1]
    return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], 1))


def cnn_params(seed=30):
    return {
        "c1": normal(seed, 3, 3, 3, 8, scale=0.2), "b1": jnp.zeros(8),
        "c2": normal(seed + 1, 3, 3, 4, 16, scale=0.2),  # 2 feature groups
        "c3": normal(seed + 2, 2, 2, 16, 32, scale=0.1),  # late: channels >> positions
        "fc": normal(seed + 3, 32, 5, scale=0.2),
    }  # fmt: skip


def cnn_loss(p, img, label):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(img[None], p["c1"], (2, 2), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(h + p["b1"][None, None, None])
    h = jax.lax.conv_general_dilated(
        h, p["c2"], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=2
    )
    h = jax.lax.conv_general_dilated(jnp.tanh(h), p["c3"], (2, 2), "VALID", dimension_numbers=dn)
    return -jax.nn.log_softmax(h.mean((0, 1, 2)) @ p["fc"])[label]


def dp_models():
    params = {
        "lm": lm_params(), "scanned": lm_params(22, stacked=True, tied=True),
        "cnn": cnn_params(),
    }  # fmt: skip

    def loss(p, tokens, img, label):
        return (
            lm_loss(p["lm"], tokens) + lm_loss(p["scanned"], tokens)
            + cnn_loss(p["cnn"], img, label)
        )  # fmt: skip

    return params, loss


def dp_batch(n, seed=40):
    tokens = np.random.default_rng(seed).integers(0, LV, (n, LT))
    tokens[0, 2] = tokens[0, 0]  # a token repeated in one sequence
    return (
        jnp.asarray(tokens, "i4"),
        normal(seed + 1, n, 8, 8, 3, scale=1.0),
        integers(seed + 2, 5, n),
    )


def test_dp_models_against_vmap():
    """The models of the benchmark (GPT-style LMs with gathered embeddings: untied,
    and tied with a scanned, rematerialised layer stack; a CNN with strided and
    grouped convolutions), N = 7 in chunks of 3 (a remainder): ghost = vmap
    (sums and norms); every leaf has a rule, and the embeddings, the stacked weights
    and the late convolution have ghost norms."""
    params, loss = dp_models()
    data = dp_batch(7)
    opts = dict(batch_size=3, return_norms=True)
    expected = jax.jit(clipped_grad_sum(loss, 1.0, **opts))(params, *data)
    actual = jax.jit(clipped_grad_sum(loss, 1.0, **opts, method="ghost"))(params, *data)
    tree_allclose(actual, expected, rtol=2e-5, atol=2e-6)
    report = ghost_report(loss, params, *(d[0] for d in data))
    assert report.fallback() == []
    rules = report.as_dict()
    for path in (
        "args[0]['lm']['emb']", "args[0]['lm']['head']",
        "args[0]['scanned']['emb']", "args[0]['scanned']['blocks']['up']",
        "args[0]['cnn']['c3']",
    ):  # fmt: skip
        assert rules[path] == "ghost", (path, rules[path])


def test_padding_dtype_and_partly_nonfinite_gradients():
    """jax-privacy's options under ghost: `is_padding_example`, `dtype=`, and
    nan_safe=True with examples whose gradients are non-finite in some entries only
    (rows of a dense leaf used twice, one entry of an elementwise leaf, rows of an
    embedding): both methods zero those entries and clip the rest, exactly as by
    hand; ghost masks them through the activations (no gradient is formed)."""

    def loss(p, xzt):
        x, z, t = xzt[0][0], xzt[1][0], xzt[2][0]
        return (
            jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
            + jnp.sum(z @ p["lin"]) + jnp.sum(jnp.tanh(x[:5] @ p["lin"]))
            + jnp.sum(p["s"] * z)
            + jnp.sum(jnp.tanh(p["emb"][t] * z[:, None]))
        )  # fmt: skip

    p = {
        "w1": normal(80, 6, 16), "w2": normal(81, 16, 3), "lin": normal(82, 5, 4),
        "s": normal(83, 5), "emb": normal(86, 40, 8),
    }  # fmt: skip
    x, z = normal(84, 7, 6, scale=1.0), normal(85, 7, 5, scale=1.0)
    z = z.at[2, 1].set(jnp.nan).at[4, 3].set(jnp.inf)
    t = integers(87, 40, 7, 5)
    xz = (x, z, t)  # each example reaches `loss` as a batch of one
    one_each = (x[:, None], z[:, None], t[:, None])
    opts = dict(l2_clip_norm=1.5, microbatch_size=3, return_grad_norms=True)
    kinds = _ghost_plan(loss, p, jax.tree.map(lambda a: a[:1], xz))
    assert {k: kinds[f"args[0]['{k}']"] for k in ("lin", "emb")} == {
        "lin": "masked", "emb": "masked"
    }  # fmt: skip

    def reference(pad):
        grads = jax.vmap(jax.grad(loss), (None, 0))(p, one_each)
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0), grads)
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(7, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
        scale = jnp.where(pad, 0, jnp.minimum(1, 1.5 / norms))
        return jax.tree.map(lambda g: jnp.tensordot(scale, g, 1), grads)

    grads = jax.vmap(jax.grad(loss), (None, 0))(p, one_each)
    assert not bool(jnp.isfinite(grads["lin"][2]).all()) and bool(jnp.isfinite(grads["w1"][2]).all())
    assert not bool(jnp.isfinite(grads["emb"][2]).all()) and bool(jnp.isfinite(grads["emb"][2][0]).all())
    pad = jnp.array([False, True, False, False, False, True, False])
    for kw in ({}, {"dtype": jnp.bfloat16}):
        results = [
            jax.jit(clipped_grad(loss, **opts, **kw, method=m))(p, xz, is_padding_example=pad)
            for m in ("vmap", "ghost")
        ]
        tree_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
        # the norms as they are: non-finite for examples 2 (NaN) and 4 (inf; with
        # ghost NaN, as documented), equal elsewhere
        norms = [r[1].grad_norms for r in results]
        finite = jnp.isfinite(norms[0])
        assert finite.tolist() == [True, True, False, True, False, True, True]
        assert jnp.isfinite(norms[1]).tolist() == finite.tolist()
        np.testing.assert_allclose(norms[1][finite], norms[0][finite], rtol=1e-5)
        expected = reference(pad)
        if kw:
            expected = jax.tree.map(lambda e: e.astype(jnp.bfloat16), expected)
        tree_allclose(results[1][0], expected, rtol=1e-5, atol=1e-6)


def test_fallback_warning_and_the_vmap_path():
    """More than 5% of the parameters without a rule: one GhostFallbackWarning per
    clipping function, naming the leaves; no ghost norm at all: the per-example path
    itself runs (the same program as method="vmap"), and the warning says so."""
    p = {"w": normal(90, 6, 32), "g": normal(91, 6, 32)}

    def gated(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]) * jax.nn.sigmoid(x @ jnp.sin(p["g"])))

    x = normal(92, 5, 6, scale=1.0)
    f = clipped_grad_sum(gated, 1.0, batch_size=2, method="ghost")
    with pytest.warns(chunkvmap.GhostFallbackWarning, match=r"50% .*args\[0\]\['g'\]"):
        out = f(p, x)
    tree_allclose(out, clipped_grad_sum(gated, 1.0, batch_size=2)(p, x), rtol=1e-5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(f)(p, x)  # once per function

    def nothing(p, x):
        return jnp.sum(jnp.tanh(x @ jnp.exp(p["g"])))

    ghost = clipped_grad_sum(nothing, 1.0, batch_size=2, method="ghost")
    vmap = clipped_grad_sum(nothing, 1.0, batch_size=2)
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="runs as method='vmap'"):
        program = str(jax.make_jaxpr(ghost)(p, x))
    assert program == str(jax.make_jaxpr(vmap)(p, x))


def test_model_parallel_mesh():
    """A ("data", "model") mesh with Megatron-style weights (columns, then rows over
    "model"; the contraction's output replicated), Explicit (examples sharded over
    "data") and Auto (shard="data", under jit): ghost = vmap, values and gradient
    shardings."""
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(1)
    p0 = {
        "w1": rng.normal(size=(8, 16)).astype("f4"), "b1": np.zeros(16, "f4"),
        "w2": rng.normal(size=(16, 3)).astype("f4"), "b2": np.zeros(3, "f4"),
    }  # fmt: skip
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    x0 = rng.normal(size=(13, 8)).astype("f4")
    y0 = rng.normal(size=(13, 3)).astype("f4")
    for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        explicit = axis_type == jax.sharding.AxisType.Explicit
        mesh = jax.make_mesh((4, 2), ("data", "model"), (axis_type,) * 2)
        n = 12 if explicit else 13

        def loss(p, x, y):
            h = jax.nn.gelu(x @ p["w1"] + p["b1"])
            out = jnp.dot(h, p["w2"], out_sharding=P() if explicit else None)
            return jnp.sum((out + p["b2"] - y) ** 2)

        with jax.set_mesh(mesh):
            params = jax.device_put(
                p0, {k: jax.sharding.NamedSharding(mesh, s) for k, s in specs.items()}
            )
            data = jax.sharding.NamedSharding(mesh, P("data") if explicit else P())
            x, y = jax.device_put((x0[:n], y0[:n]), data)
            kw = {} if explicit else {"shard": "data"}
            outs = [
                jax.jit(clipped_grad_sum(loss, 1.0, batch_size=2, method=m, **kw))(
                    params, x, y
                )
                for m in ("vmap", "ghost")
            ]
        tree_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        for g, e in zip(jax.tree.leaves(outs[1][0]), jax.tree.leaves(outs[0][0])):
            assert g.sharding.is_equivalent_to(e.sharding, g.ndim), (g.sharding, e)
        assert outs[1][0]["w1"].sharding.spec == P(None, "model")


def test_memory_embedding_scan_and_late_conv():
    """XLA's compiled temp memory: an LM whose embedding has 8192 rows, with a
    scanned layer stack, plus a late-stage convolution (256 channels at 4 x 4
    positions), N = 64 in chunks of 16. Ghost holds a small fraction of 16
    per-example gradients of the parameters (which `method="vmap"` forms)."""
    rng = np.random.default_rng(2)

    def n(*shape):
        return jnp.asarray(rng.normal(size=shape) / shape[-2] ** 0.5, "f4")

    p = {
        "emb": n(8192, 64), "stack": n(4, 64, 64), "conv": n(3, 3, 128, 256),
        "head": n(256, 10),
    }  # fmt: skip

    def loss(p, tokens, img):
        h = p["emb"][tokens]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])
        c = jax.lax.conv_general_dilated(
            img[None], p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(h**2) + jnp.sum(c.mean((0, 1, 2)) @ p["head"])

    tokens = jnp.zeros((64, 8), "i4")
    img = jnp.zeros((64, 4, 4, 128))
    report = ghost_report(loss, p, tokens[0], img[0])
    assert set(report.as_dict().values()) == {"ghost"}
    size = 4 * sum(x.size for x in jax.tree.leaves(p))  # bytes of the parameters
    ghost = temp_bytes(clipped_grad_sum(loss, 1.0, batch_size=16, method="ghost"), p, tokens, img)
    # the running sum and one chunk's sum, where vmap holds 16 gradients (6.28 MB
    # measured, 1.9 x the parameters' 3.35 MB)
    assert ghost < 2.5 * size, (ghost, size)


def test_nan_safe_where_masking_cannot():
    """nan_safe=True on leaves whose non-finite entries cannot be masked through
    their activations (an embedding also used as the tied output layer): those
    examples are fixed after the chunk's sum, one leaf at a time, every leaf's
    contribution with the corrected clip factor (here a dense leaf's gradient stays
    finite). A NaN and an infinity reaching one position each, N = 6 in chunks of
    4: ghost = vmap = by hand."""

    def loss(p, tzx):
        t, z, x = tzx[0][0], tzx[1][0], tzx[2][0]
        h = p["E"][t] * z[:, None] + p["pos"]
        return jnp.sum(jnp.tanh(h @ p["E"].T)) + jnp.sum(jnp.tanh(x @ p["w"]))

    p = {"E": normal(95, 16, 6), "pos": normal(96, 3, 6), "w": normal(97, 6, 4)}
    t = integers(98, 16, 6, 3)
    z = normal(99, 6, 3, scale=1.0).at[1, 2].set(jnp.nan).at[4, 0].set(jnp.inf)
    x = normal(100, 6, 6, scale=1.0)
    opts = dict(l2_clip_norm=0.8, microbatch_size=4)
    got = jax.jit(clipped_grad(loss, **opts, method="ghost"))(p, (t, z, x))
    plan = _ghost_plan(loss, p, (t[:1], z[:1], x[:1]))
    assert plan == {
        "args[0]['E']": "other", "args[0]['pos']": "formed", "args[0]['w']": "masked"
    }  # fmt: skip
    expected = jax.jit(clipped_grad(loss, **opts))(p, (t, z, x))
    tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    grads = jax.vmap(jax.grad(loss), (None, 0))(p, (t[:, None], z[:, None], x[:, None]))
    assert bool(jnp.isfinite(grads["w"]).all())
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0), grads)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(6, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
    by_hand = jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1, 0.8 / norms), g, 1), grads)
    tree_allclose(got, by_hand, rtol=1e-5, atol=1e-6)


def _ghost_plan(loss, params, example):
    """How nan_safe treats each rule leaf: "masked" (through its activations),
    "formed" (its gradient, instantiated) or "other" (fixed afterwards)."""
    from chunkvmap import _ghost

    traced = _ghost.Traced(
        loss, [params, example], {}, [0], [1], strip=False, has_aux=False,
        keep_batch_dim=False,
    )  # fmt: skip
    plan = traced.plan
    kinds = {}
    for k, leaf in enumerate(plan.leaves):
        if plan.maskable(k):
            kinds[leaf.path] = "masked"
        elif leaf.rule == "instantiated":
            kinds[leaf.path] = "formed"
        elif leaf.rule == "ghost":
            kinds[leaf.path] = "other"
    return kinds
