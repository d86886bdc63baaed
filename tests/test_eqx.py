"""chunkvmap.eqx.filter_batch_vmap against eqx.filter_vmap on the same inputs."""

import contextlib

import equinox as eqx  # noqa: E402
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap as cv  # noqa: E402
from chunkvmap.eqx import filter_batch_vmap  # noqa: E402

from .helpers import make_mesh, mesh_devices, tree_allclose  # noqa: E402


def make_model(key):
    return eqx.nn.MLP(3, 2, 8, 2, key=key)


KEYS = jax.random.split(jax.random.key(0), 7)
MODELS = eqx.filter_vmap(make_model)(KEYS)
X = jnp.linspace(-1.0, 1.0, 30, dtype=jnp.float32).reshape(10, 3)


def arrays(tree):
    return eqx.filter(tree, eqx.is_array)


def apply(m, x):
    return m(x)


@pytest.mark.parametrize("b", [1, 3, 7, 20, None])
def test_ensemble_forward(b):
    in_axes = (eqx.if_array(0), None)
    ref = eqx.filter_vmap(apply, in_axes=in_axes)(MODELS, X[0])
    out = filter_batch_vmap(apply, in_axes=in_axes, batch_size=b)(MODELS, X[0])
    tree_allclose(out, ref)


@pytest.mark.parametrize("b", [2, 3])
def test_building_an_ensemble_in_chunks(b):
    built = filter_batch_vmap(make_model, batch_size=b)(KEYS)
    assert jax.tree.structure(built) == jax.tree.structure(MODELS)
    tree_allclose(arrays(built), arrays(MODELS))
    assert built.activation is MODELS.activation  # non-array leaves pass through


@pytest.mark.parametrize("b", [3, 4])
def test_shared_model_under_filter_jit_and_filter_grad(b):
    model = make_model(jax.random.key(1))

    @eqx.filter_jit
    def loss(m, xs):
        preds = filter_batch_vmap(apply, in_axes=(None, 0), batch_size=b)(m, xs)
        return (preds**2).sum()

    @eqx.filter_jit
    def loss_ref(m, xs):
        return (eqx.filter_vmap(apply, in_axes=(None, 0))(m, xs) ** 2).sum()

    tree_allclose(loss(model, X), loss_ref(model, X), rtol=1e-5)
    tree_allclose(
        eqx.filter_grad(loss)(model, X),
        eqx.filter_grad(loss_ref)(model, X),
        rtol=1e-4,
        atol=1e-6,
    )


def per_example_grad(m, x):
    return eqx.filter_grad(lambda mm: (mm(x) ** 2).sum())(m)


def sum_over_examples(grads):
    return jax.tree.map(lambda g: g.sum(0), grads)


@pytest.mark.parametrize("shard", [False, True])
def test_per_example_gradients_summed_with_a_reduction(shard):
    if shard and len(mesh_devices(8)) < 8:
        pytest.skip("needs 8 devices")
    model = make_model(jax.random.key(2))
    xs = jnp.linspace(-1.0, 1.0, 13 * 3, dtype=jnp.float32).reshape(13, 3)
    ref = eqx.filter_vmap(per_example_grad, in_axes=(None, 0))(model, xs)
    summed = filter_batch_vmap(
        per_example_grad,
        in_axes=(None, 0),
        batch_size=2,
        shard=shard,
        reduction=jnp.add,
        chunk_reduction=lambda g: sum_over_examples(arrays(g)),
    )(model, xs)
    tree_allclose(summed, sum_over_examples(arrays(ref)), rtol=1e-4, atol=1e-6)
    # And stacked, unreduced.
    stacked = filter_batch_vmap(per_example_grad, in_axes=(None, 0), batch_size=4)(
        model, xs
    )
    tree_allclose(arrays(stacked), arrays(ref), rtol=1e-5, atol=1e-6)


def test_state_batchnorm_inference_mode():
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        3, axis_name="batch", mode="batch"
    )
    bn = eqx.nn.inference_mode(bn)

    def f(x, st):
        return bn(x, st)

    ref = eqx.filter_vmap(f, in_axes=(0, None), out_axes=(0, None))(X, state)
    out = filter_batch_vmap(f, in_axes=(0, None), out_axes=(0, None), batch_size=3)(
        X, state
    )
    tree_allclose(arrays(out), arrays(ref))


def test_dropout_with_per_example_keys():
    dropout = eqx.nn.Dropout(0.5)
    keys = jax.random.split(jax.random.key(3), 10)

    def f(x, k):
        return dropout(x, key=k)

    ref = eqx.filter_vmap(f)(X, keys)
    tree_allclose(filter_batch_vmap(f, batch_size=3)(X, keys), ref)


def test_axis_size_with_no_mapped_input():
    def f(x):
        return x * 2.0

    ref = eqx.filter_vmap(f, in_axes=None, axis_size=5)(X[0])
    tree_allclose(
        filter_batch_vmap(f, in_axes=None, axis_size=5, batch_size=2)(X[0]), ref
    )


def test_dict_in_axes_decorator_and_out_axes():
    @filter_batch_vmap(in_axes=dict(m=None, x=1), out_axes=1, batch_size=4)
    def f(m, x):
        return jnp.stack([m(x), m(x) * 2.0])

    model = make_model(jax.random.key(4))
    ref = eqx.filter_vmap(
        lambda m, x: jnp.stack([m(x), m(x) * 2.0]),
        in_axes=dict(m=None, x=1),
        out_axes=1,
    )(model, X.T)
    tree_allclose(f(model, X.T), ref)
    assert f.__name__ == "f"


def test_bad_specs():
    model = make_model(jax.random.key(5))
    with pytest.raises(ValueError, match=r"in_axes must be a pytree prefix"):
        filter_batch_vmap(apply, in_axes=(None, 0, 0), batch_size=2)(model, X)
    with pytest.raises(ValueError, match=r"not an array\) the axis 0"):
        filter_batch_vmap(apply, in_axes=(0, 0), batch_size=2)(MODELS, X[:7])
    with pytest.raises(TypeError, match=r"containing 'x' of type str"):
        filter_batch_vmap(apply, in_axes=("x", 0))
    with pytest.raises(ValueError, match=r"names \['y'\]"):
        filter_batch_vmap(apply, in_axes=dict(y=0), batch_size=2)(model, X)
    with pytest.raises(RuntimeError, match="keyword arguments"):
        filter_batch_vmap(apply, batch_size=2)(model, x=X)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        filter_batch_vmap(apply, batch_size=0)


# Regressions found in review.


def test_non_array_arguments_may_change_between_calls():
    x = jnp.arange(5.0)
    g = filter_batch_vmap(lambda v, s: v * s, batch_size=2)
    tree_allclose(g(x, 2.0), x * 2.0)
    tree_allclose(g(x, 3.0), x * 3.0)
    dropout = eqx.nn.Dropout(0.5)
    keys = jax.random.split(jax.random.key(0), 4)
    ones = jnp.ones((4, 3))
    apply_dropout = filter_batch_vmap(
        lambda m, v, k: m(v, key=k), in_axes=(None, 0, 0), batch_size=3
    )
    ref = eqx.filter_vmap(lambda m, v, k: m(v, key=k), in_axes=(None, 0, 0))
    tree_allclose(apply_dropout(dropout, ones, keys), ref(dropout, ones, keys))
    inference = eqx.nn.inference_mode(dropout)
    tree_allclose(apply_dropout(inference, ones, keys), ones)


def test_nothing_mapped_calls_once_like_eqx():
    x = jnp.arange(5.0)
    tree_allclose(
        filter_batch_vmap(lambda a: a + 1, in_axes=None, out_axes=None)(x), x + 1
    )
    assert filter_batch_vmap(lambda: "hi")() == "hi"
    with pytest.raises(ValueError, match="cannot resolve the batch dimension"):
        filter_batch_vmap(lambda a: a + 1, in_axes=None)(x)


def test_out_axes_range_and_python_scalar_outputs():
    with pytest.raises(ValueError, match="out_axes=3 is out of range"):
        filter_batch_vmap(lambda v: jnp.outer(v, jnp.ones(3)), out_axes=3)(X)
    ref = eqx.filter_vmap(lambda v: 1.0, out_axes=0)(jnp.arange(3.0))
    tree_allclose(
        filter_batch_vmap(lambda v: 1.0, out_axes=0, batch_size=2)(jnp.arange(3.0)), ref
    )


def test_wrapper_is_a_module_whose_arrays_get_gradients():
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    wrapped = filter_batch_vmap(model, batch_size=3)
    assert len(jax.tree.leaves(wrapped)) == len(jax.tree.leaves(eqx.filter_vmap(model)))
    grads = eqx.filter_grad(lambda w, v: w(v).sum())(wrapped, X)
    ref = eqx.filter_grad(lambda w, v: w(v).sum())(eqx.filter_vmap(model), X)
    tree_allclose(arrays(grads._fun), arrays(ref._fun), rtol=1e-5)


def test_decorator_form_keeps_chunk_size():
    calls = []

    @filter_batch_vmap(chunk_size=2, progress=lambda d, t: calls.append((d, t)))
    def double(x):
        return x * 2

    np.testing.assert_allclose(double(jnp.arange(6.0)), 2 * np.arange(6.0))
    jax.effects_barrier()
    assert calls == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match="filter_batch_vmap chunk_size must be"):
        filter_batch_vmap(chunk_size=0)(lambda x: x)


@pytest.mark.parametrize("hold", ["placed", "set_mesh", "mesh="])
@pytest.mark.parametrize(
    "entry",
    [
        "filter_batch_vmap",
        "per_example_grads",
        "clipped_grad_sum",
        "ghost",
        "gram(ghost)",
        "ggn_diagonal(ghost)",
        "projections(ghost)",
    ],
)
def test_modules_holding_functions_on_a_mesh(entry, hold):
    """An MLP holds its activation (a function) as a field: its members, or the
    data, sharded over a mesh (placed, under jax.set_mesh, or named by mesh=) run
    as on one device, as with eqx.filter_vmap and jax.vmap(jax.grad)."""
    if len(mesh_devices(8)) < 8:
        pytest.skip("needs 8 devices")
    from jax.sharding import NamedSharding, PartitionSpec as P

    from chunkvmap import clipped_grad_sum, per_example_grads

    from .helpers import clipped_sum, projected_grads

    mesh = make_mesh((8,), ("data",))

    def placed(tree):
        if hold == "mesh=":
            return tree
        sharding = NamedSharding(mesh, P("data"))
        return jax.tree.map(
            lambda a: jax.device_put(a, sharding) if eqx.is_array(a) else a, tree
        )

    options = dict(batch_size=2, shard=True, mesh=mesh) if hold == "mesh=" else {}
    options.setdefault("batch_size", 2)
    context = jax.set_mesh(mesh) if hold == "set_mesh" else contextlib.nullcontext()
    if entry == "filter_batch_vmap":
        models = eqx.filter_vmap(make_model)(jax.random.split(jax.random.key(3), 16))
        expected = eqx.filter_vmap(apply, in_axes=(eqx.if_array(0), None))(models, X[0])
        with context:
            got = filter_batch_vmap(apply, in_axes=(eqx.if_array(0), None), **options)(
                placed(models), X[0]
            )
        tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
        return
    model = make_model(jax.random.key(4))
    xs = jnp.linspace(-1.0, 1.0, 16 * 3, dtype=jnp.float32).reshape(16, 3)
    params, static = eqx.partition(model, eqx.is_array)

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    def loss_of_arrays(p, x):
        return loss(eqx.combine(p, static), x)

    grads = jax.vmap(jax.grad(loss_of_arrays), (None, 0))(params, xs)
    flat = jnp.concatenate([g.reshape(16, -1) for g in jax.tree.leaves(grads)], 1)
    with context:
        if entry == "per_example_grads":
            got = per_example_grads(loss, **options)(model, placed(xs))
            expected = grads
        elif entry == "gram(ghost)":
            gram = cv.per_example_grad_gram(loss, method="ghost", **options)
            got, expected = gram(model, placed(xs)), flat @ flat.T
        elif entry == "ggn_diagonal(ghost)":  # halved squared error
            ggn = cv.ggn_diagonal(
                apply, likelihood="gaussian", method="ghost", **options
            )
            got = ggn(model, placed(xs))
            jacobians = jax.vmap(
                jax.jacrev(lambda p, x: apply(eqx.combine(p, static), x)), (None, 0)
            )(params, xs)
            expected = jax.tree.map(lambda j: jnp.sum(j**2, (0, 1)), jacobians)
        elif entry == "projections(ghost)":
            project = cv.per_example_grad_projections(
                loss, dim=4, method="ghost", **options
            )
            got = project(model, placed(xs))
            expected = projected_grads(loss_of_arrays, params, (xs,), 4)
        else:
            method = "ghost" if entry == "ghost" else "vmap"
            clipped = clipped_grad_sum(loss, 0.5, method=method, **options)
            got = clipped(model, placed(xs))[0]
            expected = clipped_sum(loss_of_arrays, 0.5, (params, xs))[0]
    tree_allclose(arrays(got), expected, rtol=1e-4, atol=1e-6)
