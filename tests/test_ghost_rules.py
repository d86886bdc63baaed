"""Every ghost rule, chain step and structure is exact: for each leaf of small models,
one example's gradient instantiated from its uses' activations and cotangents equals
`jax.vmap(jax.grad(loss))`, and its ghost norm (taken whenever the leaf has one, even
where the mixed rule would instantiate) equals the squared norm of that gradient. No
chunking here: these are the rules themselves, compiled once per model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum
import pytest
from jax import lax

from chunkvmap import (
    GhostFallbackWarning,
    clipped_grad,
    clipped_grad_sum,
    ghost_report,
    per_example_grad_gram,
    per_example_grad_norms,
)
from chunkvmap._quantities import ghost as _ghost

from .helpers import clipped_sum


def normal(seed, *shape, scale=0.3):
    x = np.random.default_rng(seed).normal(size=shape) * scale
    return jax.device_put(x.astype(np.float32))  # a transfer: no compile


def per_example(loss, params, *data):
    """Per example: each rule leaf's instantiated gradient, its ghost norm (when it
    has one) and the plan."""
    traced = _ghost.Traced(
        loss, [params, *data], {}, [0], list(range(1, 1 + len(data))),
        strip=True, has_aux=False, keep_batch_dim=False,
    )  # fmt: skip
    plan = traced.plan

    def one(*example):
        values = traced.arrays([params, *example], {})

        def probed(probes):
            outs, records = plan.run(traced.closed, values, probes)
            return outs[0], records

        deltas, records = jax.grad(probed, has_aux=True)(plan.probes())
        out = {}
        for k, leaf in enumerate(plan.leaves):
            if leaf.rule not in (_ghost.GHOST, _ghost.INSTANTIATED):
                continue
            out[k] = {"grad": plan.instantiate(k, records, deltas)}
            if leaf.pairs:
                rule, leaf.rule = leaf.rule, _ghost.GHOST
                out[k]["sq"] = plan.sq_norm(k, records, deltas, jnp.float32)
                leaf.rule = rule
        return out

    return jax.jit(jax.vmap(one))(*data), plan


def check(loss, params, *data, oracle_data=None):
    """The instantiated gradients and ghost norms against vmap(grad) (at
    `oracle_data`, the same examples, if given); returns the plan."""
    got, plan = per_example(loss, params, *data)
    expected = jax.tree.leaves(
        jax.jit(jax.vmap(jax.grad(loss), (None, *[0] * len(data))))(
            params, *(oracle_data or data)
        )
    )
    assert got, "no leaf has a rule"
    for k, res in got.items():
        g = expected[k]
        path = plan.leaves[k].path
        np.testing.assert_allclose(res["grad"], g, rtol=2e-5, atol=2e-6, err_msg=path)
        if "sq" in res:
            g = np.asarray(g)
            sq = np.sum(g.reshape(g.shape[0], -1) ** 2, 1)
            np.testing.assert_allclose(res["sq"], sq, rtol=2e-5, err_msg=path)
    return plan


def rules(plan):
    return {leaf.path[len("args[0]") :]: leaf.rule for leaf in plan.leaves}


def pair_kinds(plan, name, rest=""):
    (leaf,) = [x for x in plan.leaves if x.path == f"args[0]['{name}']{rest}"]
    return sorted({p.kind for p in leaf.pairs.values()})


T, D, V = 5, 8, 11


def tokens(n=6, seed=0):
    t = np.random.default_rng(seed).integers(0, V, (n, T))
    t[0, 1] = t[0, 3] = t[0, 4]  # a token repeated within one example
    return jax.device_put(np.asarray(t, np.int32))


def test_language_model_embedding_tied_head_fused_qkv_scale():
    """Embedding by gather (repeated tokens) and tied output layer (`h @ E.T`): rows
    and rows-x-dense cross terms; a position table added, a layer-norm scale, a
    fused QKV matrix split in three (disjoint boxes: zero cross terms), a weight
    scaled by a constant before its dot."""

    def loss(p, t):
        h = p["E"][t] + p["pos"]
        x = h * p["ln"][None]
        q, k, v = (x @ w for w in jnp.split(p["qkv"], 3, -1))
        a = jax.nn.softmax(q @ k.T / 3.0) @ v
        h = h + a @ (0.5 * p["o"])
        logits = h @ p["E"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(T), t])

    p = {
        "E": normal(1, V, D), "pos": normal(2, T, D), "ln": 1 + normal(3, D),
        "qkv": normal(4, D, 3 * D), "o": normal(5, D, D),
    }  # fmt: skip
    plan = check(loss, p, tokens())
    assert "per-example" not in rules(plan).values()
    assert pair_kinds(plan, "E") == ["einsum", "rows", "rows-einsum"]
    assert pair_kinds(plan, "qkv") == ["einsum", "zero"]
    report = ghost_report(loss, p, tokens()[0])
    assert report.uses["args[0]['E']"] == ["dense", "embedding"]
    assert report.uses["args[0]['pos']"] == ["elementwise"]


def test_lookups_fill_and_clip_modes():
    """`jnp.take` in fill mode (out-of-range rows read 0 and get no gradient) of a
    table also used as a dense output layer (the rows x dense cross term skips
    them), `emb[tokens]` with negative tokens (normalised in the program), and
    `eqx.nn.Embedding` (a two-component index in clip mode: out-of-range tokens read
    the last row); an embedding read twice (rows cross terms)."""
    eqx = pytest.importorskip("equinox")

    def loss(p, t):
        h = jnp.take(p["E"], t + 5, axis=0, mode="fill", fill_value=0.0)
        h = h + p["E"][-t] + jax.vmap(p["emb"])(t + 5)
        return jnp.sum(jnp.tanh(h @ p["w"]) ** 2) + jnp.sum(jnp.sin(h @ p["E"].T))

    p = {
        "E": normal(1, V, D), "emb": eqx.nn.Embedding(weight=normal(2, V, D)),
        "w": normal(3, D, 3),
    }  # fmt: skip
    t = tokens()
    assert bool(jnp.any(t + 5 >= V)) and bool(jnp.any(t + 5 < V))
    plan = check(loss, p, t)
    assert pair_kinds(plan, "E") == ["einsum", "rows", "rows-einsum"]
    assert pair_kinds(plan, "emb", ".weight") == ["rows"]


def test_row_reads_by_dynamic_slice_in_a_scan():
    """A recurrent model reading one embedding row per step by a scalar token
    (`emb[t]` and `lax.dynamic_index_in_dim` compile to `dynamic_slice`), its table
    also the tied output layer: row forms, with rows and rows x dense cross terms.
    Tokens negative (normalised in the program by `emb[t]`) and out of range (the
    lax read clamps its start: the first or last row)."""

    def loss(p, t):
        def step(h, tok):
            x = p["E"][tok] + lax.dynamic_index_in_dim(p["E"], tok + 3, 0, False)
            h = jnp.tanh(x + h @ p["wh"])
            return h, jnp.sum(jnp.sin(h @ p["E"].T))

        h, out = lax.scan(step, jnp.zeros(D), t)
        return jnp.sum(out) + jnp.sum(h**2)

    rows = 512  # (a table large enough for the mixed rule to take its ghost norm)
    p = {"E": normal(4, rows, D), "wh": normal(5, D, D)}
    t = jax.device_put(np.random.default_rng(6).integers(-3, rows, (6, T), np.int32))
    t = t.at[0, 1].set(t[0, 3]).at[1, 2].set(-2).at[2, 0].set(rows - 1)
    assert bool(jnp.any(t < 0)) and bool(jnp.any(t + 3 >= rows))
    plan = check(loss, p, t)
    assert rules(plan)["['E']"] == _ghost.GHOST
    assert pair_kinds(plan, "E") == ["einsum", "rows", "rows-einsum"]
    assert "embedding x2" in plan.leaves[0].reason
    got = clipped_grad_sum(loss, 1.0, batch_size=4, method="ghost")(p, t)[0]
    expected, _ = clipped_sum(loss, 1.0, (p, t))
    for k in p:
        np.testing.assert_allclose(got[k], expected[k], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("common", [100.0, 1000.0])
def test_ghost_norms_keep_their_precision_under_cancellation(common):
    """Attention-like key weights: inputs with a large component common to every
    position, and cotangents that sum to zero over positions (a softmax ignores a
    shift), so that the gradient is far smaller than its terms. Against float64:
    the ghost norms (and the Gram's diagonal) within 3x of the per-example path's
    error, at `common` : 1."""
    rng = np.random.default_rng(7)
    t, d, k = 8, 64, 64
    x = (rng.normal(size=d) * common + rng.normal(size=(6, t, d))).astype(np.float32)
    w = (rng.normal(size=(d, k)) / (np.sqrt(d) * common)).astype(np.float32)
    q = rng.normal(size=k).astype(np.float32)

    def loss(w, x):
        return -jax.nn.log_softmax((x @ w) @ q)[0]

    assert ghost_report(loss, w, x[0]).rule("args[0]") == _ghost.GHOST
    x64, w64, q64 = (np.asarray(a, np.float64) for a in (x, w, q))
    s = np.einsum("ntd,dk,k->nt", x64, w64, q64)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[:, 0] -= 1  # the scores' cotangent
    g = np.einsum("ntd,nt,k->ndk", x64, p, q64)
    want = np.sqrt(np.sum(g**2, (1, 2)))

    def error(got):
        return np.max(np.abs(np.asarray(got, np.float64) - want) / want)

    w, x = jax.device_put(w), jax.device_put(x)
    vmap = error(per_example_grad_norms(loss, batch_size=4)(w, x))
    ghost = error(per_example_grad_norms(loss, batch_size=4, method="ghost")(w, x))
    gram = per_example_grad_gram(loss, batch_size=4, method="ghost")(w, x)
    assert ghost <= 3 * vmap + 1e-7, (ghost, vmap)
    assert error(np.sqrt(np.diag(np.asarray(gram, np.float64)))) <= 3 * vmap + 1e-7


def test_lookups_with_narrow_integer_ids():
    """`uint8` ids into tables of 300 rows (more than the ids' dtype counts): by
    `jnp.take` in fill and clip modes, `table[ids]` and `nnx.Embed`. The rows are
    compared with the table's size and clamped as int32 (in the ids' own dtype the
    size wraps: rows past 43 would be dropped or clamped), so the ghost norms and
    the clipped sums equal `method="vmap"`'s."""
    nnx = pytest.importorskip("flax.nnx")
    rows = 300
    embed_def, embed_state = nnx.split(nnx.Embed(rows, D, rngs=nnx.Rngs(0)))

    def loss(p, t):
        h = jnp.take(p["fill"], t, axis=0, mode="fill", fill_value=0.0)
        h = h + jnp.take(p["clip"], t, axis=0, mode="clip") + p["index"][t]
        h = h + nnx.merge(embed_def, p["embed"])(t)
        return jnp.sum(jnp.tanh(h @ p["w"]) ** 2)

    p = {
        "fill": normal(1, rows, D), "clip": normal(2, rows, D),
        "index": normal(3, rows, D), "embed": embed_state, "w": normal(4, D, 3),
    }  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 256, (6, T)).astype(np.uint8)
    ids[:, 0] = [0, 43, 44, 255, 200, 100]  # about where 300 wraps in uint8 (44)
    # The references take the same ids as int32: XLA:CPU's scatter (the transpose
    # of a lookup) itself mishandles uint8 ids into 300 rows under the suite's
    # compile flags (the older fusion emitters).
    wide = jax.device_put(ids.astype(np.int32))
    ids = jax.device_put(ids)
    plan = check(loss, p, ids, oracle_data=[wide])
    assert {rules(plan)[k] for k in ("['fill']", "['clip']", "['index']")} == {
        _ghost.GHOST
    }

    @jax.jit
    def sums(p, ids, wide):
        return [
            clipped_grad_sum(loss, 0.5, return_norms=True, method=m)(p, t)
            for m, t in (("ghost", ids), ("vmap", wide))
        ]

    (ghost, _, ghost_norms), (vmap, _, vmap_norms) = sums(p, ids, wide)
    np.testing.assert_allclose(ghost_norms, vmap_norms, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(ghost), jax.tree.leaves(vmap)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_scans_stacked_and_repeated():
    """A layer stack read through `xs` (weights, biases and scales stacked: norms add
    over iterations); a weight every iteration reads (an RNN, reversed, with a
    carry); a scan nested in a scan over a doubly stacked leaf."""

    def loss(p, x):
        def layer(h, w):
            return jnp.tanh(h @ w["w"] + w["b"]) * w["s"], None

        h, _ = lax.scan(layer, x, p["layers"])

        def rnn(h, xt):
            h = jnp.tanh(h @ p["u"] + xt)
            return h, h

        h, hs = lax.scan(rnn, h, jnp.stack([x, 2 * x, 3 * x]), reverse=True)

        def outer(h, ws):
            h, _ = lax.scan(lambda h, w: (jnp.sin(h @ w), None), h, ws)
            return h, None

        h, _ = lax.scan(outer, h, p["deep"])
        return jnp.sum(hs**2) + jnp.sum(h**2)

    p = {
        "layers": {
            "w": normal(1, 3, D, D), "b": normal(2, 3, D), "s": 1 + normal(3, 3, D)
        },
        "u": normal(4, D, D), "deep": normal(5, 2, 3, D, D),
    }  # fmt: skip
    plan = check(loss, p, normal(6, 6, D, scale=1.0))
    assert "per-example" not in rules(plan).values()
    assert [lv.stacked for lv in plan.leaves[0].uses[0].levels] == [True, True]
    for name, rest in (("deep", ""), ("layers", "['w']"), ("u", "")):
        assert pair_kinds(plan, name, rest) == ["einsum"], name


def test_checkpoint_cond_and_jit():
    """`jax.checkpoint` with a policy, a `cond` whose branches use a leaf differently
    (transposed in one), a jitted sub-function."""

    @jax.jit
    def dense(w, h):
        return h @ w

    def loss(p, x):
        f = jax.checkpoint(
            lambda h: jnp.tanh(dense(p["w"], h)),
            policy=jax.checkpoint_policies.nothing_saveable,
        )
        h = f(x)
        h = lax.cond(
            jnp.sum(x) > 0,
            lambda h: h @ p["a"],
            lambda h: jnp.sin(h @ p["a"].T) + h @ p["b"],
            h,
        )
        return jnp.sum(h**2)

    x = normal(1, 6, D, scale=1.0)
    assert bool(jnp.any(jnp.sum(x, 1) > 0)) and bool(jnp.any(jnp.sum(x, 1) <= 0))
    p = {"w": normal(2, D, D), "a": normal(3, D, D), "b": normal(4, D, D)}
    plan = check(loss, p, x)
    assert set(rules(plan).values()) <= {"ghost", "instantiated"}


def test_convolutions():
    """Strides, explicit padding, rhs and lhs dilation, feature groups, NHWC/HWIO and
    NCHW/OIHW layouts, a 1-D convolution, a scaled kernel, a kernel broadcast from
    a smaller leaf, few positions with many features: patches + the dense rule
    (norms from the input's windows where the kernel is its leaf)."""

    def loss(p, x):
        h = lax.conv_general_dilated(
            x[None], p["k1"], (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2,
        )  # fmt: skip
        h = jnp.tanh(h + p["b1"][None, None, None])
        h = lax.conv_general_dilated(
            h.transpose(0, 3, 1, 2), p["k2"], (1, 1), ((0, 0), (1, 0)),
            lhs_dilation=(2, 1),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )  # fmt: skip
        seq = h.reshape(1, 5, -1)
        nch = ("NCH", "OIH", "NCH")
        h = lax.conv_general_dilated(
            seq, 0.5 * p["k3"], (1,), "SAME", dimension_numbers=nch
        )
        # a kernel broadcast over its window from a smaller leaf
        wide = jnp.broadcast_to(p["k4"][:, :, None], (2, 5, 3))
        h = h + lax.conv_general_dilated(seq, wide, (1,), "SAME", dimension_numbers=nch)
        # few positions, many features, activations far from zero (a Gram's norm)
        g = lax.conv_general_dilated(
            x[None, :2, :2] + 3.0, p["k5"], (1, 1), "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )  # fmt: skip
        return jnp.sum(h**2) + jnp.sum(jnp.tanh(g))

    p = {
        "k1": normal(1, 3, 2, 2, 6), "b1": normal(2, 6), "k2": normal(3, 5, 6, 2, 2),
        "k3": normal(4, 2, 5, 3), "k4": normal(6, 2, 5), "k5": normal(7, 2, 2, 4, 16),
    }  # fmt: skip
    plan = check(loss, p, normal(5, 4, 9, 9, 4, scale=1.0))
    for name in ("k1", "k2", "k3", "k4", "k5"):
        assert pair_kinds(plan, name) == ["einsum"], name


def test_chains_slices_broadcasts_and_joins():
    """Slices of a stacked leaf (`W[0]`, `W[1]`: disjoint), overlapping column
    slices (no ghost cross term: instantiated), a broadcast leaf, a negated and
    divided weight; a class token concatenated to the sequence, a `select_n`, a
    transposed and reshaped (axes kept) weight."""

    def loss(p, x):
        h = x @ p["W"][0] + jnp.tanh(x @ p["W"][1]) @ (-p["W"][2] / 2.0)
        h = h @ p["cols"][:, :4] + h @ p["cols"][:, 2:6]
        seq = jnp.concatenate([p["cls"][None], x[None, :4]], 0)  # (2, 4)
        seq = jnp.where(seq > 0, seq, p["alt"][None]) @ p["T"].T.reshape(4, 1, 3)[:, 0]
        b = jnp.broadcast_to(p["w"][None], (2, 4, 3))
        return (
            jnp.sum(h**2)
            + jnp.sum(seq**2)
            + jnp.sum(jnp.einsum("i,nij->nj", x[:4], b) ** 2)
        )

    p = {
        "W": normal(1, 3, D, D), "cols": normal(2, D, 6), "cls": normal(3, 4),
        "alt": normal(4, 4), "T": normal(5, 3, 4), "w": normal(6, 4, 3),
    }  # fmt: skip
    plan = check(loss, p, normal(7, 6, D, scale=1.0))
    assert pair_kinds(plan, "W") == ["einsum", "zero"]
    assert rules(plan)["['cols']"] == "instantiated"
    assert not pair_kinds(plan, "cols")  # partly overlapping boxes: no ghost norm
    assert rules(plan)["['cls']"] == "instantiated"  # concatenate: linear rule
    assert "per-example" not in rules(plan).values()


def test_what_falls_back_and_why():
    """A nonlinearity applied to a weight, a custom_jvp function it enters, a while
    loop, a scan carry, a product of two weights: exact per-example gradients (no
    ghost norm anywhere: the plain per-example path runs), with the reason in the
    report."""

    def loss(p, x):
        h = x @ jnp.exp(p["log"])
        h = h @ jax.nn.relu(p["relu"])  # custom_jvp
        h = lax.while_loop(
            lambda c: c[1] < 2, lambda c: (c[0] @ p["loop"], c[1] + 1), (h, 0)
        )[0]
        h, _ = lax.scan(lambda c, _: (2 * c, None), p["carry"], None, length=2)
        return jnp.sum(h * x) + jnp.sum(x @ (p["a"] @ p["b"]))

    p = {
        name: normal(i, D, D)
        for i, name in enumerate(["log", "relu", "loop", "a", "b"])
    }
    p["carry"] = normal(9, D)
    report = ghost_report(loss, p, normal(8, D))
    assert set(report.as_dict().values()) == {"per-example"}
    reasons = {path: why for path, _, _, why in report.rows}
    assert reasons["args[0]['log']"] == "used by exp"
    assert "custom_jvp_call" in reasons["args[0]['relu']"]
    assert "while" in reasons["args[0]['loop']"]
    assert "carried through a scan" in reasons["args[0]['carry']"]
    assert "does not depend on the example" in reasons["args[0]['a']"]
    assert report.runs == "vmap"
    assert sorted(report.fallback()) == sorted(f"args[0]['{k}']" for k in p)
    assert "runs as method='vmap'" in str(report)


def test_mixed_rule_cost():
    """The mixed rule takes the ghost norm exactly when its cost (floating-point
    operations per example, by opt_einsum's count) is at most instantiation's (the
    leaf's size plus forming the gradient): a dense layer (p=16, d=16) at T
    positions is ghost for T=4 and instantiated for T=16; both costs are as
    stated."""
    for t, rule in ((4, "ghost"), (16, "instantiated")):
        report_plan = _ghost.Traced(
            lambda w, x: jnp.sum(jnp.tanh(x @ w)),
            [normal(0, 16, 16), normal(1, t, 16)],
            {}, [0], [1], strip=False, has_aux=False, keep_batch_dim=False,
        ).plan  # fmt: skip
        (leaf,) = report_plan.leaves
        ghost = opt_einsum.contract_path(
            "ab,ac,db,dc->", (t, 16), (t, 16), (t, 16), (t, 16),
            shapes=True, optimize="optimal",
        )[1].opt_cost  # fmt: skip
        inst = (
            256
            + opt_einsum.contract_path(
                "ab,ac->bc", (t, 16), (t, 16), shapes=True, optimize="optimal"
            )[1].opt_cost
        )
        assert leaf.costs == (ghost, inst), (t, leaf.costs)
        assert leaf.rule == rule, (t, leaf.costs)
    # a lookup table: ghost (rows pair T^2 (d + 2)) vs instantiated (size + T d)
    plan = _ghost.Traced(
        lambda e, i: jnp.sum(jnp.tanh(e[i])), [normal(0, 64, 4), jnp.zeros(5, "i4")],
        {}, [0], [1], strip=False, has_aux=False, keep_batch_dim=False,
    ).plan  # fmt: skip
    (leaf,) = plan.leaves
    assert leaf.costs == (5 * 5 * (4 + 2), 64 * 4 + 5 * 4)
    assert leaf.rule == "ghost"


def test_edges_ghost_must_not_miss():
    """Cases where a rule must step back or be exact at the edge: one kernel in two
    convolutions with different feature group counts (no ghost cross term); a real
    weight in a product with complex activations (per-example); a non-finite input
    pixel under nan_safe (patches are sliced, so the NaN does not spread to other
    window offsets); an out-of-range token with default indexing (its gradient is
    dropped, as by the gather's transpose). Ghost = vmap end to end."""
    import warnings

    from chunkvmap import clipped_grad, clipped_grad_sum

    def both(make, *args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", chunkvmap.GhostFallbackWarning)
            out = [make(m)(*args) for m in ("vmap", "ghost")]
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
            out[1], out[0],
        )  # fmt: skip
        return out

    import chunkvmap

    def grouped(w, x1, x2):
        y1 = lax.conv_general_dilated(
            x1[None], w, (1, 1), "VALID", feature_group_count=2
        )
        y2 = lax.conv_general_dilated(
            x2[None], w, (1, 1), "VALID", feature_group_count=4
        )
        return jnp.sum(jnp.tanh(y1)) + jnp.sum(jnp.sin(y2))

    w, x1, x2 = normal(1, 16, 4, 2, 2), normal(2, 3, 8, 3, 3), normal(3, 3, 16, 3, 3)
    report = ghost_report(grouped, w, x1[0], x2[0])
    assert report.rule("args[0]") == "instantiated"
    both(
        lambda m: clipped_grad_sum(grouped, 1.0, return_norms=True, method=m), w, x1, x2
    )

    def mixed(w, x):  # a real weight times complex activations
        return jnp.sum(
            jnp.abs(jnp.tanh(lax.dot(x, w, preferred_element_type=x.dtype))) ** 2
        )

    x = lax.complex(normal(4, 4, 8), normal(5, 4, 8))
    assert "complex values" in str(ghost_report(mixed, normal(6, 8, 8), x[0]))
    both(
        lambda m: clipped_grad_sum(mixed, 1.0, return_norms=True, method=m),
        normal(6, 8, 8),
        x,
    )

    def pixels(p, img_z):
        img, z = img_z[0][0], img_z[1][0]
        c = lax.conv(img[None], p["k"], (1, 1), "SAME")
        weights = jnp.arange(16.0).reshape(1, 1, 4, 4)
        return jnp.sum(c * weights) + jnp.sum(jnp.tanh(z @ p["w"]))

    p = {"k": normal(7, 4, 4, 3, 3), "w": normal(8, 32, 32)}
    img = jnp.ones((2, 4, 4, 4)).at[1, 0, 0, 0].set(jnp.nan)
    both(
        lambda m: clipped_grad(pixels, l2_clip_norm=1.0, method=m),
        p, (img, jnp.ones((2, 32))),
    )  # fmt: skip

    def lookup(e, t):
        return jnp.sum(jnp.tanh(e[t]))

    tok = jnp.array([[3, 50], [10, 11]])  # 50 is out of range for 50 rows
    both(
        lambda m: clipped_grad_sum(lookup, 1.0, return_norms=True, method=m),
        normal(9, 50, 8),
        tok,
    )


def test_a_weight_as_divisor_is_per_example():
    """`x / w` is not linear in `w`: the weight falls back to per-example gradients
    (and the clipped sum is still vmap's); `w / c` with a constant `c` is a chain
    step of the weight."""

    def loss(p, x):
        return jnp.sum(jnp.tanh(x / p["d"])) + jnp.sum(jnp.tanh(x @ (p["w"] / 4.0)))

    p = {"d": normal(1, D) + 2.0, "w": normal(2, D, D)}
    x = normal(3, 6, D)
    report = ghost_report(loss, p, x[0])
    assert report.rule("args[0]['d']") == "per-example"
    assert "not linear" in dict((r[0], r[3]) for r in report.rows)["args[0]['d']"]
    assert report.rule("args[0]['w']") in ("ghost", "instantiated")
    vmap = clipped_grad_sum(loss, 1.0, return_norms=True, method="vmap")(p, x)
    with pytest.warns(GhostFallbackWarning, match=r"args\[0\]\['d'\]"):
        ghost = clipped_grad_sum(loss, 1.0, return_norms=True, method="ghost")(p, x)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        ghost, vmap,
    )  # fmt: skip


def test_nan_safe_masking_keeps_every_finite_entry():
    """A per-head weight `w[h, i, o]` (a batched contraction: the head axis is in
    both the activation and the cotangent), one input entry not finite: with
    nan_safe, ghost zeroes exactly the non-finite entries of that example's
    gradient (one row of one head), as vmap does, and keeps the rest."""

    def loss(w, x):
        y = jnp.einsum("thi,hio->tho", x, w)
        return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

    w, x = normal(1, 3, 16, 16), normal(2, 4, 2, 3, 16)
    x = x.at[1, 1, 0, 3].set(jnp.nan)
    assert ghost_report(loss, w, x[0]).rule("args[0]") == "ghost"
    (vmap, vmap_aux), (ghost, ghost_aux) = (
        clipped_grad(
            loss, l2_clip_norm=1e3, keep_batch_dim=False, return_grad_norms=True,
            method=m,
        )(w, x)
        for m in ("vmap", "ghost")
    )  # fmt: skip
    assert np.isfinite(vmap).all() and not np.all(vmap == 0)
    np.testing.assert_allclose(ghost, vmap, rtol=2e-5, atol=2e-6)
    # the norms as they are: NaN for the example with a non-finite gradient
    norms = np.asarray(ghost_aux.grad_norms)
    np.testing.assert_array_equal(np.isnan(norms), [False, True, False, False])
    np.testing.assert_allclose(norms, vmap_aux.grad_norms, rtol=2e-5)


def test_cond_inside_a_scan():
    """A `cond` inside a scan over stacked layers, a leaf used in one branch only:
    the branch not taken returns zero records of one iteration's shape."""

    def loss(p, x):
        def layer(h, w):
            h = lax.cond(
                jnp.sum(h) > 0,
                lambda h: jnp.tanh(h @ w) + h @ p["a"],
                lambda h: jnp.sin(h @ w.T),
                h,
            )
            return h, None

        h, _ = lax.scan(layer, x, p["stack"])
        return jnp.sum(h**2)

    x = normal(1, 6, D, scale=1.0)
    p = {"stack": normal(2, 3, D, D), "a": normal(3, D, D)}
    plan = check(loss, p, x)
    assert set(rules(plan).values()) <= {"ghost", "instantiated"}


def test_a_dense_use_before_a_lookup_of_one_table():
    """One table used in a contraction first and looked up after: the cross term of
    a contraction with a lookup, the two forms the other way round from a tied
    output layer's."""

    def loss(p, x, t):
        logits = x @ p["E"].T
        h = jnp.tanh(p["E"][t] * 2.0)
        return jnp.sum(jax.nn.log_softmax(logits) * 0.1) + jnp.sum(h**2)

    p = {"E": normal(1, V, D)}
    plan = check(loss, p, normal(2, 6, 2, D, scale=1.0), tokens())
    assert pair_kinds(plan, "E") == ["einsum", "rows", "rows-einsum"]
