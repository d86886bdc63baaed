"""progress=: one host report per chunk, under jit, grad and sharding; same results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from chunkvmap import batch_map, batch_vmap

from .helpers import mesh_devices, tree_allclose


def recorder():
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


def expected_calls(chunks: int) -> list[tuple[int, int]]:
    return [(k, chunks) for k in range(1, chunks + 1)]


SUM = dict(reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))


@pytest.mark.parametrize(
    "n, batch_size, chunks", [(12, 4, 3), (13, 4, 4), (5, 8, 1), (5, None, 1)]
)
@pytest.mark.parametrize("reduce", [False, True])
def test_reports_every_chunk_once_and_keeps_results(n, batch_size, chunks, reduce):
    x = jnp.linspace(-1.0, 1.0, n * 3).reshape(n, 3)
    options = SUM if reduce else {}
    calls, progress = recorder()
    f = jax.jit(
        batch_vmap(jnp.sin, batch_size=batch_size, progress=progress, **options)
    )
    plain = batch_vmap(jnp.sin, batch_size=batch_size, **options)(x)
    for _ in range(2):  # a cached executable reports again on every run
        calls.clear()
        out = jax.block_until_ready(f(x))
        jax.effects_barrier()
        assert calls == expected_calls(chunks)
        tree_allclose(out, plain)


def test_reports_forward_chunks_only_under_grad():
    x = jnp.linspace(-1.0, 1.0, 10)
    calls, progress = recorder()

    def loss(x):
        return batch_vmap(jnp.sin, batch_size=3, progress=progress)(x).sum()

    g = jax.block_until_ready(jax.grad(loss)(x))
    jax.effects_barrier()
    tree_allclose(g, jnp.cos(x))
    assert calls == expected_calls(4)  # remat recomputes chunks, but does not report


@pytest.mark.parametrize("n, chunks", [(64, 4), (67, 4), (5, 3)])
def test_sharded_reports_once_from_device_zero(n, chunks):
    # 8 devices, batch_size 2: 64 -> 8 per device -> 4 chunks; 67 -> same, plus the
    # global remainder (not reported); 5 < 8 -> only the remainder runs: 3 chunks.
    mesh_devices(8)  # (on a one-chip accelerator: the test runs on the CPU's 8)
    x = jnp.linspace(-1.0, 1.0, n)
    calls, progress = recorder()
    out = batch_vmap(jnp.sin, batch_size=2, shard=True, progress=progress)(x)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert calls == expected_calls(chunks)
    tree_allclose(out, jnp.sin(x))


def test_batch_map_reports():
    calls, progress = recorder()
    x = jnp.arange(10.0)
    out = batch_map(jnp.cos, x, 4, progress=progress)
    jax.effects_barrier()
    assert calls == expected_calls(3)
    tree_allclose(out, jnp.cos(x))


class Bar:
    """A tqdm-like bar owned by the caller."""

    def __init__(self):
        self.total, self.n = None, 0

    def update(self, n):
        self.n += n


def test_user_bar_is_advanced_and_given_a_total():
    bar = Bar()
    batch_vmap(jnp.sin, batch_size=3, progress=bar)(jnp.arange(7.0))
    jax.effects_barrier()
    assert (bar.n, bar.total) == (3, 3)


def test_true_uses_tqdm(capsys):
    x = jnp.arange(7.0)
    out = batch_vmap(jnp.sin, batch_size=3, progress=True)(x)
    jax.effects_barrier()
    tree_allclose(out, jnp.sin(x))
    assert "3/3" in capsys.readouterr().err


def test_off_adds_no_callback():
    x = jnp.arange(8.0)
    on = jax.jit(batch_vmap(jnp.sin, batch_size=2, progress=lambda d, t: None))
    off = jax.jit(batch_vmap(jnp.sin, batch_size=2))
    # a host callback: a custom call on the CPU, a host transfer on an accelerator
    host = ("callback", "is_host_transfer = true")
    assert any(h in on.lower(x).as_text() for h in host)
    assert not any(h in off.lower(x).as_text() for h in host)


@pytest.mark.parametrize("bad", [1, "yes", None, object()])
def test_bad_progress_is_a_type_error(bad):
    with pytest.raises(TypeError, match="progress must be True, False, a callable"):
        batch_vmap(jnp.sin, batch_size=2, progress=bad)
    with pytest.raises(TypeError, match="progress must be"):
        batch_map(jnp.sin, jnp.ones(3), 2, progress=bad)


def test_equinox_adapter_reports():
    import equinox as eqx

    from chunkvmap.eqx import filter_batch_vmap

    calls, progress = recorder()
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    x = jnp.ones((10, 3))
    out = filter_batch_vmap(
        lambda m, x: m(x), in_axes=(None, 0), batch_size=4, progress=progress
    )(model, x)
    jax.effects_barrier()
    assert calls == expected_calls(3)
    tree_allclose(out, jax.vmap(model)(x))


def test_zero_examples_report_nothing():
    calls, progress = recorder()
    batch_vmap(jnp.sin, batch_size=3, progress=progress)(jnp.ones((0, 3)))
    batch_vmap(jnp.sin, batch_size=3, shard=True, progress=progress)(jnp.ones(0))
    jax.effects_barrier()
    assert calls == []


def test_stateful_reduction_reports_one_pass():
    # A reduced linen call that also returns state (init creates the variables) runs a
    # second, unreported pass for the state: the chunks are reported once.
    import flax.linen as nn

    import chunkvmap.linen as cl

    class Loss(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(2)(x)
            self.sow("intermediates", "y", y)
            return jnp.sum(y**2)

    calls, progress = recorder()
    summed = cl.batch_vmap(
        Loss,
        variable_axes={"params": None, "intermediates": 0},
        split_rngs={"params": False},
        batch_size=4,
        reduction=jnp.add,
        chunk_reduction=lambda loss: loss.sum(0),
        progress=progress,
    )()
    variables = summed.init(jax.random.key(0), jnp.ones((10, 3)))
    jax.effects_barrier()
    assert calls == expected_calls(3)
    assert variables["params"]["Dense_0"]["kernel"].shape == (3, 2)  # shared
