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

from .helpers import tree_allclose


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8)"
)

SHAPES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2)}


def mesh_of(shape, kind=AxisType.Explicit):
    names = ("data", "model")[: len(shape)]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


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


def test_uneven_explicit_request_and_conflicting_layouts_are_clear_errors():
    mesh = mesh_of((4, 2))
    w, x = inputs(mesh, 64)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="cannot split 13 examples evenly"):
            batch_vmap(f, (None, 0), batch_size=2, shard="data")(w, jnp.ones((13, 6)))
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
    tree_allclose(grads, ref, rtol=1e-5, atol=1e-6)
    assert grads.sharding == ref.sharding
    norms = jnp.sqrt((ref**2).sum((1, 2)))
    clipped = (ref * jnp.minimum(1.0, 0.5 / norms)[:, None, None]).sum(0)
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
    # JAX runs no host callback in a computation left automatic over Explicit axes.
    w, x = inputs(mesh_of((4, 2)), 64)
    with pytest.raises(ValueError, match=r"cannot report progress here(.|\n)*'model'"):
        batch_vmap(f, (None, 0), batch_size=5, progress=progress)(w, x)


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
    ref = jax.lax.associative_scan(jnp.matmul, jax.vmap(mat)(np.asarray(t)))[-1]
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
