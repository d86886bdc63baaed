"""Chunking that follows the data's sharding (8 simulated devices), against jax.vmap:
Explicit meshes of any shape (jax.make_mesh's default), concrete inputs on Auto meshes,
and shard=<axis names> under jit with model-parallel parameters."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from chunkvmap import batch_map, batch_vmap, clipped_grad_sum, per_example_grads

from .helpers import clipped_sum, make_mesh, mesh_devices, tree_allclose


pytestmark = pytest.mark.skipif(
    len(mesh_devices(8)) < 8, reason="needs 8 devices (jax_num_cpu_devices=8)"
)

SHAPES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2)}


def mesh_of(shape, kind=AxisType.Explicit):
    names = ("data", "model")[: len(shape)]
    return make_mesh(shape, names, axis_types=(kind,) * len(shape))


def f(w, x):
    return jnp.tanh(x @ w)


def sum0(y):
    return y.sum(0)


def inputs(mesh, n):
    """x (n, 6) sharded over "data" (replicated when n does not split evenly); w
    (6, 8) over "model" where there is one."""
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    w = rng.normal(size=(6, 8)).astype(np.float32) / 3
    model = "model" if "model" in mesh.axis_names else None
    data = "data" if n % mesh.shape["data"] == 0 else None
    return (
        jax.device_put(w, NamedSharding(mesh, P(None, model))),
        jax.device_put(x, NamedSharding(mesh, P(data))),
    )


def all_gathers(hlo: str) -> list[str]:
    """The result shapes of the all-gathers in a compiled HLO text."""
    return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather", hlo)


# Per mesh: B dividing each device's share, not dividing it, and larger than it.
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("b", [3, 4, 100])
def test_explicit_inputs_keep_the_layout_of_vmap(shape, b):
    mesh = mesh_of(SHAPES[shape])
    w, x = inputs(mesh, 64)
    ref = jax.vmap(f, (None, 0))(w, x)
    stacked = batch_vmap(f, (None, 0), batch_size=b)
    out = stacked(w, x)
    tree_allclose(out, ref)
    assert out.sharding == ref.sharding
    with jax.set_mesh(mesh):
        jitted = jax.jit(stacked)(w, x)
        reduced = jax.jit(
            batch_vmap(
                f, (None, 0), batch_size=b, reduction=jnp.add, chunk_reduction=sum0
            )  # fmt: skip
        )(w, x)
    tree_allclose(jitted, ref)
    assert jitted.sharding == ref.sharding
    tree_allclose(reduced, ref.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["8", "4x2"])
def test_explicit_program_never_gathers_the_batch_and_chunks_per_device(shape):
    mesh = mesh_of(SHAPES[shape])
    w, x = inputs(mesh, 256)
    fn = batch_vmap(f, (None, 0), batch_size=4)
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn).lower(w, x).compile().as_text()
        plain = jax.jit(jax.vmap(f, (None, 0))).lower(w, x).compile().as_text()
    assert "f32[256,6]" not in all_gathers(hlo), all_gathers(hlo)
    local = 256 // mesh.shape["data"]
    # Each device reads chunks of 4 of its own examples; jax.vmap takes all of them.
    assert "f32[4,6]" in hlo and "f32[4,6]" not in plain
    assert f"f32[{local},6]" in plain


def test_conflicting_layouts_are_a_clear_error():
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 64)
    y = jax.device_put(np.ones((64, 6), np.float32), NamedSharding(mesh, P("model")))
    with pytest.raises(ValueError, match=r"sharded differently(.|\n)*args\[2\]"):
        batch_vmap(lambda w, a, b: f(w, a + b), (None, 0, 0), batch_size=2)(w, x, y)


def test_unmapped_inputs_sharded_over_the_mapped_axes():
    mesh = mesh_of((8,))
    _, x = inputs(mesh, 64)
    w = jax.device_put(
        np.ones((6, 8), np.float32), NamedSharding(mesh, P(None, "data"))
    )
    ref = jax.vmap(f, (None, 0))(np.ones((6, 8), np.float32), np.asarray(x))
    tree_allclose(batch_vmap(f, (None, 0), batch_size=3)(w, x), ref)
    auto = mesh_of((8,), AxisType.Auto)
    wa = jax.device_put(
        np.ones((6, 8), np.float32), NamedSharding(auto, P(None, "data"))
    )
    out = batch_vmap(f, (None, 0), batch_size=3, shard=True, mesh=auto)(wa, x)
    tree_allclose(out, ref)


@pytest.mark.parametrize("n", [64, 61])  # 61: a global remainder on the Auto mesh
def test_auto_mesh_shard_by_name_under_jit_keeps_model_parallelism(n):
    mesh = mesh_of((4, 2), AxisType.Auto)
    w, x = inputs(mesh, n)
    ref = jax.vmap(f, (None, 0))(w, x)
    fn = jax.jit(batch_vmap(f, (None, 0), batch_size=3, shard="data"))
    with jax.set_mesh(mesh):
        out = fn(w, x)
        hlo = fn.lower(w, x).compile().as_text()
    tree_allclose(out, ref)
    gathered = all_gathers(hlo)
    assert f"f32[{n},6]" not in gathered and "f32[6,8]" not in gathered, gathered
    if n % 4 == 0:
        assert out.sharding.spec[0] == "data"
    # Concrete inputs show their layout: no shard= needed eagerly.
    eager = batch_vmap(f, (None, 0), batch_size=3)(w, x)
    tree_allclose(eager, ref)
    if n % 4 == 0:
        assert eager.sharding == ref.sharding


def test_grad_keeps_the_parameters_sharding():
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 32)

    def loss(w, x):
        return (batch_vmap(f, (None, 0), batch_size=3)(w, x) ** 2).sum()

    def reference(w, x):
        return (jax.vmap(f, (None, 0))(w, x) ** 2).sum()

    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(loss))(w, x)
        ref = jax.jit(jax.grad(reference))(w, x)
        gx, ref_x = jax.grad(loss, 1)(w, x), jax.grad(reference, 1)(w, x)
    tree_allclose(g, ref, rtol=1e-5, atol=1e-5)
    assert g.sharding == ref.sharding == w.sharding
    tree_allclose(gx, ref_x, rtol=1e-5, atol=1e-5)
    assert gx.sharding == ref_x.sharding


def test_gradient_functions_and_batch_map_follow_the_layout():
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 32)
    y = jax.device_put(
        np.linspace(-1, 1, 32, dtype=np.float32), NamedSharding(mesh, P("data"))
    )

    def loss(w, x, y):
        return (f(w, x).sum() - y) ** 2

    with jax.set_mesh(mesh):  # JAX needs the mesh for Explicit-typed constants
        ref = jax.vmap(jax.grad(loss), (None, 0, 0))(w, x, y)
        grads = per_example_grads(loss, batch_argnums=(1, 2), batch_size=3)(w, x, y)
        total, count = jax.jit(
            clipped_grad_sum(loss, 0.5, batch_argnums=(1, 2), batch_size=3)
        )(w, x, y)
        mapped = batch_map(lambda c: jnp.tanh(c), x, batch_size=3)
        clipped = clipped_sum(loss, 0.5, (w, x, y))[0]
    tree_allclose(grads, ref, rtol=1e-5, atol=1e-6)
    assert grads.sharding == ref.sharding
    tree_allclose(total, clipped, rtol=1e-5, atol=1e-6)
    assert int(count) == 32 and total.sharding.spec == w.sharding.spec
    tree_allclose(mapped, jnp.tanh(x))
    assert mapped.sharding == jnp.tanh(x).sharding


def test_progress_counts_one_devices_chunks_on_a_2d_mesh():
    calls = []

    def progress(i, n):
        calls.append((i, n))

    mesh = mesh_of((4, 2), AxisType.Auto)
    w, x = inputs(mesh, 64)
    fn = jax.jit(
        batch_vmap(f, (None, 0), batch_size=5, shard="data", progress=progress)
    )
    with jax.set_mesh(mesh):
        jax.block_until_ready(fn(w, x))
    jax.effects_barrier()
    assert calls == [(i, 4) for i in range(1, 5)]  # 16 examples a device, 4 chunks
    # Explicit axes (no manual axes): each chunk of every device's share reported once
    calls.clear()
    w, x = inputs(mesh_of((4, 2)), 64)
    jax.block_until_ready(
        batch_vmap(f, (None, 0), batch_size=5, progress=progress)(w, x)
    )
    jax.effects_barrier()
    assert calls == [(i, 4) for i in range(1, 5)]
    # Concrete inputs on an Auto mesh, called eagerly without shard=: the layout they
    # carry is followed inside the eager cache's compiled program too.
    calls.clear()
    w, x = inputs(mesh, 64)
    jax.block_until_ready(
        batch_vmap(f, (None, 0), batch_size=5, progress=progress)(w, x)
    )
    jax.effects_barrier()
    assert calls == [(i, 4) for i in range(1, 5)]


def test_non_commutative_reduction_in_device_order_on_a_2d_mesh():
    mesh = mesh_of((4, 2))
    t = jax.device_put(
        np.linspace(0.1, 1.0, 16, dtype=np.float32), NamedSharding(mesh, P("data"))
    )

    def mat(a):
        return jnp.array([[jnp.cos(a), a], [jnp.sin(a), 1.0]])

    out = batch_vmap(
        mat,
        batch_size=3,
        reduction=jnp.matmul,
        chunk_reduction=lambda ms: jax.lax.associative_scan(jnp.matmul, ms)[-1],
    )(t)
    ref = jax.jit(lambda t: jax.lax.associative_scan(jnp.matmul, jax.vmap(mat)(t))[-1])(
        np.asarray(t)
    )
    tree_allclose(out, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# The adapters: parameters sharded over "model", the batch over "data" (Explicit 4x2).


def model_sharded(tree, mesh, out_dim):
    """Every array of `tree` sharded over "model" along its `out_dim(ndim)` axis."""
    import equinox as eqx

    def put(a):
        if not eqx.is_array(a):
            return a
        spec = [None] * a.ndim
        spec[out_dim(a.ndim)] = "model"
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    return jax.tree.map(put, tree)


def test_equinox_model_parallel_parameters_and_data_parallel_batch():
    eqx = pytest.importorskip("equinox")
    from chunkvmap.eqx import filter_batch_vmap

    mesh = mesh_of((4, 2))
    _, x = inputs(mesh, 32)
    # eqx.nn.Linear's weight is (out, in): shard the output features.
    model = model_sharded(eqx.nn.Linear(6, 4, key=jax.random.key(0)), mesh, lambda n: 0)
    with jax.set_mesh(mesh):
        ref = eqx.filter_vmap(lambda m, x: m(x), in_axes=(None, 0))(model, x)
        out = filter_batch_vmap(lambda m, x: m(x), in_axes=(None, 0), batch_size=3)(
            model, x
        )
    tree_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert out.sharding == ref.sharding and out.sharding.spec == P("data", "model")


def test_linen_model_parallel_parameters_and_data_parallel_batch():
    nn = pytest.importorskip("flax.linen")
    from chunkvmap.linen import batch_vmap as linen_batch_vmap

    mesh = mesh_of((4, 2))
    _, x = inputs(mesh, 32)
    params = nn.Dense(4).init(jax.random.key(0), jnp.ones(6))
    params = model_sharded(params, mesh, lambda n: n - 1)  # kernel (in, out), bias
    axes = dict(variable_axes={"params": None}, split_rngs={"params": False})
    with jax.set_mesh(mesh):
        ref = nn.vmap(nn.Dense, **axes)(4).apply(params, x)
        out = linen_batch_vmap(nn.Dense, **axes, batch_size=3)(4).apply(params, x)
    tree_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert out.sharding == ref.sharding


def test_nnx_model_parallel_parameters_and_data_parallel_batch():
    nnx = pytest.importorskip("flax.nnx")
    from chunkvmap.nnx import batch_vmap as nnx_batch_vmap

    mesh = mesh_of((4, 2))
    _, x = inputs(mesh, 32)
    model = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
    nnx.update(model, model_sharded(nnx.state(model), mesh, lambda n: n - 1))
    with jax.set_mesh(mesh):
        ref = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, x)
        out = nnx_batch_vmap(lambda m, x: m(x), in_axes=(None, 0), batch_size=3)(
            model, x
        )
    tree_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert out.sharding == ref.sharding
    assert model.kernel[...].sharding.spec == P(None, "model")


# --------------------------------------------------------------------------------------
# Explicit meshes without manual axes: the edges a data-parallel DP loop meets.


def test_explicit_2d_step_gathers_nothing_and_reports_progress():
    """On ("data", "model") with model-sharded weights, the chunked program has no
    all-gather at all (as jax.vmap's), for stacked outputs, a clipped sum and its
    gradient sharding; progress reports each chunk of a device's share once."""
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 64)
    calls = []
    stacked = batch_vmap(
        f, (None, 0), batch_size=3, progress=lambda i, n: calls.append((i, n))
    )
    clipped = clipped_grad_sum(lambda w, x: jnp.sum(f(w, x)), 1.0, batch_size=3)
    with jax.set_mesh(mesh):
        for fn in (stacked, clipped):
            hlo = jax.jit(fn).lower(w, x).compile().as_text()
            assert all_gathers(hlo) == [], all_gathers(hlo)
        out = jax.jit(stacked)(w, x)
        total, _ = jax.jit(clipped)(w, x)
    jax.effects_barrier()
    assert calls == [(i, 6) for i in range(1, 7)]  # 16 a device, chunks of 3
    ref = jax.vmap(f, (None, 0))(w, x)
    tree_allclose(out, ref)
    assert out.sharding == ref.sharding
    assert total.sharding.spec == P(None, "model")


@pytest.mark.parametrize("jit", [False, True])
def test_uneven_lot_on_an_explicit_mesh(jit):
    """A lot of 13 examples (replicated: an Explicit sharding is even) asked to run
    over the 4 "data" devices: stacked, reduced and clipped results equal jax.vmap's,
    with its (replicated) layout; per-example norms too."""
    mesh = mesh_of((4, 2))
    w, _ = inputs(mesh, 64)
    x = np.random.default_rng(13).normal(size=(13, 6)).astype(np.float32)

    def loss(w, x):
        return jnp.sum(f(w, x) ** 2)

    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P()))
        calls = [
            batch_vmap(f, (None, 0), batch_size=2, shard="data"),
            batch_vmap(
                f, (None, 0), batch_size=2, shard="data", reduction=jnp.add,
                chunk_reduction=sum0,
            ),
            clipped_grad_sum(loss, 0.5, batch_size=2, shard="data", return_norms=True),
        ]  # fmt: skip
        outs = [(jax.jit(c) if jit else c)(w, x) for c in calls]
        ref = jax.vmap(f, (None, 0))(w, x)
    tree_allclose(outs[0], ref)
    assert outs[0].sharding.is_equivalent_to(ref.sharding, 2)
    tree_allclose(outs[1], ref.sum(0), rtol=1e-5, atol=1e-5)
    expected = clipped_grad_sum(loss, 0.5, batch_size=2, return_norms=True)(
        np.asarray(w), np.asarray(x)
    )
    tree_allclose(outs[2], expected, rtol=1e-5, atol=1e-6)


def test_fewer_examples_than_devices_under_grad():
    """3 replicated examples on 4 devices, shard=True, under jax.grad: all run after
    the (empty) split part, and the gradient is jax.vmap's."""
    mesh = make_mesh((4,), ("d",))
    x = jax.device_put(np.array([0.1, 0.7, 1.3], np.float32), NamedSharding(mesh, P()))

    def total(fn):
        return lambda x: jnp.sum(fn(jnp.sin)(x) ** 2)

    chunked = total(lambda g: batch_vmap(g, batch_size=2, shard=True))
    with jax.set_mesh(mesh):
        got = jax.grad(chunked)(x)
        ref = jax.grad(total(jax.vmap))(x)
    tree_allclose(got, ref)


@pytest.mark.parametrize("n", [1, 8])
def test_unmapped_argument_sharded_along_the_examples_axis(n):
    """in_axes=(0, None) with both arguments sharded over the examples' mesh axis,
    shard=True without a mesh (the inputs' mesh is used), eager and under jit: the
    unmapped one is placed whole on every device (jax.vmap itself refuses this on a
    one-device mesh)."""
    mesh = make_mesh((n,), ("caller",))
    rng = np.random.default_rng(n)
    a, b = (
        rng.normal(size=(8, 3)).astype(np.float32),
        rng.normal(size=(8, 3)).astype(np.float32),
    )
    sa, sb = (jax.device_put(v, NamedSharding(mesh, P("caller"))) for v in (a, b))
    fn = batch_vmap(
        lambda u, v: u * v.sum(), in_axes=(0, None), batch_size=2, shard=True
    )
    for out in (fn(sa, sb), jax.jit(fn)(sa, sb)):
        tree_allclose(out, a * b.sum())
        assert out.sharding.spec[0] == "caller"


def test_shard_true_uses_the_mesh_the_inputs_are_on():
    """shard=True without mesh= on inputs committed to a mesh over 4 of the 8
    devices: that mesh is the one meant (not all devices)."""
    sub = jax.sharding.Mesh(np.array(mesh_devices(4)), ("s",))
    x = jax.device_put(
        np.linspace(0, 1, 8, dtype=np.float32), NamedSharding(sub, P("s"))
    )
    out = batch_vmap(jnp.sin, batch_size=1, shard=True)(x)
    tree_allclose(out, jnp.sin(np.asarray(x)))
    assert out.sharding.mesh.devices.size == 4 and out.sharding.spec[0] == "s"
    with pytest.raises(
        ValueError, match=r"shard=\('data',\), which names mesh axes, but no mesh"
    ):
        batch_vmap(jnp.sin, shard="data")(np.ones(8, np.float32))


def test_per_example_norms_are_sharded_like_the_examples():
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 64)
    fn = clipped_grad_sum(
        lambda w, x: jnp.sum(f(w, x)), 1.0, batch_size=3, return_norms=True
    )
    with jax.set_mesh(mesh):
        norms = jax.jit(fn)(w, x)[2]
    assert norms.sharding.spec == P("data")
