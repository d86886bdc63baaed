"""The eager cache: compiled once per program, never stale (a changed closure is
seen, as by jax.vmap), bounded, never keeping user functions alive."""

import functools as ft
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_map, batch_vmap
from chunkvmap._core import _equivalence

from .helpers import CompileCounter, tree_allclose


def test_batch_map_compiles_once_and_converts_numpy_inputs():
    def fun(c):
        return jnp.sin(c) * 2

    x = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    first = batch_map(fun, x, batch_size=4)
    with CompileCounter() as compiles:
        second = batch_map(fun, x + 1, batch_size=4)  # NumPy again: same program
    assert compiles.count == 0
    np.testing.assert_allclose(first, np.sin(x) * 2, rtol=1e-6)
    np.testing.assert_allclose(second, np.sin(x + 1) * 2, rtol=1e-6)
    with CompileCounter() as compiles:
        batch_map(fun, x[:5], batch_size=4)  # a new shape is a new program
    assert compiles.count > 0


def test_batch_map_cache_does_not_keep_fun_alive():
    def fun(c):
        return c + 1

    ref = weakref.ref(fun)
    batch_map(fun, jnp.ones((5, 2)), batch_size=2)
    del fun
    gc.collect()
    assert ref() is None


def test_filter_batch_vmap_cache_does_not_keep_its_options_alive():
    eqx_adapter = pytest.importorskip("chunkvmap.eqx")

    def reduction(a, b):
        return a + b

    ref = weakref.ref(reduction)
    f = eqx_adapter.filter_batch_vmap(
        jnp.sin, batch_size=2, reduction=reduction, chunk_reduction=lambda y: y.sum(0)
    )
    np.testing.assert_allclose(f(jnp.ones(5)), 5 * np.sin(1.0), rtol=1e-6)
    del f, reduction
    gc.collect()
    assert ref() is None


def _adapter_call(adapter):
    """One call of a Flax adapter's transform with a reduction; weak references to
    the reduction and the per-example function (nothing else keeps them)."""

    def reduction(a, b):
        return a + b

    def per_example(v):
        return jnp.sin(v)

    options = dict(batch_size=2, reduction=reduction, chunk_reduction=jnp.sum)
    if adapter == "nnx":
        from chunkvmap import nnx as cn

        f = cn.batch_vmap(per_example, **options)
    else:
        import flax.linen as nn

        from chunkvmap import linen as cl

        class Apply(nn.Module):
            def __call__(self, v):
                return per_example(v)

        lifted = cl.batch_vmap(
            Apply, variable_axes={}, split_rngs={}, in_axes=0, **options
        )()
        f = lambda v: lifted.apply({}, v)  # noqa: E731
    np.testing.assert_allclose(f(jnp.ones(5)), 5 * np.sin(1.0), rtol=1e-6)
    return [weakref.ref(reduction), weakref.ref(per_example)]


@pytest.mark.parametrize("adapter", ["nnx", "linen"])
def test_flax_adapter_caches_keep_neither_options_nor_functions_alive(adapter):
    """The eager caches die with their transform, and a cache key does not
    keep the call's function (for linen, made anew by Flax at every call, its closure
    reaches the module's variables)."""
    refs = _adapter_call(adapter)
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_the_cache_is_bounded_and_forgets_the_least_recently_used(monkeypatch):
    """The eager programs, shared by every transform, are kept in a bounded
    cache (here bounded at 8 entries)."""
    from chunkvmap._core import _memory

    limit = 8
    monkeypatch.setattr(_memory.PROGRAMS, "limit", limit)
    _memory.PROGRAMS.clear()
    f = batch_vmap(lambda x, k: x * k, in_axes=(0, None), batch_size=2)
    x = jnp.ones(3)
    for k in range(limit + 1):  # a static Python int: one entry each
        f(x, k)
    assert len(_memory.PROGRAMS) == limit
    with CompileCounter() as compiles:
        f(x, limit)  # the most recent: still cached
        f(x, 1)  # used least recently but one: still cached
    assert compiles.count == 0
    with CompileCounter() as compiles:
        f(x, 0)  # the least recently used was evicted: compiled again
    assert compiles.count > 0


# The closure of the user's function changes between calls: a closed-over array
# (replaced, or a global dict's entry), a Python constant, a Python branch.
STATE = {"t": jnp.zeros(3), "scale": 1.0, "relu": False}


def _closure_cases():
    def reference(v):
        y = jnp.sum(v * STATE["t"]) * STATE["scale"]
        return jax.nn.relu(y) if STATE["relu"] else y

    return reference


@pytest.mark.parametrize(
    "entry",
    [
        "batch_vmap", "per_example_grads", "clipped_sum", "ghost",
        "per_example_grad_stats", "per_example_grad_gram", "eqx.filter_batch_vmap",
        "nnx.batch_vmap", "linen.batch_vmap",
    ],
)  # fmt: skip
def test_eager_calls_see_the_current_closure(entry):
    """A transform built once and called again returns what jax.vmap returns for
    the function as it is now (arrays and Python constants in its closure),
    compiling again only when the program changed, not when an array did (the
    adapters too: a linen call's function is made anew by Flax at every call; the
    statistics map their gradients to the last axis, a chunk of its own; the Gram's
    chunks dot their gradients with the batch's in a loop of their own)."""
    from chunkvmap import (
        clipped_grad_sum,
        per_example_grad_gram,
        per_example_grad_stats,
        per_example_grads,
    )

    f = _closure_cases()
    x = jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(4, 3) - 5)
    if entry == "batch_vmap":
        chunked, oracle = batch_vmap(f, batch_size=3), jax.vmap(f)
    elif entry == "eqx.filter_batch_vmap":
        from chunkvmap.eqx import filter_batch_vmap

        chunked, oracle = filter_batch_vmap(f, batch_size=3), jax.vmap(f)
    elif entry == "nnx.batch_vmap":
        from chunkvmap import nnx as cn

        chunked, oracle = cn.batch_vmap(f, batch_size=3), jax.vmap(f)
    elif entry == "linen.batch_vmap":
        import flax.linen as nn

        from chunkvmap import linen as cl

        class Apply(nn.Module):
            def __call__(self, v):
                return f(v)

        lifted = cl.batch_vmap(
            Apply, variable_axes={}, split_rngs={}, in_axes=0, batch_size=3
        )()
        chunked, oracle = (lambda v: lifted.apply({}, v)), jax.vmap(f)
    else:
        loss = lambda w, v: f(v @ w)  # noqa: E731
        eye = jnp.eye(3)
        grads = jax.vmap(jax.grad(loss), (None, 0))
        if entry == "per_example_grads":
            made = per_example_grads(loss, batch_size=3)
            chunked = lambda v: made(eye, v)  # noqa: E731
            oracle = lambda v: grads(eye, v)  # noqa: E731
        elif entry == "per_example_grad_stats":
            made = per_example_grad_stats(loss, batch_size=3)
            chunked = lambda v: made(eye, v).mean  # noqa: E731
            oracle = lambda v: grads(eye, v).mean(0)  # noqa: E731
        elif entry == "per_example_grad_gram":
            made = per_example_grad_gram(loss, batch_size=3)
            chunked = lambda v: made(eye, v)  # noqa: E731

            def oracle(v):
                g = grads(eye, v).reshape(len(v), -1)
                return g @ g.T
        else:
            method = "ghost" if entry == "ghost" else "vmap"
            made = clipped_grad_sum(loss, 1e6, batch_size=3, method=method)
            chunked = lambda v: made(eye, v)[0]  # noqa: E731
            oracle = lambda v: grads(eye, v).sum(0)  # noqa: E731
    STATE.update(t=jnp.zeros(3), scale=1.0, relu=False)
    try:
        np.testing.assert_allclose(chunked(x), oracle(x), rtol=1e-6)
        STATE["t"] = jnp.array([1.0, -2.0, 3.0])  # a new array: no new program
        with CompileCounter() as compiles:
            got = chunked(x)
        assert compiles.count == 0
        np.testing.assert_allclose(got, oracle(x), rtol=1e-6)
        for change in ({"scale": 2.5}, {"relu": True}):
            STATE.update(change)
            np.testing.assert_allclose(chunked(x), oracle(x), rtol=1e-6)
    finally:
        STATE.update(t=jnp.zeros(3), scale=1.0, relu=False)


SINK = {}


def test_a_changed_host_callback_is_called():
    """Programs that differ only in the Python function a callback calls are two
    programs (the jaxpr's text shows the callback without its identity)."""
    seen, other = [], []
    f = batch_vmap(lambda v: _with_callback(v, SINK["record"]), batch_size=2)
    SINK["record"] = seen.append
    f(jnp.ones(4))
    SINK["record"] = other.append
    f(jnp.ones(4))
    jax.effects_barrier()
    assert seen and other


def _with_callback(v, record):
    jax.debug.callback(record, v)
    return v * 2


def test_progress_calls_reuse_the_compiled_program():
    """A progress callback is a new Python closure at every trace; equal closures
    (same code, same contents) are the same program."""
    calls = []
    f = batch_vmap(jnp.sin, batch_size=2, progress=lambda i, n: calls.append(i))
    x = jnp.ones(6)
    f(x)
    with CompileCounter() as compiles:
        f(x)
        jax.effects_barrier()
    assert compiles.count == 0
    assert calls == [1, 2, 3] * 2  # chunks done, once per chunk and call


def test_a_recursive_closure_is_a_key():
    """A function in its own closure is compared to a bounded depth (then by
    identity): itself, never another."""

    def make():
        def countdown(n):
            return 0 if n == 0 else countdown(n - 1)

        return countdown

    first, second = make(), make()
    assert _equivalence.interchangeable(first, first)
    assert not _equivalence.interchangeable(first, second)


def test_a_linen_call_leaves_nothing_of_itself_in_the_live_transform():
    """While the transform lives (its eager caches with it), a call's per-example
    function, which Flax makes anew at every call and whose closure reaches the
    call's variables, is not kept: the variables of a finished call can be freed."""
    import flax.linen as nn

    from chunkvmap import linen as cl

    class Scale(nn.Module):
        @nn.compact
        def __call__(self, v):
            return v * self.param("w", nn.initializers.ones, (3,))

    lifted = cl.batch_vmap(
        Scale, variable_axes={"params": None}, split_rngs={"params": False},
        in_axes=0, batch_size=2,
    )()  # fmt: skip
    w = jnp.full((3,), 2.0)
    out = lifted.apply({"params": {"w": w}}, jnp.ones((5, 3)))
    np.testing.assert_allclose(out, 2.0 * np.ones((5, 3)))
    ref = weakref.ref(w)
    del w, out
    gc.collect()
    assert ref() is None
    assert lifted is not None  # alive to the end, and its transform with it


def test_held_callables_are_interchangeable_only_when_they_would_do_the_same():
    """What a program holds (a host callback, say) stands for another only when
    calling either does the same thing: floats by their bits, defaults and
    closures compared, a mutable value or an object only by identity, a function
    that rebinds its closure only by identity."""
    same = _equivalence.interchangeable

    def scaled(s):
        return lambda x, s=s: x * s

    def closing(s):
        return lambda x: x * s

    def counter():
        n = 0

        def count(x):
            nonlocal n
            n += 1
            return x

        return count

    assert same(scaled(2.0), scaled(2.0)) and same(closing(2.0), closing(2.0))
    assert not same(scaled(0.0), scaled(-0.0))
    assert not same(closing(0.0), closing(-0.0))
    assert not same(scaled(1), scaled(1.0)) and not same(scaled(1), scaled(True))
    assert not same(closing([]), closing([]))  # two lists: two states
    assert not same(counter(), counter())  # each counts its own calls

    def keyword(s):
        return lambda x, *, t=s: x * t

    assert same(keyword(1.0), keyword(1.0)) and not same(keyword(1.0), keyword(2.0))
    assert same(ft.partial(max, 1.0), ft.partial(max, 1.0))
    assert not same(ft.partial(max, 0.0), ft.partial(max, -0.0))
    first, second = [], []
    assert same(first.append, first.append) and not same(first.append, second.append)
    assert not same(np.zeros(1), np.zeros(1))  # mutable: only itself


def test_a_callback_default_of_minus_zero_is_a_new_program():
    def sign(v):
        return jax.pure_callback(
            SINK["cb"], jax.ShapeDtypeStruct(v.shape, v.dtype), v,
            vmap_method="sequential",
        )  # fmt: skip

    f, x = batch_vmap(sign, batch_size=2), jnp.ones((5, 3))
    for s in (0.0, -0.0):
        SINK["cb"] = lambda v, s=s: np.copysign(np.asarray(v), s)
        np.testing.assert_array_equal(np.signbit(f(x)), np.signbit(jax.vmap(sign)(x)))


def test_a_python_int_held_as_a_parameter_is_a_new_program():
    """A closed-over Python int that only an equation's parameters show (a flip's
    and a cumulative sum's axis, the shapes unchanged) tells programs apart."""
    axis = {"k": 0}

    def f(v):
        return jnp.flip(v, axis=axis["k"]) * jnp.cumsum(v, axis=axis["k"])

    x = jnp.arange(5 * 3 * 3.0).reshape(5, 3, 3)
    g = batch_vmap(f, batch_size=2)
    for k in (0, 1, 0):
        axis["k"] = k
        np.testing.assert_allclose(g(x), jax.vmap(f)(x))


def test_a_custom_vjp_compiles_once():
    """The derivative rules an eagerly evaluated program holds (a custom_vjp's
    output trees, made anew at every trace) do not tell programs apart."""

    @jax.custom_vjp
    def double(z):
        return z * 2

    double.defvjp(lambda z: (z * 2, None), lambda _, g: (g * 2,))
    f, x = batch_vmap(double, batch_size=2), jnp.ones((5, 3))
    f(x)
    with CompileCounter() as compiles:
        np.testing.assert_allclose(f(x), 2 * np.ones((5, 3)))
    assert compiles.count == 0


@pytest.mark.parametrize("where", ["closure", "nested jit"])
def test_a_dropped_transform_leaves_no_array_alive(where):
    """Once the transform and what its function closed over are dropped, none of
    the closure's arrays is among `jax.live_arrays()` (a distinctive shape)."""
    held = {"a": jnp.ones((7, 11))}

    def f(v):
        a = held["a"]
        if where == "nested jit":
            return jax.jit(lambda y: y @ a)(v)
        return v @ a

    g = batch_vmap(f, batch_size=2)
    for value in (1.0, 2.0):
        held["a"] = jnp.full((7, 11), value)
        np.testing.assert_allclose(g(jnp.ones((5, 7))), 7 * value * np.ones((5, 11)))
    del g, held["a"]
    gc.collect()
    assert not [a for a in jax.live_arrays() if a.shape == (7, 11)]


def test_a_nested_numpy_constant_compiled_in_is_read_by_value():
    """A nested jit with shardings of its own is left as it is, its constants
    compiled into the program: a NumPy one changed in place is a new program."""
    a = np.ones(3, np.float32)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def f(v):
        return jax.jit(lambda y: y * a, out_shardings=device)(v)

    g, x = batch_vmap(f, batch_size=2), jnp.ones((5, 3))
    for value in (1.0, 4.0):
        a[:] = value
        np.testing.assert_allclose(g(x), jax.vmap(f)(x))


def test_a_chunk_that_reads_other_arrays_at_another_length_is_not_kept():
    """`batch_size="auto"` traces the chunk at one example, then at the size it
    chose: a function that reads another array at that length (chosen by its
    chunk's length) is evaluated with it, every call, as it is now."""
    held = {"one": jnp.full((1, 3), 100.0), "many": jnp.ones((1, 3))}

    def fun(chunk):
        return chunk * (held["one"] if chunk.shape[0] == 1 else held["many"])

    x = jnp.ones((8, 3))
    for value in (2.0, 3.0):
        held["many"] = jnp.full((1, 3), value)
        out = batch_map(fun, x, "auto", memory_limit="1MiB")
        np.testing.assert_allclose(out, value * np.ones((8, 3)))


@pytest.mark.parametrize(
    "quantity", ["clipped_grad_sum", "per_example_grad_stats", "per_example_grad_gram"]
)
def test_an_eager_ghost_quantity_plans_its_loss_once(quantity, monkeypatch):
    """Every quantity made from ghost clipping's evaluation keeps the plan of its
    loss (`ghost.traced_loss`): repeated eager calls, the closure changed between
    them, analyse the loss once, compile nothing after the first call, and give
    what a new transform gives."""
    import chunkvmap
    from chunkvmap._quantities.ghost import _traced

    made = []

    class Counted(_traced.Plan):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    scale = {"s": jnp.ones(2)}  # (a scalar's value is part of the plan's key)

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) * scale["s"])

    def build():
        transform = getattr(chunkvmap, quantity)
        args = (loss, 1.0) if quantity == "clipped_grad_sum" else (loss,)
        return transform(*args, batch_size=3, method="ghost")

    w = jnp.ones((4, 2)) / 4
    x = jnp.arange(32.0).reshape(8, 4) / 32
    fn = build()
    jax.block_until_ready(fn(w, x))
    monkeypatch.setattr(_traced, "Plan", Counted)
    for s in (2.0, 3.0):
        scale["s"] = jnp.full(2, s, jnp.float32)
        with CompileCounter() as compiles:
            got = fn(w, x)
        assert compiles.count == 0, s
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(build()(w, x))):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert len(made) == 2  # the two new transforms', none of the kept one's


def _ghost_entries():
    import chunkvmap as cv

    ghost = {"method": "ghost", "batch_size": 4}
    loss_entries = {
        "clipped_grad_sum": lambda f: cv.clipped_grad_sum(f, 1.0, **ghost),
        **{
            name: ft.partial(lambda name, f: getattr(cv, name)(f, **ghost), name)
            for name in (
                "per_example_grad_norms",
                "per_example_grad_stats",
                "per_example_grad_gram",
                "per_example_grad_projections",
            )
        },
    }
    model_entries = {
        "ggn_diagonal": lambda f: cv.ggn_diagonal(
            f, likelihood="gaussian", method="ghost", batch_size=4
        ),
        "kfac_factors": lambda f: cv.kfac_factors(
            f, likelihood="gaussian", batch_size=4
        ),
    }
    return loss_entries, model_entries


_LOSS_ENTRIES, _MODEL_ENTRIES = _ghost_entries()


@pytest.mark.parametrize("entry", [*_LOSS_ENTRIES, *_MODEL_ENTRIES])
def test_an_eager_ghost_call_keeps_none_of_its_arrays(entry, always_ghost):
    """After an eager ghost call, neither the arrays its function closed over nor
    its inputs stay alive once the user lets go of them (the plan kept for the
    next call held both, as `method="vmap"` never did); the next call, with new
    arrays, gives the new values."""
    d = 32
    rng = np.random.default_rng(4)
    p = {"w": jnp.asarray(rng.normal(size=(d, d)) * 0.2, jnp.float32)}
    state = {"c": jnp.full((d,), 2.0, jnp.float32)}

    def model(p, x):
        return jnp.tanh(x @ p["w"]) * state["c"]

    def loss(p, x, y):
        return jnp.sum((model(p, x) - y) ** 2)

    is_model = entry in _MODEL_ENTRIES
    fn = _MODEL_ENTRIES[entry](model) if is_model else _LOSS_ENTRIES[entry](loss)
    x = jnp.asarray(rng.normal(size=(9, d)), jnp.float32) + 1.0
    y = jnp.zeros((9, d), jnp.float32)
    call = (lambda x: fn(p, x)) if is_model else (lambda x: fn(p, x, y))
    first = call(x)
    refs = [weakref.ref(state["c"]), weakref.ref(x)]
    state["c"] = jnp.ones((d,), jnp.float32)
    del x
    gc.collect()
    assert all(r() is None for r in refs), "an eager ghost call kept its arrays"
    x2 = jnp.asarray(rng.normal(size=(9, d)), jnp.float32)
    again = call(x2)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), first, again)
    assert any(jax.tree.leaves(changed))  # the new closure and inputs were read


def _inline_entries():
    import chunkvmap as cv

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"]) - y) ** 2)

    def oracle_grads(p, x, y):
        return jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y)

    return {
        "batch_vmap": (
            lambda p: cv.batch_vmap(lambda x: jnp.tanh(x @ p["w"]), batch_size=4),
            lambda p: jax.vmap(lambda x: jnp.tanh(x @ p["w"])),
            False,
        ),
        "per_example_grads": (
            lambda p: ft.partial(cv.per_example_grads(loss, batch_size=4), p),
            lambda p: ft.partial(oracle_grads, p),
            True,
        ),
        "per_example_grad_norms": (
            lambda p: ft.partial(cv.per_example_grad_norms(loss, batch_size=4), p),
            lambda p: (
                lambda x, y: jnp.sqrt(
                    jnp.sum(oracle_grads(p, x, y)["w"].reshape(len(x), -1) ** 2, 1)
                )
            ),
            True,
        ),
    }


@pytest.mark.parametrize("entry", list(_inline_entries()))
def test_a_transform_built_inline_compiles_once(entry):
    """`per_example_grads(loss, batch_size=4)(p, x, y)` written inside a loop (a
    new transform at every call) compiles its program once, as a held transform
    does (it compiled at every call: 461 ms a call against 8.7 ms held), and each
    call computes with its own closure and arguments."""
    make, oracle, takes_y = _inline_entries()[entry]
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(10, 6)), jnp.float32)
    y = jnp.zeros((10, 6), jnp.float32)
    args = (x, y) if takes_y else (x,)
    counts = []
    for step in range(4):
        p = {"w": jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)}
        with CompileCounter() as compiles:
            got = make(p)(*args)
        counts.append(compiles.count)
        tree_allclose(got, oracle(p)(*args), rtol=2e-5, atol=2e-5)
    assert counts[1:] == [0, 0, 0], counts


def _ghost_entries():
    """Ghost entry points built with one of two settings each: `make(s)` builds the
    transform, called with `(p, x, y)` (the models' with `(p, x)` and labels
    where `fisher="empirical"` takes them)."""
    import chunkvmap as cv

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"]) - y) ** 2)

    def model(p, x):  # x: (positions, features)
        return jnp.tanh(x @ p["w"])

    def with_labels(f):  # the empirical Fisher reads the labels
        return lambda s: lambda p, x, y: f(s)(p, x, **({"labels": y} if s else {}))

    return {
        "clipped_grad_sum": (
            lambda s: cv.clipped_grad_sum(loss, s, batch_size=4, method="ghost"),
            (1.0, 0.05),
        ),
        "per_example_grad_norms": (
            lambda s: cv.per_example_grad_norms(loss, batch_size=s, method="ghost"),
            (4, 4),
        ),
        "per_example_grad_stats": (
            lambda s: cv.per_example_grad_stats(
                loss, batch_size=4, method="ghost", argnums=s
            ),
            (0, 0),
        ),
        "ggn_diagonal": (
            with_labels(
                lambda s: cv.ggn_diagonal(
                    model,
                    likelihood="gaussian",
                    batch_size=4,
                    method="ghost",
                    fisher="empirical" if s else "exact",
                )  # fmt: skip
            ),
            (False, True),
        ),
        "kfac_factors": (
            lambda s: (
                lambda p, x, y: cv.kfac_factors(
                    model, likelihood="gaussian", batch_size=4, variant=s
                )(p, x)
            ),
            ("expand", "reduce"),
        ),
        "per_example_grad_projections": (
            lambda s: cv.per_example_grad_projections(
                loss, batch_size=4, method="ghost", dim=4, seed=s
            ),
            (0, 1),
        ),
    }


@pytest.mark.parametrize("entry", list(_ghost_entries()))
def test_a_ghost_transform_built_inline_compiles_once(entry, always_ghost):
    """The ghost quantities too: a transform built anew at every call, alternating
    between two settings (a clipping norm, a Fisher, a KFAC variant, a projection's
    seed), compiles once per setting, and each call computes what a transform held
    for its setting computes (a program of one setting never serves the other)."""
    make, settings = _ghost_entries()[entry]
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(10, 3, 6)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(10, 3, 6)), jnp.float32)
    held = {s: make(s) for s in settings}
    counts = []
    for step in range(6):
        s = settings[step % 2]
        p = {"w": jnp.asarray(rng.normal(size=(6, 6)) / 3, jnp.float32)}
        with CompileCounter() as compiles:
            got = make(s)(p, x, y)
        counts.append(compiles.count)
        tree_allclose(got, held[s](p, x, y), rtol=1e-6, atol=1e-7)
    assert counts[2:] == [0, 0, 0, 0], counts
    if settings[0] != settings[1]:  # the two settings compute differently
        p = {"w": jnp.asarray(rng.normal(size=(6, 6)) / 3, jnp.float32)}
        a, b = (jax.tree.leaves(held[s](p, x, y)) for s in settings)
        assert any(bool(jnp.any(u != v)) for u, v in zip(a, b) if u.shape == v.shape)


def _scaled_on_host(x, *, scale):
    return np.asarray(x) * np.float32(scale)


@pytest.mark.parametrize("held", ["keyword", "bound method"])
def test_a_held_callbacks_state_is_read_at_every_call(held):
    """A host callback the traced program holds (its text shows nothing of it): a
    partial whose keyword changed, or a bound method of another instance, between
    two calls of one held transform is a new program, never the first call's."""

    class Host:
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, x):
            return np.asarray(x) * np.float32(self.scale)

        def run(self, x):
            return self(x)

    state = {}

    def f(v):
        shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return jax.pure_callback(state["cb"], shape, v, vmap_method="sequential")

    fn = batch_vmap(f, batch_size=2)
    x = jnp.arange(6.0, dtype=jnp.float32)
    for scale in (2.0, 3.0, 2.0):
        if held == "keyword":
            state["cb"] = ft.partial(_scaled_on_host, scale=scale)
        else:
            state["cb"] = Host(scale).run
        np.testing.assert_array_equal(fn(x), np.asarray(x) * scale)


def _scaled(scale: float):
    """A rule of the loss's own: the identity with its derivative scaled."""

    @jax.custom_jvp
    def rule(v):
        return v

    rule.defjvp(lambda p, t: (p[0], scale * t[0]))
    return rule


# (the Gram's dot products pair two examples' records outside `over_chunks`: its
# example is traced at every call)
_REUSED = [e for e in [*_LOSS_ENTRIES, *_MODEL_ENTRIES] if e != "per_example_grad_gram"]


@pytest.mark.parametrize("entry", _REUSED)
def test_an_eager_ghost_call_traces_its_example_once(entry, always_ghost, monkeypatch):
    """An eager ghost call evaluates one example with its loss's plan (the
    instrumented example, `Plan.pullback`) at its first call: a later call of the
    same loss program reuses that trace with its own arrays (a closed-over array
    changed among them), a custom JVP rule known by what it computes (a float in
    its closure changed: traced again). A loss closing over an array inside a
    nested `jit` is traced at every call; a loss traced before is reused again,
    also by a new transform (as one built inline). Every call gives what a new
    transform gives."""
    from chunkvmap._quantities.ghost import _plan

    d, n = 6, 9
    rng = np.random.default_rng(5)
    p = {"w": jnp.asarray(rng.normal(size=(d, d)) * 0.3, jnp.float32)}
    state = {"c": jnp.full((d,), 2.0), "rule": None, "jit": False}

    def model(p, x):
        h = jnp.tanh(x @ p["w"]) * state["c"]
        h = h if state["rule"] is None else state["rule"](h)
        return jax.jit(lambda h: h * state["nested"])(h) if state["jit"] else h

    def loss(p, x, y):
        return jnp.sum((model(p, x) - y) ** 2)

    is_model = entry in _MODEL_ENTRIES
    make = _MODEL_ENTRIES[entry] if is_model else _LOSS_ENTRIES[entry]
    fn = make(model if is_model else loss)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    y = jnp.zeros((n, d), jnp.float32)

    def call(f):
        return f(p, x) if is_model else f(p, x, y)

    traces = []
    pullback = _plan.Plan.pullback
    monkeypatch.setattr(
        _plan.Plan, "pullback", lambda *a, **k: traces.append(1) or pullback(*a, **k)
    )
    # (what changes before the call, whether the held transform traces the
    # example, whether a new transform then does: only where nothing is kept)
    steps = [
        (lambda: None, True, False),
        (lambda: state.update(c=jnp.full((d,), 3.0)), False, False),
        (lambda: state.update(rule=_scaled(-2.0)), True, False),
        (lambda: state.update(c=jnp.full((d,), 0.5)), False, False),
        (lambda: state.update(rule=_scaled(3.0)), True, False),
        (lambda: state.update(rule=None, jit=True, nested=jnp.ones(d)), True, True),
        (lambda: state.update(nested=jnp.full((d,), 4.0)), True, True),
        (lambda: state.update(jit=False, c=jnp.full((d,), 5.0)), False, False),
    ]
    for i, (change, traced, again) in enumerate(steps):
        change()
        got = call(fn)
        count, traces[:] = len(traces), []
        want = call(make(model if is_model else loss))  # (a new transform)
        assert (count > 0) == traced, (i, count)
        assert bool(traces) == again, (i, len(traces))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)
        traces[:] = []


def test_reused_evaluations_are_told_apart_by_what_the_quantity_was_made_with(
    always_ghost,
):
    """Two ghost transforms of one loss that differ only in what their quantity
    reads besides the loss (the clip norm, the per-leaf norms) each give their own
    result: an instrumented example traced for one is not reused by the other."""
    import chunkvmap as cv

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"]) - y) ** 2)

    rng = np.random.default_rng(6)
    p = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(7, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    grads = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y)["w"]
    norms = jnp.sqrt(jnp.sum(grads**2, (1, 2)))
    for clip in (1.0, 0.25, 1.0):
        clipped = cv.clipped_grad_sum(loss, clip, batch_size=3, method="ghost")
        got, _ = clipped(p, x, y)
        scale = jnp.minimum(1.0, clip / norms)
        want = jnp.einsum("n,nij->ij", scale, grads)
        np.testing.assert_allclose(got["w"], want, rtol=2e-5, atol=1e-6)
    for per_leaf in (False, True):
        got = cv.per_example_grad_norms(
            loss, per_leaf=per_leaf, batch_size=3, method="ghost"
        )(p, x, y)
        got = got["w"] if per_leaf else got
        np.testing.assert_allclose(got, norms, rtol=2e-5)


def test_a_reused_evaluation_keeps_nothing_of_its_call(always_ghost):
    """The instrumented examples kept for reuse hold nothing of the call that
    traced them or used them: after eager ghost calls, neither the loss function
    nor the transform stays alive once the user lets go of them, and no kept
    evaluation holds a call's loss."""
    import chunkvmap as cv
    from chunkvmap._quantities.ghost import _traced

    def make():
        scale = jnp.full((3,), 2.0)

        def loss(p, x, y):
            return jnp.sum((jnp.tanh(x @ p["w"]) * scale - y) ** 2)

        return loss

    p = {"w": jnp.ones((5, 3)) / 5}
    x, y = jnp.ones((7, 5)), jnp.zeros((7, 3))
    loss = make()
    clipped = cv.clipped_grad_sum(loss, 1.0, batch_size=3, method="ghost")
    for _ in range(2):
        jax.block_until_ready(clipped(p, x, y))
    refs = [weakref.ref(loss), weakref.ref(clipped)]
    del loss, clipped
    gc.collect()
    assert [r() is None for r in refs] == [True, True], "kept its call alive"
    assert not any(calling for _, calling in _traced._EVALUATIONS.values())
