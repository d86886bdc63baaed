"""The models DP is trained on, written the ordinary way in plain JAX, for the
clipping benchmarks (`bench_clipping.py` table (c), `device.py`, `bench_choice.py`).

* a GPT-style language model: token and position embeddings read by indexing
  (`emb[tokens]`, a gather), pre-norm blocks with a fused QKV matrix and a 4x MLP,
  and an untied output layer; the same with the output layer tied to the embedding;
  the same with its blocks stacked and run by `lax.scan` (each block under
  `jax.checkpoint`);
* a CIFAR-style convnet: three 3x3 convolutions (3 -> 64 -> 128 -> 256 channels by
  default) with ReLU and 2x2 max pooling, global average pooling, a dense head;
* a ViT: the image cut into patches (a reshape), a dense patch embedding, a learned
  position table, the language model's pre-norm blocks without the causal mask,
  mean pooling, a dense head;
* an MLP: dense layers with tanh, a squared-error loss.

Each loss is one example's (a sequence of tokens, or one image and its label).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


LM = {"vocab": 2048, "width": 256, "positions": 32, "blocks": 2, "heads": 4}
CNN = {"channels": (3, 64, 128, 256), "image": 32, "classes": 10}
VIT = {"image": 32, "patch": 4, "width": 192, "blocks": 4, "heads": 3, "classes": 10}
MLP = {"widths": (784, 1024, 1024, 1024, 10)}


def _normal(rng, *shape, scale=None):
    fan = shape[-2] if len(shape) > 1 else 1
    scale = fan**-0.5 if scale is None else scale
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


def lm_params(rng, cfg=LM, tied=False, stacked=False):
    v, d, t = cfg["vocab"], cfg["width"], cfg["positions"]

    def block():
        return {
            "ln1_s": jnp.ones(d), "ln1_b": jnp.zeros(d),
            "qkv": _normal(rng, d, 3 * d), "qkv_b": jnp.zeros(3 * d),
            "o": _normal(rng, d, d), "o_b": jnp.zeros(d),
            "ln2_s": jnp.ones(d), "ln2_b": jnp.zeros(d),
            "up": _normal(rng, d, 4 * d), "up_b": jnp.zeros(4 * d),
            "down": _normal(rng, 4 * d, d), "down_b": jnp.zeros(d),
        }  # fmt: skip

    blocks = [block() for _ in range(cfg["blocks"])]
    p = {
        "emb": _normal(rng, v, d, scale=0.1),
        "pos": _normal(rng, t, d, scale=0.1),
        "lnf_s": jnp.ones(d),
        "lnf_b": jnp.zeros(d),
        "blocks": jax.tree.map(lambda *x: jnp.stack(x), *blocks) if stacked else blocks,
    }
    if not tied:
        p["head"] = _normal(rng, d, v)
    return p


def _block(b, h, heads, causal=True):
    t, d = h.shape
    x = layer_norm(h, b["ln1_s"], b["ln1_b"])
    q, k, v = jnp.split(x @ b["qkv"] + b["qkv_b"], 3, axis=-1)
    q, k, v = (z.reshape(t, heads, d // heads) for z in (q, k, v))
    scores = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(d // heads)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    o = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v).reshape(t, d)
    h = h + o @ b["o"] + b["o_b"]
    x = layer_norm(h, b["ln2_s"], b["ln2_b"])
    return h + jax.nn.gelu(x @ b["up"] + b["up_b"]) @ b["down"] + b["down_b"]


def lm_loss(p, tokens, targets, heads=LM["heads"]):
    """Next-token cross-entropy of one sequence."""
    logp = jax.nn.log_softmax(lm_logits(p, tokens, heads))
    return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], 1))


def lm_logits(p, tokens, heads=LM["heads"]):
    """The next-token logits of one sequence, `(T, V)`."""
    h = p["emb"][tokens] + p["pos"]
    if isinstance(p["blocks"], list):
        for b in p["blocks"]:
            h = _block(b, h, heads)
    else:
        step = jax.checkpoint(lambda b, h: _block(b, h, heads))
        h, _ = lax.scan(lambda h, b: (step(b, h), None), h, p["blocks"])
    h = layer_norm(h, p["lnf_s"], p["lnf_b"])
    return h @ (p["head"] if "head" in p else p["emb"].T)


def lm_batch(rng, n, cfg=LM):
    tokens = jnp.asarray(rng.integers(0, cfg["vocab"], (n, cfg["positions"])), "i4")
    return tokens, jnp.roll(tokens, -1, 1)


def cnn_params(rng, cfg=CNN):
    chans = cfg["channels"]
    p = {}
    for i, (a, b) in enumerate(zip(chans[:-1], chans[1:])):
        p[f"conv{i}"] = _normal(rng, 3, 3, a, b, scale=(9 * a) ** -0.5)
        p[f"bias{i}"] = jnp.zeros(b)
    p["head"] = _normal(rng, chans[-1], cfg["classes"])
    p["head_b"] = jnp.zeros(cfg["classes"])
    return p


def cnn_loss(p, image, label):
    """Cross-entropy of one image (H, W, C)."""
    return -jax.nn.log_softmax(cnn_logits(p, image))[label]


def cnn_logits(p, image):
    """The class logits of one image (H, W, C)."""
    h = image[None]
    i = 0
    while f"conv{i}" in p:
        h = lax.conv_general_dilated(
            h, p[f"conv{i}"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        h = jax.nn.relu(h + p[f"bias{i}"])
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        i += 1
    return h.mean((1, 2))[0] @ p["head"] + p["head_b"]


def cnn_batch(rng, n, cfg=CNN):
    s, c = cfg["image"], cfg["channels"][0]
    images = jnp.asarray(rng.normal(size=(n, s, s, c)), jnp.float32)
    return images, jnp.asarray(rng.integers(0, cfg["classes"], n), "i4")


def _sizes(quick: bool) -> tuple[dict, dict]:
    """The language model's and the convnet's configurations, full or tiny."""
    lm = dict(LM, vocab=64, width=16, positions=4, blocks=2, heads=2) if quick else LM
    cnn = dict(CNN, channels=(3, 4, 8), image=8) if quick else CNN
    return lm, cnn


def models(quick: bool = False) -> dict:
    """name -> (params maker, loss, batch maker), at full or tiny (`quick`) size."""
    lm, cnn = _sizes(quick)

    def lm_model(**kw):
        return (
            lambda rng: lm_params(rng, lm, **kw),
            lambda p, tokens, targets: lm_loss(p, tokens, targets, lm["heads"]),
            lambda rng, n: lm_batch(rng, n, lm),
        )

    d, v, t = lm["width"], lm["vocab"], lm["positions"]
    return {
        f"GPT-style LM (V={v}, d={d}, T={t}, {lm['blocks']} blocks), untied head": (
            lm_model()
        ),
        "same, head tied to the embedding": lm_model(tied=True),
        "same, blocks stacked and run by lax.scan (remat)": lm_model(stacked=True),
        f"CIFAR-style convnet {'->'.join(map(str, cnn['channels']))}, 3x3": (
            lambda rng: cnn_params(rng, cnn),
            cnn_loss,
            lambda rng, n: cnn_batch(rng, n, cnn),
        ),
    }


def output_models(quick: bool = False) -> dict:
    """name -> (params maker, model output of one example `(params, x)`, inputs
    maker `(rng, n) -> x`): the models of `models` before their loss."""
    lm, cnn = _sizes(quick)

    def lm_model(**kw):
        return (
            lambda rng: lm_params(rng, lm, **kw),
            lambda p, tokens: lm_logits(p, tokens, lm["heads"]),
            lambda rng, n: lm_batch(rng, n, lm)[0],
        )

    d, v, t = lm["width"], lm["vocab"], lm["positions"]
    return {
        f"GPT-style LM (V={v}, d={d}, T={t}, {lm['blocks']} blocks), untied head": (
            lm_model()
        ),
        "same, head tied to the embedding": lm_model(tied=True),
        "same, blocks stacked and run by lax.scan (remat)": lm_model(stacked=True),
        f"CIFAR-style convnet {'->'.join(map(str, cnn['channels']))}, 3x3": (
            lambda rng: cnn_params(rng, cnn),
            cnn_logits,
            lambda rng, n: cnn_batch(rng, n, cnn)[0],
        ),
    }


def family_outputs(quick: bool = False) -> dict:
    """name -> (params maker, model output of one example, inputs maker), as
    `output_models`, for the model families of `bench_families` beyond the DP
    models: a convnet in the NCHW layout, a GRU, an Equinox and a Flax linen
    convnet (each maker builds the family at the size it is asked for)."""
    import bench_families as families

    cases = {
        "convnet NCHW (families)": families.cnn_nchw,
        "GRU (families)": families.gru,
        "Equinox convnet (families)": families.eqx_cnn,
        "Flax linen convnet (families)": families.linen_cnn,
    }
    out = {}
    for name, family in cases.items():
        _, model, _ = family(np.random.default_rng(0), 1, quick)
        out[name] = (
            lambda rng, f=family: f(rng, 1, quick)[0],
            model,
            lambda rng, n, f=family: f(rng, n, quick)[2],
        )
    return out


def vit_params(rng, cfg=VIT):
    d, s, k = cfg["width"], cfg["image"], cfg["patch"]
    lm = {"vocab": 1, "width": d, "positions": (s // k) ** 2, "blocks": cfg["blocks"]}
    p = lm_params(rng, lm, tied=True)
    del p["emb"]
    p["patch"] = _normal(rng, k * k * 3, d)
    p["patch_b"] = jnp.zeros(d)
    p["head"] = _normal(rng, d, cfg["classes"])
    return p


def vit_logits(p, image, cfg=VIT):
    """The class logits of one image (H, W, 3)."""
    s, k = cfg["image"], cfg["patch"]
    patches = image.reshape(s // k, k, s // k, k, 3).transpose(0, 2, 1, 3, 4)
    h = patches.reshape((s // k) ** 2, k * k * 3) @ p["patch"] + p["patch_b"]
    h = h + p["pos"]
    for b in p["blocks"]:
        h = _block(b, h, cfg["heads"], causal=False)
    return layer_norm(h, p["lnf_s"], p["lnf_b"]).mean(0) @ p["head"]


def vit_loss(p, image, label, cfg=VIT):
    return -jax.nn.log_softmax(vit_logits(p, image, cfg))[label]


def vit_batch(rng, n, cfg=VIT):
    return cnn_batch(rng, n, {"image": cfg["image"], "channels": (3,), **cfg})


def mlp_params(rng, cfg=MLP):
    w = cfg["widths"]
    return [{"w": _normal(rng, a, b), "b": jnp.zeros(b)} for a, b in zip(w[:-1], w[1:])]


def mlp_loss(p, x, y):
    for layer in p[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.sum((x @ p[-1]["w"] + p[-1]["b"] - y) ** 2)


def mlp_batch(rng, n, cfg=MLP):
    w = cfg["widths"]
    x = jnp.asarray(rng.normal(size=(n, w[0])), jnp.float32)
    return x, jnp.asarray(rng.normal(size=(n, w[-1])), jnp.float32)
