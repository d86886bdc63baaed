"""`build_store`, `load_store` and `GradientStore.query` against the same scores
made in memory (`per_example_grad_projections`' rows and their inner products,
ranked by NumPy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap as cv
from chunkvmap._quantities import _store

from .helpers import make_mesh, nll


def _setup(n=37, m=4):
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w1": jax.random.normal(k[0], (6, 8)) / 3,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k[1], (8, 3)) / 3,
    }

    def model(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    def loss(p, x, y):
        return nll("categorical", model(p, x), y)

    x = jax.random.normal(k[2], (n, 6))
    y = jax.random.randint(k[3], (n,), 0, 3)
    xq, yq = jax.random.normal(k[4], (m, 6)), jnp.arange(m) % 3
    return params, model, loss, (x, y), (xq, yq)


def _ranked(scores, k):
    """Each query's `k` highest and lowest (indices, scores), by NumPy."""
    order = np.argsort(-scores, axis=0, kind="stable")
    top = order[:k].T
    low = np.argsort(scores, axis=0, kind="stable")[:k].T
    take = lambda idx: np.take_along_axis(scores.T, idx, 1)  # noqa: E731
    return top, take(top), low, take(low)


def _check(got, scores, k):
    top, top_s, low, low_s = _ranked(np.asarray(scores, np.float64), k)
    np.testing.assert_allclose(got.proponent_scores, top_s, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got.opponent_scores, low_s, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got.proponents, top)
    np.testing.assert_array_equal(got.opponents, low)


@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_the_store_scores_as_the_rows_in_memory(tmp_path, similarity):
    """N = 37 written 8 at a time (chunks of 3), read 5 at a time: the rows are the
    projections made in memory, and each query's proponents and opponents their
    top and bottom scores; a store loaded again answers alike."""
    params, _, loss, data, queries = _setup()
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=8,
                           batch_size=3)  # fmt: skip
    project = cv.per_example_grad_projections(loss, dim=4, batch_size=3)
    rows, q = np.asarray(project(params, *data)), np.asarray(project(params, *queries))
    np.testing.assert_allclose(store.rows, rows, rtol=1e-6, atol=1e-7)
    if similarity == "cosine":
        rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    for held in (store, cv.load_store(tmp_path)):
        got = held.query(loss, params, *queries, k=6, similarity=similarity,
                         read_size=5)  # fmt: skip
        _check(got, rows @ q.T, 6)


def test_an_interrupted_build_resumes_after_its_last_block(tmp_path, monkeypatch):
    """A build stopped after its second block: the store is unfinished (loading
    it says so); built again, it projects only the blocks not written and ends
    with the rows made in memory."""
    params, _, loss, data, _ = _setup()
    written = []
    original = _store.write_block

    def stopping(rows, start, block):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(start)
        original(rows, start, block)

    monkeypatch.setattr(_store, "write_block", stopping)
    with pytest.raises(KeyboardInterrupt):
        cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=8)
    with pytest.raises(ValueError, match="unfinished .16 of 37 examples written"):
        cv.load_store(tmp_path)
    monkeypatch.setattr(_store, "write_block", original)
    seen = []
    monkeypatch.setattr(
        _store, "write_block", lambda r, s, b: seen.append(s) or original(r, s, b)
    )
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=8)
    assert seen == [16, 24, 32]
    rows = cv.per_example_grad_projections(loss, dim=4)(params, *data)
    np.testing.assert_allclose(store.rows, np.asarray(rows), rtol=1e-6, atol=1e-7)
    seen.clear()  # a finished store is returned as it is
    cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=8)
    assert seen == []


def test_the_next_block_runs_while_one_is_written(tmp_path, monkeypatch):
    """Each block's rows are written after the next block's projection is
    dispatched (the device is not idle during the writes), and the rows are those
    made in memory."""
    params, _, loss, data, _ = _setup()
    events = []
    made, written = _store._one_program, _store.write_block

    def logged(*args):
        call = made(*args)
        return lambda block: events.append(("run", len(block[0]))) or call(block)

    monkeypatch.setattr(_store, "_one_program", logged)
    monkeypatch.setattr(
        _store, "write_block",
        lambda r, s, b: events.append(("write", s)) or written(r, s, b),
    )  # fmt: skip
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=16)
    assert events == [
        ("run", 16), ("run", 16), ("write", 0), ("run", 5), ("write", 16),
        ("write", 32),
    ]  # fmt: skip
    rows = cv.per_example_grad_projections(loss, dim=4)(params, *data)
    np.testing.assert_allclose(store.rows, np.asarray(rows), rtol=1e-6, atol=1e-7)


def test_memory_holds_one_block(tmp_path, monkeypatch):
    """The build projects at most `write_size` examples at a time and the query
    moves at most `read_size` rows to the device at a time, whatever N."""
    params, _, loss, data, queries = _setup(n=64)
    blocks, reads = [], []
    original = _store.write_block
    monkeypatch.setattr(
        _store, "write_block",
        lambda r, s, b: blocks.append(len(b)) or original(r, s, b),
    )  # fmt: skip
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=16)
    moved = _store.to_device
    monkeypatch.setattr(
        _store, "to_device", lambda b: reads.append(b.shape) or moved(b)
    )
    store.query(loss, params, *queries, k=3, read_size=10)
    assert blocks == [16] * 4
    assert max(r[0] for r in reads) == 10 and sum(r[0] for r in reads) == 64


def test_a_preconditioned_store_scores_influence(tmp_path):
    """Rows whitened by EK-FAC factors (`precondition=`): the store's rows and its
    dot scores (influence) are those of the whitened projections in memory; a
    query without the preconditioner is refused."""
    params, model, loss, data, queries = _setup()
    factors = cv.ekfac_factors(model, likelihood="categorical", batch_size=8)(
        params, data[0]
    )
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=10,
                           precondition=factors, damping=0.2)  # fmt: skip
    project = cv.per_example_grad_projections(loss, dim=4)
    rows = np.asarray(project(params, *data, precondition=factors, damping=0.2))
    q = np.asarray(project(params, *queries, precondition=factors, damping=0.2))
    np.testing.assert_allclose(store.rows, rows, rtol=1e-5, atol=1e-6)
    got = store.query(loss, params, *queries, k=4, precondition=factors)
    _check(got, rows @ q.T, 4)
    with pytest.raises(ValueError, match="precondition= that is not the one"):
        store.query(loss, params, *queries)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_a_preconditioned_build_whitens_its_blocks_without_eigendecompositions(
    tmp_path, monkeypatch, kind
):
    """The whitening's eigendecompositions are made once per build, of the
    factors as they are, not by each block's program: no eigendecomposition
    is traced, whatever the number of blocks; the rows are the in-memory ones."""
    from chunkvmap._quantities import _projections

    params, model, loss, data, _ = _setup()
    made = getattr(cv, f"{kind}_factors")(model, likelihood="categorical",
                                          batch_size=8)(params, data[0])  # fmt: skip
    calls = []
    eigh = _projections.eigh

    def counted(x):
        calls.append(isinstance(x, jax.core.Tracer))
        return eigh(x)

    monkeypatch.setattr(_projections, "eigh", counted)
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=5,
                           precondition=made, damping=0.3)  # fmt: skip
    assert calls and not any(calls), calls
    monkeypatch.setattr(_projections, "eigh", eigh)
    project = cv.per_example_grad_projections(loss, dim=4)
    rows = project(params, *data, precondition=made, damping=0.3)
    np.testing.assert_allclose(store.rows, np.asarray(rows), rtol=1e-5, atol=1e-6)


def test_sharded_ghost_build_and_an_equinox_model_holding_a_function(tmp_path):
    """The blocks projected over 8 devices by ghost rules (N = 37 uneven over
    them) give the rows made in memory; an Equinox MLP (holding its activation)
    is stored and queried."""
    import equinox as eqx

    params, _, loss, data, queries = _setup()
    mesh = make_mesh((8,), ("d",))
    store = cv.build_store(tmp_path / "a", loss, params, *data, dim=4,
                           write_size=16, method="ghost", shard=True, mesh=mesh,
                           batch_size=1)  # fmt: skip
    rows = cv.per_example_grad_projections(loss, dim=4, method="ghost")(params, *data)
    np.testing.assert_allclose(store.rows, np.asarray(rows), rtol=1e-5, atol=1e-6)

    mlp = eqx.nn.MLP(6, 3, 5, 1, activation=jnp.tanh, key=jax.random.key(2))

    def eqx_loss(m, x, y):
        return nll("categorical", m(x), y)

    store = cv.build_store(tmp_path / "b", eqx_loss, mlp, *data, dim=3, write_size=16)
    project = cv.per_example_grad_projections(eqx_loss, dim=3)
    rows, q = np.asarray(project(mlp, *data)), np.asarray(project(mlp, *queries))
    _check(store.query(eqx_loss, mlp, *queries, k=2), rows @ q.T, 2)


def test_progress_counts_the_blocks(tmp_path):
    params, _, loss, data, _ = _setup()
    calls = []
    report = lambda done, total: calls.append((done, total))  # noqa: E731
    cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=10, progress=report)
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_errors_name_what_differs(tmp_path):
    params, _, loss, data, queries = _setup()
    store = cv.build_store(tmp_path, loss, params, *data, dim=4, write_size=16)
    with pytest.raises(ValueError, match="another configuration .* differs in dim"):
        cv.build_store(tmp_path, loss, params, *data, dim=5)
    other = jax.tree.map(lambda a: a + 1.0, params)
    with pytest.raises(ValueError, match="another configuration .* differs in params"):
        cv.build_store(tmp_path, loss, other, *data, dim=4)
    with pytest.raises(ValueError, match="params that differ from those the store"):
        store.query(loss, other, *queries)
    with pytest.raises(ValueError, match="queries of per-example shapes and dtypes"):
        store.query(loss, params, queries[0][:, :5], queries[1])
    with pytest.raises(ValueError, match="similarity must be 'dot' or 'cosine'"):
        store.query(loss, params, *queries, similarity="l2")
    with pytest.raises(TypeError, match="k must be a positive int, but got k=0"):
        store.query(loss, params, *queries, k=0)
    with pytest.raises(TypeError, match="write_size must be a positive int"):
        cv.build_store(tmp_path / "c", loss, params, *data, dim=4, write_size=0)
    with pytest.raises(ValueError, match="examples along axis 0 of every leaf"):
        cv.build_store(tmp_path / "d", loss, params, data[0], data[1][:5], dim=4)
    with pytest.raises(ValueError, match="found no gradient store"):
        cv.load_store(tmp_path / "nothing")
    with pytest.raises(TypeError, match="progress must be"):
        cv.build_store(tmp_path / "e", loss, params, *data, dim=4, progress=3)


def _sequence_setup(n=9, t=5):
    k = jax.random.split(jax.random.key(3), 4)
    params = {"emb": jax.random.normal(k[0], (7, 4)) / 2,
              "w": jax.random.normal(k[1], (4, 7)) / 2}  # fmt: skip

    def token_losses(p, tokens, targets):  # one loss per position
        h = jnp.tanh(p["emb"][tokens])
        return -jnp.take_along_axis(
            jax.nn.log_softmax(h @ p["w"]), targets[:, None], axis=1
        )[:, 0]

    def loss(p, tokens, targets):
        return jnp.sum(token_losses(p, tokens, targets))

    tokens = jax.random.randint(k[2], (n, t), 0, 7)
    targets = jax.random.randint(k[3], (n, t), 0, 7)
    return params, token_losses, loss, (tokens, targets)


def test_per_position_rows_are_each_positions_projected_gradient():
    """`per_position=True`: an `(N, T, K)` array, each position's row the
    projection of that position's loss's gradient (`jax.jacrev` per example,
    projected as defined), summing to the row of the summed loss; N = 9 in
    chunks of 4."""
    from .helpers import projected_rows

    params, token_losses, loss, data = _sequence_setup()
    rows = cv.per_example_grad_projections(
        token_losses, dim=3, per_position=True, batch_size=4
    )(params, *data)
    jac = jax.vmap(jax.jacrev(token_losses), (None, 0, 0))(params, *data)
    flat = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), jac)
    want = np.asarray(projected_rows(flat, 3)).reshape(rows.shape)
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6)
    summed = cv.per_example_grad_projections(loss, dim=3)(params, *data)
    np.testing.assert_allclose(rows.sum(1), summed, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="per_position=True forms each position"):
        cv.per_example_grad_projections(token_losses, per_position=True, method="ghost")
    with pytest.raises(TypeError, match="per_position=True scores no other="):
        cv.per_example_grad_projections(token_losses, dim=3, per_position=True)(
            params, *data, other=(params, *data)
        )


def test_a_store_queried_token_by_token(tmp_path):
    """A store of whole sequences (the summed loss) queried per position: each
    query token's proponents and opponents among the training sequences, as the
    per-position rows' inner products with the store's rows rank them."""
    params, token_losses, loss, data = _sequence_setup(n=23)
    queries = jax.tree.map(lambda a: a[:3], _sequence_setup(n=3)[3])
    store = cv.build_store(tmp_path, loss, params, *data, dim=3, write_size=10)
    got = store.query(token_losses, params, *queries, k=4, per_position=True,
                      read_size=7)  # fmt: skip
    assert got.proponents.shape == (3, 5, 4)
    q = cv.per_example_grad_projections(token_losses, dim=3, per_position=True)(
        params, *queries
    )
    scores = np.asarray(q).reshape(15, -1) @ np.asarray(store.rows).T
    flat = cv.TopK(*(a.reshape(15, 4) for a in got))
    _check(flat, scores.T, 4)


def test_a_later_build_compiles_nothing(tmp_path, monkeypatch):
    """A second build of the same program (new parameters, a loss whose closed-over
    array changed, another folder) compiles nothing and writes its own rows."""
    from chunkvmap._core import _memory, _program

    monkeypatch.setattr(_memory, "PROGRAMS", _program.LRU(limit=256))
    params, _, loss, (x, y), _ = _setup(n=12)
    shift = {"value": jnp.zeros(())}

    def shifted(p, x, y):
        return loss(p, x, y) + shift["value"] * jnp.sum(jax.tree.leaves(p)[0])

    sizes = []
    for k in range(2):
        shift["value"] = jnp.asarray(float(k))
        at = jax.tree.map(lambda p: p * (1 + k), params)
        store = cv.build_store(
            tmp_path / str(k), shifted, at, x, y, dim=4, method="ghost",
            batch_size=4, write_size=8,
        )  # fmt: skip
        sizes.append(len(_memory.PROGRAMS))
        want = cv.per_example_grad_projections(shifted, dim=4)(at, x, y)
        np.testing.assert_allclose(store.rows, want, rtol=1e-5, atol=1e-6)
    assert sizes[0] == sizes[1] > 0, sizes


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_blocks_of_a_build_are_traced_once(tmp_path, method):
    """A build's blocks of equal size run one program: the loss is traced as many
    times for 12 blocks as for 2 (an eager call per block traced it per block),
    and the rows are those of the projections in memory."""
    params, _, loss, (x, y), _ = _setup(n=48)
    traces = []

    def counted(p, x, y):
        traces.append(None)  # (at trace time)
        return loss(p, x, y)

    counts = []
    for write_size, folder in ((24, "two"), (4, "twelve")):
        traces.clear()
        store = cv.build_store(
            tmp_path / folder, counted, params, x, y, dim=4, method=method,
            batch_size=4, write_size=write_size,
        )  # fmt: skip
        counts.append(len(traces))
        want = cv.per_example_grad_projections(loss, dim=4, method=method)(params, x, y)
        np.testing.assert_allclose(store.rows, want, rtol=1e-5, atol=1e-6)
    assert counts[0] == counts[1] > 0, counts
