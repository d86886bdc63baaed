"""chunkvmap.linen.batch_vmap against nn.vmap with the same arguments.

Each case evaluates its chunked model in one `jax.jit` (compiling is what costs time
on CPU) and compares it with `nn.vmap` under `jax.jit`, computed once per module.
"""

import functools as ft

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap.linen import batch_vmap

from .flax_cases import SUM, T, X, chunked_by, classic_threefry  # noqa: F401
from .helpers import jaxpr_eqns, tree_allclose


def assert_same_variables(actual, expected):
    """Bit-identical variables: same structure (boxes included) and values."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


chunked = chunked_by(batch_vmap)


class MLP(nn.Module):
    features: int = 2

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(nn.tanh(nn.Dense(6)(x)))


ENSEMBLE = dict(
    variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=7
)
SHARED = dict(variable_axes={"params": None}, split_rngs={"params": False})


# --------------------------------------------------------------------------------------
# Ensembles: parameters mapped, data shared.


def ensemble_run(vmap):
    model = vmap(nn.Dense, **ENSEMBLE)(features=2)
    k = jax.random.key(0)

    @jax.jit
    def run(reference_variables):
        return model.init(k, X[0]), model.apply(reference_variables, X[0])

    return run


@ft.cache
def ensemble_reference():
    model = nn.vmap(nn.Dense, **ENSEMBLE)(features=2)
    variables = jax.jit(model.init)(jax.random.key(0), X[0])
    return variables, ensemble_run(nn.vmap)(variables)


@pytest.mark.parametrize("b", [1, 3, 20, None])
def test_ensemble_init_and_apply(b):
    variables, (_, out_ref) = ensemble_reference()
    init, out = ensemble_run(chunked(b))(variables)
    assert_same_variables(init, variables)  # key splitting ignores the chunks
    assert init["params"]["kernel"].shape == (7, 3, 2)
    tree_allclose(out, out_ref)


# --------------------------------------------------------------------------------------
# One model shared over batched data.


def shared_run(vmap, params):
    model = vmap(MLP, **SHARED)()

    def loss(p):
        return (model.apply({"params": p}, X) ** 2).sum()

    return jax.jit(
        lambda: (
            (model.init(jax.random.key(0), X), model.apply({"params": params}, X))
            + jax.value_and_grad(loss)(params)
        )
    )()


@ft.cache
def shared_reference():
    params = jax.jit(nn.vmap(MLP, **SHARED)().init)(jax.random.key(0), X)["params"]
    return params, shared_run(nn.vmap, params)


@pytest.mark.parametrize("b", [3, 5, 20, None])
def test_shared_parameters_init_apply_and_grad(b):
    params, (init_ref, out_ref, loss_ref, grads_ref) = shared_reference()
    init, out, loss, grads = shared_run(chunked(b), params)
    assert_same_variables(init, init_ref)
    tree_allclose(out, out_ref)
    tree_allclose(loss, loss_ref, rtol=1e-5)
    tree_allclose(grads, grads_ref, rtol=1e-4)


def test_eager_apply_and_axes_like_nn_vmap():
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, s):
            return nn.Dense(2)(x) * s

    s = jnp.stack([T, 2.0 * T])
    kw = dict(SHARED, in_axes=(1, -1), out_axes=-1)
    ref = nn.vmap(Scaled, **kw)()
    params = ref.init(jax.random.key(0), X.T, s)
    out = batch_vmap(Scaled, **kw, batch_size=3)().apply(params, X.T, s)
    tree_allclose(out, ref.apply(params, X.T, s))
    assert out.shape == (2, 10)


# --------------------------------------------------------------------------------------
# A submodule of a parent: dropout split per example, intermediates.


class Block(nn.Module):
    """Dense, recorded with sow, dropout (deterministic as a keyword), Dense."""

    @nn.compact
    def __call__(self, x, deterministic=False):
        h = nn.Dense(6)(x)
        self.sow("intermediates", "h", h)
        h = nn.Dropout(0.5, deterministic=deterministic)(h)
        return nn.Dense(2)(h)


def parent_model(vmap):
    class Parent(nn.Module):
        @nn.compact
        def __call__(self, x):
            Batched = vmap(
                Block,
                variable_axes={"params": None, "intermediates": 0},
                split_rngs={"params": False, "dropout": True},
            )
            a = Batched()(x)  # auto-named as nn.vmap names it: VmapBlock_0
            b = Batched()(x)  # a second call: the RNG counters advance once per call
            return a + nn.Dense(2)(b)

    return Parent()


INIT_RNGS = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
DROPOUT = {"dropout": jax.random.key(3)}


def parent_run(vmap, params):
    model = parent_model(vmap)

    @jax.jit
    def run():
        init = model.init(INIT_RNGS, X)
        out, state = model.apply(
            {"params": params}, X, rngs=DROPOUT, mutable=["intermediates"]
        )
        return init, out, state

    return run()


@ft.cache
def parent_reference():
    params = jax.jit(parent_model(nn.vmap).init)(INIT_RNGS, X)["params"]
    return params, parent_run(nn.vmap, params)


def test_submodule_with_dropout_and_intermediates():
    params, (init_ref, out_ref, state_ref) = parent_reference()
    assert set(params) == {"VmapBlock_0", "VmapBlock_1", "Dense_0"}
    init, out, state = parent_run(chunked(4), params)
    assert_same_variables(init, init_ref)
    tree_allclose(out, out_ref)  # the same dropout masks, example by example
    tree_allclose(state, state_ref)
    assert state["intermediates"]["VmapBlock_0"]["h"][0].shape == (10, 6)


def test_keyword_arguments_are_mapped_or_passed_on():
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, *, scale, square=False):
            y = nn.Dense(2)(x) * scale
            return y**2 if square else y

    # An array keyword argument is mapped over its leading axis, as jax.vmap maps
    # keyword arguments (nn.vmap would warn and drop it); a Python bool reaches every
    # example unchanged.
    model = batch_vmap(Scaled, **SHARED, batch_size=4)()
    params = model.init(jax.random.key(0), X, scale=T)

    @jax.jit
    def run(params):
        def one(x, s):
            return Scaled().apply(params, x, scale=s, square=True)

        return model.apply(params, X, scale=T, square=True), jax.vmap(one)(X, T)

    tree_allclose(*run(params))


# --------------------------------------------------------------------------------------
# Mutable collections and boxed (partitioned) parameters.


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))


def normed_run(vmap):
    # Each of 5 members normalises the shared data batch with its own statistics.
    model = vmap(
        Normed,
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True},
        in_axes=None,
        axis_size=5,
    )()

    @jax.jit
    def run():
        variables = model.init(jax.random.key(0), X)
        return variables, model.apply(variables, X, mutable=["batch_stats"])

    return run()


@pytest.mark.optimized  # bitwise: the same initialisation as nn.vmap
def test_mutable_batch_stats_per_member():
    variables, (out, stats) = normed_run(chunked(2))
    variables_ref, (out_ref, stats_ref) = normed_run(nn.vmap)
    assert_same_variables(variables, variables_ref)
    tree_allclose(out, out_ref, rtol=1e-4, atol=1e-5)
    tree_allclose(stats, stats_ref)
    assert stats["batch_stats"]["BatchNorm_0"]["mean"].shape == (5, 4)


def test_partitioned_params_with_metadata_params():
    class PDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(3, kernel_init=init)(x)

    def run(vmap):
        model = vmap(
            PDense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            metadata_params={nn.PARTITION_NAME: "members"},
        )()

        @jax.jit
        def both():
            variables = model.init(jax.random.key(0), X)
            return variables, model.apply(variables, X)

        return both()

    (variables, out), (variables_ref, out_ref) = run(chunked(4)), run(nn.vmap)
    assert_same_variables(variables, variables_ref)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.Partitioned)
    assert kernel.names == ("members", None, "model")
    tree_allclose(out, out_ref)


# --------------------------------------------------------------------------------------
# Reductions: a loss summed over the batch.


class Loss(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        pred = MLP(1)(x)[0]
        self.sow("intermediates", "pred", pred)
        return (pred - t) ** 2


def loss_run(vmap, params, **kw):
    model = vmap(Loss, **kw)()

    def total(p):
        return jnp.sum(model.apply({"params": p}, X, T))

    @jax.jit
    def run():
        value, grads = jax.value_and_grad(total)(params)
        losses, state = model.apply({"params": params}, X, T, mutable=["intermediates"])
        return (
            model.init(jax.random.key(0), X, T)["params"],
            value,
            grads,
            losses,
            state,
        )

    return run()


@ft.cache
def loss_reference():
    params = jax.jit(nn.vmap(Loss, **SHARED)().init)(jax.random.key(0), X, T)["params"]
    kw = dict(SHARED, variable_axes={"params": None, "intermediates": 0})
    return params, loss_run(nn.vmap, params, **kw)


@pytest.mark.parametrize("b", [3, 5, 20, None])
def test_summed_loss_with_a_reduction_jit_and_grad(b):
    params, (_, value_ref, grads_ref, losses_ref, state_ref) = loss_reference()
    kw = dict(SHARED, variable_axes={"params": None, "intermediates": 0})
    init, value, grads, total, state = loss_run(chunked(b, **SUM), params, **kw)
    # init goes through the reduction too (its parameters kept beside the sum).
    assert_same_variables(init, params)
    assert value.shape == total.shape == ()
    tree_allclose(value, value_ref, rtol=1e-5)
    tree_allclose(total, losses_ref.sum(), rtol=1e-5)
    tree_allclose(grads, grads_ref, rtol=1e-4)
    tree_allclose(state, state_ref)  # a mapped collection comes back stacked


def test_a_reduction_and_state_make_one_loop_over_the_chunks():
    """The loss folded and the sown collection stacked in the same chunked evaluation
    (one loop, the user's method evaluated once per chunk), with progress reported
    once per chunk; and so over devices."""
    params, _ = loss_reference()
    calls = []
    kw = dict(SHARED, variable_axes={"params": None, "intermediates": 0})
    model = chunked(3, **SUM, progress=lambda done, total: calls.append(done))(
        Loss, **kw
    )()
    jaxpr = jax.make_jaxpr(
        lambda p: model.apply({"params": p}, X, T, mutable=["intermediates"])
    )(params)
    scans = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1, len(scans)
    jax.block_until_ready(model.apply({"params": params}, X, T, mutable=True))
    jax.effects_barrier()
    assert calls == [1, 2, 3, 4]
    # over 8 devices (10 examples: a global remainder), under jit
    _, (_, _, _, losses_ref, state_ref) = loss_reference()
    sharded = chunked(1, **SUM, shard=True)(Loss, **kw)()
    total, state = jax.jit(
        lambda p: sharded.apply({"params": p}, X, T, mutable=["intermediates"])
    )(params)
    tree_allclose(total, losses_ref.sum(), rtol=1e-5)
    tree_allclose(state, state_ref)


# --------------------------------------------------------------------------------------
# Decorator form, methods=, batch_size="auto".


class Encoder(nn.Module):
    @nn.compact
    def encode(self, x):
        return nn.Dense(4)(x) * 2.0


def test_decorated_method_and_methods_argument():
    def run(vmap):
        class Model(nn.Module):
            @ft.partial(vmap, **SHARED)  # the decorator form, inside a class body
            @nn.compact
            def __call__(self, x):
                return nn.relu(nn.Dense(3)(x))

        model = Model()
        encoder = vmap(Encoder, **SHARED, methods=["encode"])()

        @jax.jit
        def both():
            v = model.init(jax.random.key(0), X)
            e = encoder.init(jax.random.key(1), X, method="encode")
            return v, model.apply(v, X), e, encoder.apply(e, X, method="encode")

        return both()

    (v, out, e, enc), (v_ref, out_ref, e_ref, enc_ref) = run(chunked(4)), run(nn.vmap)
    assert_same_variables(v, v_ref)
    assert_same_variables(e, e_ref)
    tree_allclose(out, out_ref)
    tree_allclose(enc, enc_ref)


def test_batch_size_auto():
    params, (_, out_ref, *_) = shared_reference()
    model = batch_vmap(MLP, **SHARED, batch_size="auto", memory_limit="64KiB")()
    out = jax.jit(model.apply)({"params": params}, X)
    tree_allclose(out, out_ref)


def test_shard_over_devices():
    # tests/conftest.py asks for 8 CPU devices; 13 examples leave a global remainder.
    x = jnp.linspace(-1.0, 1.0, 39, dtype=jnp.float32).reshape(13, 3)
    ref = nn.vmap(nn.Dense, **SHARED)(2)
    params = jax.jit(ref.init)(jax.random.key(0), x)
    stacked = batch_vmap(nn.Dense, **SHARED, batch_size=1, shard=True)(2)
    summed = batch_vmap(nn.Dense, **SHARED, batch_size=1, shard=True, **SUM)(2)
    tree_allclose(stacked.apply(params, x), ref.apply(params, x))
    tree_allclose(summed.apply(params, x), ref.apply(params, x).sum(0), rtol=1e-5)


# --------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"variable_axes must be a mapping .* got"):
        batch_vmap(MLP, variable_axes=["params"])
    with pytest.raises(TypeError, match=r"variable_axes\['params'\] must be an int"):
        batch_vmap(MLP, variable_axes={"params": "0"})
    with pytest.raises(TypeError, match=r"split_rngs\['params'\] must be a bool"):
        batch_vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": 1})
    with pytest.raises(TypeError, match=r"in_axes must be an int, None, or a tuple"):
        batch_vmap(MLP, in_axes={"x": 0})
    with pytest.raises(ValueError, match=r"batch_size must be a positive int"):
        batch_vmap(MLP, batch_size=0)
    with pytest.raises(TypeError, match=r"metadata_params must be a mapping"):
        batch_vmap(MLP, metadata_params="batch")
    with pytest.raises(TypeError, match=r"target must be a linen Module class"):
        batch_vmap(3)
    model = batch_vmap(MLP, **SHARED, in_axes=(0, 0), batch_size=2)()
    with pytest.raises(ValueError, match=r"in_axes=\(0, 0\) has 2 entries .* 1"):
        model.init(jax.random.key(0), X)
    ens = batch_vmap(
        MLP, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None
    )
    with pytest.raises(ValueError, match=r"no mapped argument and axis_size=None"):
        ens(2).init(jax.random.key(0), X[0])
    params = ensemble_reference()[0]
    wrong = batch_vmap(nn.Dense, variable_axes={"params": 0}, batch_size=2)
    with pytest.raises(ValueError, match=r"(?s)inconsistent sizes.*size 7.*size 10"):
        wrong(2).apply(params, X)
