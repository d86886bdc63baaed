"""`method="ghost"` of `clipped_grad` / `clipped_grad_sum` against `method="vmap"`
(and a hand-written `jax.vmap(jax.grad)` reference), `ghost_report`'s rules, and the
memory it saves. https://github.com/ (issue 14)"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap
from chunkvmap import clipped_grad, clipped_grad_sum, ghost_report

from .helpers import (
    clip_and_sum,
    clipped_sum,
    make_mesh,
    mesh_devices,
    temp_bytes,
    tree_allclose,
)


# Test data from NumPy: eager jax.random compiles one kernel per shape, which is most
# of a small test's time on CPU.
# Inputs are made with NumPy and transferred with `jax.device_put`: an array op run
# eagerly compiles a program per shape (so does `jnp.asarray` of a NumPy array).
def normal(seed, *shape, scale=1.0):
    x = np.random.default_rng(seed).normal(size=shape) * scale
    return jax.device_put(x.astype(np.float32))


def integers(seed, high, *shape):
    x = np.random.default_rng(seed).integers(0, high, shape)
    return jax.device_put(x.astype(np.int32))


def clipped_by_hand(loss, params, one_each, clip, pad=None):
    """The clipped sum by hand, as nan_safe defines it: each example's gradient with
    its non-finite entries zeroed, scaled by min(1, clip / norm), and by 0 where
    `pad` marks a padding example."""
    return clipped_sum(loss, clip, (params, one_each), finite_only=True, pad=pad)[0]


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


def test_mlp_against_the_oracle():
    """The clipped sum and norms of `helpers.clipped_sum`, N = 9, chunks of 4 (not a
    divisor), under jax.jit."""
    p = mlp_params()
    x, y = normal(30, 9, 5), normal(31, 9, 3)
    expected, norms = clipped_sum(mlp_loss, 0.5, (p, x, y))
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
    # clipped_grad's default nan_safe=True masks non-finite entries through the
    # activations, so it holds no more than nan_safe=False (2.87 vs 2.81 MiB; forming
    # the gradients to mask them took 8.4 MiB).
    safe, unsafe = (
        temp_bytes(
            clipped_grad(
                lambda p, xy: mlp_loss(p, *xy), l2_clip_norm=1.0, microbatch_size=64,
                keep_batch_dim=False, method="ghost", nan_safe=flag,
            ),
            p, (x, y),
        )
        for flag in (True, False)
    )  # fmt: skip
    assert safe <= 1.05 * unsafe, (safe, unsafe)


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


@pytest.mark.parametrize("zero_sum", [True, False])
def test_bfloat16_records_with_a_large_common_part(zero_sum):
    """bf16 activations sharing a large part over 16 positions (30 + noise), their
    cotangents summing to zero over the positions (a softmax over them) or not: the
    ghost norms, whose bf16 records are centred in f32 and kept in bf16, match the
    norms of the f32 gradients of the same bf16 values to bf16 precision."""

    def loss(w, x):  # x: (T, D) bf16 values, the product accumulated in f32
        h = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        if zero_sum:
            return -jax.nn.log_softmax(h[:, 0])[3] + jnp.sum(h[:, 1:] ** 2) * 0
        return jnp.sum(jnp.tanh(h) * jnp.arange(1.0, h.shape[1] + 1)[None, :])

    w = normal(70, 64, 64, scale=0.02)
    x = (30.0 + normal(71, 5, 16, 64)).astype(jnp.bfloat16)
    ghost = clipped_grad(
        loss, l2_clip_norm=jnp.inf, return_grad_norms=True, method="ghost",
        keep_batch_dim=False, batch_size=3,
    )  # fmt: skip
    with warnings.catch_warnings():  # ghost runs for its memory here
        warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
        norms = jax.jit(ghost)(w, x)[1].grad_norms

    def f32_loss(w, x):  # the same values, in float32 throughout
        return loss(w, x.astype(jnp.float32).astype(jnp.bfloat16))

    grads = jax.vmap(jax.grad(f32_loss), (None, 0))(w, x)
    expected = jnp.sqrt(jnp.sum(grads.astype(jnp.float32) ** 2, (1, 2)))
    np.testing.assert_allclose(norms, expected, rtol=1e-2)


@pytest.mark.parametrize("call", ["eager", "jit"])
def test_padding_with_infinite_gradients_leaves_a_per_example_leaf_out(
    always_ghost, call
):
    """A ghost program with a per-example leaf (`s`, used through `s**2`) beside a
    ghost one (`w`), its chunk sum one contraction per leaf: padding examples whose
    gradients would be infinite and NaN (`x_0 = 0`) never reach the sum, without
    nan_safe; N = 11 in chunks of 4, eager and jitted."""

    def loss(p, x):
        h = jnp.tanh(x[1:] @ p["w"]) * jnp.log(jnp.abs(x[0]))
        return jnp.sum(h * p["s"] ** 2)

    rng = np.random.default_rng(8)
    p = {"w": normal(80, 3, 16, scale=0.3), "s": normal(81, 16)}
    x = rng.normal(size=(11, 4)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 0.5
    pad = np.arange(11) >= 8
    x[9, 0] = 0.0  # a padding example's infinite and NaN gradient
    cg = clipped_grad(
        loss, l2_clip_norm=0.7, keep_batch_dim=False, batch_size=4, nan_safe=False,
        method="ghost",
    )  # fmt: skip
    run = cg if call == "eager" else jax.jit(cg)
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="per-example gradients"):
        got = run(p, jnp.asarray(x), is_padding_example=jnp.asarray(pad))
    assert ghost_report(loss, p, jnp.asarray(x[0])).as_dict() == {
        "args[0]['s']": "per-example",
        "args[0]['w']": "ghost",
    }
    grads = jax.vmap(jax.grad(loss), (None, 0))(p, jnp.asarray(x[~pad]))
    tree_allclose(got, clip_and_sum(grads, 0.7)[0], rtol=1e-5, atol=1e-6)


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
    explicit = make_mesh((8,), ("data",), (jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(explicit):
        data = jax.sharding.NamedSharding(explicit, jax.P("data"))
        xs, ys = jax.device_put((x, y), data)
        out = jax.jit(clipped("ghost", batch_size=2))(p, xs, ys)
    tree_allclose(out, expected, rtol=1e-5, atol=1e-5)
    auto_mesh = make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
    out = clipped("ghost", batch_size=2, shard=True, mesh=auto_mesh)(p, x, y)
    tree_allclose(out, expected, rtol=1e-5, atol=1e-5)

    def outer(method):
        def f(x):
            total = clipped(method, batch_size=5)(p, x, y)[0]
            return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(total))

        return jax.jit(jax.grad(f))(x)

    tree_allclose(outer("ghost"), outer("vmap"), rtol=1e-4, atol=1e-5)


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

    grads = jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(p, one_each)
    assert not bool(jnp.isfinite(grads["lin"][2]).all()) and bool(
        jnp.isfinite(grads["w1"][2]).all()
    )
    assert not bool(jnp.isfinite(grads["emb"][2]).all()) and bool(
        jnp.isfinite(grads["emb"][2][0]).all()
    )
    pad = jnp.array([False, True, False, False, False, True, False])
    results = [
        jax.jit(clipped_grad(loss, **opts, method=m))(p, xz, is_padding_example=pad)
        for m in ("vmap", "ghost")
    ]
    tree_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    # the norms as they are: non-finite for examples 2 (NaN) and 4 (inf; with ghost
    # NaN, as documented), equal elsewhere
    norms = [r[1].grad_norms for r in results]
    finite = jnp.isfinite(norms[0])
    assert finite.tolist() == [True, True, False, True, False, True, True]
    assert jnp.isfinite(norms[1]).tolist() == finite.tolist()
    np.testing.assert_allclose(norms[1][finite], norms[0][finite], rtol=1e-5)
    expected = clipped_by_hand(loss, p, one_each, 1.5, pad)
    tree_allclose(results[1][0], expected, rtol=1e-5, atol=1e-6)
    # dtype=: the sum cast (method="vmap" casts each gradient first: bf16 precision)
    bf16 = jax.jit(clipped_grad(loss, **opts, dtype=jnp.bfloat16, method="ghost"))
    got = bf16(p, xz, is_padding_example=pad)[0]
    tree_allclose(got, jax.tree.map(lambda e: e.astype(jnp.bfloat16), expected))


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


def _wide_over_positions(p, x):
    """A dense layer 256 -> 256 over 64 positions: its ghost norm (positions^2 x
    widths) costs more than moving its per-example gradient (widths^2), which is
    much larger than the activations it keeps."""
    return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)


def _sequence_net(p, x, y):
    """A dense layer over 64 positions (its ghost norm costs more than forming its
    gradient, which is no larger than its operands) and a small dense head."""
    h = jnp.tanh(x @ p["w"]).mean(0)
    return jnp.sum((h @ p["head"] - y) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_ghost_runs_the_vmap_program_where_it_is_predicted_no_faster(jit):
    """A model where only a tiny head has a ghost norm gains nothing from the ghost
    program: method="ghost" runs the vmap program itself (the same jaxpr, the same
    compiled memory) and says why, once. N = 13 in chunks of 5, eager and under
    jit; the statistics decide the same way."""
    p = {"w": normal(110, 32, 32, scale=0.2), "head": normal(112, 32, 2)}
    x, y = normal(113, 13, 64, 32), normal(114, 13, 2)
    report = ghost_report(_sequence_net, p, x[0], y[0])
    assert report.runs == "vmap" and not report.slower
    assert report.rule("args[0]['head']") == "ghost"
    assert "predicted no faster" in report.why and report.why in str(report)
    wrap = jax.jit if jit else (lambda f: f)
    ghost = clipped_grad_sum(_sequence_net, 1.0, batch_size=5, method="ghost")
    vmap = clipped_grad_sum(_sequence_net, 1.0, batch_size=5)
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="runs as method='vmap'"):
        total, count = wrap(ghost)(p, x, y)
    tree_allclose(total, clipped_sum(_sequence_net, 1.0, (p, x, y))[0], rtol=1e-5)
    assert int(count) == 13
    assert str(jax.make_jaxpr(ghost)(p, x, y)) == str(jax.make_jaxpr(vmap)(p, x, y))
    assert temp_bytes(ghost, p, x, y) == temp_bytes(vmap, p, x, y)
    stats = chunkvmap.per_example_grad_stats(
        _sequence_net, batch_size=5, method="ghost"
    )
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="runs as method='vmap'"):
        got = wrap(stats)(p, x, y)
    want = chunkvmap.per_example_grad_stats(_sequence_net, batch_size=5)(p, x, y)
    tree_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_verdict_measures_the_programs_that_run(monkeypatch):
    """Where `method="ghost"` checks the memory of a ghost program predicted slower
    (on CPU), it compiles the very programs a call runs, for the call's chunk of 8:
    their figures are those of `clipped_grad_sum` by each method on 8 examples.
    For a scanned stack the ghost program is its two passes, within the
    non-private bound; the vmap program is not."""
    with jax.default_device(jax.devices("cpu")[0]):  # (the verdict CPU makes)
        _check_the_verdict_measures_the_programs_that_run(monkeypatch)


def _check_the_verdict_measures_the_programs_that_run(monkeypatch):
    from chunkvmap._core import _memory
    from chunkvmap._quantities import _choice

    p, net, x, y = _scanned_stack(True)
    x, y = x[:8], y[:8]
    seen = []
    measure = _choice.compiled_memory
    monkeypatch.setattr(_choice, "_needs_memory", lambda report: True)
    monkeypatch.setattr(_memory, "HOST_FRACTION", 0.0)  # (no chunk fits)
    monkeypatch.setattr(
        _choice, "compiled_memory", lambda *a: seen.append(measure(*a)) or seen[-1]
    )
    ghost = clipped_grad_sum(net, 1.0, batch_size=8, method="ghost")
    vmap = clipped_grad_sum(net, 1.0, batch_size=8)
    ghost(p, x, y)
    (figures,) = seen
    want_ghost, want_vmap = temp_bytes(ghost, p, x, y), temp_bytes(vmap, p, x, y)
    assert figures["ghost"] == pytest.approx(want_ghost, rel=0.02)
    assert figures["vmap"] == pytest.approx(want_vmap, rel=0.02)
    assert figures["ghost"] <= _private_bound(net, 8, p, x, y) < figures["vmap"]


def test_a_weight_every_iteration_reads_keeps_its_cross_terms():
    """Beside a stack's layers (each iteration its own slice, their norms taken per
    iteration), a recurrent weight every iteration reads whole: its gradient sums
    over the iterations, so its norm is not taken per iteration. Norms and sums as
    `jax.grad`'s."""
    D = 64
    p = {
        "w": normal(150, 4, D, D, scale=D**-0.5),
        "u": normal(151, D, D, scale=D**-0.5),
        "head": normal(152, D, 2, scale=D**-0.5),
    }

    def net(p, x, y):
        def step(h, w):
            return jnp.tanh(h @ w + jnp.tanh(h @ p["u"])), None

        h, _ = jax.lax.scan(step, x, p["w"])
        return jnp.sum((h.mean(0) @ p["head"] - y) ** 2)

    x, y = normal(153, 9, 2, D), normal(154, 9, 2)
    report = ghost_report(net, p, x[0], y[0])
    assert report.runs == "ghost" and report.rule("args[0]['u']") == "ghost"
    want, norms = clipped_sum(net, 1.0, (p, x, y))
    norm_of = chunkvmap.per_example_grad_norms(net, batch_size=4, method="ghost")
    tree_allclose(norm_of(p, x, y), norms, rtol=2e-5, atol=1e-6)
    total, _ = clipped_grad_sum(net, 1.0, batch_size=4, method="ghost")(p, x, y)
    tree_allclose(total, want, rtol=2e-5, atol=1e-6)


# How a stack's `xs` is made from a leaf: shared by every layer (each iteration reads
# the same entries: not a ghost stack), or proven to give each layer its own slice.
_SHARED_STACKS = {
    "broadcast_to": lambda w: jnp.broadcast_to(w, (3, *w.shape)),
    "repeat": lambda w: jnp.repeat(w[None], 3, axis=0),
    "tile": lambda w: jnp.tile(w[None], (3, 1, 1)),
}
_OWN_SLICES = {
    "identity": lambda w: w,
    "transposed": lambda w: jnp.transpose(w, (1, 0, 2)),
    "sliced": lambda w: w[1:],
    "cast": lambda w: w.astype(jnp.float32) * 0.5,
}


@pytest.mark.parametrize("how", [*_SHARED_STACKS, *_OWN_SLICES])
def test_a_stack_shares_a_weight_only_where_proven_disjoint(how):
    """A weight every layer of a scanned stack shares (`broadcast_to`, `repeat`,
    `tile` fed to `lax.scan` as `xs`) has one gradient, the sum over the layers:
    its iterations' norms do not add, and a clipped sum must stay within the bound
    (its ghost norms were 7.7% off and one example's clipped sum had norm 0.5277
    for a bound of 0.5). Only a leaf whose scanned axis is one of its own axes is
    taken per iteration. Norms and clipped sums as `jax.vmap(jax.grad)`'s."""
    D = 64
    shared = how in _SHARED_STACKS
    make = {**_SHARED_STACKS, **_OWN_SLICES}[how]
    shape = (D, D) if shared else ((D, 3, D) if how == "transposed" else (4, D, D))
    p = {"w": normal(160, *shape, scale=0.7 * D**-0.5)}

    def net(p, x, y):
        def step(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(step, x, make(p["w"]))
        return jnp.sum((h - y) ** 2)

    x, y = normal(161, 7, D), normal(162, 7, D)
    report = ghost_report(net, p, x[0], y[0])
    assert report.rule("args[0]['w']") == ("per-example" if shared else "ghost")
    want, norms = clipped_sum(net, 0.5, (p, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
        norm_of = chunkvmap.per_example_grad_norms(net, batch_size=4, method="ghost")
        tree_allclose(norm_of(p, x, y), norms, rtol=2e-5, atol=1e-6)
        clip = clipped_grad_sum(net, 0.5, batch_size=4, method="ghost")
        total, _ = clip(p, x, y)
        one, _ = clip(p, x[:1], y[:1])
    tree_allclose(total, want, rtol=2e-5, atol=1e-6)
    assert float(jnp.linalg.norm(one["w"])) <= 0.5 * (1 + 1e-6)


def _private_bound(net, batch_size, p, *data):
    """What ghost clipping may hold (XLA's compiled temporary bytes): 1.5x the
    non-private step's (`jax.grad` of the loss summed over the same chunks) plus
    three parameter copies."""
    chunked = chunkvmap.batch_vmap(net, (None, 0, 0), batch_size=batch_size)

    def non_private(p, *data):
        return jax.grad(lambda p: chunked(p, *data).sum())(p)

    params = sum(a.nbytes for a in jax.tree.leaves(p))
    return 1.5 * temp_bytes(non_private, p, *data) + 3 * params


@pytest.mark.parametrize("groups", [1, 4])
def test_convolutions_run_ghost_near_the_non_private_memory(groups):
    """A convnet's kernels, plain and grouped (NCHW): the ghost program forms their
    gradients from the input's shifted views, one window offset at a time (no
    patches), and runs where the vmap program would run XLA's per-example kernel
    gradients. Its compiled memory stays within 1.5x the non-private step's on the
    same chunks, plus a few parameter copies; the sum is exact."""
    p = {
        "c": normal(120, 16, 16 // groups, 3, 3, scale=0.2),
        "b": normal(121, 16),
        "head": normal(122, 16, 2),
    }

    def net(p, img, y):
        h = jax.lax.conv_general_dilated(
            img[None], p["c"], (1, 1), "SAME", feature_group_count=groups
        )[0]
        h = jnp.tanh(h + p["b"][:, None, None]).mean((1, 2))
        return jnp.sum((h @ p["head"] - y) ** 2)

    img, y = normal(123, 13, 16, 12, 12), normal(124, 13, 2)
    report = ghost_report(net, p, img[0], y[0])
    assert report.runs == "ghost" and not report.slower, report.why
    f = clipped_grad_sum(net, 1.0, batch_size=5, method="ghost")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total, _ = jax.jit(f)(p, img, y)
    tree_allclose(total, clipped_sum(net, 1.0, (p, img, y))[0], rtol=1e-5, atol=1e-6)
    assert temp_bytes(f, p, img, y) <= _private_bound(net, 5, p, img, y)


def _scanned_stack(nested: bool):
    """Layers of `tanh(h @ W_l + b_l)` run by `lax.scan` over their stacked
    parameters, each step under `jax.checkpoint`, then a shared head; `nested`: the
    stack is two scans deep (4 blocks of 2 layers)."""
    D, lead = 64, ((4, 2) if nested else (8,))
    p = {
        "w": normal(140, *lead, D, D, scale=D**-0.5),
        "b": normal(141, *lead, D, scale=0.1),
        "head": normal(142, D, 3, scale=D**-0.5),
    }

    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b[None]), None

    def net(p, x, y):
        step = jax.checkpoint(layer)
        if nested:  # 4 blocks of 2 layers
            block = lambda h, wb: jax.lax.scan(step, h, wb)  # noqa: E731
            h, _ = jax.lax.scan(block, x, (p["w"], p["b"]))
        else:
            h, _ = jax.lax.scan(step, x, (p["w"], p["b"]))
        return jnp.sum((h.mean(0) @ p["head"] - y) ** 2)

    return p, net, normal(143, 45, 8, D), normal(144, 45, 3)


@pytest.mark.parametrize("nested", [False, True], ids=["scan", "nested scans"])
def test_a_rematerialised_scan_clips_in_the_non_private_memory(nested):
    """A stack of layers scanned over its stacked parameters under `jax.checkpoint`,
    N = 45 in chunks of 16: each layer's norm is taken in the backward pass, one
    iteration at a time (nothing recorded), and the clipped sum is a second
    backward pass weighted by the clip factors; padding and (with nan_safe)
    non-finite examples are left out of it, the latter formed apart. Norms and
    sums as `jax.grad`'s, eagerly, under `jit` and under `grad`; `clipped_grad_sum`,
    `clipped_grad` and the norms hold no more than 1.5x the non-private step plus
    three parameter copies (keeping every layer's activations and cotangents for
    the chunk held up to four times more). The nested stack: the sum and the norms,
    eagerly, and their memory (the rest takes the same route as one scan's)."""
    p, net, x, y = _scanned_stack(nested)
    assert "second backward pass" in ghost_report(net, p, x[0], y[0]).why
    want, norms = clipped_sum(net, 1.0, (p, x, y))
    f = clipped_grad_sum(net, 1.0, batch_size=16, method="ghost", return_norms=True)
    for call in (f,) if nested else (f, jax.jit(f)):
        total, count, got = call(p, x, y)
        assert count == 45
        tree_allclose(total, want, rtol=2e-5, atol=1e-6)
        tree_allclose(got, norms, rtol=2e-5, atol=1e-6)
    by_norms = chunkvmap.per_example_grad_norms(net, batch_size=16, method="ghost")
    tree_allclose(by_norms(p, x, y), norms, rtol=2e-5, atol=1e-6)
    bound = _private_bound(net, 16, p, x, y)
    for program in (f, by_norms):
        assert temp_bytes(program, p, x, y) <= bound
    if nested:
        return
    # a padded buffer, its padding non-finite: left out of the weighted pass
    pad = np.arange(45) >= 40
    total, count, _ = f(p, x.at[42, 0, 0].set(jnp.nan), y, is_padding_example=pad)
    assert count == 40
    tree_allclose(total, clipped_sum(net, 1.0, (p, x[:40], y[:40]))[0], rtol=2e-5)
    # nan_safe (clipped_grad's default): an example whose gradient is non-finite
    # but for the head's first column is formed apart, its finite entries clipped
    safe = clipped_grad(
        net, l2_clip_norm=1.0, return_grad_norms=True, method="ghost",
        keep_batch_dim=False, batch_size=16, batch_argnums=(1, 2),
    )  # fmt: skip
    bad = y.at[3, 1].set(jnp.inf)
    one = clipped_sum(net, 1.0, (p, x[3:4], bad[3:4]), finite_only=True)[0]
    assert float(jnp.abs(one["head"][:, 0]).max()) > 0  # (what is fixed is not zero)
    padded = jax.jit(lambda *a: safe(*a, is_padding_example=pad))
    worse = x.at[42, 0, 0].set(jnp.nan)  # (non-finite everywhere: its sum is zero)
    for call, n in ((safe, 45), (padded, 40)):
        total, aux = call(p, worse, bad)
        kept, _ = clipped_sum(net, 1.0, (p, worse[:n], bad[:n]), finite_only=True)
        tree_allclose(total, kept, rtol=2e-5, atol=1e-6)
        nonfinite = jnp.flatnonzero(~jnp.isfinite(aux.grad_norms)).tolist()
        assert nonfinite == [3, 42][: 2 if n == 45 else 1]

    def outer(p, f):  # a function of the parameters through the clipped sum
        total = f(p, x, y)[0]
        return sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(total))

    tree_allclose(
        jax.grad(outer)(p, f),
        jax.grad(outer)(p, clipped_grad_sum(net, 1.0, batch_size=16, method="vmap")),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    assert temp_bytes(safe, p, x, y) <= bound


@pytest.mark.parametrize(
    "layout, groups, channels, size",
    [
        # (running its wide convolutions, not compiling them, takes the time)
        pytest.param("NHWC", 4, (128, 256), 4, marks=pytest.mark.optimized),
        pytest.param("NCHW", 4, (64, 256), 8, marks=pytest.mark.optimized),
        ("NHWC", 32, (32, 64), 4),
    ],
    ids=["grouped-gram", "grouped-entries", "depthwise"],
)
def test_grouped_convolutions_clip_in_the_non_private_memory(
    layout, groups, channels, size
):
    """Grouped convolutions (128 to 256 channels in 4 groups on 4x4 images, in chunks
    of 32; 64 to 256 on 8x8; depthwise), N = 45: `clipped_grad` (nan_safe=True)
    and `clipped_grad_sum` (nan_safe=False) by ghost hold no more than 1.5x the
    non-private step plus three parameter copies (the last window summarised at
    the chunk's length, with the examples earlier chunks counted uncounted). The
    kernel's norm comes from the input's windows (their Gram over few positions,
    each offset's kernel entries over many), its non-finite entries are masked
    per window column, and a depthwise kernel (smaller than its operands) is
    formed. With a NaN and an infinity in two examples' images: values and norms
    as `jax.grad`'s, example by example."""
    c_in, c_out = channels
    nhwc = layout == "NHWC"
    kernel = (3, 3, c_in // groups, c_out) if nhwc else (c_out, c_in // groups, 3, 3)
    p = {"k": normal(130, *kernel, scale=0.05), "b": normal(131, c_out, scale=0.1)}
    p["head"] = normal(132, c_out, 10, scale=0.05)
    dn = (layout, "HWIO" if nhwc else "OIHW", layout)

    def net(p, img, y):
        h = jax.lax.conv_general_dilated(
            img[None] + 2.0, p["k"], (1, 1), "SAME", dimension_numbers=dn,
            feature_group_count=groups,
        )[0]  # fmt: skip
        h = jnp.tanh(h + (p["b"][None, None] if nhwc else p["b"][:, None, None]))
        return jnp.sum((h.mean((0, 1) if nhwc else (1, 2)) @ p["head"] - y) ** 2)

    def data(n):
        shape = (n, size, size, c_in) if nhwc else (n, c_in, size, size)
        return normal(133, *shape), normal(134, n, 10)

    img, y = data(45)
    bad = img.at[3, 1, 2, 1].set(jnp.nan).at[30, 2, 0, 0].set(jnp.inf)
    opts = dict(keep_batch_dim=False, batch_size=32, batch_argnums=(1, 2))
    safe = clipped_grad(
        net, l2_clip_norm=1.0, return_grad_norms=True, method="ghost", **opts
    )
    total, aux = jax.jit(safe)(p, bad, y)
    # (the gradients one example at a time: XLA:CPU's batched kernel gradient of a
    # grouped convolution spreads one example's NaN to the others)
    grads = jax.jit(jax.lax.map, static_argnums=0)(
        lambda e: jax.grad(net)(p, *e), (bad, y)
    )
    want, norms = clip_and_sum(grads, 1.0, finite_only=True)
    tree_allclose(total, want, rtol=1e-5, atol=1e-6)
    nonfinite = ~jnp.isfinite(aux.grad_norms)
    assert jnp.flatnonzero(nonfinite).tolist() == [3, 30]
    np.testing.assert_allclose(aux.grad_norms[~nonfinite], norms[~nonfinite], rtol=1e-5)
    # (its values on a grouped kernel: test_convolutions_run_ghost_near_the_...)
    plain = clipped_grad_sum(net, 1.0, batch_size=32, method="ghost")
    bound = _private_bound(net, 32, p, img, y)
    params = sum(a.nbytes for a in jax.tree.leaves(p))
    for f in (safe, plain):
        assert temp_bytes(f, p, img, y) <= bound, temp_bytes(f, p, img, y) / params


@pytest.mark.skipif(len(mesh_devices(8)) < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
    "hold, calls",
    [("mesh=", "eager"), ("set_mesh", "jit"), ("set_mesh + placed", "jit")],
)
def test_convolution_windows_wherever_the_mesh_is_held(hold, calls):
    """Kernels whose norms come from their input's windows (a grouped one, each
    offset's kernel entries; a wide one, the views' Gram), `clipped_grad` with
    nan_safe masking, on an Explicit mesh passed (`shard=True`), entered
    (`shard=True`) or holding the placed inputs, eagerly or under `jit` (each
    way of holding meets each call in this test or the scanned stack's): the
    unsharded call's values (N = 45; placed, 48)."""
    p = {
        "k1": normal(141, 3, 3, 8, 64, scale=0.1),
        "k2": normal(142, 3, 3, 64, 128, scale=0.05),
        "head": normal(143, 128, 3, scale=0.1),
    }
    dn = ("NHWC", "HWIO", "NHWC")

    def net(p, img, y):
        h = jax.lax.conv_general_dilated(
            img[None] + 1.0, p["k1"], (1, 1), "SAME", dimension_numbers=dn,
            feature_group_count=4,
        )  # fmt: skip
        h = jax.lax.conv_general_dilated(
            jnp.tanh(h), p["k2"], (1, 1), "SAME", dimension_numbers=dn
        )[0]
        return jnp.sum((jnp.tanh(h).mean((0, 1)) @ p["head"] - y) ** 2)

    n = 48 if "placed" in hold else 45
    img, y = normal(144, n, 4, 4, 32), normal(145, n, 3)
    _clipped_wherever(hold, calls, net, p, img.at[5, 1, 1, 2].set(jnp.nan), y)


def _clipped_wherever(hold, calls, net, p, *data, pad=None):
    """`clipped_grad` (ghost, nan_safe, chunks of 4) of `net` on an Explicit
    8-device mesh held as `hold` says, called as `calls` says ("eager", "jit" or
    "eager, jit"): the unsharded call's sum and norms (`pad`: the padding flags of a
    padded buffer)."""
    opts = dict(
        l2_clip_norm=1.0, keep_batch_dim=False, batch_size=4, batch_argnums=(1, 2),
        return_grad_norms=True, method="ghost",
    )  # fmt: skip
    flags = {} if pad is None else {"is_padding_example": jnp.asarray(pad)}
    want, aux = clipped_grad(net, **opts)(p, *data, **flags)
    mesh = make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    shard = {} if "placed" in hold else {"shard": True}
    if hold == "mesh=":
        shard["mesh"] = mesh
    f = clipped_grad(net, **opts, **shard)
    with jax.set_mesh(mesh) if "set_mesh" in hold else contextlib.nullcontext():
        if "placed" in hold:
            at = jax.sharding.NamedSharding(mesh, jax.P("data"))
            data = [jax.device_put(a, at) for a in data]
            flags = {k: jax.device_put(v, at) for k, v in flags.items()}
        runs = {"eager": f, "jit": jax.jit(f)}
        for call in (runs[c] for c in calls.split(", ")):
            got, got_aux = call(p, *data, **flags)
            tree_allclose(got, want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_aux.grad_norms, aux.grad_norms, rtol=1e-5)


@pytest.mark.skipif(len(mesh_devices(8)) < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
    "hold, calls",
    [("mesh=", "jit"), ("set_mesh", "eager"), ("set_mesh + placed", "eager, jit")],
)
def test_a_scanned_stack_clips_in_two_passes_wherever_the_mesh_is_held(hold, calls):
    """A scanned layer stack's two passes (norms in the backward pass, then the
    weighted pass and the non-finite examples formed apart), `clipped_grad` with
    nan_safe and a padded buffer, on an Explicit mesh passed, entered or holding
    the placed inputs, eagerly or under `jit` (placed: both): the unsharded
    call's values."""
    p, net, x, y = _scanned_stack(False)
    n = 48 if "placed" in hold else 45
    x, y = jnp.concatenate([x, x[:3]]), jnp.concatenate([y, y[:3]])
    x, y = x[:n], y.at[3, 1].set(jnp.inf)[:n]
    _clipped_wherever(hold, calls, net, p, x, y, pad=np.arange(n) % 7 == 6)


def test_ghost_warns_where_it_runs_slower_for_its_memory(monkeypatch):
    """Where the ghost program is predicted slower than the vmap program but keeps
    much less memory, the vmap program runs where its chunk fits the memory budget
    (the faster program that fits, as on an accelerator), and the ghost program
    runs where it does not, each with a warning that says so and why; where the
    ghost program is predicted faster, nothing is said."""
    import warnings

    from chunkvmap._core import _memory

    p = {"w": normal(115, 256, 256, scale=256**-0.5)}
    x = normal(116, 6, 64, 256)
    expected = clipped_sum(_wide_over_positions, 1.0, (p, x))[0]
    vmap = clipped_grad_sum(_wide_over_positions, 1.0, batch_size=6)
    # a quarter of the machine's memory holds the vmap program's chunk
    report = ghost_report(_wide_over_positions, p, x[0])
    assert report.runs == "vmap" and not report.slower, report.why
    assert "predicted slower" in report.why and "fits in memory" in report.why
    f = clipped_grad_sum(_wide_over_positions, 1.0, batch_size=6, method="ghost")
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="runs as method='vmap'"):
        total, _ = f(p, x)
    tree_allclose(total, expected, rtol=1e-4)
    assert temp_bytes(f, p, x) == temp_bytes(vmap, p, x)
    # a budget that holds no chunk: the ghost program runs for its memory
    monkeypatch.setattr(_memory, "HOST_FRACTION", 0.0)
    report = ghost_report(_wide_over_positions, p, x[0])
    assert report.runs == "ghost" and report.slower
    assert "runs for its memory" in report.why and "a budget of 0 MiB" in report.why
    f = clipped_grad_sum(_wide_over_positions, 1.0, batch_size=6, method="ghost")
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="predicted slower"):
        total, _ = f(p, x)
    tree_allclose(total, expected, rtol=1e-4)
    assert temp_bytes(f, p, x) < 0.7 * temp_bytes(vmap, p, x)

    q = {"w": normal(117, 256, 256, scale=256**-0.5)}
    one = normal(118, 6, 1, 256)  # one position: the ghost norm costs 2 x 256
    assert not ghost_report(_wide_over_positions, q, one[0]).slower
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clipped_grad_sum(_wide_over_positions, 1.0, batch_size=4, method="ghost")(
            q, one
        )


def _mlp_over_positions(p, x):
    """A position-wise MLP (d -> w -> d) over 16 positions."""
    h = jax.nn.gelu(x @ p["up"])
    return jnp.sum((h @ p["down"]) ** 2)


@pytest.mark.parametrize("d, w, runs", [(32, 96, "vmap"), (64, 192, "ghost")])
def test_a_ghost_program_predicted_to_save_memory_is_measured(d, w, runs, monkeypatch):
    """Predicted slower, the ghost program runs for its memory only where the vmap
    program's chunk does not fit the budget (here none does) and XLA's compiled
    estimate of a chunk shows it keeping a quarter less than the vmap program
    (measured for chunks of 4 to 64: 0.77-0.85x at widths 32 -> 96, where the vmap
    program runs and the warning says what was measured; 0.41-0.60x at 64 ->
    192)."""
    from chunkvmap._core import _memory

    monkeypatch.setattr(_memory, "HOST_FRACTION", 0.0)
    p = {
        "up": normal(119, d, w, scale=d**-0.5),
        "down": normal(120, w, d, scale=w**-0.5),
    }
    x = normal(121, 6, 16, d)
    report = ghost_report(_mlp_over_positions, p, x[0])
    assert report.runs == runs and report.slower == (runs == "ghost"), report.why
    assert "XLA's estimate for chunks of 64 examples" in report.why
    f = clipped_grad_sum(_mlp_over_positions, 1.0, batch_size=4, method="ghost")
    match = "saves little memory" if runs == "vmap" else "runs for its memory"
    with pytest.warns(chunkvmap.GhostFallbackWarning, match=match):
        total, _ = f(p, x)
    expected = clipped_sum(_mlp_over_positions, 1.0, (p, x))[0]
    tree_allclose(total, expected, rtol=1e-4, atol=1e-6)
    vmap = clipped_grad_sum(_mlp_over_positions, 1.0, batch_size=4)
    ratio = temp_bytes(f, p, x) / temp_bytes(vmap, p, x)
    assert ratio == 1.0 if runs == "vmap" else ratio < 0.75, ratio


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
    # (example 3 also in the last window, [2, 6): fixed once)
    z = normal(99, 6, 3, scale=1.0).at[3, 2].set(jnp.nan).at[4, 0].set(jnp.inf)
    x = normal(100, 6, 6, scale=1.0)
    opts = dict(l2_clip_norm=0.8, microbatch_size=4)
    got = jax.jit(clipped_grad(loss, **opts, method="ghost"))(p, (t, z, x))
    plan = _ghost_plan(loss, p, (t[:1], z[:1], x[:1]))
    assert plan == {
        "args[0]['E']": "other", "args[0]['pos']": "formed", "args[0]['w']": "masked"
    }  # fmt: skip
    expected = jax.jit(clipped_grad(loss, **opts))(p, (t, z, x))
    tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    one_each = (t[:, None], z[:, None], x[:, None])
    grads = jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(p, one_each)
    assert bool(jnp.isfinite(grads["w"]).all())
    by_hand = clipped_by_hand(loss, p, one_each, 0.8)
    tree_allclose(got, by_hand, rtol=1e-5, atol=1e-6)


def _ghost_plan(loss, params, example):
    """How nan_safe treats each rule leaf: "masked" (through its activations),
    "formed" (its gradient, instantiated) or "other" (fixed afterwards)."""
    from chunkvmap._quantities import ghost as _ghost

    traced = _ghost.Traced(
        loss, [params, example], {}, [0], [1], strip=False, has_aux=False,
        keep_batch_dim=False,
    )  # fmt: skip
    plan = traced.plan
    kinds = {}
    for k, leaf in enumerate(plan.leaves):
        small = leaf.size <= plan.operand_size(k)  # formed, where instantiated
        if plan.maskable(k) and not (leaf.rule == "instantiated" and small):
            kinds[leaf.path] = "masked"
        elif leaf.rule == "instantiated":
            kinds[leaf.path] = "formed"
        elif leaf.rule == "ghost":
            kinds[leaf.path] = "other"
    return kinds


def test_a_record_carries_the_plan_of_the_context_it_was_made_in():
    """A chunk's records are read by the plan that made them, carried in their
    own structure (not looked up by which example was traced last): two plans in
    one context (a replicated and a column-sharded weight on an Explicit mesh) stay
    apart through `jax.vmap`, `lax.scan` and a jitted call, and the chunk's sums
    read each by its own."""
    from chunkvmap._quantities import ghost as _ghost

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]))

    mesh = make_mesh((2,), ("m",), (jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w, x = normal(90, 4, 6), normal(91, 3, 4)
        replicated = {"w": jax.device_put(w, jax.P())}
        columns = {"w": jax.device_put(w, jax.P(None, "m"))}
        traced = _ghost.Traced(
            loss, [replicated, x], {}, [0], [1], strip=True, has_aux=False,
            keep_batch_dim=False,
        )  # fmt: skip
        plans, sums = [], []
        for params in (replicated, columns):  # the column-sharded one made last

            def chunk(p, xs):
                def one(xi):
                    return traced.record(traced.arrays([p, xi], {}), [])[0]

                records = jax.vmap(one)(xs)
                _, scanned = jax.lax.scan(lambda c, r: (c, r), 0, records)
                return records, scanned, records.chunk_sum(0)

            records, scanned, total = jax.jit(chunk)(params, x)
            plans.append(records.plan)
            assert scanned.plan is records.plan
            here = traced.plan_here(traced.arrays([params, x[0]], {}))[0]
            assert records.plan is here
            sums.append(total)
        assert plans[0] is not plans[1]
        expected = jax.grad(lambda w: sum(loss({"w": w}, xi) for xi in x))(w)
        for total in sums:
            np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-6)


_KEY = jax.random.key(7)


def _closes_over_a_typed_key(p, x, y, s):
    mask = jax.random.bernoulli(jax.random.fold_in(_KEY, 3), 0.5, (x.shape[-1],))
    h = jnp.where(mask, jnp.tanh(x @ p["w"]), 0.0) + p["b"]
    return jnp.sum((h - y) ** 2) * s


def _scaled_by_a_traced_scalar(p, x, y, s):
    return jnp.sum((jnp.tanh(x @ (s * p["w"])) + p["b"] - y) ** 2)


@pytest.mark.parametrize("loss", [_closes_over_a_typed_key, _scaled_by_a_traced_scalar])
@pytest.mark.parametrize("entry", ["norms", "clipped sum", "ggn_diagonal"])
def test_ghost_never_reads_a_traced_or_key_constant(loss, entry, always_ghost):
    """A loss closing over a typed PRNG key (fixed dropout masks), or a weight
    scaled by a scalar that `jax.jit` traces (`x @ (s * w)`): the ghost analysis
    reads neither by value (both crashed every ghost quantity). Values as
    `jax.vmap(jax.grad)`'s, under `jax.jit` with the scalar an argument."""
    D = 32
    p = {"w": normal(170, D, D, scale=D**-0.5), "b": normal(171, D)}
    x, y = normal(172, 9, D), normal(173, 9, D)

    def run(p, x, y, s):
        f = lambda p, x, y: loss(p, x, y, s)  # noqa: E731
        if entry == "norms":
            return chunkvmap.per_example_grad_norms(f, batch_size=4, method="ghost")(
                p, x, y
            ), clipped_sum(f, 1.0, (p, x, y))[1]
        if entry == "clipped sum":
            got, _ = clipped_grad_sum(f, 1.0, batch_size=4, method="ghost")(p, x, y)
            return got, clipped_sum(f, 1.0, (p, x, y))[0]
        model = lambda p, x: jnp.tanh(x @ (s * p["w"])) + p["b"]  # noqa: E731
        ggn = chunkvmap.ggn_diagonal
        return tuple(
            ggn(model, likelihood="gaussian", method=m, batch_size=4)(p, x)
            for m in ("ghost", "vmap")
        )

    with warnings.catch_warnings():  # (a traced scale: its leaf per-example)
        warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
        got, want = jax.jit(run)(p, x, y, jnp.float32(1.5))
    tree_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_a_plan_is_made_once_and_never_changed_by_a_call(rng):
    """A loss's ghost plan is made once per program and is a value: a later call of
    the same program (another closed-over array, read by a nested `jax.jit`) is
    evaluated by passing its own program to the plan, so that no attribute of
    the plan changes, none holds a call's program, and each call's value is its
    own."""
    from chunkvmap._quantities import ghost as _ghost

    kept: dict = {}

    def memo(key, build):
        if key not in kept:
            kept[key] = build()
        return kept[key]

    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)

    def loss_with(scale):
        inner = jax.jit(lambda h: h * scale)  # the closed array, nested

        def loss(p, xi):
            return jnp.sum(inner(jnp.tanh(xi @ p["w"])) ** 2)

        return loss

    def norms(loss):
        traced = _ghost.traced_loss(memo, "test", loss, ({"w": w}, x), {}, (0,),
                                    in_axes=(None, 0))  # fmt: skip

        def one(xi):
            values = traced.arrays([{"w": w}, xi], {})
            record, _ = traced.record(values, [])
            plan = record.plan
            acc = jnp.float32
            return sum(plan.sq_norm(k, record.records, record.deltas, acc)
                       for k in range(len(plan.leaves)))  # fmt: skip

        return traced.plan, jax.vmap(one)(x)

    # (an array, not a scalar: a closed scalar's value is part of the plan's key)
    plan, first = norms(loss_with(jnp.full((2,), 1.0, jnp.float32)))
    attributes = {k: id(v) for k, v in vars(plan).items()}
    again, second = norms(loss_with(jnp.full((2,), 2.0, jnp.float32)))
    assert again is plan and {k: id(v) for k, v in vars(plan).items()} == attributes
    assert not any(
        isinstance(v, jax.extend.core.ClosedJaxpr) for v in vars(plan).values()
    )
    for scale, got in ((1.0, first), (2.0, second)):
        loss = loss_with(jnp.full((2,), scale, jnp.float32))
        grads = jax.vmap(jax.grad(loss), (None, 0))({"w": w}, x)
        tree_allclose(got, jnp.sum(grads["w"] ** 2, axis=(1, 2)), rtol=1e-5)
