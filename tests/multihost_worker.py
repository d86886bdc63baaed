"""One process of the multi-host test (run by tests/test_multihost.py, not by pytest).

Usage: python multihost_worker.py COORDINATOR_PORT PROCESS_ID NUM_PROCESSES
Each process owns 2 CPU devices; together they form one global mesh.
"""

import sys

import jax


jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

port, process_id, num_processes = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=30,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from chunkvmap import batch_vmap  # noqa: E402


def f(params, x):
    return jnp.tanh(x @ params["w"]) + params["b"]


params = {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2),
    "b": jnp.array([0.5, -0.5], jnp.float32),
}
assert jax.device_count() == 2 * num_processes, jax.devices()
assert jax.local_device_count() == 2


def check_every_shard(out, expected, rtol=1e-5, atol=1e-5):
    """Each of this process's shards against the single-process reference at its
    index, and the whole global array (gathered from both processes)."""
    expected = np.asarray(expected)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert len(out.addressable_shards) == jax.local_device_count()
    for shard in out.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data), expected[shard.index], rtol=rtol, atol=atol
        )
    gathered = multihost_utils.process_allgather(out, tiled=True)
    np.testing.assert_allclose(np.asarray(gathered), expected, rtol=rtol, atol=atol)


for n in (13, 16):  # with a global remainder (13 % 4 = 1), and divisible
    x = jnp.linspace(-2.0, 2.0, n * 3, dtype=jnp.float32).reshape(n, 3)
    expected = np.asarray(jax.vmap(f, (None, 0))(params, x))  # single-process answer
    out = batch_vmap(f, (None, 0), batch_size=2, shard=True)(params, x)
    check_every_shard(out, expected, atol=0)
    if n % 4:
        assert out.sharding.is_fully_replicated
    else:
        # Stays split over the 4 devices of both processes: 4 disjoint blocks of
        # n / 4 rows, two of them held here.
        assert not out.sharding.is_fully_replicated, out.sharding
        blocks = out.sharding.devices_indices_map(out.shape)
        assert len(blocks) == 4, blocks
        rows = sorted((index[0].indices(n)[:2], index[1:]) for index in blocks.values())
        assert [r for r, _ in rows] == [(0, 4), (4, 8), (8, 12), (12, 16)], rows
        assert all(rest in ((), (slice(None),)) for _, rest in rows), rows
        for shard in out.addressable_shards:
            assert shard.data.shape == (n // 4, 2), shard.data.shape
        held = sorted(s.index[0].indices(n)[0] for s in out.addressable_shards)
        assert len(set(held)) == 2, held  # two different blocks, not one copied
    total = batch_vmap(
        f,
        (None, 0),
        batch_size=2,
        shard=True,
        reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0),
    )(params, x)
    check_every_shard(total, expected.sum(0))
    grad = jax.grad(
        lambda p: batch_vmap(f, (None, 0), batch_size=3, shard=True)(p, x).sum()
    )(params)
    grad_ref = jax.grad(lambda p: jax.vmap(f, (None, 0))(p, x).sum())(params)
    assert jax.tree.structure(grad) == jax.tree.structure(grad_ref)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_ref)):
        check_every_shard(a, b)

# progress=: one report per chunk of the device at mesh index 0 (process 0 owns it),
# nothing from the other process.
reports = []
x = jnp.linspace(-2.0, 2.0, 13 * 3, dtype=jnp.float32).reshape(13, 3)
progress = batch_vmap(
    f, (None, 0), batch_size=2, shard=True, progress=lambda d, t: reports.append((d, t))
)
jax.block_until_ready(progress(params, x))
jax.effects_barrier()
print(f"process {process_id}: progress {reports}", flush=True)
expected_reports = [(1, 2), (2, 2)] if process_id == 0 else []  # 13 // 4 = 3 per device
assert reports == expected_reports, reports

# A 2-D mesh from jax.make_mesh (default Explicit axes): the examples over "data",
# which spans the processes, the weights over "model", each process's own devices.
# Every process gets jax.vmap's answer and layout, without shard= or mesh=.
mesh = jax.make_mesh((2, 2), ("data", "model"))
assert {d.process_index for d in mesh.devices[0]} == {0}, mesh.devices
rng = np.random.default_rng(0)
x_np = rng.normal(size=(16, 3)).astype(np.float32)
w_np = rng.normal(size=(3, 4)).astype(np.float32)


def global_array(value, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])


def g(w, x):
    return jnp.tanh(x @ w)


xg, wg = global_array(x_np, P("data")), global_array(w_np, P(None, "model"))
expected = np.tanh(x_np @ w_np)
with jax.set_mesh(mesh):
    ref = jax.vmap(g, (None, 0))(wg, xg)
    out = batch_vmap(g, (None, 0), batch_size=3)(wg, xg)
    jitted = jax.jit(batch_vmap(g, (None, 0), batch_size=3))(wg, xg)
    summed = batch_vmap(
        g,
        (None, 0),
        batch_size=3,
        reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0),
    )(wg, xg)
for result in (out, jitted):
    check_every_shard(result, expected)
    assert result.sharding == ref.sharding, (result.sharding, ref.sharding)
check_every_shard(summed, expected.sum(0))

print(f"process {process_id}: OK", flush=True)
jax.distributed.shutdown()
