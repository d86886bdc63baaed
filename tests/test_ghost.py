"""`method="ghost"` of `clipped_grad` / `clipped_grad_sum` against `method="vmap"`
(and a hand-written `jax.vmap(jax.grad)` reference), `ghost_report`'s rules, and the
memory it saves. https://github.com/ (issue 14)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import chunkvmap
from chunkvmap import clipped_grad, clipped_grad_sum, ghost_report

from .helpers import temp_bytes, tree_allclose


def keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


# -- models ----------------------------------------------------------------------------


def mlp_params(sizes=(5, 8, 3), seed=0):
    ks = keys(len(sizes), seed)
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = jax.random.normal(ks[i], (a, b)) / a**0.5
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
    k = keys(5, 1)
    return {
        "E": jax.random.normal(k[0], (V, D)),  # gather + tied output layer
        "wide": jax.random.normal(k[1], (D, 3 * D)) / 3,  # T^2 = 16 <= 108: ghost
        "small": jax.random.normal(k[2], (3 * D, 2)) / 3,  # 16 > 36? no: ghost
        "tiny": jax.random.normal(k[3], (2, 2)),  # T^2 = 16 > 4: instantiated
        "tied": jax.random.normal(k[4], (D, D)) / 2,  # x @ W and h @ W.T
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
    k = keys(2, seed)
    return (
        jax.random.randint(k[0], (n, T), 0, V),
        jax.random.randint(k[1], (n,), 0, V),
    )


# -- exactness -------------------------------------------------------------------------


def test_mlp_against_hand_written_reference():
    """jax.vmap(jax.grad) + clip + sum by hand, N = 9, chunks of 4 (not a divisor),
    under jax.jit."""
    p = mlp_params()
    k = keys(2, 3)
    x, y = jax.random.normal(k[0], (9, 5)), jax.random.normal(k[1], (9, 3))
    grads = jax.jit(jax.vmap(jax.grad(mlp_loss), (None, 0, 0)))(p, x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(9, -1) ** 2, 1) for g in grads.values()))
    factor = jnp.minimum(1.0, 0.5 / norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(factor, g, 1), grads)
    total, count, got_norms = jax.jit(
        clipped_grad_sum(mlp_loss, 0.5, batch_size=4, return_norms=True, method="ghost")
    )(p, x, y)
    tree_allclose((total, got_norms), (expected, norms), rtol=1e-5, atol=1e-6)
    assert int(count) == 9


def test_sequence_model_tied_and_fallbacks():
    """Dense layers at every position (both sides of the mixed rule), a matrix used in
    two dots (once transposed), a tied embedding (gather: per-example) and an
    elementwise scale, with values, norms and aux; N = 6, chunks of 3 (a
    divisor)."""
    p = seq_params()
    tokens, target = seq_batch(6)

    def loss_aux(p, batch):
        tok, tgt = batch
        return seq_loss(p, tok[0], tgt[0]), {"first": tok[0, 0]}

    opts = dict(
        l2_clip_norm=0.3,
        has_aux=True,
        return_values=True,
        return_grad_norms=True,
        microbatch_size=3,
    )
    expected = clipped_grad(loss_aux, **opts)(p, (tokens, target))
    actual = clipped_grad(loss_aux, **opts, method="ghost")(p, (tokens, target))
    tree_allclose(actual, expected, rtol=2e-5, atol=1e-6)


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


def test_equinox_module_and_nan_safe():
    """An Equinox MLP as the parameter (non-float leaves get None), with jax-privacy's
    defaults (a batch of one, nan_safe=True) and a NaN example, under jit."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    k = keys(2, 4)
    x, y = jax.random.normal(k[0], (6, 4)), jax.random.normal(k[1], (6, 2))
    x = x.at[2, 1].set(jnp.nan)

    def loss(m, xy):
        return jnp.sum((jax.vmap(m)(xy[0]) - xy[1]) ** 2)

    opts = dict(l2_clip_norm=0.5, return_grad_norms=True, microbatch_size=4)
    expected = clipped_grad(loss, **opts)(model, (x, y))
    actual = eqx.filter_jit(clipped_grad(loss, **opts, method="ghost"))(model, (x, y))
    tree_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(actual[0]))
    assert bool(jnp.isnan(actual[1].grad_norms[2]))
    rules = set(ghost_report(loss, model, (x[:1], y[:1])).as_dict().values())
    assert rules == {"ghost", "per-example"}  # weights ghost, biases per-example


def test_prng_argnum():
    """Regression: with `prng_argnum`, the key argument is split into one key per
    example (mapped) but passed to `fun` without a batch axis; ghost traced it with
    all N keys ("normal accepts a single key, but was given a key array of shape
    (5,)")."""

    def loss(p, xy, key):
        x, y = xy
        noise = 0.1 * jax.random.normal(key, x.shape)
        return jnp.sum((jnp.tanh((x + noise) @ p["w0"] + p["b0"][None]) - y) ** 2)

    p = mlp_params((3, 2))
    k = keys(3, 5)
    xy = (jax.random.normal(k[0], (5, 3)), jax.random.normal(k[1], (5, 2)))
    opts = dict(l2_clip_norm=0.5, return_values=True, prng_argnum=2, batch_size=2)
    expected = clipped_grad(loss, **opts)(p, xy, k[2])
    actual = jax.jit(clipped_grad(loss, **opts, method="ghost"))(p, xy, k[2])
    tree_allclose(actual, expected, rtol=1e-5, atol=1e-6)


# -- memory ----------------------------------------------------------------------------


def test_memory_wide_mlp():
    """MLP 256-512-512-10, N = 256, chunks of 64: XLA's compiled temp bytes of ghost
    clipping are far below per-example gradients' (measured 1.77 MiB vs 97.6 MiB,
    55x; asserted 20x)."""
    p = mlp_params((256, 512, 512, 10))
    x, y = jnp.ones((256, 256)), jnp.ones((256, 10))
    vmap = temp_bytes(clipped_grad_sum(mlp_loss, 1.0, batch_size=64), p, x, y)
    ghost = temp_bytes(
        clipped_grad_sum(mlp_loss, 1.0, batch_size=64, method="ghost"), p, x, y
    )
    assert 20 * ghost < vmap, (ghost, vmap)


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
