"""chunkvmap.nnx.batch_vmap against nnx.vmap with the same arguments.

Each case runs under one `nnx.jit` (compiling is what costs time on CPU).
"""

import functools as ft

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from chunkvmap.nnx import batch_vmap

from .flax_cases import SUM, T, X, chunked_by, classic_threefry  # noqa: F401
from .helpers import jaxpr_eqns, tree_allclose


chunked = chunked_by(batch_vmap)


def state_of(*nodes):
    return [nnx.state(n) for n in nodes]


class MLP(nnx.Module):
    def __init__(self, rngs, din=3, dout=2):
        self.hidden = nnx.Linear(din, 6, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(6, dout, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1  # a Variable write, the same for every example
        return self.out(self.dropout(nnx.tanh(self.hidden(x))))


def apply(model, x):
    return model(x)


# --------------------------------------------------------------------------------------
# Ensembles: 7 members created with split RNGs, applied in chunks.


def create_ensemble(vmap):
    @nnx.jit
    def create(rngs):
        @nnx.split_rngs(splits=7)
        @vmap(in_axes=(0,))
        def members(rngs):
            return MLP(rngs)

        return members(rngs)

    return create(nnx.Rngs(params=0, dropout=1))


@ft.cache
def ensemble_reference():
    created = create_ensemble(nnx.vmap)
    ensemble = nnx.clone(created)
    outputs = apply_ensemble(nnx.vmap, ensemble)
    return created, outputs, state_of(ensemble)


def apply_ensemble(vmap, ensemble):
    """Evaluation and training mode outputs; updates `ensemble` in place."""

    @nnx.jit
    def run(ensemble, x):
        ensemble.eval()
        y_eval = vmap(apply, in_axes=(0, None))(ensemble, x)
        ensemble.train()  # dropout draws from the members' own (mapped) streams
        return y_eval, vmap(apply, in_axes=(0, None))(ensemble, x)

    return run(ensemble, X[0])


@pytest.mark.parametrize("b", [1, 3, 20, None])
def test_ensemble_created_with_nnx_vmap_applied_in_chunks(b):
    created, (y_eval_ref, y_train_ref), state_ref = ensemble_reference()
    ensemble = nnx.clone(created)
    y_eval, y_train = apply_ensemble(chunked(b), ensemble)
    assert ensemble.hidden.kernel.shape == (7, 3, 6)
    tree_allclose(y_eval, y_eval_ref)
    tree_allclose(y_train, y_train_ref)
    # RNG counters and the Variable writes came back into the members, as with
    # nnx.vmap: the state after both calls is the reference's.
    tree_allclose(state_of(ensemble), state_ref)
    assert (ensemble.calls[...] == 2).all()


def test_ensemble_created_in_chunks():
    created = ensemble_reference()[0]
    tree_allclose(state_of(create_ensemble(chunked(3))), state_of(created))


# --------------------------------------------------------------------------------------
# One model shared over batched data, under nnx.jit and nnx.grad.


def shared_run(vmap, total):
    model = MLP(nnx.Rngs(0))
    model.eval()

    @nnx.jit
    def run(model, x, t):
        def loss_fn(model):
            losses = vmap(lambda m, x, t: (m(x)[0] - t) ** 2, in_axes=(None, 0, 0))(
                model, x, t
            )
            return total(losses)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        return loss, grads

    loss, grads = run(model, X, T)
    return loss, grads, model


@ft.cache
def shared_reference():
    return shared_run(nnx.vmap, jnp.sum)


@pytest.mark.parametrize("reduce", [False, True], ids=["stacked", "summed"])
@pytest.mark.parametrize("b", [3, 5, 20, None])
def test_shared_model_under_jit_and_grad(b, reduce):
    loss_ref, grads_ref, model_ref = shared_reference()
    if reduce:
        loss, grads, model = shared_run(chunked(b, **SUM), lambda total: total)
    else:
        loss, grads, model = shared_run(chunked(b), jnp.sum)
    assert loss.shape == ()
    tree_allclose(loss, loss_ref, rtol=1e-5)
    tree_allclose(grads, grads_ref, rtol=1e-4)
    tree_allclose(state_of(model), state_of(model_ref))  # calls == 1, like nnx.vmap


# --------------------------------------------------------------------------------------
# Dropout per example, in an optimizer's training step.


def train_run(vmap):
    model = MLP(nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.02, momentum=0.9), wrt=nnx.Param)
    # The model's parameters are shared, its RNG streams split per example.
    axes = nnx.StateAxes({nnx.RngState: 0, ...: None})

    @nnx.jit
    def step(model, optimizer, x, t):
        @nnx.split_rngs(splits=x.shape[0], only="dropout")
        @vmap(in_axes=(axes, 0, 0))
        def losses(model, x, t):
            return (model(x)[0] - t) ** 2

        def loss_fn(model):
            value = losses(model, x, t)
            return value if value.ndim == 0 else value.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    values = jnp.stack([step(model, optimizer, X, T) for _ in range(3)])
    return values, model, optimizer


@ft.cache
def train_reference():
    return train_run(nnx.vmap)


@pytest.mark.parametrize(
    "options", [dict(batch_size=4), dict(batch_size=3, **SUM)], ids=["stacked", "sum"]
)
def test_optimizer_step_with_dropout_per_example(options):
    losses_ref, model_ref, optimizer_ref = train_reference()
    losses, model, optimizer = train_run(chunked(**options))
    tree_allclose(losses, losses_ref, rtol=1e-5)
    assert losses[-1] < losses[0]
    tree_allclose(
        state_of(model, optimizer),
        state_of(model_ref, optimizer_ref),
        rtol=1e-4,
        atol=1e-5,
    )


def test_a_reduction_and_state_make_one_loop_over_the_chunks():
    """The losses folded and the RNG state (split per example) stacked, the
    parameters (unmapped) kept: one chunked evaluation, one loop."""
    graphdef, state = nnx.split(MLP(nnx.Rngs(params=0, dropout=1)))
    axes = nnx.StateAxes({nnx.RngState: 0, ...: None})

    def total(state, x, t):
        model = nnx.merge(graphdef, state)

        @nnx.split_rngs(splits=x.shape[0], only="dropout")
        @chunked(3, **SUM)(in_axes=(axes, 0, 0))
        def losses(model, x, t):
            return (model(x)[0] - t) ** 2

        return losses(model, x, t)

    jaxpr = jax.make_jaxpr(total)(state, X, T)
    scans = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1, len(scans)


# --------------------------------------------------------------------------------------
# State updates: BatchNorm statistics per member, Variable writes, graph outputs.


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.seen = nnx.Variable(jnp.zeros((3,), jnp.float32))

    def __call__(self, xs):
        self.seen[...] = xs.mean(0)  # a write that differs per member
        return self.norm(self.linear(xs))


@ft.cache
def normed_members():
    @nnx.jit
    def create(rngs):
        @nnx.split_rngs(splits=5)
        @nnx.vmap(in_axes=(0,))
        def members(rngs):
            return Normed(rngs)

        return members(rngs)

    return create(nnx.Rngs(0))


def normed_run(vmap):
    members = nnx.clone(normed_members())

    @nnx.jit
    def run(members, xs, scales):
        @vmap(in_axes=(0, None, 0))
        def forward(member, xs, scale):
            return member(xs * scale)

        return forward(members, xs, scales)

    return members, run(members, X, jnp.arange(1.0, 6.0, dtype=jnp.float32))


def test_batch_stats_and_variable_writes_propagate():
    members, out = normed_run(chunked(2))
    members_ref, out_ref = normed_run(nnx.vmap)
    tree_allclose(out, out_ref, rtol=1e-4, atol=1e-5)
    tree_allclose(state_of(members), state_of(members_ref))
    assert members.norm.mean.shape == (5, 4)
    assert not (members.norm.mean[...] == normed_members().norm.mean[...]).any()


def test_out_axes_state_axes_and_decorator_forms():
    # Graph nodes returned with StateAxes: parameters per member, the rest shared.
    out_axes = nnx.StateAxes({nnx.Param: 0, ...: None})

    def run(vmap):
        @nnx.jit
        def go(keys):
            @vmap(in_axes=0, out_axes=out_axes)
            def create(key):
                return nnx.Linear(3, 2, rngs=nnx.Rngs(key))

            return create(keys)

        return go(jax.random.split(jax.random.key(0), 5))

    layers, layers_ref = run(chunked(2)), run(nnx.vmap)
    tree_allclose(state_of(layers), state_of(layers_ref))

    # Bare decorator (defaults of nnx.vmap), and keyword arguments bound to positions.
    @batch_vmap
    def double(x):
        return 2.0 * x

    tree_allclose(double(X), 2.0 * X)

    def scaled(x, scale, shift=0.0):
        return x * scale + shift

    f = batch_vmap(scaled, in_axes=(0, None, None), batch_size=4)
    g = nnx.vmap(scaled, in_axes=(0, None, None))
    tree_allclose(f(X, scale=2.0, shift=1.0), g(X, scale=2.0, shift=1.0))
    assert f.__name__ == "scaled"


def test_nested_in_itself():
    members = ensemble_reference()[0]
    xs = X[:7]

    def run(vmap, **options):
        per_example = vmap(apply, in_axes=(None, 0), **options)
        per_member = vmap(per_example, in_axes=(0, None), **options)
        return nnx.jit(per_member)(nnx.clone(members), xs)

    tree_allclose(run(batch_vmap, batch_size=3), run(nnx.vmap))


def test_batch_size_auto():
    loss_ref, grads_ref, _ = shared_reference()
    loss, grads, _ = shared_run(
        chunked("auto", memory_limit="64KiB", **SUM), lambda total: total
    )
    tree_allclose(loss, loss_ref, rtol=1e-5)
    tree_allclose(grads, grads_ref, rtol=1e-4)


def test_shard_over_devices():
    # tests/conftest.py asks for 8 CPU devices; 13 examples leave a global remainder.
    x = jnp.linspace(-1.0, 1.0, 39, dtype=jnp.float32).reshape(13, 3)
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    out = batch_vmap(apply, in_axes=(None, 0), batch_size=1, shard=True)(layer, x)
    tree_allclose(out, nnx.vmap(apply, in_axes=(None, 0))(layer, x))


# --------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments():
    model = MLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"in_axes must be an int, None, nnx.StateAxes"):
        batch_vmap(apply, in_axes={"m": 0})
    with pytest.raises(TypeError, match=r"in_axes\[0\] is StateAxes.*contains .*Carry"):
        batch_vmap(apply, in_axes=(nnx.StateAxes({...: nnx.Carry}), 0))
    with pytest.raises(TypeError, match=r"out_axes .* is '0' of type str"):
        batch_vmap(apply, out_axes={"a": "0"})
    with pytest.raises(ValueError, match=r"batch_size must be a positive int"):
        batch_vmap(apply, batch_size=-1)
    with pytest.raises(TypeError, match=r"f must be a callable"):
        batch_vmap(3)
    with pytest.raises(TypeError, match=r"bound methods .* MLP"):
        batch_vmap(model.__call__)

    def keyword_only(x, *, scale):
        return x * scale

    with pytest.raises(TypeError, match=r"\['scale'\] are keyword-only"):
        batch_vmap(keyword_only, batch_size=2)(X, scale=2.0)
    with pytest.raises(ValueError, match=r"(?s)inconsistent sizes.*size 10.*size 9"):
        batch_vmap(lambda a, b: a + b, batch_size=2)(T, T[:9])
    with pytest.raises(ValueError, match=r"returned a graph node .* at out"):
        batch_vmap(lambda k: nnx.Linear(2, 2, rngs=nnx.Rngs(k)), batch_size=2, **SUM)(
            jax.random.split(jax.random.key(0), 3)
        )
