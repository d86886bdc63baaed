"""batch_vmap against jax.vmap on the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_vmap

from .helpers import HostLog, TraceCounter, jaxpr_eqns, make_mesh, tree_allclose


SIZES = [1, 7, 12, 64]  # one, prime, divisible, large


def batch_sizes(n):
    """{1, divisor, non-divisor, > N, None}, de-duplicated."""
    divisor = next(d for d in (4, 3, 2, 1) if n % d == 0)
    non_divisor = next((b for b in (5, 3, 2) if n % b and b < n), None)
    return sorted({1, divisor, n + 3} | ({non_divisor} - {None})) + [None]


def f_mlp(x, w):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("n", SIZES)
def test_matches_vmap_over_sizes(n, rng):
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    expected = jax.vmap(f_mlp, (0, None))(x, w)
    for b in batch_sizes(n):
        actual = batch_vmap(f_mlp, (0, None), batch_size=b)(x, w)
        tree_allclose(actual, expected)


# in_axes / out_axes: {0, 1, -1, None, pytree prefix}
IN_AXES_CASES = {
    "0": (0, lambda x: x),
    "1": (1, lambda x: jnp.moveaxis(x, 0, 1)),
    "-1": (-1, lambda x: jnp.moveaxis(x, 0, -1)),
}


@pytest.mark.parametrize("axis_name", sorted(IN_AXES_CASES))
@pytest.mark.parametrize("b", [1, 3, 5, None])
def test_in_axes_ints(axis_name, b, rng):
    axis, layout = IN_AXES_CASES[axis_name]
    x = layout(jnp.asarray(rng.normal(size=(10, 4, 3)), jnp.float32))

    def f(v):
        return v.sum(0) * v[0]

    expected = jax.vmap(f, in_axes=axis)(x)
    tree_allclose(batch_vmap(f, in_axes=axis, batch_size=b)(x), expected)


@pytest.mark.parametrize("out_axes", [0, 1, -1, 2, -3])
@pytest.mark.parametrize("b", [1, 4, 7, 100])
def test_out_axes_ints(out_axes, b, rng):
    x = jnp.asarray(rng.normal(size=(11, 4, 3)), jnp.float32)

    def f(v):
        return v * 2.0

    expected = jax.vmap(f, out_axes=out_axes)(x)
    actual = batch_vmap(f, out_axes=out_axes, batch_size=b)(x)
    tree_allclose(actual, expected)


@pytest.mark.parametrize("b", [1, 3, 6, None])
def test_pytree_prefix_axes(b, rng):
    n = 6
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "scale": 2.0}
    data = (
        jnp.asarray(rng.normal(size=(n, 3)), jnp.float32),
        {"bias": jnp.asarray(rng.normal(size=(2, n)), jnp.float32)},
    )

    def f(p, d):
        x, extra = d
        h = x @ p["w"] * p["scale"]
        return {"h": h + extra["bias"], "norm": jnp.sum(h**2), "const": p["w"]}

    in_axes = (None, (0, {"bias": 1}))
    out_axes = {"h": 1, "norm": 0, "const": None}
    expected = jax.vmap(f, in_axes, out_axes)(params, data)
    actual = batch_vmap(f, in_axes, out_axes, batch_size=b)(params, data)
    tree_allclose(actual, expected)


@pytest.mark.parametrize("b", [2, 5, None])
def test_none_in_axes_for_some_args_and_list_in_axes(b, rng):
    x = jnp.asarray(rng.normal(size=(9, 2)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(2,)), jnp.float32)

    def f(a, c, label):
        assert label == "tag"  # non-array arguments pass through untouched
        return a * c

    expected = jax.vmap(f, [0, None, None])(x, y, "tag")
    tree_allclose(batch_vmap(f, [0, None, None], batch_size=b)(x, y, "tag"), expected)


@pytest.mark.parametrize("b", [1, 4, None])
def test_keyword_arguments_mapped_over_leading_axis(b, rng):
    x = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)

    def f(a, *, weight):
        return (a * weight).sum()

    expected = jax.vmap(f)(x, weight=w)
    tree_allclose(batch_vmap(f, batch_size=b)(x, weight=w), expected)


@pytest.mark.parametrize("b", [1, 2, 3, None])
def test_axis_size_without_mapped_inputs(b):
    c = jnp.arange(3.0)

    def f(v):
        return v * 2.0

    expected = jax.vmap(f, in_axes=None, axis_size=5)(c)
    tree_allclose(batch_vmap(f, in_axes=None, axis_size=5, batch_size=b)(c), expected)


def test_out_axes_none_for_unmapped_output(rng):
    x = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    c = jnp.arange(2.0)

    def f(a):
        return a + c, c * 3.0

    expected = jax.vmap(f, out_axes=(0, None))(x)
    tree_allclose(batch_vmap(f, out_axes=(0, None), batch_size=3)(x), expected)


def test_out_axes_none_for_mapped_output_is_an_error(rng):
    x = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    with pytest.raises(ValueError, match="out_axes"):
        batch_vmap(lambda a: a * 2.0, out_axes=None, batch_size=3)(x)


@pytest.mark.parametrize("batch_size", [3, None])
@pytest.mark.parametrize("how", ["eager", "jit", "grad"])
def test_an_unmapped_output_is_checked_before_jax_vmap(rng, batch_size, how):
    """out_axes None on an output that varies across examples is found before
    jax.vmap is asked for it (chunked or one plain jax.vmap, eager, under jit and
    under grad), and named in the user's terms; an output that does not vary (an
    unmapped argument, a psum over the mapped axis) is accepted, and a jax.vmap
    misused inside the function keeps JAX's own error."""
    x = jnp.asarray(rng.normal(size=(7, 2)), jnp.float32)

    def two(a, w):
        return a * w, jnp.sum(a) + w[0]

    def run(fn, *args):
        if how == "jit":
            return jax.jit(fn)(*args)
        if how == "grad":
            return jax.grad(lambda *a: jnp.sum(jax.tree.leaves(fn(*a))[0]))(*args)
        return fn(*args)

    chunked = batch_vmap(two, (0, None), (0, None), batch_size=batch_size)
    with pytest.raises(
        ValueError, match=r"gives out\[1\] the axis None.*\.two returns"
    ):
        run(chunked, x, jnp.ones(2))
    keeps = batch_vmap(
        lambda a, w: (a * w, w), (0, None), (0, None), batch_size=batch_size
    )
    tree_allclose(
        run(keeps, x, jnp.ones(2)),
        run(jax.vmap(lambda a, w: (a * w, w), (0, None), (0, None)), x, jnp.ones(2)),
    )
    if batch_size is None:  # collectives need the unchunked map
        total = batch_vmap(lambda a: jax.lax.psum(a, "i"), out_axes=None, axis_name="i")
        oracle = jax.vmap(lambda a: jax.lax.psum(a, "i"), out_axes=None, axis_name="i")
        tree_allclose(run(total, x), run(oracle, x))

    def inner(a):
        return jax.vmap(lambda t: t, out_axes=None)(a)

    with pytest.raises(ValueError, match="got axis spec None but output was batched"):
        run(batch_vmap(inner, batch_size=batch_size), x)


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64]
)
@pytest.mark.parametrize("b", [3, None])
def test_dtypes_are_preserved(dtype, b):
    x = (jnp.arange(7 * 2) % 5).reshape(7, 2).astype(dtype)

    def f(v):
        return v, v[::-1], jnp.stack([v[0], v[1]])

    expected = jax.vmap(f)(x)
    actual = batch_vmap(f, batch_size=b)(x)
    tree_allclose(actual, expected)
    assert all(a.dtype == dtype for a in jax.tree.leaves(actual))


@pytest.mark.parametrize("b", [2, 3, None])
def test_typed_prng_keys(b):
    keys = jax.random.split(jax.random.key(0), 7)

    def f(k):
        k1, k2 = jax.random.split(k)
        return jax.random.normal(k1, (2,)), k2

    expected = jax.vmap(f)(keys)
    actual = batch_vmap(f, batch_size=b)(keys)
    tree_allclose(actual, expected)
    assert jax.dtypes.issubdtype(actual[1].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("b", [1, 3, None])
def test_zero_examples_like_vmap(b):
    x = jnp.zeros((0, 3), jnp.float32)
    expected = jax.vmap(lambda v: v.sum() * 2.0)(x)
    actual = batch_vmap(lambda v: v.sum() * 2.0, batch_size=b)(x)
    tree_allclose(actual, expected)
    assert actual.shape == (0,)


def test_numpy_and_python_inputs():
    x = np.arange(10.0, dtype=np.float32).reshape(5, 2)
    expected = jax.vmap(lambda v, s: v * s, (0, None))(x, 3.0)
    tree_allclose(
        batch_vmap(lambda v, s: v * s, (0, None), batch_size=2)(x, 3.0), expected
    )


@pytest.mark.parametrize("b", [3, 4, 100])
def test_f_is_traced_once_per_call(b, rng):
    x = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    counted = TraceCounter(f_mlp)
    batch_vmap(counted, (0, None), batch_size=b)(x, w)
    assert counted.count == 1
    counted.count = 0
    jax.jit(batch_vmap(counted, (0, None), batch_size=b))(x, w)
    assert counted.count == 1


def test_wraps_metadata():
    def my_function(x):
        """Doc."""
        return x

    wrapped = batch_vmap(my_function, batch_size=2)
    assert wrapped.__name__ == "my_function"
    assert wrapped.__doc__ == "Doc."


def test_chunk_size_alias(rng):
    x = jnp.asarray(rng.normal(size=(9, 2)), jnp.float32)
    expected = jax.vmap(jnp.sum)(x)
    tree_allclose(batch_vmap(jnp.sum, chunk_size=4)(x), expected)


def test_chunk_reduction_without_reduction_post_processes_full_output(rng):
    x = jnp.asarray(rng.normal(size=(9, 2)), jnp.float32)
    actual = batch_vmap(jnp.sum, batch_size=4, chunk_reduction=lambda y: y.mean(0))(x)
    tree_allclose(actual, jax.vmap(jnp.sum)(x).mean(0))


def test_remainder_window_sees_only_real_examples():
    """No padding reaches f: the last chunk is the window [N - B, N) of real examples,
    so 10 examples in chunks of 4 evaluate 0-3, 4-7, 6-9 (two recomputed)."""
    seen = HostLog()

    def f(v):
        jax.debug.callback(lambda val: seen.append(np.asarray(val).copy()), v)
        return v * 2.0

    x = jnp.arange(10.0)
    out = batch_vmap(f, batch_size=4)(x)
    jax.block_until_ready(out)
    jax.effects_barrier()
    values = sorted(np.concatenate([np.atleast_1d(s) for s in seen]).tolist())
    assert values == [0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 8, 9]
    tree_allclose(out, x * 2.0)


# Regressions found in review.


@pytest.mark.parametrize("b", [2, None])
def test_none_arguments_do_not_shift_in_axes(b):
    x = jnp.arange(10.0).reshape(5, 2)
    y = jnp.arange(15.0).reshape(3, 5)

    def f(a, nothing, c):
        assert nothing is None
        return a.sum() + c.sum()

    tree_allclose(
        batch_vmap(f, (0, None, 1), batch_size=b)(x, None, y),
        jax.vmap(f, (0, None, 1))(x, None, y),
    )

    def f2(nothing, a, c):
        return f(a, nothing, c)

    tree_allclose(
        batch_vmap(f2, (None, 0, 1), batch_size=b)(None, x, y),
        jax.vmap(f2, (None, 0, 1))(None, x, y),
    )

    def g(c, nothing, *, a):
        return a.sum() + c.sum()

    tree_allclose(
        batch_vmap(g, (1, None), batch_size=b)(y, None, a=x),
        jax.vmap(g, (1, None))(y, None, a=x),
    )


@pytest.mark.parametrize("b", [2, None])
def test_outputs_containing_none_and_list_out_axes(b):
    x = jnp.arange(10.0).reshape(5, 2)
    for g, out_axes in [
        (lambda a: (None, a, a.sum()), (None, 1, 0)),
        (lambda a: (None, a, a), (None, 0, 1)),
        (lambda a: {"a": None, "b": a, "c": a.sum()}, {"a": None, "b": 1, "c": 0}),
        (lambda a: [a, a.sum()], [1, 0]),
    ]:
        tree_allclose(
            batch_vmap(g, 0, out_axes, batch_size=b)(x), jax.vmap(g, 0, out_axes)(x)
        )
    with pytest.raises(ValueError, match="out_axes (must be a pytree|specification)"):
        batch_vmap(lambda a: (a, a.sum()), 0, [1, 0], batch_size=b)(x)


@pytest.mark.parametrize("b", [1, 5, 8, None])
def test_weak_types_are_kept(b):
    """Weak types survive when the chunks are stacked as scan outputs (B divides N) or
    when there is one chunk. (With a remainder window the output is assembled with
    dynamic_update_slice, which JAX types strongly: the dtype is kept, the weak type
    is not.)"""
    x = jnp.arange(10.0).reshape(5, 2)
    for g in (lambda v, s: s, lambda v, s: 1.0, lambda v, s: v.sum()):
        ref = jax.vmap(g, (0, None))(x, 2.0)
        out = batch_vmap(g, (0, None), batch_size=b)(x, 2.0)
        assert jax.typeof(out).weak_type == jax.typeof(ref).weak_type
        assert out.dtype == ref.dtype
    # A weak result promotes like jax.vmap's would.
    ref = jax.vmap(lambda v, s: s, (0, None))(x, 2.0) + jnp.ones(5, jnp.bfloat16)
    out = batch_vmap(lambda v, s: s, (0, None), batch_size=b)(x, 2.0)
    assert (out + jnp.ones(5, jnp.bfloat16)).dtype == ref.dtype == jnp.bfloat16


@pytest.mark.parametrize("b", [2, None])
def test_axis_size_zero(b):
    c = jnp.ones(2)
    out = batch_vmap(lambda v: v * 2.0, in_axes=None, axis_size=0, batch_size=b)(c)
    tree_allclose(out, jax.vmap(lambda v: v * 2.0, in_axes=None, axis_size=0)(c))


@pytest.mark.parametrize("n", [1000, 1003])  # without and with a remainder
@pytest.mark.parametrize("out_axes", [0, (0, 1)])
def test_stacked_outputs_trace_f_once_and_once_in_the_program(out_axes, n):
    """`jax.vmap(f)` is traced once under jit, for the output structure, before the
    loop is built, and the loop's chunk reuses that trace: f is traced once (under
    grad too) and its one `sin` appears once in the program."""

    def f(v):
        return jnp.sin(v), jnp.cos(v[:2])

    x = np.linspace(0, 1, n * 3, dtype=np.float32).reshape(n, 3)
    counted = TraceCounter(f)
    fn = batch_vmap(counted, out_axes=out_axes, batch_size=10)
    jaxpr = jax.make_jaxpr(fn)(x)
    assert counted.count == 1
    eqns = jaxpr_eqns(jaxpr)
    assert sum(e.primitive.name == "sin" for e in eqns) == 1
    expected = jax.vmap(f, out_axes=out_axes)(x)
    tree_allclose(fn(x), expected)
    counted = TraceCounter(f)
    fn = batch_vmap(counted, out_axes=out_axes, batch_size=10)
    grad = jax.jit(jax.grad(lambda x: sum(y.sum() for y in fn(x))))
    jax.make_jaxpr(grad)(x)
    assert counted.count == 1


def test_later_loops_reuse_the_first_trace():
    """After f is traced once (inline, or for the output structure), later loops of
    the same call (an "auto" measurement, a sharded evaluation with a remainder) use
    the jitted chunk, which JAX's cache serves, instead of tracing f in place again;
    an error from a jax.vmap inside f is JAX's own, with no second trace of f."""
    count = [0]

    def f(v):
        count[0] += 1
        return jnp.sin(v) * 2

    def traces(fn, x):
        count[0] = 0
        jax.make_jaxpr(fn)(x)
        return count[0]

    x = jnp.ones((64, 3))
    assert traces(batch_vmap(f, batch_size=8), x) == 1
    assert traces(batch_vmap(f, batch_size="auto", memory_limit=10**6), x) <= 3
    mesh = make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    for n, most in [(9, 3), (8, 2)]:
        fn = batch_vmap(f, batch_size=2, shard="d", mesh=mesh)
        assert traces(fn, jnp.ones((n, 3))) <= most

    def g(v):
        count[0] += 1
        return jax.vmap(lambda a: a * 2, out_axes=None)(v)

    count[0] = 0
    with pytest.raises(ValueError, match="at vmap out_axes, got axis spec None"):
        jax.make_jaxpr(batch_vmap(g, batch_size=2))(jnp.ones((6, 3)))
    assert count[0] == 1
