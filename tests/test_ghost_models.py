"""`method="ghost"` on whole models against `method="vmap"`: each framework's layers
as its users write them, the models DP is trained on (GPT-style LMs, a convnet),
model-parallel meshes, and the memory ghost saves on them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import clipped_grad, clipped_grad_sum, ghost_report

from .helpers import make_mesh, temp_bytes, tree_allclose
from .test_ghost import filled, integers, normal


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


# -- the models DP is trained on, end to end -------------------------------------------

LV, LT, LD = 64, 4, 16  # vocabulary, positions, width: embedding rows >> positions^2


def lm_params(seed=20, tied=False, stacked=False):
    def n(i, *shape):
        return normal(
            seed * 10 + i, *shape, scale=shape[-2] ** -0.5 if len(shape) > 1 else 0.1
        )

    def block(i):
        return {
            "ln": jnp.ones(LD), "qkv": n(i, LD, 3 * LD), "o": n(i + 1, LD, LD),
            "up": n(i + 2, LD, 2 * LD), "up_b": jnp.zeros(2 * LD),
            "down": n(i + 3, 2 * LD, LD),
        }  # fmt: skip

    if stacked:
        blocks = jax.tree.map(lambda *x: jnp.stack(x), block(10), block(20))
    else:
        blocks = [block(10)]
    p = {
        "emb": n(1, LV, LD),
        "pos": n(2, LT, LD),
        "lnf": jnp.ones(LD),
        "blocks": blocks,
    }
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
    h = jax.lax.conv_general_dilated(
        img[None], p["c1"], (2, 2), "SAME", dimension_numbers=dn
    )
    h = jax.nn.relu(h + p["b1"][None, None, None])
    h = jax.lax.conv_general_dilated(
        h, p["c2"], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=2
    )
    h = jax.lax.conv_general_dilated(
        jnp.tanh(h), p["c3"], (2, 2), "VALID", dimension_numbers=dn
    )
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
        jax.device_put(tokens.astype(np.int32)),
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
    specs = {
        "w1": P(None, "model"),
        "b1": P("model"),
        "w2": P("model", None),
        "b2": P(),
    }
    x0 = rng.normal(size=(13, 8)).astype("f4")
    y0 = rng.normal(size=(13, 3)).astype("f4")
    for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        explicit = axis_type == jax.sharding.AxisType.Explicit
        mesh = make_mesh((4, 2), ("data", "model"), (axis_type,) * 2)
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


def memory_case():
    """An LM whose embedding has 8192 rows, with a scanned layer stack, plus a
    late-stage convolution (256 channels at 4 x 4 positions), and N = 64 examples:
    parameters, loss and batch (zeros: for compiled memory only)."""
    rng = np.random.default_rng(2)

    def n(*shape):
        return jax.device_put((rng.normal(size=shape) / shape[-2] ** 0.5).astype("f4"))

    p = {
        "emb": n(8192, 64), "stack": n(4, 64, 64), "conv": n(3, 3, 128, 256),
        "head": n(256, 10),
    }  # fmt: skip

    def loss(p, tokens, img):
        h = p["emb"][tokens]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])
        c = jax.lax.conv_general_dilated(
            img[None],
            p["conv"],
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return jnp.sum(h**2) + jnp.sum(c.mean((0, 1, 2)) @ p["head"])

    return p, loss, jnp.zeros((64, 8), "i4"), jnp.zeros((64, 4, 4, 128))


def test_memory_embedding_scan_and_late_conv():
    """XLA's compiled temp memory of `memory_case` in chunks of 16. Ghost holds a
    small fraction of 16 per-example gradients of the parameters (which
    `method="vmap"` forms)."""
    p, loss, tokens, img = memory_case()
    report = ghost_report(loss, p, tokens[0], img[0])
    assert set(report.as_dict().values()) == {"ghost"}
    size = 4 * sum(x.size for x in jax.tree.leaves(p))  # bytes of the parameters
    ghost = temp_bytes(
        clipped_grad_sum(loss, 1.0, batch_size=16, method="ghost"), p, tokens, img
    )
    # the running sum and one chunk's sum, where vmap holds 16 gradients (6.28 MB
    # measured, 1.9 x the parameters' 3.35 MB)
    assert ghost < 2.5 * size, (ghost, size)
