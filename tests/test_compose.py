"""Composition with jit, grad, vjp, jvp, vmap, checkpoint, and with itself."""

import jax
import jax.numpy as jnp
import pytest
from jax.test_util import check_grads

from chunkvmap import batch_map, batch_vmap

from .helpers import CompileCounter, TraceCounter, tree_allclose


def model(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum(h @ params["w2"])


@pytest.fixture
def setup(rng):
    params = {
        "w1": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(11, 3)), jnp.float32)
    return params, x


@pytest.mark.parametrize("jit_inner", [False, True])
@pytest.mark.parametrize("jit_outer", [False, True])
@pytest.mark.parametrize("b", [1, 4, None])
def test_jit(setup, jit_inner, jit_outer, b):
    params, x = setup
    inner = jax.jit(model) if jit_inner else model
    fn = batch_vmap(inner, (None, 0), batch_size=b)
    fn = jax.jit(fn) if jit_outer else fn
    tree_allclose(fn(params, x), jax.vmap(model, (None, 0))(params, x))


@pytest.mark.parametrize("b", [1, 4, 11, None])
@pytest.mark.parametrize("reduce", [False, True])
def test_grad_matches_vmap(setup, b, reduce):
    params, x = setup

    def loss_ref(p, xs):
        return jnp.sum(jax.vmap(model, (None, 0))(p, xs) ** 2)

    if reduce:
        chunked = batch_vmap(
            lambda p, xi: model(p, xi) ** 2,
            (None, 0),
            batch_size=b,
            reduction=jnp.add,
            chunk_reduction=lambda y: y.sum(0),
        )

        def loss(p, xs):
            return chunked(p, xs)
    else:

        def loss(p, xs):
            return jnp.sum(batch_vmap(model, (None, 0), batch_size=b)(p, xs) ** 2)

    tree_allclose(
        jax.grad(loss, argnums=(0, 1))(params, x),
        jax.grad(loss_ref, argnums=(0, 1))(params, x),
        rtol=1e-4,
    )


@pytest.mark.parametrize("b", [3, None])
def test_check_grads(setup, b):
    params, x = setup
    x64 = x[:5]

    def loss(p, xs):
        return jnp.sum(batch_vmap(model, (None, 0), batch_size=b)(p, xs))

    # Under jit, each derivative program is compiled once (eagerly, every probe of
    # check_grads would trace and run the chunked loop op by op).
    check_grads(
        jax.jit(loss),
        (params, x64),
        order=2,
        modes=["fwd", "rev"],
        atol=5e-2,
        rtol=5e-2,
    )


def test_vjp_and_jvp(setup):
    params, x = setup
    fn = batch_vmap(model, (None, 0), batch_size=4)
    ref = jax.vmap(model, (None, 0))
    out, vjp_fn = jax.vjp(fn, params, x)
    ref_out, ref_vjp = jax.vjp(ref, params, x)
    tree_allclose(out, ref_out)
    ct = jnp.linspace(-1.0, 1.0, x.shape[0], dtype=jnp.float32)
    tree_allclose(vjp_fn(ct), ref_vjp(ct), rtol=1e-4)
    tangents = (jax.tree.map(jnp.ones_like, params), jnp.ones_like(x))
    tree_allclose(
        jax.jvp(fn, (params, x), tangents),
        jax.jvp(ref, (params, x), tangents),
        rtol=1e-4,
    )


def test_per_example_grads_chunked(setup):
    """The usual placement: batch_vmap(grad(f)), memory bounded by batch_size."""
    params, x = setup
    per_ex = batch_vmap(jax.grad(model), (None, 0), batch_size=3)(params, x)
    tree_allclose(per_ex, jax.vmap(jax.grad(model), (None, 0))(params, x), rtol=1e-4)


@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_of_batch_vmap(in_axes, rng):
    x = jnp.asarray(rng.normal(size=(4, 7, 3)), jnp.float32)

    def f(v):
        return jnp.sin(v) * v.sum()

    inner = batch_vmap(f, batch_size=3)
    ref = jax.vmap(jax.vmap(f), in_axes=in_axes)
    x_in = x if in_axes == 0 else jnp.moveaxis(x, 0, 1)
    tree_allclose(jax.vmap(inner, in_axes=in_axes)(x_in), ref(x_in))
    # and the reduced flavour
    reduced = batch_vmap(
        f, batch_size=3, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)
    )
    tree_allclose(
        jax.vmap(reduced, in_axes=in_axes)(x_in),
        jax.vmap(lambda v: jax.vmap(f)(v).sum(0), in_axes=in_axes)(x_in),
        rtol=1e-5,
    )


def test_batch_vmap_nested_in_itself(rng):
    x = jnp.asarray(rng.normal(size=(5, 6, 2)), jnp.float32)

    def f(v):
        return jnp.cos(v).sum()

    nested = batch_vmap(batch_vmap(f, batch_size=4), batch_size=2)
    tree_allclose(nested(x), jax.vmap(jax.vmap(f))(x))
    tree_allclose(
        jax.grad(lambda a: nested(a).sum())(x),
        jax.grad(lambda a: jax.vmap(jax.vmap(f))(a).sum())(x),
    )


def test_checkpoint(setup):
    params, x = setup

    def loss(p):
        return jnp.sum(batch_vmap(model, (None, 0), batch_size=4)(p, x))

    def ref(p):
        return jnp.sum(jax.vmap(model, (None, 0))(p, x))

    tree_allclose(
        jax.grad(jax.checkpoint(loss))(params), jax.grad(ref)(params), rtol=1e-4
    )


def test_closure_over_traced_values(setup):
    """f may close over tracers of an outer transformation (grad of a closure)."""
    params, x = setup

    def loss(p):
        return jnp.sum(batch_vmap(lambda xi: model(p, xi), batch_size=4)(x))

    def ref(p):
        return jnp.sum(jax.vmap(lambda xi: model(p, xi))(x))

    tree_allclose(jax.grad(loss)(params), jax.grad(ref)(params), rtol=1e-4)


@pytest.mark.parametrize("b", [1, 4, None])
def test_batch_map_composes(setup, b):
    params, x = setup
    vec = jax.vmap(model, (None, 0))

    def loss(p):
        return jnp.sum(batch_map(lambda c: vec(p, c), x, b) ** 2)

    def ref(p):
        return jnp.sum(vec(p, x) ** 2)

    tree_allclose(jax.jit(jax.grad(loss))(params), jax.grad(ref)(params), rtol=1e-4)
    tree_allclose(
        jax.vmap(lambda s: batch_map(lambda c: vec(params, c) * s, x, b))(
            jnp.arange(3.0)
        ),
        jax.vmap(lambda s: vec(params, x) * s)(jnp.arange(3.0)),
    )


@pytest.mark.parametrize(
    "remat", [True, False, jax.checkpoint_policies.dots_with_no_batch_dims_saveable]
)
@pytest.mark.parametrize("reduce", [False, True])
def test_remat_options_give_the_same_gradients(setup, remat, reduce):
    params, x = setup
    b = 3  # 11 examples: a remainder

    def loss(p):
        if reduce:
            return batch_vmap(
                model,
                (None, 0),
                batch_size=b,
                remat=remat,
                reduction=jnp.add,
                chunk_reduction=lambda y: y.sum(0),
            )(p, x)
        return batch_vmap(model, (None, 0), batch_size=b, remat=remat)(p, x).sum()

    def ref(p):
        return jax.vmap(model, (None, 0))(p, x).sum()

    tree_allclose(jax.grad(loss)(params), jax.grad(ref)(params), rtol=1e-4)


def test_f_traced_once_under_grad_with_remainder(setup):
    params, x = setup
    counted = TraceCounter(model)

    def loss(p):
        return batch_vmap(counted, (None, 0), batch_size=4)(p, x).sum()

    jax.jit(jax.grad(loss))(params)
    assert counted.count == 1
    counted.count = 0
    jax.grad(
        lambda p: batch_vmap(
            counted,
            (None, 0),
            batch_size=4,
            reduction=jnp.add,
            chunk_reduction=lambda y: y.sum(0),
        )(p, x)
    )(params)
    assert counted.count == 1


def test_grad_wrt_mapped_input_with_overlapping_last_window(rng):
    """The last window recomputes examples; their gradient must be counted once."""
    x = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)

    def f(v):
        return jnp.sin(v).sum() * v[0]

    for b in (3, 4, 6):
        g = jax.grad(lambda a: batch_vmap(f, batch_size=b)(a).sum())(x)
        tree_allclose(g, jax.grad(lambda a: jax.vmap(f)(a).sum())(x))
        g = jax.grad(
            lambda a: batch_vmap(
                f, batch_size=b, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)
            )(a)
        )(x)
        tree_allclose(g, jax.grad(lambda a: jax.vmap(f)(a).sum())(x))


def test_eager_calls_reuse_the_compiled_program():
    f = batch_vmap(lambda x, scale: jnp.sin(x) * scale, in_axes=(0, None), batch_size=3)
    x = jnp.linspace(0.0, 1.0, 10)
    tree_allclose(f(x, 2.0), jnp.sin(x) * 2.0)
    y = x + 1.0
    with CompileCounter() as compiles:  # same structure and types: compiled once
        out = f(y, 2.0)
    assert compiles.count == 0
    tree_allclose(out, jnp.sin(y) * 2.0)
    with CompileCounter() as compiles:
        out = f(x, 3.0)  # a new static value: a new program
    assert compiles.count == 1
    tree_allclose(out, jnp.sin(x) * 3.0)
    head = x[:7]
    with CompileCounter() as compiles:
        out = f(head, 3.0)  # a new shape: a new program
    assert compiles.count == 1
    tree_allclose(out, jnp.sin(x[:7]) * 3.0)
