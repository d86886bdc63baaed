"""`ekfac_factors` and `multiply_inverse` against oracles made without the library:
the eigenvalue-corrected blocks from activations and output gradients captured by
hand (`ekfac_by_hand`), and dense solves of those blocks."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap as cv
from chunkvmap import EigenKronecker, Kronecker, ekfac_factors, multiply_inverse
from tests.helpers import (
    ekfac_block,
    ekfac_by_hand,
    kfac_by_hand,
    make_mesh,
    tree_allclose,
)
from tests.test_curvature import (
    BIASED,
    MODELS,
    _call_args,
    _cotangents,
    _labels,
    _model,
)


def _check_blocks(name, got, expected, rtol=1e-4):
    for leaf, block in expected.items():
        factor = got["ws"] if leaf.startswith("ws") else got[leaf]
        assert isinstance(factor, EigenKronecker), (leaf, factor)
        layer = int(leaf[2:]) if leaf.startswith("ws") else None
        mine = ekfac_block(factor, layer)
        scale = np.abs(block).max()
        np.testing.assert_allclose(mine, block, rtol=rtol, atol=rtol * scale)


def _check_other_leaves(got, model, params, x, biased):
    """A joined bias is None, every leaf without Kronecker factors keeps
    `kfac_factors`' diagonal of these examples, and a rotated leaf its axes and
    joined bias."""
    kfac = cv.kfac_factors(model, likelihood="categorical", batch_size=2)(params, x)
    for leaf in params:
        if leaf in biased.values():
            assert got[leaf] is None
        elif not isinstance(kfac[leaf], Kronecker):
            np.testing.assert_allclose(got[leaf], kfac[leaf], rtol=1e-5, atol=1e-7)
        else:
            assert got[leaf].axes == kfac[leaf].axes
            assert got[leaf].bias == kfac[leaf].bias


_NAMES = ["mlp", "tokens", "scanned", "conv-NHWC", "conv-NCHW", "embedding",
          "attention-layernorm"]  # fmt: skip


@pytest.mark.parametrize(
    "name, method",
    [(name, "vmap") for name in _NAMES] + [(name, "ghost") for name in _NAMES],
)
def test_ekfac_matches_the_eigen_corrected_blocks_built_by_hand(name, method):
    """Each product weight's block (a joined bias its last input row; a scanned
    stack's one block per layer) equals the oracle's; every other leaf keeps
    `kfac_factors`' diagonal and a joined bias is None. N = 5 in chunks of 2."""
    params, x, tapped, model = _model(MODELS[name])
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    biased = BIASED.get(name, {})
    expected = ekfac_by_hand(tapped, params, x, cots, biased=biased)
    got = ekfac_factors(model, likelihood="categorical", batch_size=2, method=method)(
        params, x
    )
    _check_blocks(name, got, expected)
    _check_other_leaves(got, model, params, x, biased)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 5, 7, 3, 200), (2, 13, 32, 300, 130), (1, 1, 1, 1, 1), (3, 9, 4, 129, 257),
        (1, 3, 1600, 384, 1152),
    ],
)  # fmt: skip
def test_the_squares_kernel_is_the_sum_of_squared_products(shape):
    """`sum_e (a_e^T d_e)^2` by the Pallas kernel (interpreted off the TPU):
    examples, rows and columns not whole tiles, one position, several layers,
    tiles of 384 and positions too long for several examples a step."""
    from chunkvmap._quantities import _squares

    layers, examples, positions, rows, cols = shape
    k = jax.random.split(jax.random.key(0), 2)
    a = jax.random.normal(k[0], (layers, examples, positions, rows))
    d = jax.random.normal(k[1], (layers, examples, positions, cols))
    products = np.einsum("lepi,lepj->leij", np.float64(a), np.float64(d))
    expected = np.sum(products**2, 1)
    interpret = jax.default_backend() != "tpu"
    got = _squares._kernel_sum(a, d, interpret=interpret)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.max())


def test_ekfac_under_grad_with_the_kernel(squares_in_kernel):
    """`jax.grad` of EK-FAC's eigenvalues (ghost) through the kernel, which has no
    derivative of its own: the gradient of the same computation without it."""
    from chunkvmap._quantities import _squares

    params, x, _, model = _model(MODELS["mlp"])
    ek = ekfac_factors(model, likelihood="categorical", batch_size=2, method="ghost")

    def total(p):
        found = jax.tree.leaves(ek(p, x), is_leaf=_is_eigen)
        return sum(jnp.sum(f.eigenvalues) for f in found if _is_eigen(f))

    got = jax.grad(total)(params)
    assert squares_in_kernel
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(_squares, "IN_KERNEL", frozenset())
        want = jax.grad(total)(params)
    tree_allclose(got, want, rtol=1e-5, atol=1e-6)


def _is_eigen(x):
    return isinstance(x, EigenKronecker)


def test_the_squares_kernel_takes_the_callers_precision():
    """The kernel's products at the precision the caller set: full float32 for
    "highest", three bfloat16 passes for "high", else the platform's default."""
    from jax import lax

    from chunkvmap._quantities import _squares

    for wanted, precision in [
        ("highest", lax.Precision.HIGHEST), ("float32", lax.Precision.HIGHEST),
        ("high", lax.Precision.HIGH), ("tensorfloat32", lax.Precision.HIGH),
        ("BF16_BF16_F32_X3", lax.Precision.HIGH),
        ("F32_F32_F32", lax.Precision.HIGHEST),
        ("default", lax.Precision.DEFAULT), ("bfloat16", lax.Precision.DEFAULT),
    ]:  # fmt: skip
        with jax.default_matmul_precision(wanted):
            assert _squares._precision() == precision, wanted


def test_ghost_second_moments_by_the_kernel(squares_in_kernel):
    """EK-FAC's second pass with every leaf's squares summed by the kernel (as on
    the TPU): the blocks built by hand (scanned layers: several per kernel call;
    a convolution with a joined bias: positions over two axes; lookups), N = 5
    in chunks of 2, eagerly and (the scanned stack) jitted. (Every model's pairs
    by `einsum`: test_ekfac_matches_the_eigen_corrected_blocks_built_by_hand.)"""
    for name in ["scanned", "conv-NCHW", "embedding"]:
        params, x, tapped, model = _model(MODELS[name])
        cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
        biased = BIASED.get(name, {})
        expected = ekfac_by_hand(tapped, params, x, cots, biased=biased)
        ek = ekfac_factors(
            model, likelihood="categorical", batch_size=2, method="ghost"
        )
        calls = len(squares_in_kernel)
        _check_blocks(
            name, (jax.jit(ek) if name == "scanned" else ek)(params, x), expected
        )
        assert len(squares_in_kernel) > calls, name


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_lookups_of_rows_out_of_range(method):
    """A table looked up in fill mode (`.at[x].get(mode="fill")`) with ids past
    its rows: those positions read nothing and their gradient is dropped, so
    they add nothing to the table's block (its factors are its kept positions':
    the oracle's activation there a row of zeros, its output gradient not
    taken); the blocks built by hand."""
    k = jax.random.split(jax.random.key(5), 3)
    params = {
        "table": jax.random.normal(k[0], (7, 4)) * 0.5,
        "head": jax.random.normal(k[1], (4, 3)) * 0.5,
    }
    x = jax.random.randint(k[2], (5, 6), 0, 7).at[:, 2].set(9).at[1, 4].set(7)

    def tapped(p, x, probes):
        e = p["table"].at[x].get(mode="fill", fill_value=0.0)
        kept = ((x >= 0) & (x < 7))[:, None]  # (the positions that read a row)
        e = e if probes is None else e + jnp.where(kept, probes["table"], 0.0)
        out = jnp.tanh(e) @ p["head"]
        out = out if probes is None else out + probes["head"]
        acts = {"table": jax.nn.one_hot(x, 7), "head": jnp.tanh(e)}
        return out, acts, {"table": e, "head": out}

    def model(p, x):
        return tapped(p, x, None)[0]

    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    expected = ekfac_by_hand(tapped, params, x, cots)
    got = ekfac_factors(model, likelihood="categorical", batch_size=2, method=method)
    _check_blocks("lookups", got(params, x), expected)


@pytest.mark.parametrize(
    "likelihood,fisher,samples",
    [("categorical", "mc", 2), ("gaussian", "empirical", 1), ("gaussian", "exact", 1)],
)
def test_ekfac_fisher_types(likelihood, fisher, samples):
    params, x, tapped, model = _model(MODELS["tokens"])
    key = jax.random.key(7)
    labels = _labels(likelihood, model, params, x, jax.random.key(8))
    cots = _cotangents(likelihood, fisher, model, params, x, labels, key, samples)
    expected = ekfac_by_hand(tapped, params, x, cots, biased=BIASED["tokens"])
    for method in ("vmap", "ghost"):
        got = ekfac_factors(
            model, likelihood=likelihood, fisher=fisher, samples=samples,
            batch_size=3, method=method,
        )(params, x, **_call_args(fisher, labels, key))  # fmt: skip
        _check_blocks("tokens", got, expected)


@pytest.mark.parametrize(
    "name, method, given, call",
    [
        ("tokens", "vmap", "kfac", "eager"),
        ("conv-NCHW", "ghost", "kfac", "jit"),
        ("mlp", "ghost", "ekfac", "eager"),
        ("embedding", "vmap", "ekfac", "jit"),
        ("scanned", "ghost", "kfac", "jit"),
        ("attention-layernorm", "vmap", "kfac", "eager"),
    ],
)
def test_given_factors_give_the_bases(name, method, given, call):
    """`factors=` fitted on other examples (the examples 1, 2, 3, 4, 0, 1: a
    subset weighted otherwise) gives the bases: each block equals the oracle's
    with those examples' bases and these examples' eigenvalues, and every other
    leaf gets these examples' diagonal (one pass: the first is not run)."""
    params, x, tapped, model = _model(MODELS[name])
    other = x[jnp.array([1, 2, 3, 4, 0, 1])]
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    cots_other = _cotangents(
        "categorical", "exact", model, params, other, None, None, 1
    )
    biased = BIASED.get(name, {})
    expected = ekfac_by_hand(
        tapped, params, x, cots, biased=biased, bases_from=(other, cots_other)
    )
    fit = cv.kfac_factors if given == "kfac" else ekfac_factors
    factors = fit(model, likelihood="categorical", batch_size=2)(params, other)
    ek = ekfac_factors(model, likelihood="categorical", batch_size=2, method=method)
    run = ek if call == "eager" else jax.jit(ek)
    got = run(params, x, factors=factors)
    _check_blocks(name, got, expected)
    _check_other_leaves(got, model, params, x, biased)


def test_given_factors_of_other_parameters_are_refused():
    """`factors=` of another model's parameters (other shapes), a tree of another
    structure, or a leaf's entry missing gives an error naming the argument."""
    params, x, _, model = _model(MODELS["mlp"])
    ek = ekfac_factors(model, likelihood="categorical", batch_size=2)
    kfac = cv.kfac_factors(model, likelihood="categorical")(params, x)
    weight = next(k for k, f in kfac.items() if isinstance(f, Kronecker))
    wrong = dict(kfac)
    wrong[weight] = Kronecker(
        kfac[weight].inputs[:-1, :-1], kfac[weight].outputs, kfac[weight].count,
        axes=kfac[weight].axes, bias=kfac[weight].bias,
    )  # fmt: skip
    with pytest.raises(ValueError, match="factors=, differentiated leaf .* inputs"):
        ek(params, x, factors=wrong)
    with pytest.raises(TypeError, match="factors= must be structured like"):
        ek(params, x, factors=[kfac])
    missing = {**kfac, weight: None}
    with pytest.raises(ValueError, match="expected Kronecker factors.* got None"):
        ek(params, x, factors=missing)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_convolutions_over_an_explicit_mesh(layout):
    """A convolution's KFAC and EK-FAC blocks (ghost: no per-example gradient,
    which `jax.vmap` of a convolution's derivative cannot form over an Explicit
    mesh) with 16 examples placed over 8 devices: eagerly and jitted (NHWC), with
    the mesh entered (NCHW), each the blocks built by hand."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    name = f"conv-{layout}"
    params, x, tapped, model = _model(MODELS[name])
    x = jnp.concatenate([x, x * 0.5, x - 0.25, x[:1]])  # 16 examples
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    kfac = kfac_by_hand(tapped, params, x, cots, biased=BIASED[name])
    expected = ekfac_by_hand(tapped, params, x, cots, biased=BIASED[name])
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    placed = jax.device_put(x, NamedSharding(mesh, P("d")))
    opts = dict(likelihood="categorical", batch_size=1)
    for how in ("placed", "jitted") if layout == "NHWC" else ("entered",):
        kf = cv.kfac_factors(model, **opts)
        ek = ekfac_factors(model, method="ghost", **opts)
        if how == "jitted":
            kf, ek = jax.jit(kf), jax.jit(ek)
        with jax.set_mesh(mesh) if how == "entered" else contextlib.nullcontext():
            factors, eigen = kf(params, placed), ek(params, placed)
        for leaf, (a, g, _) in kfac.items():
            np.testing.assert_allclose(factors[leaf].inputs, a, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(factors[leaf].outputs, g, rtol=1e-5, atol=1e-5)
        _check_blocks(name, eigen, expected)


def test_ekfac_eager_jitted_sharded_and_uneven_agree():
    """The same factors eagerly, under `jax.jit`, over 8 devices (N = 13: uneven
    over them and the chunks) and in one chunk."""
    params, x, _, model = _model(MODELS["conv-NHWC"])
    x = jnp.concatenate([x, x[:3] * 0.5, x[:5] - 0.25])  # 13 examples
    one = ekfac_factors(model, likelihood="categorical")(params, x)
    mesh = make_mesh((8,), ("data",))
    ghost = dict(likelihood="categorical", method="ghost")
    for f in (
        ekfac_factors(model, likelihood="categorical", batch_size=3),
        jax.jit(ekfac_factors(model, likelihood="categorical", batch_size=3)),
        ekfac_factors(
            model, likelihood="categorical", batch_size=1, shard=True, mesh=mesh
        ),
        ekfac_factors(model, batch_size=4, **ghost),
        jax.jit(ekfac_factors(model, batch_size=4, **ghost)),
        ekfac_factors(model, batch_size=1, shard=True, mesh=mesh, **ghost),
    ):
        got = f(params, x)
        for leaf, factor in got.items():
            if isinstance(factor, EigenKronecker):
                np.testing.assert_allclose(
                    ekfac_block(factor), ekfac_block(one[leaf]), rtol=1e-4, atol=1e-5
                )
            else:
                tree_allclose(factor, one[leaf], rtol=1e-5, atol=1e-6)


def _dense_solve(block, vec, damping):
    return np.linalg.solve(block + damping * np.eye(len(block)), vec)


@pytest.mark.parametrize("kind", ["ekfac", "kfac"])
def test_multiply_inverse_is_the_damped_dense_solve(kind):
    """`(F + damping I)^-1 g` for each block (a weight with its joined bias
    solved together; a scanned stack's layers each with its block; the
    diagonal's leaves entrywise), against `np.linalg.solve` of the dense block
    (EK-FAC's, or KFAC's `kron(A, G) / count`)."""
    damping = 0.3
    for name in ("mlp", "scanned", "attention-layernorm"):
        params, x, tapped, model = _model(MODELS[name])
        cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
        biased = BIASED.get(name, {})
        make = ekfac_factors if kind == "ekfac" else cv.kfac_factors
        factors = make(model, likelihood="categorical", batch_size=2)(params, x)
        if kind == "ekfac":
            blocks = ekfac_by_hand(tapped, params, x, cots, biased=biased)
        else:
            blocks = {
                k: np.kron(a, g) / count
                for k, (a, g, count) in kfac_by_hand(
                    tapped, params, x, cots, biased=biased
                ).items()
            }
        grads = jax.tree.map(
            lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params
        )
        got = multiply_inverse(factors, grads, damping=damping)
        for leaf, block in blocks.items():
            if leaf.startswith("ws"):
                layer = int(leaf[2:])
                g, mine = grads["ws"][layer], got["ws"][layer]
            else:
                g, mine = grads[leaf], got[leaf]
            vec = np.asarray(g, np.float64).reshape(-1)
            bias = biased.get(leaf)
            if bias is not None:  # the bias: the last input row
                vec = np.concatenate([vec, np.asarray(grads[bias], np.float64)])
                mine = np.concatenate(
                    [np.asarray(mine).reshape(-1), np.asarray(got[bias])]
                )
            want = _dense_solve(block, vec, damping)
            np.testing.assert_allclose(
                np.asarray(mine).reshape(-1), want, rtol=2e-4, atol=2e-5
            )
        for leaf, factor in factors.items():  # the diagonal's leaves
            blocked = isinstance(factor, (Kronecker, EigenKronecker))
            if factor is not None and not blocked:
                want = np.asarray(grads[leaf]) / (np.asarray(factor) + damping)
                np.testing.assert_allclose(got[leaf], want, rtol=1e-5, atol=1e-7)


def test_equinox_and_flax_models():
    """An Equinox MLP (weights `(out, in)`, holding its activation function) and a
    Flax linen MLP (kernels `(in, out)`) against the same model written out; the
    Equinox model's gradient (`eqx.filter_grad`: None at the function) solved
    against the dense block."""
    import equinox as eqx
    import flax.linen as nn

    from tests.test_curvature import CLASSES, N, _tap

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
    expected = ekfac_by_hand(tapped, mlp, x, cots, biased={"l0", "l1"})
    for method in ("ghost", "vmap"):
        got = ekfac_factors(
            model, likelihood="categorical", batch_size=3, method=method
        )(mlp, x)
        for i in range(2):
            weight = got.layers[i].weight
            assert weight.axes == ((), (1,), (0,))  # (out, in) weights
            np.testing.assert_allclose(
                ekfac_block(weight), expected[f"l{i}"], rtol=1e-4, atol=1e-5
            )
            assert got.layers[i].bias is None
    g = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(mlp)
    solved = multiply_inverse(got, g, damping=0.5)
    vec = np.concatenate(
        [np.asarray(g.layers[0].weight).T.reshape(-1), np.asarray(g.layers[0].bias)]
    )
    want = _dense_solve(expected["l0"], vec, 0.5)
    mine = np.concatenate(
        [
            np.asarray(solved.layers[0].weight).T.reshape(-1),
            np.asarray(solved.layers[0].bias),
        ]
    )
    np.testing.assert_allclose(mine, want, rtol=2e-4, atol=2e-5)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(6, name="Dense_0")(x))
            return nn.Dense(CLASSES, name="Dense_1")(h)

    variables = Linen().init(key, x[0])
    apply = lambda v, x: Linen().apply(v, x)  # noqa: E731
    p = variables["params"]

    def tapped_linen(v, x, probes):
        y1 = _tap("d0", x @ p["Dense_0"]["kernel"], probes)
        h = jnp.tanh(y1 + p["Dense_0"]["bias"])
        y2 = _tap("d1", h @ p["Dense_1"]["kernel"], probes)
        out = y2 + p["Dense_1"]["bias"]
        return out, {"d0": x, "d1": h}, {"d0": y1, "d1": y2}

    cots = _cotangents("categorical", "exact", apply, variables, x, None, None, 1)
    expected = ekfac_by_hand(tapped_linen, variables, x, cots, biased={"d0", "d1"})
    for method in ("ghost", "vmap"):
        got = ekfac_factors(
            apply, likelihood="categorical", batch_size=2, method=method
        )(variables, x)
        for i in range(2):
            np.testing.assert_allclose(
                ekfac_block(got["params"][f"Dense_{i}"]["kernel"]),
                expected[f"d{i}"], rtol=1e-4, atol=1e-5,
            )  # fmt: skip


def test_errors_name_the_argument():
    params, x, _, model = _model(MODELS["mlp"])
    factors = ekfac_factors(model, likelihood="categorical")(params, x)
    for bad in (-1.0, True, "0.1", jnp.ones(2), math.nan):
        with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
            multiply_inverse(factors, params, damping=bad)
    with pytest.raises(TypeError, match="damping must be a float scalar, but got a"):
        jax.jit(multiply_inverse)(factors, params, damping=jnp.ones(2))
    with pytest.raises(ValueError, match="one entry per leaf of grads"):
        multiply_inverse(factors, {"w1": params["w1"]}, damping=1.0)
    diag = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match="factors leaf 0 has shape"):
        multiply_inverse(diag, {**params, "b1": params["b1"][:2]}, damping=1.0)
    with pytest.raises(ValueError, match="likelihood must be one of"):
        ekfac_factors(model, likelihood="poisson")


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_changed_closure_or_parameters_are_seen(method):
    """Eager calls of one transform: new parameters, and a model whose closed-over
    array changed between calls, give the factors of what they hold now (a
    transform built afresh is the reference)."""
    params, x, _, _ = _model(MODELS["mlp"])
    scale = [jnp.float32(1.0)]

    def model(p, x):
        h = jnp.tanh(x @ p["w1"] + p["b1"]) * scale[0]
        return h @ p["w2"] + p["b2"]

    opts = dict(likelihood="categorical", batch_size=2, method=method)
    held = ekfac_factors(model, **opts)
    held(params, x)
    for change in ("params", "closure"):
        if change == "params":
            params = jax.tree.map(lambda a: a * 1.5, params)
        else:
            scale[0] = jnp.float32(0.25)
        got, want = held(params, x), ekfac_factors(model, **opts)(params, x)
        for leaf in ("w1", "w2"):
            np.testing.assert_allclose(
                ekfac_block(got[leaf]), ekfac_block(want[leaf]), rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("name", ["mlp", "scanned", "embedding"])
def test_ekfac_preconditioned_projections(name, always_ghost):
    """`per_example_grad_projections(..., precondition=ekfac_factors(...))`: each
    leaf's projected gradient whitened by `(P^T F P + lambda)^(-1/2)`, `F` its
    EK-FAC block (a joined bias's row its own block, the cross terms left out; a
    scanned stack's layers each their block; a diagonal leaf's diagonal), against
    the oracle's whitening of the dense blocks (`preconditioned_rows`), both
    methods, N = 5 in chunks of 2."""
    from tests.helpers import nll, preconditioned_rows, projected_grads

    params, x, _, model = _model(MODELS[name])
    y = jnp.arange(len(x)) % 3
    if name == "embedding":
        y = jnp.broadcast_to(y[:, None], x.shape)
    loss = lambda p, x, y: nll("categorical", model(p, x), y)  # noqa: E731
    factors = ekfac_factors(model, likelihood="categorical", batch_size=2)(params, x)
    dim, damping = 3, 0.3
    rows = projected_grads(loss, params, (x, y), dim=dim)
    biased = {v: k for k, v in BIASED.get(name, {}).items()}
    dense = []
    for leaf, p in sorted(params.items()):
        f = factors[leaf]
        if leaf in biased:  # the bias: its row of the weight's block
            w = factors[biased[leaf]]
            n_in, n_out = w.eigenvalues.shape
            block = ekfac_block(w).reshape(n_in, n_out, n_in, n_out)
            dense.append(block[-1, :, -1, :])
        elif isinstance(f, EigenKronecker):
            n_in, n_out = f.eigenvalues.shape[-2:]
            if f.axes[0]:  # a scanned stack: one block per layer
                blocks = [ekfac_block(f, b) for b in range(p.shape[0])]
                size = n_in * n_out
                full = np.zeros((len(blocks) * size,) * 2)
                for b, block in enumerate(blocks):
                    full[b * size : (b + 1) * size, b * size : (b + 1) * size] = block
                dense.append(full)
            elif f.bias is not None:
                block = ekfac_block(f).reshape(n_in, n_out, n_in, n_out)
                m = n_in - 1
                dense.append(block[:m, :, :m, :].reshape(m * n_out, m * n_out))
            else:
                dense.append(ekfac_block(f))
        else:
            dense.append(np.diag(np.asarray(f, np.float64).reshape(-1)))
    shapes = [p.shape for _, p in sorted(params.items())]
    expected = preconditioned_rows(rows, shapes, dense, dim, damping)
    for method in ("vmap", "ghost"):
        project = cv.per_example_grad_projections(
            loss, dim=dim, batch_size=2, method=method
        )
        got = project(params, x, y, precondition=factors, damping=damping)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-4 * scale)


def _spectral(eigh, x):
    """Quantities of `eigh(x)` that do not depend on the eigenvectors' signs: the
    values' squares, and the projector onto the two lowest eigenvectors seen
    through a matrix that does not commute with `x` (through `x` itself its
    derivative would not depend on the vectors')."""
    values, vectors = eigh(x)
    low = vectors[..., :, :2]
    seen = jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
    return (values**2).sum() + (low @ jnp.swapaxes(low, -1, -2) * seen).sum()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_eigendecompositions_on_the_host_are_jaxs(eigh_on_host, dtype):
    """Where the host computes them (the TPU), `eigh` gives `jnp.linalg.eigh`'s
    values and its reconstruction, eagerly, jitted and over a batch by `jax.vmap`,
    and its derivatives (`jax.grad`, `jax.jacfwd`)."""
    from chunkvmap._quantities._eigh import eigh

    tol = dict(rtol=2e-4, atol=2e-5) if dtype == "float32" else dict(rtol=1e-10)
    with jax.enable_x64(dtype == "float64"):
        a = jax.random.normal(jax.random.key(0), (3, 6, 6), dtype)
        x = a @ jnp.swapaxes(a, -1, -2) + jnp.asarray(0.1, dtype) * a  # not symmetric
        for call in (eigh, jax.jit(eigh), jax.vmap(eigh)):
            values, vectors = call(x)
            want_values, _ = jnp.linalg.eigh(x)
            np.testing.assert_allclose(values, want_values, **tol)
            sym = (x + jnp.swapaxes(x, -1, -2)) / 2
            rebuilt = vectors * values[..., None, :] @ jnp.swapaxes(vectors, -1, -2)
            np.testing.assert_allclose(rebuilt, sym, **tol)
        assert eigh_on_host, "no eigendecomposition ran on the host"
        for derivative in (jax.grad, jax.jacfwd):
            got = derivative(lambda x: _spectral(eigh, x))(x)
            want = derivative(lambda x: _spectral(jnp.linalg.eigh, x))(x)
            np.testing.assert_allclose(got, want, **tol)
        assert {d for _, d in eigh_on_host} == {np.dtype(dtype)}, eigh_on_host


def test_ekfac_and_its_inverse_with_eigendecompositions_on_the_host(eigh_on_host):
    """`ekfac_factors`, `multiply_inverse` and an EK-FAC-whitened projection with
    the host's eigendecompositions (the TPU's path): the blocks built by hand,
    eagerly, jitted and over 8 devices (N = 13), and the same preconditioned
    gradients as the default path."""
    params, x, tapped, model = _model(MODELS["mlp"])
    x = jnp.concatenate([x, x[:3] * 0.5, x[:5] - 0.25])  # 13 examples
    cots = _cotangents("categorical", "exact", model, params, x, None, None, 1)
    expected = ekfac_by_hand(tapped, params, x, cots, biased=BIASED["mlp"])
    mesh = make_mesh((8,), ("data",))
    opts = dict(likelihood="categorical", batch_size=3)
    for f in (
        ekfac_factors(model, **opts),
        jax.jit(ekfac_factors(model, method="ghost", **opts)),
        ekfac_factors(model, shard=True, mesh=mesh, **opts),
        jax.jit(ekfac_factors(model, shard=True, mesh=mesh, method="ghost", **opts)),
    ):
        _check_blocks("mlp", f(params, x), expected)
    factors = ekfac_factors(model, **opts)(params, x)
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size)).reshape(p.shape), params)
    calls = len(eigh_on_host)
    got = jax.jit(multiply_inverse)(factors, grads, damping=0.3)  # (traced)
    kfac = cv.kfac_factors(model, **opts)(params, x)
    got_kfac = multiply_inverse(kfac, grads, damping=0.3)
    assert len(eigh_on_host) > calls
    eigh_on_host.clear()
    with pytest.MonkeyPatch.context() as undo:  # the default path, for comparison
        from chunkvmap._quantities import _eigh

        undo.setattr(_eigh, "ON_HOST", frozenset())
        tree_allclose(got, multiply_inverse(factors, grads, damping=0.3), rtol=1e-4)
        tree_allclose(got_kfac, multiply_inverse(kfac, grads, damping=0.3), rtol=1e-4)
    assert not eigh_on_host
