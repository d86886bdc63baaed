"""`per_example_grad_projections`: every example's gradient projected by a seeded,
Kronecker-structured Gaussian projection, against `jax.vmap(jax.grad)` followed by
the same projection (`tests.helpers.projected_grads`), by both methods: the ghost
method projects each use's form (dense layers, attention, convolutions, embedding
lookups) without forming those gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import per_example_grad_projections

from . import test_ghost_models as models
from .helpers import projected_grads, temp_bytes


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


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("case", list(CASES))
def test_projections_match_the_projected_vmap_gradients(case, method, rng):
    """N uneven in chunks of 3 (and 2 under jit); the ghost method on the LMs and
    the CNN projects their dense, attention, convolution and embedding uses."""
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
    from chunkvmap._dp import _projections

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
        mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
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
