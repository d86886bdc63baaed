"""per_example_grads and clipped_grad_sum against jax.vmap(jax.grad) and optax."""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chunkvmap import clipped_grad_sum, per_example_grads

from .helpers import (
    check_auto_choice,
    clipped_sum,
    init_mlp,
    mlp,
    record_auto_searches,
    temp_bytes,
    tree_allclose,
)


SIZES = [4, 8, 3]
BATCH_SIZES = [None, 1, 3, 4, 50]


def loss(params, x, y):
    return jnp.sum((mlp(params, x) - y) ** 2)


def data(n, key=1):
    kx, ky = jax.random.split(jax.random.key(key))
    x = jax.random.normal(kx, (n, SIZES[0]))
    y = jax.random.normal(ky, (n, SIZES[-1]))
    return x, y


PARAMS = init_mlp(jax.random.key(0), SIZES)


# ---------------------------------------------------------------------------------
# per_example_grads


# N and the chunk size: N = 1 in a chunk larger than N, a remainder (7 by 3), chunks
# of 1. Divisors and one chunk of all N are in every entry point's conformance checks
# (tests/test_conformance.py), the clipped sums' other sizes in tests/test_clipping.py.
N_AND_BATCH = [(1, 50), (7, 3), (12, 1)]


@pytest.mark.parametrize("n, batch_size", N_AND_BATCH)
def test_per_example_grads_match_vmap_of_grad(n, batch_size):
    x, y = data(n)
    out = per_example_grads(loss, batch_argnums=(1, 2), batch_size=batch_size)(
        PARAMS, x, y
    )
    expected = jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))(PARAMS, x, y)
    tree_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("argnums", [1, (0, 1), -2, (2, 0)])
def test_argnums_and_has_aux(argnums):
    x, y = data(9)

    def f(params, x, y):
        err = mlp(params, x) - y
        return jnp.sum(err**2), {"err": err}

    out = per_example_grads(
        f, argnums, has_aux=True, batch_argnums=(1, 2), batch_size=4
    )(PARAMS, x, y)
    expected = jax.vmap(jax.grad(f, argnums, has_aux=True), (None, 0, 0))(PARAMS, x, y)
    tree_allclose(out, expected, atol=1e-5)


def test_keyword_arguments_are_mapped_as_in_jax_vmap():
    # One rule across the library (issue 15): keyword arguments are mapped over their
    # leading axis, as jax.vmap maps them; shared values go positionally.
    x, y = data(5)
    scales = jnp.linspace(0.5, 2.0, 5)

    def f(params, x, y, *, scale):
        return scale * loss(params, x, y)

    out = per_example_grads(f, batch_size=2)(PARAMS, x, y, scale=scales)
    expected = jax.vmap(jax.grad(f), (None, 0, 0))(PARAMS, x, y, scale=scales)
    tree_allclose(out, expected, atol=1e-5)


def test_every_argument_not_differentiated_is_mapped_by_default():
    # Issue 15: loss(params, x, y) with the default batch_argnums maps x and y (it
    # used to map x only and hand all of y to every example: a silent wrong answer).
    x, y = data(6)
    out = per_example_grads(loss, batch_size=4)(PARAMS, x, y)
    tree_allclose(out, jax.vmap(jax.grad(loss), (None, 0, 0))(PARAMS, x, y), atol=1e-5)
    total, count = clipped_grad_sum(loss, 0.5, batch_size=4)(PARAMS, x, y)
    expected, _ = clipped_sum(loss, 0.5, (PARAMS, x, y))
    tree_allclose(total, expected, rtol=1e-5, atol=1e-6)
    # Shared values: name the mapped ones.
    shared = per_example_grads(loss, batch_argnums=1, batch_size=4)(PARAMS, x, y[0])
    tree_allclose(
        shared, jax.vmap(jax.grad(loss), (None, 0, None))(PARAMS, x, y[0]), atol=1e-5
    )


def test_per_example_grads_under_jit_and_sharded():
    x, y = data(13)
    expected = jax.vmap(jax.grad(loss), (None, 0, 0))(PARAMS, x, y)
    g = per_example_grads(loss, batch_argnums=(1, 2), batch_size=2, shard=True)
    tree_allclose(jax.jit(g)(PARAMS, x, y), expected, atol=1e-5)


def test_non_float_leaves_get_none_like_filter_grad():
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0))  # has function leaves
    x, y = data(6)

    def f(model, x, y):
        return jnp.sum((model(x) - y) ** 2)

    out = per_example_grads(f, batch_argnums=(1, 2), batch_size=4)(model, x, y)
    expected = eqx.filter_vmap(eqx.filter_grad(f), in_axes=(None, 0, 0))(model, x, y)
    tree_allclose(out, expected)
    params = {"w": jnp.ones(4), "step": jnp.array(3)}  # an integer leaf
    out = per_example_grads(lambda p, x: jnp.dot(p["w"], x) * p["step"])(params, x)
    assert out["step"] is None
    tree_allclose(out["w"], 3.0 * x)


# ---------------------------------------------------------------------------------
# clipped_grad_sum


@pytest.mark.parametrize("n, batch_size", [(1, 50), (12, 1)])
def test_clipped_sum_matches_reference(n, batch_size):
    x, y = data(n)
    clip = 1.0
    total, count, norms = clipped_grad_sum(
        loss, clip, batch_argnums=(1, 2), batch_size=batch_size, return_norms=True
    )(PARAMS, x, y)
    expected, expected_norms = clipped_sum(loss, clip, (PARAMS, x, y))
    tree_allclose(total, expected, rtol=1e-5, atol=1e-5)
    tree_allclose(norms, expected_norms)
    assert count.dtype == jnp.int32 and int(count) == n
    assert 0 < int((expected_norms > clip).sum()) or n == 1  # clipping happened


def test_clipped_sum_without_norms_and_sharded():
    x, y = data(13)
    expected, norms = clipped_sum(loss, 0.5, (PARAMS, x, y))
    for shard in (False, True):
        f = clipped_grad_sum(loss, 0.5, batch_argnums=(1, 2), batch_size=3, shard=shard)
        total, count = jax.jit(f)(PARAMS, x, y)
        tree_allclose(total, expected, rtol=1e-5, atol=1e-5)
        assert int(count) == 13
    f = clipped_grad_sum(
        loss, 0.5, batch_argnums=(1, 2), batch_size=2, shard=True, return_norms=True
    )
    tree_allclose(f(PARAMS, x, y)[2], norms)


def test_matches_optax_differentially_private_aggregate():
    x, y = data(12)
    per_example = jax.vmap(jax.grad(loss), (None, 0, 0))
    dp = optax.contrib.differentially_private_aggregate(
        l2_norm_clip=0.7, noise_multiplier=0.0, key=jax.random.key(0)
    )
    mean, _ = jax.jit(lambda p, x, y: dp.update(per_example(p, x, y), dp.init(p)))(
        PARAMS, x, y
    )
    total, count = clipped_grad_sum(loss, 0.7, batch_argnums=(1, 2), batch_size=5)(
        PARAMS, x, y
    )
    tree_allclose(jax.tree.map(lambda g: g / int(count), total), mean, atol=1e-6)


def test_matches_optax_micro_grad():
    x, y = data(12)
    clip_by_norm = optax.clip_by_global_norm(0.7)  # optax's own per-example clip

    def clip(g):
        return clip_by_norm.update(g, clip_by_norm.init(g))[0]

    expected, _ = optax.microbatching.micro_grad(
        loss,
        batch_argnums=(1, 2),
        keep_batch_dim=False,
        microbatch_size=4,
        transform_fn=clip,
    )(PARAMS, x, y)
    total, _ = clipped_grad_sum(loss, 0.7, batch_argnums=(1, 2), batch_size=5)(
        PARAMS, x, y
    )
    tree_allclose(total, expected, rtol=1e-5, atol=1e-6)


def test_zero_gradients_are_nan_free_also_under_grad():
    def f(w, x):
        return jnp.dot(w, x) ** 2  # gradient 2 (w.x) x: zero for x = 0 and w.x = 0

    w = jnp.array([1.0, -1.0])
    x = jnp.array([[0.0, 0.0], [1.0, 1.0], [2.0, 0.5]])  # two zero gradients
    total, _, norms = clipped_grad_sum(f, 1.0, batch_size=2, return_norms=True)(w, x)
    assert np.all(np.isfinite(total)) and np.all(np.isfinite(norms))
    np.testing.assert_allclose(norms[:2], 0.0)
    expected, expected_norms = clipped_sum(f, 1.0, (w, x))
    tree_allclose(total, expected)
    tree_allclose(norms, expected_norms)
    outer = jax.grad(lambda x: clipped_grad_sum(f, 1.0, batch_size=2)(w, x)[0].sum())(x)
    assert np.all(np.isfinite(outer))
    # Second order against jax.grad of the hand-written clipped sum. The zero gradient
    # at x = (1, 1) (w.x = 0) still has a nonzero derivative: 2 w sum(x) = (4, -4).
    outer_ref = jax.grad(lambda x: clipped_sum(f, 1.0, (w, x))[0].sum())(x)
    assert np.all(np.isfinite(outer_ref))
    tree_allclose(outer, outer_ref)
    np.testing.assert_allclose(outer[:2], [[0.0, 0.0], [4.0, -4.0]], atol=1e-6)


@pytest.mark.parametrize("batch_size", [3, None])
def test_second_order_through_the_clipped_sum(batch_size):
    """jax.grad of the clipped sum (w.r.t. the examples and w.r.t. the clip norm),
    against jax.grad of the hand-written clipped sum; 7 examples, some clipped."""
    x, y = data(7)
    clip = 12.0  # between the per-example norms (about 9 to 23): some clip, some not

    def outer(x, clip):
        total, _ = clipped_grad_sum(
            loss, clip, batch_argnums=(1, 2), batch_size=batch_size
        )(PARAMS, x, y)
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(total))

    def outer_ref(x, clip):
        total, _ = clipped_sum(loss, clip, (PARAMS, x, y))
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(total))

    norms = clipped_sum(loss, clip, (PARAMS, x, y))[1]
    assert 0 < int((norms > clip).sum()) < 7, norms
    actual = jax.jit(jax.grad(outer, (0, 1)))(x, clip)
    expected = jax.grad(outer_ref, (0, 1))(x, clip)
    assert np.abs(np.asarray(expected[0])).max() > 1e-2  # a nontrivial derivative
    tree_allclose(actual, expected, rtol=1e-5, atol=1e-5)


# Absolute tolerance of the clipped sum (entries up to ~1.2, a sum of 7 clipped
# gradients) and relative tolerance of the norms (~9-23), against a float32 reference
# on the same rounded inputs: float32 differs only by summation order; float16 and
# bfloat16 round every intermediate (eps 2**-11, 2**-8; measured errors 1.2e-3 and
# 9.5e-3 in the sum, 5e-4 and 4e-3 relative in the norms).
DTYPE_TOLERANCES = {
    jnp.bfloat16: (3e-2, 1e-2),
    jnp.float16: (5e-3, 2e-3),
    jnp.float32: (1e-6, 1e-5),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_keeps_parameter_dtypes(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    x, y = data(7)
    x, y = x.astype(dtype), y.astype(dtype)
    total, _, norms = clipped_grad_sum(
        loss, 1.0, batch_argnums=(1, 2), batch_size=3, return_norms=True
    )(params, x, y)
    assert all(g.dtype == dtype for g in jax.tree.leaves(total))
    assert norms.dtype == jnp.float32
    # The reference in float32 from the very (rounded) values the chunked sum saw.
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x, y))
    expected, expected_norms = clipped_sum(loss, 1.0, wide)
    atol, norm_rtol = DTYPE_TOLERANCES[dtype]
    for a, e in zip(jax.tree.leaves(total), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.float32(a), e, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(norms, expected_norms, rtol=norm_rtol)
    assert np.all(np.asarray(expected_norms) > 1.0)  # every example was clipped


# ---------------------------------------------------------------------------------
# errors


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="argnums must be an int or a sequence"):
        per_example_grads(loss, argnums="0")
    with pytest.raises(ValueError, match="batch_argnums=5 is out of range"):
        per_example_grads(loss, batch_argnums=5)(PARAMS, *data(3))
    with pytest.raises(ValueError, match="argnums must not be empty"):
        clipped_grad_sum(loss, 1.0, argnums=())
    with pytest.raises(ValueError, match="l2_clip_norm must be non-negative"):
        clipped_grad_sum(loss, -1.0)
    with pytest.raises(TypeError, match="l2_clip_norm must be a non-negative number"):
        clipped_grad_sum(loss, "big")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        clipped_grad_sum(loss, 1.0, batch_size=0)
    with pytest.raises(TypeError, match="return_norms must be a bool"):
        clipped_grad_sum(loss, 1.0, return_norms=1)
    with pytest.raises(ValueError, match="inconsistent sizes .*Batch axis must"):
        x, y = data(4)
        clipped_grad_sum(loss, 1.0, batch_argnums=(1, 2))(PARAMS, x, y[:3])


def test_zero_examples_give_zero_sums_and_count():
    total, count, norms = clipped_grad_sum(
        loss, 1.0, batch_argnums=(1, 2), batch_size=4, return_norms=True
    )(PARAMS, *data(0))
    tree_allclose(total, jax.tree.map(jnp.zeros_like, PARAMS))
    assert int(count) == 0 and norms.shape == (0,)


def test_python_float_fields_are_constants_like_filter_grad():
    class Scaled(eqx.Module):
        linear: eqx.nn.Linear
        scale: float = 2.0  # a hyperparameter, not a parameter

        def __call__(self, x):
            return self.scale * self.linear(x)

    model = Scaled(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    x, y = data(6)

    def f(model, x, y):
        return jnp.sum((model(x) - y) ** 2)

    out = per_example_grads(f, batch_argnums=(1, 2), batch_size=4)(model, x, y)
    expected = eqx.filter_vmap(eqx.filter_grad(f), in_axes=(None, 0, 0))(model, x, y)
    assert out.scale is None
    tree_allclose(out, expected)


def test_python_float_parameters_are_differentiated_like_jax_grad():
    """Python floats in the parameters' dicts and lists are differentiated, as by
    `jax.grad` (a float32 gradient), by every entry point; a Python
    int is not (None)."""
    from chunkvmap import (
        per_example_grad_gram,
        per_example_grad_norms,
        per_example_grad_stats,
    )

    def f(p, x):
        h = jnp.tanh(x @ p["w"]) * p["s"] + p["c"][0] * x[:2] ** 2
        return jnp.sum(h) + p["n"]

    w = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
    params = {"w": jax.device_put(w), "s": 2.0, "c": [0.5], "n": 3}
    x = jax.device_put(np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4))

    @jax.jit
    def oracle(floats, x):  # the floats as weakly typed arguments, as jax.grad has
        return jax.vmap(jax.grad(lambda q, x: f({**q, "n": 3}, x)), (None, 0))(
            floats, x
        )

    floats = {k: v for k, v in params.items() if k != "n"}
    expected = oracle(floats, x)
    flat = np.concatenate(
        [np.asarray(g).reshape(6, -1) for g in jax.tree.leaves(expected)], 1
    )
    clipped, norms = clipped_sum(lambda q, x: f({**q, "n": 3}, x), 0.5, (floats, x))

    @jax.jit
    def ours(x):  # the floats stay Python floats (as arguments of jit they are not)
        sums = [
            clipped_grad_sum(f, 0.5, batch_size=4, method=m)(params, x)[0]
            for m in ("vmap", "ghost")
        ]
        return (
            per_example_grads(f, batch_size=4)(params, x),
            sums,
            per_example_grad_norms(f, method="ghost")(params, x),
            per_example_grad_stats(f, method="ghost")(params, x).mean,
            per_example_grad_gram(f, batch_size=4)(params, x),
        )

    grads, sums, got_norms, mean, gram = ours(x)
    assert grads["n"] is None and grads["s"].dtype == jnp.float32
    tree_allclose({**grads, "n": None}, {**expected, "n": None}, rtol=1e-5)
    for total in sums:
        assert total["n"] is None
        tree_allclose({**total, "n": None}, {**clipped, "n": None}, rtol=1e-5)
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    np.testing.assert_allclose(mean["s"], np.mean(expected["s"]), rtol=1e-5)
    np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-5, atol=1e-6)


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budget")
@pytest.mark.parametrize("limit", [16 * 2**10])  # all 64 examples do not fit
def test_auto_batch_size_is_chosen_once_and_reported(limit, monkeypatch):
    from chunkvmap import last_batch_size

    searches = record_auto_searches(monkeypatch)
    x, y = data(64)
    f = clipped_grad_sum(
        loss, 1.0, batch_argnums=(1, 2), batch_size="auto", memory_limit=limit
    )
    expected, _ = clipped_sum(loss, 1.0, (PARAMS, x, y))
    for _ in range(2):
        tree_allclose(f(PARAMS, x, y)[0], expected, rtol=1e-5, atol=1e-5)
    assert 1 <= last_batch_size(f) <= 64
    (search,) = searches  # chosen once: the second call reuses the choice
    check_auto_choice(
        search,
        last_batch_size(f),
        64,
        limit,
        lambda b: temp_bytes(
            clipped_grad_sum(loss, 1.0, batch_argnums=(1, 2), batch_size=b),
            PARAMS,
            x,
            y,
        ),
    )


# ---------------------------------------------------------------------------------
# clipped_grad_sum options, each against the hand-written jax.vmap(jax.grad) + clip +
# sum. Inputs are NumPy-built; clip 1.0 is below every norm here, clip 12.0 between.


def np_data(n, dtype=np.float32, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, SIZES[0])).astype(dtype)
    y = rng.normal(size=(n, SIZES[-1])).astype(dtype)
    return x, y


def check_clipped(out, expected, n, *, rtol=1e-5, atol=1e-5):
    """`out` = (sum, count, norms) against `expected` = (sum, norms)."""
    total, count, norms = out
    tree_allclose(total, expected[0], rtol=rtol, atol=atol)
    tree_allclose(norms, expected[1], rtol=rtol, atol=atol)
    assert count.dtype == jnp.int32 and int(count) == n


@pytest.mark.parametrize("argnums", [(0, 3), (-1, 0)])
def test_clipped_sum_with_several_argnums(argnums):
    x, y = np_data(7)
    bias = np.linspace(-0.5, 0.5, SIZES[-1], dtype=np.float32)

    def f(params, x, y, bias):
        return jnp.sum((mlp(params, x) + bias - y) ** 2)

    out = clipped_grad_sum(
        f,
        12.0,
        argnums=argnums,
        batch_argnums=(1, 2),
        batch_size=3,
        return_norms=True,
    )(PARAMS, x, y, bias)
    resolved = tuple(a % 4 for a in argnums)
    expected = clipped_sum(
        f, 12.0, (PARAMS, x, y, bias), in_axes=(None, 0, 0, None), argnums=resolved
    )
    check_clipped(out, expected, 7)
    assert isinstance(out[0], tuple) and len(out[0]) == 2
    assert out[0][resolved.index(3)].shape == bias.shape  # in the order of argnums
    # The norm is global over both arguments: it differs from the params-only norm.
    alone = clipped_sum(f, 12.0, (PARAMS, x, y, bias), in_axes=(None, 0, 0, None))[1]
    assert np.all(np.asarray(expected[1]) > np.asarray(alone) + 1e-3)


def test_clipped_sum_keyword_arguments_are_mapped():
    n = 6
    x, y = np_data(n)
    offset = np.linspace(-1.0, 1.0, n * SIZES[-1], dtype=np.float32).reshape(n, -1)
    scale = np.linspace(0.5, 2.0, n, dtype=np.float32)

    def f(params, x, y, *, offset, scale):
        return scale * jnp.sum((mlp(params, x) + offset - y) ** 2)

    def positional(params, x, y, offset, scale):
        return f(params, x, y, offset=offset, scale=scale)

    chunked = {
        b: clipped_grad_sum(f, 12.0, batch_size=b, return_norms=True) for b in (4, None)
    }
    mapped = (None, 0, 0, 0, 0)
    expected = clipped_sum(
        positional, 12.0, (PARAMS, x, y, offset, scale), in_axes=mapped
    )
    for g in chunked.values():
        check_clipped(g(PARAMS, x, y, offset=offset, scale=scale), expected, n)
    # Other values, same function: not a cached constant.
    out = chunked[4](PARAMS, x, y, offset=-offset, scale=2 * scale)
    args = (PARAMS, x, y, -offset, 2 * scale)
    check_clipped(out, clipped_sum(positional, 12.0, args, in_axes=mapped), n)


def test_clipped_sum_in_float64():
    with jax.enable_x64(True):
        params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p, np.float64)), PARAMS)
        x, y = np_data(7, np.float64)
        out = clipped_grad_sum(
            loss, 12.0, batch_argnums=(1, 2), batch_size=3, return_norms=True
        )(params, x, y)
        expected = clipped_sum(loss, 12.0, (params, x, y))
        assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(out[0]))
        assert out[2].dtype == jnp.float64  # norms accumulated in double precision
        # Agreement far beyond float32 (eps 1.2e-7): the whole computation is double.
        check_clipped(out, expected, 7, rtol=1e-12, atol=1e-12)


def complex_loss(w, x, y):
    """A real loss of complex parameters (jax.grad gives the conjugate gradient)."""
    z = x.astype(w.dtype) @ w
    return jnp.sum(jnp.abs(z - y.astype(w.dtype)) ** 2)


def complex_params(dtype):
    rng = np.random.default_rng(5)
    shape = (SIZES[0], SIZES[-1])
    return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(dtype)


@pytest.mark.parametrize("x64", [False, True])
def test_clipped_sum_of_complex_parameters(x64):
    """The norm of a complex gradient is sqrt(sum |g|^2), accumulated in float32 for
    complex64 and in float64 for complex128."""
    dtype, real, tol = (
        (np.complex128, jnp.float64, 1e-12)
        if x64
        else (np.complex64, jnp.float32, 1e-5)
    )
    with jax.enable_x64(x64):
        w = jnp.asarray(complex_params(dtype))
        x, y = np_data(7, np.float64 if x64 else np.float32)
        f = clipped_grad_sum(
            complex_loss, 12.0, batch_argnums=(1, 2), batch_size=3, return_norms=True
        )
        if x64 and jax.default_backend() == "tpu":  # no complex128 there
            with pytest.raises(TypeError, match=r"args\[0\] of dtype complex128"):
                f(w, x, y)
            return
        out = f(w, x, y)
        expected = clipped_sum(complex_loss, 12.0, (w, x, y))
        assert out[0].dtype == dtype and out[2].dtype == real
        assert 0 < int((expected[1] > 12.0).sum()) < 7  # some clipped, some not
        check_clipped(out, expected, 7, rtol=tol, atol=tol)


def test_clipped_sum_remat_policy_under_grad():
    """remat matters under differentiation only (values with and without it are in
    tests/test_conformance.py; gradients through remat=False in test_compose.py)."""
    remat = jax.checkpoint_policies.dots_saveable
    x, y = np_data(7)

    def outer(fn, x):
        total = fn(x)
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(total))

    def chunked(x):
        return clipped_grad_sum(
            loss, 12.0, batch_argnums=(1, 2), batch_size=3, remat=remat
        )(PARAMS, x, y)[0]

    def reference(x):
        return clipped_sum(loss, 12.0, (PARAMS, x, y))[0]

    # remat matters under differentiation only: value and gradient in one go.
    tree_allclose(
        jax.value_and_grad(ft.partial(outer, chunked))(x),
        jax.value_and_grad(ft.partial(outer, reference))(x),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("n, batch_size", [(7, 3)])  # 3 chunks, the last a window
def test_clipped_sum_reports_progress(n, batch_size):
    x, y = np_data(n)
    calls = []
    f = clipped_grad_sum(
        loss,
        12.0,
        batch_argnums=(1, 2),
        batch_size=batch_size,
        return_norms=True,
        progress=lambda done, total: calls.append((done, total)),
    )
    out = jax.block_until_ready(f(PARAMS, x, y))
    jax.effects_barrier()
    chunks = -(-n // batch_size)
    assert calls == [(k, chunks) for k in range(1, chunks + 1)]
    check_clipped(out, clipped_sum(loss, 12.0, (PARAMS, x, y)), n)


def test_a_shared_argument_shaped_like_the_examples_warns_once():
    # Issue 15: y left out of batch_argnums but with N rows is probably per example.
    x, y = data(6)

    def against_the_mean(params, x, ys):  # legitimately shared, but looks per example
        return loss(params, x, ys.mean(0))

    grads = per_example_grads(against_the_mean, batch_argnums=1, batch_size=4)
    with pytest.warns(UserWarning, match=r"args\[2\] whole .* batch_argnums=\(1, 2\)"):
        out = grads(PARAMS, x, y)
    tree_allclose(
        out, jax.vmap(jax.grad(against_the_mean), (None, 0, None))(PARAMS, x, y)
    )
    grads(PARAMS, x, y)  # once: no second warning (warnings are errors in the suite)
    # Not ambiguous: nothing shaped like the examples is left out.
    per_example_grads(loss, batch_argnums=(1, 2), batch_size=4)(PARAMS, x, y)


def test_a_nan_gradient_is_not_summed_unclipped():
    # Found by tests/test_hostile.py: a NaN total used to give norm 0, and the
    # example's finite parts entered the sum unclipped (breaking DP's clipping bound).
    def f(w, x):
        return jnp.sum(w * x)

    x = np.array([[np.nan, 100.0, 0.0], [0.3, 0.4, 0.0]], np.float32)
    total, _, norms = clipped_grad_sum(f, 1.0, return_norms=True, batch_size=1)(
        np.ones(3, np.float32), x
    )
    assert np.isnan(norms[0]) and np.isclose(norms[1], 0.5)
    # jax-privacy's rule without nan_safe: a NaN norm scales the example by 0, so only
    # its NaN entries reach the sum (NaN), never its finite ones (the 100.0).
    assert np.isnan(total[0]) and np.allclose(total[1:], [0.4, 0.0])


@pytest.mark.parametrize("weight", [(10, 10), (10, 3)])
def test_input_gradients_with_the_default_batch_argnums_are_warned(weight):
    """`per_example_grads(loss, argnums=1)` for the gradients of each example's
    inputs (saliency) maps the parameters with the default `batch_argnums`: a
    square weight returned a `(10, 10, 10)` array silently, another shape a
    contraction error; both now warn, naming `batch_argnums`, and with it the
    result is `jax.vmap(jax.grad(loss, 1))`'s."""

    def loss(w, x, y):
        return jnp.sum((x @ w - y) ** 2)

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=weight), jnp.float32)
    x = jnp.asarray(rng.normal(size=(10, 10)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(10, weight[1])), jnp.float32)
    with pytest.warns(UserWarning, match=r"batch_argnums=\(1, 2\)"):
        try:
            per_example_grads(loss, argnums=1)(w, x, y)
        except TypeError:  # (the parameters mapped: a contraction of wrong sizes)
            assert weight != (10, 10)
    with pytest.warns(UserWarning, match="passes args.0. whole"):  # (10 rows)
        got = per_example_grads(loss, argnums=1, batch_argnums=(1, 2))(w, x, y)
    tree_allclose(got, jax.vmap(jax.grad(loss, 1), (None, 0, 0))(w, x, y))
