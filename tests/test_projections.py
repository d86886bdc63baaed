"""`per_example_grad_projections`: every example's gradient projected by a seeded,
Kronecker-structured Gaussian projection, against `jax.vmap(jax.grad)` followed by
the same projection (`tests.helpers.projected_grads`), by both methods: the ghost
method projects each use's form (dense layers, attention, convolutions, embedding
lookups) without forming those gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import Kronecker, per_example_grad_projections

from . import test_ghost_models as models
from .helpers import make_mesh, nll, preconditioned_rows, projected_grads, temp_bytes


def _close(got, expected, rtol=2e-5):
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got), expected, atol=rtol * scale)


def _mlp(rng):
    p = {
        "w1": jnp.asarray(rng.normal(size=(20, 30)), jnp.float32),
        "b1": jnp.zeros(30),
        "w2": jnp.asarray(rng.normal(size=(30, 3)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(13, 20)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(13, 3)), jnp.float32)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    return loss, p, (x, y)


def _nchw(rng):
    w = jnp.asarray(rng.normal(size=(6, 3, 3, 3)), jnp.float32) * 0.3  # OIHW
    v = jnp.asarray(rng.normal(size=(6 * 4 * 4, 2)), jnp.float32) * 0.1
    x = jnp.asarray(rng.normal(size=(9, 3, 8, 8)), jnp.float32)  # NCHW

    def loss(p, x):
        h = jax.lax.conv_general_dilated(
            x[None], p["w"], (2, 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return jnp.sum(jnp.tanh(h.reshape(-1) @ p["v"]) ** 2)

    return loss, {"w": w, "v": v}, (x,)


def _lookup(rng):
    """An embedding read with `mode="fill"`: tokens past the table read zeros (and
    get no gradient)."""
    p = {
        "emb": jnp.asarray(rng.normal(size=(300, 32)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(32, 2)), jnp.float32) * 0.2,
    }
    tokens = jnp.asarray(rng.integers(0, 330, (7, 5)), jnp.int32)  # some past 300

    def loss(p, tokens):
        h = jnp.take(p["emb"], tokens, axis=0, mode="fill", fill_value=0.0)
        return jnp.sum(jnp.tanh(h @ p["w"] + 0.5) ** 2)  # (not flat at the fill)

    return loss, p, (tokens,)


def _dp(n):
    params, loss = models.dp_models()  # the LMs (gathered, tied and scanned), a CNN
    return loss, params, models.dp_batch(n)


CASES = {
    "mlp": lambda rng: _mlp(rng),
    "conv NCHW": _nchw,
    "LMs and CNN": lambda rng: _dp(7),
    "lookup past the table": _lookup,
}


@pytest.mark.parametrize(
    "case, method",
    [
        (c, m)
        for c in CASES
        for m in ("vmap", "ghost")
        if (c, m) != ("LMs and CNN", "vmap")
    ],
)
def test_projections_match_the_projected_vmap_gradients(case, method, rng):
    """N uneven in chunks of 3 (and 2 under jit); the ghost method on the LMs and
    the CNN projects their dense, attention, convolution and embedding uses.
    (`method="vmap"` forms and projects every leaf alike, whatever the model: it
    meets the LMs and the CNN over a mesh, in `test_projections_over_a_mesh`.)"""
    loss, params, batch = CASES[case](rng)
    expected = projected_grads(loss, params, batch, dim=4, seed=3)
    project = per_example_grad_projections(
        loss, dim=4, seed=3, batch_size=3, method=method
    )
    _close(project(params, *batch), expected)
    jitted = jax.jit(
        per_example_grad_projections(loss, dim=4, seed=3, batch_size=2, method=method)
    )
    _close(jitted(params, *batch), expected)


def test_the_ghost_method_forms_no_gradient_of_its_ghost_leaves(monkeypatch):
    """On the LMs and the CNN, every use with a ghost form is projected from its
    form (nothing instantiated but the leaves no form covers), and the
    projection's memory is below forming and projecting (chunks of 32)."""
    from chunkvmap._quantities import _projections

    made = []
    original = _projections._form_projection

    def counted(*args):
        out = original(*args)
        made.append(out is not None)
        return out

    monkeypatch.setattr(_projections, "_form_projection", counted)
    loss, params, batch = _dp(5)
    per_example_grad_projections(loss, dim=4, batch_size=2, method="ghost")(
        params, *batch
    )
    assert made and all(made), made
    monkeypatch.undo()
    p = models.lm_params(tied=True, stacked=True)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, models.LV, (256, models.LT)), jnp.int32
    )
    memory = {
        m: temp_bytes(
            per_example_grad_projections(
                models.lm_loss, dim=8, batch_size=32, method=m
            ),
            p,
            tokens,
        )
        for m in ("vmap", "ghost")
    }
    assert memory["ghost"] < 0.6 * memory["vmap"], memory


def test_equinox_and_flax_models(rng):
    """An Equinox MLP (its activation function not differentiated) and a linen
    layer's variables, by the ghost method."""
    eqx = pytest.importorskip("equinox")
    import flax.linen as nn

    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (9, 3))
    arrays, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    expected = projected_grads(
        lambda a, x: loss(eqx.combine(a, static), x), arrays, (x,), dim=4
    )
    got = per_example_grad_projections(loss, dim=4, batch_size=4, method="ghost")(
        model, x
    )
    _close(got, expected)

    dense = nn.Dense(5)
    variables = dense.init(jax.random.key(1), x[:1])

    def flax_loss(v, x):
        return jnp.sum(jnp.tanh(dense.apply(v, x)) ** 2)

    got = per_example_grad_projections(flax_loss, dim=3, batch_size=4, method="ghost")(
        variables, x
    )
    _close(got, projected_grads(flax_loss, variables, (x,), dim=3))


def test_aux_seeds_and_errors(rng):
    loss, params, batch = _mlp(rng)

    def with_aux(p, x, y):
        return loss(p, x, y), x.sum()

    rows, aux = per_example_grad_projections(with_aux, has_aux=True, dim=4)(
        params, *batch
    )
    np.testing.assert_allclose(aux, batch[0].sum(1), rtol=1e-6)
    other = per_example_grad_projections(loss, dim=4, seed=1)(params, *batch)
    assert rows.shape == other.shape == (13, 4 * 4 + 4 + 4 * 3)
    assert not np.allclose(rows, other)  # another seed, another projection
    with pytest.raises(TypeError, match="dim must be a positive int"):
        per_example_grad_projections(loss, dim=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        per_example_grad_projections(loss, seed=1.5)
    with pytest.raises(ValueError, match="similarity must be one of"):
        per_example_grad_projections(loss, similarity="l2")


@pytest.mark.parametrize("method, similarity", [("vmap", "cosine"), ("ghost", "dot")])
def test_scores_against_another_batch(method, similarity, rng):
    """`other=`: the `N x M` scores of the projected gradients against another
    batch's (TracIn / TRAK-style), equal to the rows' inner products (or cosines)
    from the oracle, eagerly and under `jit`, N uneven in the chunks. (Each
    similarity with one method: the scores are made from the rows the other tests
    check by both.)"""
    loss, params, batch = CASES["LMs and CNN"](rng)
    other = models.dp_batch(3, seed=50)
    rows = projected_grads(loss, params, batch, dim=4)
    against = projected_grads(loss, params, other, dim=4)
    if similarity == "cosine":
        rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        against = against / np.linalg.norm(against, axis=1, keepdims=True)
    scores = per_example_grad_projections(
        loss, dim=4, batch_size=3, method=method, similarity=similarity
    )
    _close(scores(params, *batch, other=(params, *other)), rows @ against.T)
    jitted = jax.jit(lambda p, b, o: scores(p, *b, other=(p, *o)))
    _close(jitted(params, batch, other), rows @ against.T)
    with pytest.raises(TypeError, match="other must be a tuple"):
        scores(params, *batch, other=list(other))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize(
    "case, hold", [("mlp", "placed"), ("LMs and CNN", "shard=True")]
)
def test_projections_over_a_mesh(case, hold, method, rng):
    """16 examples over 8 devices: placed on an Explicit mesh (eagerly; the rows
    stay split over it), or `shard=True` under `jit` (the LMs' lookups need an
    Auto mesh: over Explicit axes `jax.vmap` itself asks for the gather's
    sharding)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    loss, params, batch = CASES[case](rng)
    batch = tuple(jnp.concatenate([b, b, b])[:16] for b in batch)
    expected = projected_grads(loss, params, batch, dim=4)
    if hold == "placed":
        mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
        placed = [jax.device_put(b, NamedSharding(mesh, P("d"))) for b in batch]
        project = per_example_grad_projections(loss, dim=4, batch_size=1, method=method)
        got = project(params, *placed)
        assert got.sharding.spec[0] == "d"
    else:
        project = per_example_grad_projections(
            loss, dim=4, batch_size=1, method=method, shard=True
        )
        got = jax.jit(project)(params, *batch)
    _close(got, expected)


def _gained_mlp(rng):
    """Dense weights `(in, out)` with their biases joined, and a gain (no
    factors: its diagonal)."""
    p = {
        "w1": jnp.asarray(rng.normal(size=(5, 6)), jnp.float32) * 0.5,
        "b1": jnp.asarray(rng.normal(size=(6,)), jnp.float32) * 0.1,
        "g": 1.0 + jnp.asarray(rng.normal(size=(6,)), jnp.float32) * 0.1,
        "w2": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32) * 0.5,
        "b2": jnp.zeros(3),
    }

    def logits(p, x):
        return (jnp.tanh(x @ p["w1"] + p["b1"]) * p["g"]) @ p["w2"] + p["b2"]

    def dense(f):  # each leaf's dense curvature from the factors, by hand
        def kron(k):
            a = np.asarray(k.inputs, np.float64)
            return np.kron(a[:-1, :-1], np.asarray(k.outputs) / float(k.count))

        def bias(k):
            a = np.asarray(k.inputs, np.float64)
            return np.asarray(k.outputs, np.float64) * a[-1, -1] / float(k.count)

        return [bias(f["w1"]), bias(f["w2"]), np.diag(f["g"]), kron(f["w1"]),
                kron(f["w2"])]  # fmt: skip

    return p, logits, (5,), dense


def _eqx_mlp(rng):
    """Equinox's `(out, in)` weights: the leaf's order is `kron(G, A)`."""
    import equinox as eqx

    mlp = eqx.nn.MLP(5, 3, 6, 1, activation=jnp.tanh, key=jax.random.key(1))

    def logits(m, x):
        return m(x)

    def dense(f):
        out = []
        for layer in f.layers:
            a = np.asarray(layer.weight.inputs, np.float64)
            g = np.asarray(layer.weight.outputs, np.float64) / float(layer.weight.count)
            out += [np.kron(g, a[:-1, :-1]), g * a[-1, -1]]  # weight, then bias
        return out

    return mlp, logits, (5,), dense


def _conv_nchw(rng):
    """An `OIHW` kernel with its bias joined: `kron(G, A)` in the leaf's order."""
    p = {
        "kernel": jnp.asarray(rng.normal(size=(4, 2, 3, 3)), jnp.float32) * 0.4,
        "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32) * 0.1,
        "head": jnp.asarray(rng.normal(size=(4 * 9, 3)), jnp.float32) * 0.3,
    }

    def logits(p, x):
        y = jax.lax.conv_general_dilated(
            x[None], p["kernel"], (1, 1), "VALID",
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )  # fmt: skip
        y = y + p["bias"][None, :, None, None]  # (on the convolution's output)
        return jnp.tanh(y[0]).reshape(-1) @ p["head"]

    def dense(f):
        k, h = f["kernel"], f["head"]
        a = np.asarray(k.inputs, np.float64)
        g = np.asarray(k.outputs, np.float64) / float(k.count)
        head = np.kron(np.asarray(h.inputs), np.asarray(h.outputs) / float(h.count))
        return [g * a[-1, -1], head, np.kron(g, a[:-1, :-1])]  # bias, head, kernel

    return p, logits, (2, 5, 5), dense


def _scanned(rng):
    """A stack of layers scanned over: a block per layer, block-diagonal."""
    import scipy.linalg

    p = {
        "ws": jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32) * 0.5,
        "head": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) * 0.5,
    }

    def logits(p, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])
        return h @ p["head"]

    def kron(k):
        return np.kron(np.asarray(k.inputs, np.float64), k.outputs / float(k.count))

    def dense(f):
        stack = [kron(Kronecker(*blocks, f["ws"].count)) for blocks in zip(
            f["ws"].inputs, f["ws"].outputs)]  # fmt: skip
        return [kron(f["head"]), scipy.linalg.block_diag(*stack)]

    return p, logits, (4,), dense


@pytest.mark.parametrize(
    "case, method",
    [
        (_gained_mlp, "ghost"),
        (_gained_mlp, "vmap"),
        (_eqx_mlp, "ghost"),
        (_conv_nchw, "ghost"),
        (_scanned, "vmap"),
    ],  # fmt: skip
)
def test_kfac_preconditioned_rows_and_scores(case, method, rng):
    """`precondition=kfac_factors(...)`: each leaf's projected gradient whitened by
    `(P^T F P + lambda)^(-1/2)` (`F` its KFAC block, a joined bias's block, or a
    diagonal), against the same from the dense curvature built by hand in the
    leaf's layout (`tests.helpers.preconditioned_rows`); the scores against
    another batch are the whitened rows' inner products. Eagerly and under `jit`,
    N uneven in the chunks."""
    import equinox as eqx

    from chunkvmap import kfac_factors

    params, logits, shape, dense = case(rng)
    x = jnp.asarray(rng.normal(size=(11, *shape)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 11), jnp.int32)
    loss = lambda p, x, y: nll("categorical", logits(p, x), y)  # noqa: E731
    factors = kfac_factors(logits, likelihood="categorical", batch_size=4)(params, x)
    dim, damping = 3 if case is _scanned else 4, 0.3
    arrays, static = eqx.partition(params, eqx.is_inexact_array)
    rows = projected_grads(
        lambda a, x, y: loss(eqx.combine(a, static), x, y), arrays, (x, y), dim=dim
    )
    shapes = [a.shape for a in jax.tree.leaves(arrays)]
    expected = preconditioned_rows(rows, shapes, dense(factors), dim, damping)
    project = per_example_grad_projections(loss, dim=dim, batch_size=4, method=method)
    got = project(params, x, y, precondition=factors, damping=damping)
    _close(got, expected, rtol=1e-4)
    scores = eqx.filter_jit(
        lambda p, f: project(p, x, y, other=(p, x[:3], y[:3]), precondition=f,
                             damping=damping)
    )(params, factors)  # fmt: skip
    _close(scores, expected @ expected[:3].T, rtol=1e-4)


def test_preconditioning_errors_name_the_argument(rng):
    loss, p, batch = _mlp(rng)
    project = per_example_grad_projections(loss, dim=4)
    diagonals = jax.tree.map(jnp.ones_like, p)
    with pytest.raises(TypeError, match="damping is for precondition="):
        project(p, *batch, damping=0.1)
    with pytest.raises(TypeError, match="damping must be a non-negative float"):
        project(p, *batch, precondition=diagonals, damping=-1.0)
    with pytest.raises(TypeError, match="precondition must be structured like"):
        project(p, *batch, precondition=[diagonals])
    with pytest.raises(ValueError, match=r"leaf 1 of shape \(20, 30\): None, and no"):
        project(p, *batch, precondition={**diagonals, "w1": None})
    with pytest.raises(ValueError, match=r"a diagonal of the leaf's shape \(20, 30\)"):
        project(p, *batch, precondition={**diagonals, "w1": jnp.ones(3)})


def test_preconditioned_rows_over_a_mesh(rng):
    """Factors and whitened rows over 8 devices, N = 13 uneven over them: with
    `shard=True` and `mesh=`, and with the inputs placed on an Explicit mesh."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from chunkvmap import kfac_factors

    params, logits, shape, _ = _gained_mlp(rng)
    x = jnp.asarray(rng.normal(size=(13, *shape)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 13), jnp.int32)
    loss = lambda p, x, y: nll("categorical", logits(p, x), y)  # noqa: E731
    factors = kfac_factors(logits, likelihood="categorical", batch_size=5)(params, x)
    expected = per_example_grad_projections(loss, dim=4, batch_size=5)(
        params, x, y, precondition=factors
    )
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    opts = dict(batch_size=1, shard=True, mesh=mesh)
    sharded = kfac_factors(logits, likelihood="categorical", **opts)(params, x)
    project = per_example_grad_projections(loss, dim=4, method="ghost", **opts)
    _close(project(params, x, y, precondition=sharded), np.asarray(expected), 1e-4)
    x16, y16 = jnp.concatenate([x, x[:3]]), jnp.concatenate([y, y[:3]])
    x16, y16 = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x16, y16))
    project = per_example_grad_projections(loss, dim=4, method="ghost")
    got = np.asarray(project(params, x16, y16, precondition=factors))[:13]
    _close(got, np.asarray(expected), rtol=1e-4)
