"""shard=True on 8 simulated CPU devices, against jax.vmap."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from chunkvmap import batch_map, batch_vmap

from .helpers import (
    HostLog,
    TraceCounter,
    make_mesh,
    mesh_devices,
    temp_bytes,
    tree_allclose,
)


pytestmark = pytest.mark.skipif(
    len(mesh_devices(8)) < 8, reason="needs 8 devices (jax_num_cpu_devices=8)"
)

MESH = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def f(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


PARAMS = {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2),
    "b": jnp.array([0.1, -0.2], jnp.float32),
}


def data(n):  # made on the host: an eager op compiles per shape
    return jax.device_put(np.linspace(-2.0, 2.0, n * 3, dtype=np.float32).reshape(n, 3))


def sum0(y):
    return y.sum(0)


# N below, at, and above the 8 devices, with and without a global remainder; for each,
# batch sizes that divide the per-device share, do not, exceed it, and None.
# (Thinned to a covering 5: tests/test_layouts.py covers the same layouts on 2-D
# meshes, and tests/test_conformance.py runs shard=True for every entry point.)
CASES = [(1, 3), (8, None), (13, 4), (35, 3), (64, 100)]


@pytest.mark.parametrize("n, b", CASES)
def test_matches_vmap_under_jit_and_grad(n, b):
    x = data(n)
    ref = jax.vmap(f, (None, 0))(PARAMS, x)
    stacked = batch_vmap(f, (None, 0), batch_size=b, shard=True, mesh=MESH)
    reduced = batch_vmap(
        f,
        (None, 0),
        batch_size=b,
        shard=True,
        mesh=MESH,
        reduction=jnp.add,
        chunk_reduction=sum0,
    )
    out = jax.jit(stacked)(PARAMS, x)
    tree_allclose(out, ref)
    tree_allclose(jax.jit(reduced)(PARAMS, x), ref.sum(0), rtol=1e-5, atol=1e-5)

    # Gradients w.r.t. replicated inputs equal the unsharded ones (not D times them),
    # and w.r.t. the sharded input too.
    def loss_ref(p, xs):
        return (jax.vmap(f, (None, 0))(p, xs) ** 2).sum()

    def loss(p, xs):
        return (stacked(p, xs) ** 2).sum()

    expected = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(PARAMS, x)
    tree_allclose(
        jax.jit(jax.grad(loss, argnums=(0, 1)))(PARAMS, x), expected, atol=1e-5
    )
    tree_allclose(
        jax.jit(jax.grad(lambda p, xs: reduced(p, xs).sum(), argnums=(0, 1)))(
            PARAMS, x
        ),
        jax.grad(lambda p, xs: jax.vmap(f, (None, 0))(p, xs).sum(), argnums=(0, 1))(
            PARAMS, x
        ),
        atol=1e-5,
    )


@pytest.mark.parametrize("n", [16, 64])
def test_divisible_output_stays_sharded(n):
    out = batch_vmap(f, (None, 0), batch_size=3, shard=True, mesh=MESH)(PARAMS, data(n))
    assert out.sharding.is_equivalent_to(NamedSharding(MESH, P("d")), out.ndim)


@pytest.mark.parametrize("n", [3, 13])
def test_output_with_a_global_remainder_is_replicated(n):
    out = batch_vmap(f, (None, 0), batch_size=3, shard=True, mesh=MESH)(PARAMS, data(n))
    assert out.sharding.is_fully_replicated
    red = batch_vmap(
        f,
        (None, 0),
        batch_size=3,
        shard=True,
        mesh=MESH,
        reduction=jnp.add,
        chunk_reduction=sum0,
    )(PARAMS, data(n))
    assert red.sharding.is_fully_replicated


def test_out_axes_and_in_axes_other_than_zero():
    x = data(24).T  # mapped axis 1
    fn = batch_vmap(
        lambda v: jnp.outer(v, v),
        in_axes=1,
        out_axes=2,
        batch_size=2,
        shard=True,
        mesh=MESH,
    )
    tree_allclose(fn(x), jax.vmap(lambda v: jnp.outer(v, v), 1, 2)(x))
    x = data(27).T  # with a global remainder
    tree_allclose(fn(x), jax.vmap(lambda v: jnp.outer(v, v), 1, 2)(x))


def window_counts(length, b):
    """How often each of `length` examples is evaluated by chunks of `b` whose last
    chunk is the window of the last `b` examples."""
    counts = np.zeros(length, int)
    if length:
        b = min(b, length)
        for i in range(-(-length // b)):
            start = min(i * b, length - b)
            counts[start : start + b] += 1
    return counts


@pytest.mark.parametrize("n, b", [(64, 3), (35, 2), (13, 4), (5, 2), (33, 4)])
def test_work_is_split_and_the_global_remainder_runs_once(n, b):
    """Each example's evaluation is recorded by a host callback. Every device runs its
    own chunks (local windows recompute at most b-1 of its examples) and the global
    remainder is evaluated by one device, not once per device, in chunks of the
    shares' length (fewer examples than that: one window of that length ending
    with them, which evaluates the last examples before them again)."""
    seen = HostLog()

    def g(v):
        jax.debug.callback(lambda i: seen.append(int(i)), v[0])
        return v * 2.0

    x = jnp.stack([jnp.arange(n, dtype=jnp.float32)] * 2, axis=1)
    out = batch_vmap(g, batch_size=b, shard=True, mesh=MESH)(x)
    jax.block_until_ready(out)
    jax.effects_barrier()
    tree_allclose(out, x * 2.0)
    counts = np.bincount(np.array(seen), minlength=n)
    per_device, rem = divmod(n, 8)
    prefix = n - rem
    # The prefix: each device covers its own slice with its own chunk windows.
    expected = np.zeros(n, int)
    expected[:prefix] = np.tile(window_counts(per_device, b), 8)
    # The global remainder: on one device only, in chunks of the shares' length.
    length = min(b, per_device or rem)
    if rem >= length:
        expected[prefix:] += window_counts(rem, length)
    elif rem:
        expected[n - length :] += 1
    assert np.array_equal(counts, expected), counts
    assert counts.sum() < 2 * n  # nowhere near 8x: the work is split


def test_non_commutative_reduction_keeps_order_across_devices():
    n = 21
    t = jnp.linspace(0.1, 1.0, n, dtype=jnp.float32)

    def mat(a):
        return jnp.array([[jnp.cos(a), a], [jnp.sin(a), 1.0]])

    out = batch_vmap(
        mat,
        batch_size=2,
        shard=True,
        mesh=MESH,
        reduction=jnp.matmul,
        chunk_reduction=lambda ms: jax.lax.associative_scan(jnp.matmul, ms)[-1],
    )(t)
    ref = jax.jit(lambda t: jax.lax.associative_scan(jnp.matmul, jax.vmap(mat)(t))[-1])(
        t
    )
    tree_allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [16, 19])
def test_batch_map_sharded(n):
    x = data(n)
    vec = jax.vmap(f, (None, 0))
    tree_allclose(
        batch_map(lambda c: vec(PARAMS, c), x, 2, shard=True, mesh=MESH), vec(PARAMS, x)
    )
    tree_allclose(
        batch_map(
            lambda c: vec(PARAMS, c),
            x,
            3,
            shard=True,
            mesh=MESH,
            reduction=jnp.add,
            chunk_reduction=sum0,
        ),
        vec(PARAMS, x).sum(0),
        atol=1e-5,
    )


@pytest.mark.parametrize("default", [None, "cpu"])
def test_default_mesh_spans_all_devices_and_is_built_once(default):
    """`shard=True` without a mesh spans every device of the default device's
    platform: the default backend's, or the CPU's under `jax.default_device` (as
    the CPU's devices of an accelerator's machine)."""
    from chunkvmap._core import _sharding

    with jax.default_device(default):
        devices = jax.devices(default)
        out = batch_vmap(f, (None, 0), batch_size=2, shard=True)(PARAMS, data(16))
        assert out.sharding.device_set == set(devices)  # (one on a one-chip machine)
        assert _sharding.default_mesh().devices.tolist() == devices
        assert _sharding.default_mesh() is _sharding.default_mesh()


def test_remat_and_reduction_under_grad_with_sharding():
    x = data(37)

    def loss(p, remat):
        return batch_vmap(
            f,
            (None, 0),
            batch_size=2,
            shard=True,
            mesh=MESH,
            remat=remat,
            reduction=jnp.add,
            chunk_reduction=lambda y: (y**2).sum(0),
        )(p, x).sum()

    ref = jax.grad(lambda p: (jax.vmap(f, (None, 0))(p, x) ** 2).sum())(PARAMS)
    tree_allclose(jax.grad(lambda p: loss(p, True))(PARAMS), ref, atol=1e-5)
    tree_allclose(jax.grad(lambda p: loss(p, False))(PARAMS), ref, atol=1e-5)


def test_per_device_memory_is_set_by_batch_size():
    """Compiled per-device temp memory of a reduced sharded map does not grow with N."""

    def big(v):
        h = jnp.tanh(jnp.outer(v, v))  # 64 x 64 per example
        return h.sum()

    def fn(x):
        return batch_vmap(
            big,
            batch_size=4,
            shard=True,
            mesh=MESH,
            reduction=jnp.add,
            chunk_reduction=sum0,
        )(x)

    for extra in (0, 3):  # divisible, and with a global remainder
        small = temp_bytes(fn, jnp.ones((8 * 16 + extra, 64), jnp.float32))
        large = temp_bytes(fn, jnp.ones((8 * 256 + extra, 64), jnp.float32))
        assert large <= 1.05 * small + 4096, (extra, small, large)


def test_divisible_stacked_output_needs_no_all_gather():
    def g(v):
        return jnp.tanh(jnp.outer(v, v)).mean(0)

    fn = batch_vmap(g, batch_size=4, shard=True, mesh=MESH)
    hlo = jax.jit(fn).lower(jnp.ones((8 * 32, 64), jnp.float32)).compile().as_text()
    assert "all-gather" not in hlo


# --------------------------------------------------------------------------------------
# Inputs already sharded, on other meshes, Explicit-typed, and ambient meshes.


def test_input_already_sharded_on_the_mesh_is_used_as_is():
    x = jax.device_put(data(16), NamedSharding(MESH, P("d")))
    out = batch_vmap(f, (None, 0), batch_size=1, shard=True, mesh=MESH)(PARAMS, x)
    assert out.sharding.is_equivalent_to(x.sharding, 2)


def _mapper(entry):
    """`batch_vmap`'s signature, by `entry` (the core or an adapter)."""
    if entry == "nnx.batch_vmap":
        from chunkvmap import nnx as cn

        return lambda f, in_axes, **o: cn.batch_vmap(f, in_axes=in_axes, **o)
    if entry == "eqx.filter_batch_vmap":
        from chunkvmap.eqx import filter_batch_vmap

        return lambda f, in_axes, **o: filter_batch_vmap(f, in_axes=in_axes, **o)
    return batch_vmap


@pytest.mark.parametrize(
    "entry", ["batch_vmap", "nnx.batch_vmap", "eqx.filter_batch_vmap"]
)
def test_input_on_another_mesh_is_moved_onto_the_mesh(entry):
    mapper = _mapper(entry)
    mesh4 = jax.sharding.Mesh(
        np.array(mesh_devices(4)), ("e",), axis_types=(AxisType.Auto,)
    )
    x = jax.device_put(data(16), NamedSharding(mesh4, P("e")))
    out = mapper(f, (None, 0), batch_size=1, shard=True, mesh=MESH)(PARAMS, x)
    tree_allclose(out, jax.vmap(f, (None, 0))(PARAMS, data(16)))
    one = jax.device_put(data(13), mesh_devices(8)[5])
    out = mapper(f, (None, 0), batch_size=1, shard=True, mesh=mesh4)(PARAMS, one)
    tree_allclose(out, jax.vmap(f, (None, 0))(PARAMS, data(13)))


def explicit_other():
    """An Explicit 1-D mesh over the devices in reverse order, axis "e"."""
    devices = np.array(mesh_devices(8)[::-1])
    return jax.sharding.Mesh(devices, ("e",), axis_types=(AxisType.Explicit,))


def test_explicit_inputs_and_ambient_meshes():
    explicit = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    xe = jax.device_put(data(16), NamedSharding(explicit, P("d")))
    ref = jax.vmap(f, (None, 0))(PARAMS, data(16))
    fn = batch_vmap(f, (None, 0), batch_size=1, shard=True, mesh=MESH)
    # An Explicit input is resharded onto the requested Auto mesh.
    tree_allclose(fn(PARAMS, xe), ref)
    with jax.set_mesh(explicit):
        # A mesh= other than the ambient one is a clear error ...
        with pytest.raises(ValueError, match="called under jax.set_mesh"):
            fn(PARAMS, data(16))
        # ... and without mesh= the ambient (here Explicit) mesh is used.
        out = batch_vmap(f, (None, 0), batch_size=1, shard=True)(PARAMS, data(16))
        tree_allclose(out, ref)
        assert out.sharding.spec == P("d", None)
    # Inputs placed on the mesh= they name do not let it override the held one.
    on_other = jax.device_put(data(16), NamedSharding(explicit_other(), P("e")))
    with jax.set_mesh(explicit):
        with pytest.raises(ValueError, match="called under jax.set_mesh"):
            batch_vmap(f, (None, 0), batch_size=1, shard=True, mesh=explicit_other())(
                PARAMS, on_other
            )
    # An ambient 1-D Auto mesh is used when no mesh is passed.
    with jax.set_mesh(MESH):
        out = batch_vmap(f, (None, 0), batch_size=1, shard=True)(PARAMS, data(16))
        assert out.sharding.mesh.axis_names == ("d",)


def test_auto_batch_size_with_shard_is_chosen_per_device():
    from chunkvmap import last_batch_size

    fn = batch_vmap(
        f, (None, 0), batch_size="auto", memory_limit="1MiB", shard=True, mesh=MESH
    )
    tree_allclose(fn(PARAMS, data(64)), jax.vmap(f, (None, 0))(PARAMS, data(64)))
    assert last_batch_size(fn) == 8  # all of each device's share fits


def _held(how: str, x: jax.Array) -> tuple[dict, jax.Array, object]:
    """The options, the examples and the context of a call whose mesh is held as
    a user holds it: passed (`mesh=`), entered (`jax.set_mesh`) or placed (the
    examples already sharded over it)."""
    if how == "mesh=":
        return dict(shard=True, mesh=MESH), x, contextlib.nullcontext()
    if how == "set_mesh":
        return dict(shard=True), x, jax.set_mesh(MESH)
    if how == "explicit":  # Explicit axes, entered
        return dict(shard=True), x, jax.set_mesh(EXPLICIT)
    if how == "explicit placed":
        placed = jax.device_put(x, NamedSharding(EXPLICIT, P("d")))
        return {}, placed, jax.set_mesh(EXPLICIT)
    return {}, jax.device_put(x, NamedSharding(MESH, P("d"))), contextlib.nullcontext()


EXPLICIT = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))


HELD = [
    *[(how, 24) for how in ("mesh=", "set_mesh", "placed", "explicit placed")],
    *[("mesh=", 27), ("set_mesh", 29), ("explicit", 24), ("explicit", 29)],
]
CALLS = ["eager", "jit", "grad"]


@pytest.mark.parametrize(
    "how, n, batch_size, call",
    [
        # every way the mesh is held with every batch size and every call (rotated:
        # each batch size meets each call across the ways)
        (how, n, batch_size, CALLS[(i + j) % 3])
        for j, (how, n) in enumerate(HELD)
        for i, batch_size in enumerate([2, 3, None])
    ],
)
def test_f_is_traced_once_per_call_over_the_devices(how, n, batch_size, call, rng):
    """The chunk is traced where the loop runs it (each device's share, in the
    context of `shard_map`'s manual axes), so `f` is traced once per call, as
    without a mesh: 24 examples, 3 per device (chunks of 2 leave a window); 27 or
    29, whose global remainder of 3 or 5 runs on one device in chunks of the
    shares' length (a window of it where fewer: `_loop.window`). Over Explicit
    axes the chunk is traced at the sharding types the loop's chunks have
    (`_sharding.chunk_type`)."""
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    counted = TraceCounter(lambda x, w: jnp.tanh(x @ w).sum())
    options, x, context = _held(how, x)
    g = batch_vmap(counted, (0, None), batch_size=batch_size, **options)
    run = {
        "eager": g,
        "jit": jax.jit(g),
        "grad": jax.grad(lambda w, x: g(x, w).sum()),
    }[call]
    args = (w, x) if call == "grad" else (x, w)
    reference = jax.vmap(lambda x, w: jnp.tanh(x @ w).sum(), (0, None))
    with context:
        out = run(*args)
        expected = {
            "grad": lambda: jax.grad(lambda w: reference(x, w).sum())(w),
        }.get(call, lambda: reference(x, w))()
    assert counted.count == 1
    tree_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [P(None, "d"), P("d", None)])
@pytest.mark.parametrize("batch_size, call", [(2, "eager"), (3, "jit"), (2, "grad")])
def test_an_unmapped_input_sharded_over_the_examples_axis_is_traced_once(
    spec, batch_size, call, rng
):
    """Over an Explicit mesh, a committed unmapped input sharded over the axis the
    examples are split over (the loop gathers it off that axis) is traced once,
    at the type the loop gives it; the values are `jax.vmap`'s with it replicated
    (`jax.vmap` itself refuses such an unmapped input)."""
    x = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    counted = TraceCounter(lambda x, w: jnp.tanh(x @ w).sum())
    with jax.set_mesh(EXPLICIT):
        x = jax.device_put(x, NamedSharding(EXPLICIT, P("d")))
        w = jax.device_put(w, NamedSharding(EXPLICIT, spec))
        g = batch_vmap(counted, (0, None), batch_size=batch_size)
        if call == "grad":
            out = jax.grad(lambda w: g(x, w).sum())(w)
        else:
            out = (g if call == "eager" else jax.jit(g))(x, w)
        whole = jax.sharding.reshard(w, P())
        reference = jax.vmap(lambda x, w: jnp.tanh(x @ w).sum(), (0, None))
        expected = (
            jax.grad(lambda w: reference(x, w).sum())(whole)
            if call == "grad"
            else reference(x, whole)
        )
    assert counted.count == 1
    tree_allclose(out, expected, rtol=1e-5, atol=1e-6)


@jax.tree_util.register_pytree_node_class
class _Tagged:
    """An output whose structure holds the mesh context it was made in."""

    def __init__(self, value, context):
        self.value, self.context = value, context

    def tree_flatten(self):
        return (self.value,), self.context

    @classmethod
    def tree_unflatten(cls, context, children):
        return cls(*children, context)


def test_each_trace_gives_back_the_structure_it_made():
    """A chunk traced again in another mesh context gives its outputs in the
    structure that trace made (what the function put there in its context, as
    ghost clipping puts its plan), never in the first trace's or the latest's,
    whichever order the contexts come in."""
    from chunkvmap._core import _program

    made = []

    def fn(x):
        out = _Tagged(2 * x, jax.sharding.get_abstract_mesh())
        leaves, tree = jax.tree.flatten(out)
        made[:] = [tree]
        return leaves

    def jitted(length):
        return jax.jit(lambda x: fn(x))

    x = jnp.arange(4.0)
    first = _program.Trace.of(jax.make_jaxpr(jitted(4))(x))
    retraced = _program.Retraced(first, (4, [jax.typeof(x)]), jitted, lambda: made[0])
    outside = jax.sharding.get_abstract_mesh()
    explicit = make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    for _ in range(2):
        out = retraced(first.consts, [x], 4)
        assert out.context == outside
        np.testing.assert_array_equal(out.value, 2 * x)
        with jax.set_mesh(explicit):
            out = retraced(first.consts, [jnp.arange(4.0)], 4)
            assert out.context == explicit.abstract_mesh
            np.testing.assert_array_equal(out.value, 2 * x)


def test_a_trace_runs_only_where_its_mesh_context_allows():
    """The rule by which a chunk traced in one mesh context is evaluated in another
    (`_program.runs_here`): a trace made outside any mesh, or inside `shard_map`'s
    Manual axes only, records no mesh in its operations and runs wherever no axis
    is Explicit; one made under a mesh with Auto or Explicit axes runs only under
    that mesh (JAX refuses its operations under another: "context mesh ... should
    match the aval mesh")."""
    from chunkvmap._core import _program

    none = jax.sharding.get_abstract_mesh()
    auto = MESH.abstract_mesh
    manual = auto.update_axis_types({"d": AxisType.Manual})
    explicit = auto.update_axis_types({"d": AxisType.Explicit})
    assert _program.runs_here(none, auto) and _program.runs_here(none, manual)
    assert _program.runs_here(manual, manual) and _program.runs_here(manual, none)
    assert not _program.runs_here(none, explicit)
    assert not _program.runs_here(auto, manual)
    assert not _program.runs_here(explicit, manual)
    assert _program.runs_here(explicit, explicit)


@pytest.mark.parametrize("how", ["mesh=", "explicit"])
@pytest.mark.parametrize("n, b", [(33, 4), (35, 3), (5, 2)])
def test_a_remainder_window_counts_each_example_once(how, n, b):
    """A global remainder shorter than the shares' chunks runs as one window of
    that length (`_loop.window`): its earlier examples are evaluated again but
    neither folded nor written twice, by an ordered fold (a reduction that is not
    a known sum) or by stacking, Auto axes or Explicit."""
    x = jnp.arange(2 * n, dtype=jnp.float32).reshape(n, 2) + 1.0
    options, x, context = _held(how, x)
    folded = batch_vmap(
        lambda v: v * v, batch_size=b, reduction=lambda a, c: a + c,
        chunk_reduction=lambda y: y.sum(0), **options,
    )  # fmt: skip
    stacked = batch_vmap(lambda v: (3.0 * v, v.sum()), batch_size=b, **options)
    with context:
        total, (rows, sums) = folded(x), stacked(x)
    tree_allclose(total, (x * x).sum(0))
    tree_allclose((rows, sums), (3.0 * x, x.sum(1)))
