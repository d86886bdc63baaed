"""`ggn_diagonal` and `kfac_factors` against oracles made without the library: the
dense Jacobian (`jax.jacfwd`) and the loss's Hessian (`jax.hessian`) for the
diagonal, activations and output gradients captured by hand for the factors, and
labels drawn as documented for the Monte-Carlo Fisher (`tests.helpers`)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from chunkvmap import Kronecker, ggn_diagonal, kfac_factors
from chunkvmap._quantities import _curvature
from tests.helpers import (
    drawn_by_hand,
    example_cotangents,
    ggn_diagonal_dense,
    kfac_by_hand,
    make_mesh,
    temp_bytes,
    tree_allclose,
)


N, CLASSES = 5, 3


def _tap(name, y, probes):
    return y if probes is None else y + probes[name]


def _normal(key, shape, scale=0.5):
    return scale * jax.random.normal(key, shape)


# Each model: (params, inputs, tapped). `tapped(params, x, probes)` is the model
# written out, returning (output, acts, ys) as `kfac_by_hand` reads them; the model
# itself is `tapped(...)[0]` with no probes.


def _mlp():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w1": _normal(k[0], (4, 6)),
        "b1": _normal(k[1], (6,)),
        "w2": _normal(k[2], (6, CLASSES)),
        "b2": _normal(k[3], (CLASSES,)),
    }

    def tapped(p, x, probes):
        y1 = _tap("w1", x @ p["w1"], probes)
        h = jnp.tanh(y1 + p["b1"])
        y2 = _tap("w2", h @ p["w2"], probes)
        return y2 + p["b2"], {"w1": x, "w2": h}, {"w1": y1, "w2": y2}

    return params, _normal(k[4], (N, 4), 1.0), tapped


def _tokens():
    """A product over positions (weight sharing) with a per-position output."""
    k = jax.random.split(jax.random.key(1), 3)
    params = {
        "w": _normal(k[0], (4, 6)),
        "bw": _normal(k[1], (6,)),
        "head": _normal(k[1], (6, CLASSES)),
    }

    def tapped(p, x, probes):
        y = _tap("w", x @ p["w"], probes)
        h = jax.nn.relu(y + p["bw"][None])
        out = _tap("head", h @ p["head"], probes)
        return out, {"w": x, "head": h}, {"w": y, "head": out}

    return params, _normal(k[2], (N, 5, 4), 1.0), tapped


def _scanned():
    """A stack of layers scanned over their stacked weights: one block per layer."""
    k = jax.random.split(jax.random.key(2), 3)
    params = {"ws": _normal(k[0], (3, 4, 4)), "head": _normal(k[1], (4, CLASSES))}

    def tapped(p, x, probes):
        acts, ys = {}, {}
        h = x
        for layer in range(3):  # the hand-written loop; the model scans
            name = f"ws{layer}"
            acts[name], ys[name] = h, h @ p["ws"][layer]
            h = jnp.tanh(_tap(name, ys[name], probes))
        out = _tap("head", h @ p["head"], probes)
        acts["head"], ys["head"] = h, out
        return out, acts, ys

    def model(p, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])
        return h @ p["head"]

    return params, _normal(k[2], (N, 4), 1.0), tapped, model


def _conv(layout):
    k = jax.random.split(jax.random.key(3), 3)
    if layout == "NHWC":
        kernel, dn = _normal(k[0], (3, 3, 2, 4)), ("NHWC", "HWIO", "NHWC")
        x = _normal(k[2], (N, 6, 6, 2), 1.0)
    else:
        kernel, dn = _normal(k[0], (4, 2, 3, 3)), ("NCHW", "OIHW", "NCHW")
        x = _normal(k[2], (N, 2, 6, 6), 1.0)
    bias = _normal(k[1], (4,))
    params = {"kernel": kernel, "bias": bias, "head": _normal(k[1], (4, CLASSES))}
    channels = -1 if layout == "NHWC" else 0  # of one example's output

    def conv(kern, x):
        return lax.conv_general_dilated(
            x[None], kern, (1, 1), "VALID", dimension_numbers=dn
        )[0]

    def biased_conv(p, x):  # the bias added to the convolution's own output
        y = lax.conv_general_dilated(
            x[None], p["kernel"], (1, 1), "VALID", dimension_numbers=dn
        )
        b = (
            p["bias"][None, None, None, :]
            if layout == "NHWC"
            else p["bias"][None, :, None, None]
        )
        return (y + b)[0]

    def tapped(p, x, probes):
        y = conv(p["kernel"], x)
        y_pos = jnp.moveaxis(y, channels, -1).reshape(-1, 4)  # (positions, out)
        # the patches in the kernel's input-axis order: d y[pos, 0] / d kernel[.., 0]
        first = (lambda kk: kk[..., 0]) if layout == "NHWC" else (lambda kk: kk[0])

        def out0(w0):
            kern = (
                p["kernel"].at[..., 0].set(w0)
                if layout == "NHWC"
                else p["kernel"].at[0].set(w0)
            )
            return jnp.moveaxis(conv(kern, x), channels, -1).reshape(-1, 4)[:, 0]

        patches = jax.jacfwd(out0)(first(p["kernel"])).reshape(y_pos.shape[0], -1)
        y_pos = _tap("kernel", y_pos, probes)
        h = jax.nn.relu(y_pos + p["bias"][None]).mean(0)
        out = _tap("head", h @ p["head"], probes)
        return out, {"kernel": patches, "head": h}, {"kernel": y_pos, "head": out}

    def model(p, x):
        h = jax.nn.relu(biased_conv(p, x)).mean((0, 1) if layout == "NHWC" else (1, 2))
        return h @ p["head"]

    return params, x, tapped, model


def _embedding():
    k = jax.random.split(jax.random.key(4), 3)
    params = {"table": _normal(k[0], (7, 4)), "head": _normal(k[1], (4, CLASSES))}

    def tapped(p, x, probes):
        e = _tap("table", p["table"][x], probes)
        out = _tap("head", jnp.tanh(e) @ p["head"], probes)
        return (
            out,
            {"table": jax.nn.one_hot(x, 7), "head": jnp.tanh(e)},
            {
                "table": e,
                "head": out,
            },
        )

    x = jax.random.randint(k[2], (N, 5), 0, 7)
    return params, x, tapped


def _tied():
    """An embedding table read by rows and, transposed, as the output layer."""
    k = jax.random.split(jax.random.key(9), 2)
    params = {"table": _normal(k[0], (CLASSES, 4)), "scale": 1.0 + _normal(k[1], (4,))}

    def model(p, x):
        return jnp.tanh(p["table"][x] * p["scale"][None]) @ p["table"].T

    x = jax.random.randint(k[1], (N, 5), 0, CLASSES)
    return params, x, (lambda p, x, probes: (model(p, x), {}, {})), model


def _attention():
    """Self-attention after a LayerNorm, per-position outputs."""
    k = jax.random.split(jax.random.key(5), 6)
    d = 4
    params = {
        "scale": 1.0 + _normal(k[0], (d,), 0.1),
        "q": _normal(k[1], (d, d)),
        "k": _normal(k[2], (d, d)),
        "v": _normal(k[3], (d, d)),
        "head": _normal(k[4], (d, CLASSES)),
    }

    def tapped(p, x, probes):
        mu = x.mean(-1, keepdims=True)
        h = (
            (x - mu)
            / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
            * p["scale"][None]
        )
        ys = {n: _tap(n, h @ p[n], probes) for n in "qkv"}
        att = jax.nn.softmax(ys["q"] @ ys["k"].T / 2.0, axis=-1)
        z = att @ ys["v"] + x
        out = _tap("head", z @ p["head"], probes)
        return out, {"q": h, "k": h, "v": h, "head": z}, {**ys, "head": out}

    return params, _normal(k[5], (N, 5, d), 1.0), tapped


def _model(case):
    made = case()
    if len(made) == 4:
        return made
    params, x, tapped = made
    return params, x, tapped, lambda p, x: tapped(p, x, None)[0]


MODELS = {
    "mlp": _mlp,
    "tokens": _tokens,
    "scanned": _scanned,
    "conv-NHWC": lambda: _conv("NHWC"),
    "conv-NCHW": lambda: _conv("NCHW"),
    "embedding": _embedding,
    "attention-layernorm": _attention,
    "tied-embedding": _tied,
}


def _labels(likelihood, model, params, x, key):
    outputs = jax.vmap(model, (None, 0))(params, x)
    if likelihood == "categorical":
        return jax.random.randint(key, outputs.shape[:-1], 0, CLASSES)
    return outputs + jax.random.normal(key, outputs.shape)


def _cotangents(likelihood, fisher, model, params, x, labels, key, samples):
    outputs = jax.vmap(model, (None, 0))(params, x)
    return example_cotangents(likelihood, fisher, outputs, labels, key, samples)


def _call_args(fisher, labels, key):
    return (
        {"labels": labels}
        if fisher == "empirical"
        else ({"key": key} if fisher == "mc" else {})
    )


@pytest.mark.parametrize(
    "name, method",
    [(name, "ghost") for name in MODELS]
    + [
        (name, "vmap")
        for name in ("mlp", "scanned", "conv-NCHW", "attention-layernorm")
    ],
)
def test_ggn_diagonal_matches_the_dense_ggn(name, method, always_ghost):
    params, x, _, model = _model(MODELS[name])
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    rows, unravel = ggn_diagonal_dense(model, params, x, cots)
    diagonal = ggn_diagonal(
        model, likelihood="categorical", batch_size=2, method=method
    )
    got = diagonal(params, x)
    tree_allclose(
        got, unravel(jnp.asarray(rows.sum(0), jnp.float32)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "likelihood,fisher,samples",
    [
        ("categorical", "mc", 3),
        ("categorical", "empirical", 1),
        ("gaussian", "exact", 1),
        ("gaussian", "mc", 2),
        ("gaussian", "empirical", 1),
    ],
)
def test_ggn_diagonal_fisher_types_and_per_example(
    likelihood, fisher, samples, always_ghost
):
    params, x, _, model = _model(_tokens)
    key = jax.random.key(7)
    labels = _labels(likelihood, model, params, x, jax.random.key(8))
    cots = _cotangents(likelihood, fisher, model, params, x, labels, key, samples)
    rows, unravel = ggn_diagonal_dense(model, params, x, cots)
    call = _call_args(fisher, labels, key)
    opts = dict(likelihood=likelihood, fisher=fisher, samples=samples)
    summed = ggn_diagonal(model, batch_size=3, **opts)(params, x, **call)
    tree_allclose(
        summed, unravel(jnp.asarray(rows.sum(0), jnp.float32)), rtol=1e-5, atol=1e-6
    )
    expected = jax.vmap(unravel)(jnp.asarray(rows, jnp.float32))
    for method in ("vmap", "ghost"):
        each = ggn_diagonal(
            model, batch_size=2, per_example=True, method=method, **opts
        )
        tree_allclose(jax.jit(each)(params, x, **call), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.runs_on_cpu("float64 precision: a TPU has no native float64")
def test_mc_curvature_keeps_float64(always_ghost):
    """`fisher="mc"` on float64 parameters and inputs (x64 on): the labels drawn
    from float64 probabilities as documented (float64 uniforms: other draws than
    float32's), each example's diagonal float64 and the oracle's, both methods,
    eagerly and jitted."""
    with jax.enable_x64(True):
        params, x, _, model = _model(_tokens)
        params, x = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x))
        key = jax.random.key(5)
        cots = _cotangents("categorical", "mc", model, params, x, None, key, 2)
        rows, unravel = ggn_diagonal_dense(model, params, x, cots)
        expected = jax.vmap(unravel)(jnp.asarray(rows))
        opts = dict(likelihood="categorical", fisher="mc", samples=2, per_example=True)
        for method in ("vmap", "ghost"):
            each = ggn_diagonal(model, batch_size=2, method=method, **opts)
            for f in (each, jax.jit(each)):
                # (the oracle's cotangents are float32 gradients: its last digits)
                tree_allclose(f(params, x, key=key), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_mc_draws_keep_the_keys_generator(impl, always_ghost):
    """A typed key of another generator than JAX's default (rbg, unsafe_rbg: the
    fast ones on a TPU) draws each example's labels from `fold_in(key, i)` of that
    generator: eagerly, jitted, over 8 devices with N uneven, both methods. (In
    chunks of one example: these generators' draws under `jax.vmap` depend on the
    batch in JAX itself, so only a chunk of one draws what the oracle's example
    alone draws.)"""
    params, x, _, model = _model(_tokens)
    key = jax.random.key(11, impl=impl)
    cots = _cotangents("categorical", "mc", model, params, x, None, key, 2)
    rows, unravel = ggn_diagonal_dense(model, params, x, cots)
    expected = jax.vmap(unravel)(jnp.asarray(rows, jnp.float32))
    mesh = make_mesh((8,), ("d",))
    opts = dict(likelihood="categorical", fisher="mc", samples=2, per_example=True)
    for method, shard in (("vmap", False), ("ghost", False), ("ghost", True)):
        each = ggn_diagonal(model, batch_size=1, method=method, shard=shard,
                            mesh=mesh if shard else None, **opts)  # fmt: skip
        for f in (each, jax.jit(each)):
            tree_allclose(f(params, x, key=key), expected, rtol=1e-5, atol=1e-6)


def _kron_leaf(got, name):
    return got["ws"] if name.startswith("ws") else got[name]


BIASED = {  # a product's added bias: joint blocks, as kfac-jax's
    "mlp": {"w1": "b1", "w2": "b2"},
    "tokens": {"w": "bw"},
    "conv-NHWC": {"kernel": "bias"},
    "conv-NCHW": {"kernel": "bias"},
}


AXES = {  # (blocks, inputs, outputs) where not a dense (in, out) weight's
    ("scanned", "ws"): ((0,), (1,), (2,)),
    ("conv-NHWC", "kernel"): ((), (0, 1, 2), (3,)),
    ("conv-NCHW", "kernel"): ((), (1, 2, 3), (0,)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_kfac_factors_match_the_factors_captured_by_hand(name):
    params, x, tapped, model = _model(MODELS[name])
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    biased = BIASED.get(name, {})
    expected = kfac_by_hand(tapped, params, x, cots, biased=biased)
    got = kfac_factors(model, likelihood="categorical", batch_size=2)(params, x)
    for leaf, (a, g, count) in expected.items():
        factors = _kron_leaf(got, leaf)
        assert isinstance(factors, Kronecker), (leaf, factors)
        inputs, outputs = factors.inputs, factors.outputs
        if leaf.startswith("ws"):  # one block per layer
            inputs, outputs = inputs[int(leaf[2:])], outputs[int(leaf[2:])]
        if leaf == "table":  # an embedding's inputs: the diagonal
            a = np.diag(a)
        np.testing.assert_allclose(inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outputs, g, rtol=1e-5, atol=1e-5)
        assert float(factors.count) == count, (leaf, factors.count, count)
        axes = AXES.get((name, leaf.rstrip("012")), ((), (0,), (1,)))
        assert factors.axes == axes, (leaf, factors.axes)
        bias = biased.get(leaf)
        assert factors.bias == (None if bias is None else sorted(params).index(bias))
    if name == "tied-embedding":  # a lookup and a product: no Kronecker factors
        assert not isinstance(got["table"], Kronecker)
    for bias in biased.values():  # in its weight's factors
        assert got[bias] is None
    # every other leaf: its diagonal, as ggn_diagonal's
    diagonal = ggn_diagonal(model, likelihood="categorical")(params, x)
    for leaf in params:
        if leaf not in biased.values() and not isinstance(got[leaf], Kronecker):
            np.testing.assert_allclose(got[leaf], diagonal[leaf], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tokens", "conv-NHWC"])
def test_kfac_reduce_variant(name):
    params, x, tapped, model = _model(MODELS[name])
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    expected = kfac_by_hand(
        tapped, params, x, cots, variant="reduce", biased=BIASED[name]
    )
    got = jax.jit(
        kfac_factors(model, likelihood="categorical", variant="reduce", batch_size=3)
    )(params, x)
    for leaf, (a, g, count) in expected.items():
        np.testing.assert_allclose(got[leaf].inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[leaf].outputs, g, rtol=1e-5, atol=1e-5)
        assert float(got[leaf].count) == count


@pytest.mark.parametrize(
    "likelihood,fisher", [("categorical", "mc"), ("gaussian", "empirical")]
)
def test_kfac_fisher_types(likelihood, fisher):
    params, x, tapped, model = _model(_mlp)
    key = jax.random.key(3)
    labels = _labels(likelihood, model, params, x, jax.random.key(4))
    cots = _cotangents(likelihood, fisher, model, params, x, labels, key, 2)
    expected = kfac_by_hand(tapped, params, x, cots, biased=BIASED["mlp"])
    got = kfac_factors(
        model, likelihood=likelihood, fisher=fisher, samples=2, batch_size=4
    )(params, x, **_call_args(fisher, labels, key))
    for leaf, (a, g, count) in expected.items():
        np.testing.assert_allclose(got[leaf].inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[leaf].outputs, g, rtol=1e-5, atol=1e-5)
        assert float(got[leaf].count) == count


def test_equinox_and_flax_models():
    """An Equinox MLP (weights `(out, in)`, holding its activation function) and a
    Flax linen MLP (kernels `(in, out)`) against the same model written out."""
    key = jax.random.key(6)
    x = jax.random.normal(key, (N, 4))
    mlp = eqx.nn.MLP(4, CLASSES, 6, 1, activation=jnp.tanh, key=key)

    def tapped(p, x, probes):
        y1 = _tap("l0", p.layers[0].weight @ x, probes)
        h = jnp.tanh(y1 + p.layers[0].bias)
        y2 = _tap("l1", p.layers[1].weight @ h, probes)
        return y2 + p.layers[1].bias, {"l0": x, "l1": h}, {"l0": y1, "l1": y2}

    model = lambda m, x: m(x)  # noqa: E731
    cots = _cotangents("categorical", "exact", model, mlp, x, None, None, 1)
    expected = kfac_by_hand(tapped, mlp, x, cots, biased={"l0", "l1"})
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    got = kfac_factors(model, likelihood="categorical", batch_size=3)(mlp, x)
    for i in range(2):
        a, g, _ = expected[f"l{i}"]
        assert got.layers[i].weight.axes == ((), (1,), (0,))  # (out, in) weights
        np.testing.assert_allclose(got.layers[i].weight.inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            got.layers[i].weight.outputs, g, rtol=1e-5, atol=1e-5
        )
    del params, static

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(6, name="Dense_0")(x))
            return nn.Dense(CLASSES, name="Dense_1")(h)

    variables = Linen().init(key, x[0])
    apply = lambda v, x: Linen().apply(v, x)  # noqa: E731
    k0 = variables["params"]["Dense_0"]["kernel"]
    k1 = variables["params"]["Dense_1"]["kernel"]
    b0 = variables["params"]["Dense_0"]["bias"]

    def tapped_linen(p, x, probes):
        y1 = _tap("d0", x @ k0, probes)
        h = jnp.tanh(y1 + b0)
        y2 = _tap("d1", h @ k1, probes)
        out = y2 + variables["params"]["Dense_1"]["bias"]
        return out, {"d0": x, "d1": h}, {"d0": y1, "d1": y2}

    cots = _cotangents("categorical", "exact", apply, variables, x, None, None, 1)
    expected = kfac_by_hand(tapped_linen, variables, x, cots, biased={"d0", "d1"})
    got = kfac_factors(apply, likelihood="categorical", batch_size=2)(variables, x)
    for i in range(2):
        a, g, _ = expected[f"d{i}"]
        dense = got["params"][f"Dense_{i}"]["kernel"]
        np.testing.assert_allclose(dense.inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dense.outputs, g, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    params, x, _, model = _model(_mlp)
    with pytest.raises(ValueError, match="likelihood must be one of"):
        ggn_diagonal(model, likelihood="poisson")
    with pytest.raises(ValueError, match="fisher must be one of"):
        kfac_factors(model, likelihood="gaussian", fisher="type2")
    with pytest.raises(TypeError, match="samples must be a positive int"):
        ggn_diagonal(model, likelihood="gaussian", samples=0)
    with pytest.raises(ValueError, match="variant must be"):
        kfac_factors(model, likelihood="gaussian", variant="mean")
    with pytest.raises(TypeError, match="needs labels="):
        ggn_diagonal(model, likelihood="categorical", fisher="empirical")(params, x)
    with pytest.raises(TypeError, match="needs key="):
        kfac_factors(model, likelihood="categorical", fisher="mc")(params, x)


@pytest.mark.parametrize("hold", ["placed", "shard=True"])
def test_over_a_mesh(hold):
    """16 examples over 8 devices, placed on an Explicit mesh (eagerly) or with
    `shard=True` under `jit`: the same factors and diagonal as on one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    params, x, tapped, model = _model(_tokens)
    x = jnp.concatenate([x, x, x, x])[:16]
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    expected = kfac_by_hand(tapped, params, x, cots, biased=BIASED["tokens"])
    rows, unravel = ggn_diagonal_dense(model, params, x, cots)
    opts = dict(likelihood="categorical", batch_size=1)
    if hold == "placed":
        mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
        x = jax.device_put(x, NamedSharding(mesh, P("d")))
        factors = kfac_factors(model, **opts)(params, x)
        diagonal = ggn_diagonal(model, **opts)(params, x)
    else:
        factors = jax.jit(kfac_factors(model, shard=True, **opts))(params, x)
        diagonal = jax.jit(ggn_diagonal(model, shard=True, **opts))(params, x)
    for leaf, (a, g, _) in expected.items():
        np.testing.assert_allclose(factors[leaf].inputs, a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(factors[leaf].outputs, g, rtol=1e-5, atol=1e-5)
    expected_diag = unravel(jnp.asarray(rows.sum(0), jnp.float32))
    tree_allclose(diagonal, expected_diag, rtol=1e-5, atol=1e-6)


def test_eager_calls_see_a_changed_closure():
    """A model closing over an array that changes between eager calls."""
    params, x, _, model = _model(_mlp)
    shift = {"value": jnp.zeros(CLASSES)}

    def shifted(p, x):
        return model(p, x) + shift["value"]

    factors = kfac_factors(shifted, likelihood="categorical", batch_size=2)
    diagonal = ggn_diagonal(shifted, likelihood="categorical", batch_size=2)
    for value in (0.0, 3.0):
        shift["value"] = jnp.array([value, 0.0, -value])
        cots = _cotangents("categorical", "exact", shifted, params, x, None, None, 1)
        rows, unravel = ggn_diagonal_dense(shifted, params, x, cots)
        tree_allclose(
            diagonal(params, x), unravel(jnp.asarray(rows.sum(0), jnp.float32)),
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip
        np.testing.assert_allclose(
            factors(params, x)["w2"].outputs,
            kfac_by_hand(_mlp()[2], params, x, cots, biased={"w2"})["w2"][1],
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip


@pytest.mark.parametrize("fn", [ggn_diagonal, kfac_factors])
def test_memory_is_flat_in_the_number_of_examples(fn):
    """XLA's compiled temporary memory at N = 64 and N = 4096, chunks of 32, on
    a model over tokens (a 64-wide dense layer over 16 positions): the same."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": _normal(k[0], (64, 64)), "head": _normal(k[1], (64, 10))}

    def model(p, x):
        return jax.nn.relu(x @ p["w"]) @ p["head"]

    curvature = fn(model, likelihood="categorical", batch_size=32)
    small, large = (
        temp_bytes(curvature, params, jnp.zeros((n, 16, 64))) for n in (64, 4096)
    )
    assert large <= small * 1.02, (small, large)


@pytest.mark.optimized  # its training and predictive sampling run for most of it
def test_laplace_example_calibrates_the_overconfident_map():
    """examples/laplace.py: the diagonal Laplace predictive has a lower test NLL
    and calibration error than the overconfident MAP, and its GGN diagonal is
    the dense GGN's (`jax.jacfwd`, `jax.hessian`) on a few of its examples."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "examples" / "laplace.py"
    spec = importlib.util.spec_from_file_location("laplace_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["laplace_example"] = module
    try:
        spec.loader.exec_module(module)
        with jax.numpy_dtype_promotion("standard"):  # as users run it (optax's Adam)
            result = module.main(["--samples", "16", "--steps", "150"])
    finally:
        del sys.modules["laplace_example"]
    assert result["laplace"]["nll"] < 0.8 * result["map"]["nll"], result
    assert result["laplace"]["ece"] < result["map"]["ece"], result
    assert result["prior"] < max(module.PRIORS)  # not the MAP itself
    model, (x, _) = result["model"], result["train"]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    apply = lambda p, x: module.logits(eqx.combine(p, static), x)  # noqa: E731
    cots = _cotangents("categorical", "exact", apply, params, x[:6], None, None, 1)
    rows, unravel = ggn_diagonal_dense(apply, params, x[:6], cots)
    got = ggn_diagonal(module.logits, likelihood="categorical", batch_size=4)(
        model, x[:6]
    )
    tree_allclose(
        eqx.filter(got, eqx.is_inexact_array),
        unravel(jnp.asarray(rows.sum(0), jnp.float32)),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def _two_outputs(p, x):
    h = x @ p["w"]
    return jnp.sum(h), h


def _dict_output(p, x):
    h = x @ p["w"]
    return {"aux": jnp.sum(h), "logits": h}


@pytest.mark.parametrize("model", [_two_outputs, _dict_output])
@pytest.mark.parametrize(
    "entry",
    ["ggn_diagonal(vmap)", "ggn_diagonal(ghost)", "kfac_factors"],
)
def test_a_model_of_several_outputs_is_refused(model, entry):
    """A model returning several outputs (`(aux, logits)`, a dict) has no one
    output to take the curvature of: every method refuses it, naming what it
    returned (ghost and KFAC silently took the first: all zeros, or 0.42 off)."""
    p = {"w": jnp.ones((5, 3), jnp.float32)}
    x = jnp.ones((4, 5), jnp.float32)
    if entry == "kfac_factors":
        fn = kfac_factors(model, likelihood="categorical")
    else:
        method = entry.split("(")[1][:-1]
        fn = ggn_diagonal(model, likelihood="categorical", method=method)
    with pytest.raises(TypeError, match="one real array") as info:
        fn(p, x)
    assert "float32[3]" in str(info.value)


@pytest.mark.parametrize(
    "entry", ["ggn_diagonal(vmap)", "ggn_diagonal(ghost)", "kfac_factors"]
)
def test_zero_examples_sum_to_zero(entry):
    """Over zero examples the curvature is the empty sum, zeros, as clipping's
    sums are (it raised about a reduction these entry points do not take)."""
    p = {"w": jnp.ones((5, 3), jnp.float32)}
    x = jnp.ones((0, 5), jnp.float32)

    def model(p, x):
        return x @ p["w"]

    if entry == "kfac_factors":
        got = kfac_factors(model, likelihood="gaussian", batch_size=2)(p, x)["w"]
        tree_allclose(got.inputs, jnp.zeros((5, 5)))
        tree_allclose(got.outputs, jnp.zeros((3, 3)))
    else:
        method = entry.split("(")[1][:-1]
        ggn = ggn_diagonal(model, likelihood="gaussian", method=method, batch_size=2)
        tree_allclose(ggn(p, x), {"w": jnp.zeros((5, 3))})


def _linear(p, x):
    return x @ p["w"]


def _its_loss(p, x):
    return jnp.sum(_linear(p, x) ** 2)


_P5, _X5 = {"w": jnp.ones((5, 3), jnp.float32)}, jnp.ones((6, 5), jnp.float32)
# (model, likelihood, fisher, call's keyword arguments, error, what it says)
_MISUSES = {
    "labels of the wrong length": (
        _linear, "categorical", "empirical", {"labels": jnp.zeros(4, jnp.int32)},
        ValueError, r"labels= must hold one label per example, 6 along axis 0, "
        r"but got shape \(4,\)",
    ),
    "the loss passed as the model": (
        _its_loss, "categorical", "exact", {}, TypeError,
        "takes the model's logits.*pass the model, not its loss",
    ),
    "one-hot labels": (
        _linear, "categorical", "empirical",
        {"labels": jax.nn.one_hot(jnp.zeros(6, jnp.int32), 3)}, TypeError,
        r"integer class indices, but got dtype float32.*jnp.argmax",
    ),
    "targets of the wrong shape": (
        _linear, "gaussian", "empirical", {"labels": jnp.zeros((6, 4))}, ValueError,
        r"labels= of one example must have shape \(3,\)",
    ),
    "labels with the exact Fisher": (
        _linear, "categorical", "exact", {"labels": jnp.zeros(6, jnp.int32)},
        TypeError, "got labels=, which only fisher='empirical' reads",
    ),
    "a key with the empirical Fisher": (
        _linear, "categorical", "empirical",
        {"labels": jnp.zeros(6, jnp.int32), "key": jax.random.key(0)}, TypeError,
        "got key=, which only fisher='mc' reads",
    ),
}  # fmt: skip


@pytest.mark.parametrize("entry", ["ggn_diagonal(vmap)", "ggn_diagonal(ghost)", "kfac"])
@pytest.mark.parametrize("misuse", _MISUSES)
def test_curvature_misuses_are_named(misuse, entry):
    """Each misuse gets the entry point's own message naming the argument, what
    arrived and what was expected (they gave JAX's internals, named the labels
    `args[2]`, or ignored `labels=`)."""
    model, likelihood, fisher, kwargs, error, says = _MISUSES[misuse]
    if entry == "kfac":
        fn = kfac_factors(model, likelihood=likelihood, fisher=fisher)
    else:
        method = entry.split("(")[1][:-1]
        fn = ggn_diagonal(model, likelihood=likelihood, fisher=fisher, method=method)
    name = "kfac_factors" if entry == "kfac" else "ggn_diagonal"
    with pytest.raises(error, match=f"{name}.*{says}"):
        fn(_P5, _X5, **kwargs)


def test_a_model_called_without_its_parameters_is_named():
    """A model object passed as `fun` and called on the inputs alone maps no
    argument: the message says how to call it (it gave the core's in_axes
    error)."""
    with pytest.raises(TypeError, match=r"maps no argument.*fun\(params, x\)"):
        ggn_diagonal(lambda x: x @ jnp.ones((5, 3)), likelihood="gaussian")(_X5)


def test_monte_carlo_keys_cost_an_index_per_example():
    """`fisher="mc"` makes each example's key in its chunk from its index: its
    memory grows by the 4-byte index per example only (it held the split keys,
    16 bytes per example); XLA's compiled estimate, 4096 and 65536 examples."""

    def model(p, x):
        return jnp.tanh(x @ p["w"])

    p = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    temps = []
    for n in (4096, 65536):
        x = jax.ShapeDtypeStruct((n, 8), jnp.float32)
        f = ggn_diagonal(model, likelihood="categorical", fisher="mc", batch_size=256)
        temps.append(temp_bytes(lambda p, x: f(p, x, key=jax.random.key(0)), p, x))
    assert temps[1] - temps[0] <= 5 * (65536 - 4096), temps


@pytest.mark.parametrize("classes", [9, 128, 300, 4096])
def test_mc_labels_are_the_inverse_cdf_draws(classes):
    """`fisher="mc"` draws its categorical labels as documented (one uniform per
    position and sample, under the inverse cumulative distribution, in blocks of
    classes past 128): equal to NumPy's float64 draws of the same uniforms, at
    the frequencies of the probabilities; classes of probability zero (leading,
    inside and trailing) never drawn."""
    logits = 3 * jax.random.normal(jax.random.key(0), (2, 3, classes))
    logits = logits.at[..., :2].set(-jnp.inf).at[..., -3:].set(-jnp.inf)
    logits = logits.at[..., classes // 2].set(-jnp.inf)
    p = jax.nn.softmax(logits, -1)
    key = jax.random.key(1)
    got = np.asarray(jax.jit(_curvature.drawn_classes, static_argnums=2)(key, p, 7))
    want, margin = drawn_by_hand(key, np.asarray(logits), 7, margins=True)
    # equal but where the draw lies within float32 rounding of a class's edge
    # (the device's sums of thousands of probabilities, in its own order)
    clear = margin > 2e-5
    assert clear.mean() > 0.9, margin
    np.testing.assert_array_equal(got[clear], want[clear])
    # (there the class beside it, past a class of no mass in between)
    assert np.all(np.abs(got - want)[~clear] <= 2)
    assert np.all(np.take_along_axis(np.asarray(p)[None], got[..., None], -1) > 0)
    many = _curvature.drawn_classes(key, p[0, 0], 40_000)
    counts = np.bincount(np.asarray(many), minlength=classes) / 40_000
    p0 = np.asarray(p[0, 0], np.float64)
    assert counts[p0 == 0].sum() == 0
    np.testing.assert_allclose(counts, p0, atol=5 * np.sqrt(p0.max() / 40_000))


def test_mc_labels_never_draw_zero_mass_at_the_ends():
    """Where rounding puts the scaled uniform at (or past) the total, or at zero
    before leading classes of no mass, the draw is held to a class of mass."""
    mass = jnp.array([[0.0, 0.0, 0.5, 0.5, 0.0]])
    ends = jnp.cumsum(mass, -1)
    for v, want in ((0.0, 2), (0.49, 2), (0.5, 3), (1.0, 3), (1.5, 3)):
        assert int(_curvature._first_above(ends, mass, jnp.array([v]))[0]) == want


def _bias_cases():
    key = jax.random.key(0)
    lin, conv = eqx.nn.Linear(5, 3, key=key), eqx.nn.Conv2d(3, 4, 3, key=key)
    dense, lconv = nn.Dense(3), nn.Conv(4, (3, 3))

    def one_example_conv(p, x):
        y = lax.conv_general_dilated(x[None], p["k"], (1, 1), "SAME")[0]
        return y + p["b"][:, None, None]

    def batch_conv(p, x):
        y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME")
        return y + p["b"][None, :, None, None]

    def scanned(p, x):
        step = lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None)  # noqa: E731
        return lax.scan(step, x, (p["w"], p["b"]))[0]

    kb = {"k": jnp.ones((4, 3, 3, 3)), "b": jnp.ones(4)}
    x5, img = jnp.ones((4, 5)), jnp.ones((4, 3, 8, 8))
    # (model, params, inputs, the weight's path, the bias's path, joined)
    return {
        "x @ w + b": (
            lambda p, x: x @ p["w"] + p["b"], {"w": jnp.ones((5, 3)), "b": jnp.ones(3)},
            x5, "['w']", "['b']", True,
        ),
        "eqx.nn.Linear": (lambda m, x: m(x), lin, x5, ".weight", ".bias", True),
        "nn.Dense": (
            lambda v, x: dense.apply(v, x), dense.init(key, jnp.ones(5)), x5,
            "['params']['kernel']", "['params']['bias']", True,
        ),
        "nn.Conv": (
            lambda v, x: lconv.apply(v, x), lconv.init(key, jnp.ones((8, 8, 3))),
            jnp.ones((4, 8, 8, 3)), "['params']['kernel']", "['params']['bias']", True,
        ),
        "conv of a batch": (
            batch_conv, kb, jnp.ones((4, 1, 3, 8, 8)), "['k']", "['b']", True,
        ),
        "eqx.nn.Conv2d": (lambda m, x: m(x), conv, img, ".weight", ".bias", False),
        "conv(x[None])[0] + b": (one_example_conv, kb, img, "['k']", "['b']", False),
        "a scanned stack": (
            scanned, {"w": jnp.ones((2, 5, 5)), "b": jnp.ones((2, 5))}, x5,
            "['w']", "['b']", False,
        ),
    }  # fmt: skip


_BIASES = _bias_cases()


@pytest.mark.parametrize("case", _BIASES)
def test_a_bias_joins_its_weight_exactly_where_documented(case):
    """`kfac_factors`' docstring says exactly when a bias joins its weight's
    factors (kfac-jax's blocks) and when it keeps its own diagonal."""
    model, params, x, weight, bias, joined = _BIASES[case]
    factors = kfac_factors(model, likelihood="gaussian")(params, x)
    found = {
        jax.tree_util.keystr(p): v
        for p, v in jax.tree_util.tree_flatten_with_path(
            factors, is_leaf=lambda v: isinstance(v, Kronecker) or v is None
        )[0]
    }
    assert isinstance(found[weight], Kronecker)
    assert (found[bias] is None) == joined
    assert (found[weight].bias is not None) == joined
