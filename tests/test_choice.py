"""Which program `method="ghost"` runs: on an accelerator both programs are measured
on one chunk of the call (`_choice`), on CPU the cost model decides and the memory
of a ghost program predicted slower is checked on the programs that run.

CI has no accelerator: the measured path is exercised on CPU by adding "cpu" to the
measured platforms, and the timings are replaced where a test needs one program to
be the faster."""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkvmap
from chunkvmap._quantities import _choice
from chunkvmap._quantities.ghost import GhostReport, Method

from .helpers import make_mesh, tree_allclose
from .test_ghost import _wide_over_positions


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.sum((h @ p["head"] - y) ** 2)


def _problem(n=13, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    p = {"w": arr(6, 32) / 3, "b": arr(32) / 10, "head": arr(32, 3) / 6}
    return p, arr(n, 6), arr(n, 3)


@pytest.fixture
def measured(monkeypatch):
    """The choice measured on CPU too; the list of timings taken, and a way to set
    the seconds each program takes (ghost first, then vmap, per measurement)."""
    monkeypatch.setattr(_choice, "MEASURED_PLATFORMS", frozenset({_choice.platform()}))
    timings = []
    real = _choice.time_programs

    def recording(*args):
        timings.append(real(*args))
        return timings[-1]

    monkeypatch.setattr(_choice, "time_programs", recording)

    def times(ghost, vmap):
        """Each program takes the given seconds (or raises); returns the shapes
        of the arrays each measured run was given."""
        seconds = itertools.cycle([ghost, vmap])
        shapes = []

        def fake(compiled, inputs):
            shapes.append([np.shape(a) for a in jax.tree.leaves(inputs)])
            jax.block_until_ready(compiled(*inputs))  # it runs
            value = next(seconds)
            if isinstance(value, BaseException):
                raise value
            return value

        monkeypatch.setattr(_choice, "_seconds", fake)
        return shapes

    return timings, times


def _device_kind():
    device = jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


def _report(runs="ghost"):
    return GhostReport([("args[0]['w']", (3, 2), "ghost", "dense")], runs=runs)


def _timing(ghost, vmap):
    failed = {m: "out of memory" for m, s in (("ghost", ghost), ("vmap", vmap)) if s}
    return _choice.Timing(
        64, "TPU v5 lite", {Method.GHOST: ghost, Method.VMAP: vmap}, failed
    )


@pytest.mark.parametrize(
    "ghost, vmap, runs",
    [
        (1.0, 4.0, "ghost"),  # faster
        (1.04, 1.0, "ghost"),  # within the tie: it keeps less memory
        (1.2, 1.0, "vmap"),
        (2e-3, None, "ghost"),  # the vmap program does not fit
        (None, 1e-3, "vmap"),  # the ghost program does not fit
    ],
)
@pytest.mark.parametrize("predicted", ["ghost", "vmap"])
def test_the_faster_measured_program_runs(ghost, vmap, runs, predicted):
    """Whatever the model predicted, the measured verdict runs the faster program
    (the ghost program where it takes at most 1.05x the vmap program's time), and
    never one that does not fit; the report says what was measured."""
    report = _choice.measured_report(_report(predicted), _timing(ghost, vmap))
    assert report.runs == runs and not report.slower
    assert report.why.startswith("measured on TPU v5 lite for a chunk of 64")
    assert ("does not fit" in report.why) == (ghost is None or vmap is None)
    assert report.timing.seconds[Method.GHOST] == ghost


def test_nothing_fitting_leaves_the_verdict_to_the_call():
    report = _report("ghost")
    assert _choice.measured_report(report, _timing(None, None)) is report


@pytest.mark.parametrize(
    "ghost, vmap, budget, runs",
    [
        (0, 0, None, "vmap"),  # nothing against nothing: nothing saved
        (0, 100, None, "ghost"),  # no budget known: the memory saved decides
        (75, 100, 99, "ghost"),
        (76, 100, 99, "vmap"),  # saves little
        (10, 100, 100, "vmap"),  # the vmap program's chunk fits: the faster runs
        (10, 100, 10**9, "vmap"),
    ],
)
def test_the_memory_verdict_runs_the_faster_program_that_fits(
    ghost, vmap, budget, runs
):
    """On CPU, a ghost program predicted slower runs for its memory only where the
    vmap program's chunk does not fit the budget and XLA's estimate shows the ghost
    program keeping at most three quarters of the vmap program's: an estimate of
    nothing against nothing shows nothing saved."""
    report = _report("ghost").replace(slower=True)
    figures = {Method.GHOST: ghost, Method.VMAP: vmap}
    checked = _choice.memory_checked(report, figures, 16, budget)
    assert checked.runs == runs
    assert checked.slower == (runs == "ghost")
    assert "XLA's estimate for chunks of 16 examples" in checked.why
    fits = budget is not None and vmap <= budget
    assert ("fits in memory" in checked.why) == fits, checked.why


def test_the_budget_is_the_calls_memory_limit_or_a_share_of_the_machine():
    """The CPU's budget for a chunk: a call's `memory_limit` where it has one
    (`batch_size="auto"`), else a quarter of the machine's physical memory."""
    import os

    from chunkvmap._core import _memory
    from chunkvmap._transforms._grads import grad_transform

    def loss(w, x):
        return jnp.sum(x @ w)

    def made(**options):
        return grad_transform("clipped_grad_sum", loss, 0, None, **options)

    limited = made(batch_size="auto", memory_limit="3MiB")
    assert _choice.budget(limited) == 3 * 2**20
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert _choice.budget(made(batch_size=4)) == physical // 4
    assert _memory.host_budget() == physical // 4


def _entries(p, x, y):
    """(name, function, reference) of each ghost entry point as users call them."""
    clip = dict(
        l2_clip_norm=1.0, batch_argnums=(1, 2), batch_size=5, keep_batch_dim=False
    )
    return [
        (
            "clipped_grad_sum",
            chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5, method="ghost"),
            chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5),
        ),
        (
            "clipped_grad",
            chunkvmap.clipped_grad(_loss, method="ghost", **clip),
            chunkvmap.clipped_grad(_loss, **clip),
        ),
        (
            "per_example_grad_stats",
            chunkvmap.per_example_grad_stats(_loss, batch_size=5, method="ghost"),
            chunkvmap.per_example_grad_stats(_loss, batch_size=5),
        ),
        *_quantities(),
    ]


def _model(p, x, y):
    """`_loss`'s model: its residuals, one example's output."""
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["head"] - y


def _quantities(model=_model, loss=_loss):
    """(name, function, reference) of the ghost quantities beside clipping and the
    statistics, each by the one policy (`_choice.decided`)."""
    curvature = dict(likelihood="gaussian", batch_size=5)
    made = [
        (
            chunkvmap.per_example_grad_projections,
            loss,
            dict(dim=8, batch_size=5),
        ),
        (chunkvmap.per_example_grad_gram, loss, dict(batch_size=5)),
        (chunkvmap.ggn_diagonal, model, curvature),
        (chunkvmap.ekfac_factors, model, curvature),
    ]
    return [
        (f.__name__, f(fun, method="ghost", **options), f(fun, **options))
        for f, fun, options in made
    ]


def _called(how, f):
    if how == "eager":
        return f
    if how == "jit":
        return jax.jit(f)

    def under_grad(p, x, y):  # the gradient of the result, through the call
        def scalar(s):
            out = f(jax.tree.map(lambda a: a * s, p), x, y)
            leaves = jax.tree.leaves(out)
            return sum(
                jnp.sum(a) for a in leaves if jnp.issubdtype(a.dtype, jnp.inexact)
            )

        return jax.grad(scalar)(jnp.ones((), x.dtype))

    return under_grad


@pytest.mark.parametrize("how", ["eager", "jit", "grad"])
@pytest.mark.parametrize("winner", ["ghost", "vmap"])
def test_every_entry_point_runs_the_measured_choice(measured, how, winner):
    """clipped_grad_sum, clipped_grad, the statistics, the projections, the Gram
    matrix, the GGN diagonal and EK-FAC's factors, eager, under jit and under grad
    of the result (the last four eager and under grad), N = 13 in chunks of 5: one
    measurement of a chunk of 5 per function; the program measured faster runs
    (the vmap program's run is the vmap method's own program, warned once), and
    the results are the vmap method's."""
    timings, times = measured
    times(*((1e-3, 5e-3) if winner == "ghost" else (5e-3, 1e-3)))
    p, x, y = _problem()
    # (the quantities beside clipping and the statistics: eager and under grad here,
    # jitted in test_every_quantity_follows_the_one_policy_on_cpu)
    entries = _entries(p, x, y)[: 3 if how == "jit" else None]
    for name, ghost, vmap in entries:
        before = len(timings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _called(how, ghost)(p, x, y)
            again = _called(how, ghost)(p, x, y)
        want = _called(how, vmap)(p, x, y)
        tree_allclose(got, want, rtol=2e-5, atol=1e-5)
        tree_allclose(again, got)
        assert len(timings) == before + 1, name  # measured once
        assert timings[-1].chunk == 5 and timings[-1].device == _device_kind()
        fallback = [
            w for w in caught if issubclass(w.category, chunkvmap.GhostFallbackWarning)
        ]
        if winner == "vmap":
            said = str(fallback[0].message)
            assert len(fallback) == 1 and f"measured on {_device_kind()}" in said
            assert str(jax.make_jaxpr(ghost)(p, x, y)) == str(
                jax.make_jaxpr(vmap)(p, x, y)
            )
        else:
            assert not fallback, name
            assert str(jax.make_jaxpr(ghost)(p, x, y)) != str(
                jax.make_jaxpr(vmap)(p, x, y)
            )


def _unhelped_model(p, x, y):
    """A model whose one parameter no ghost rule covers (read through `exp`)."""
    return jnp.tanh(x @ jnp.exp(p["g"])) - y


def _unhelped_loss(p, x, y):
    return jnp.sum(_unhelped_model(p, x, y) ** 2)


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("helped", [True, False])
def test_every_quantity_follows_the_one_policy_on_cpu(how, helped):
    """Unmeasured (the CPU): the projections, the Gram matrix, the GGN diagonal
    and EK-FAC's factors run their ghost program where it takes some parameter's
    share from its operands, silently; where it helps no parameter, the vmap
    method's own program runs (the same jaxpr, the same values) and one
    GhostFallbackWarning says so, as clipping's does."""
    p, x, y = _problem()
    if helped:
        made = _quantities()
    else:
        p = {"g": p["w"][:, :3]}
        made = _quantities(_unhelped_model, _unhelped_loss)
    for name, ghost, vmap in made:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _called(how, ghost)(p, x, y)
            _called(how, ghost)(p, x, y)
        said = [
            str(w.message)
            for w in caught
            if issubclass(w.category, chunkvmap.GhostFallbackWarning)
        ]
        tree_allclose(got, _called(how, vmap)(p, x, y), rtol=2e-5, atol=1e-5)
        same = str(jax.make_jaxpr(ghost)(p, x, y)) == str(jax.make_jaxpr(vmap)(p, x, y))
        if helped:
            assert not said and not same, name
        else:
            assert len(said) == 1 and same, name
            assert f"{name} method='ghost' runs as method='vmap'" in said[0]


def test_the_gram_searching_auto_warns_once():
    """`batch_size="auto"` tries several sizes of the Gram's rows, each its own
    chunking: a ghost program that helps no leaf is still warned once per
    function."""
    p, x, y = _problem()
    gram = chunkvmap.per_example_grad_gram(
        _unhelped_loss, method="ghost", batch_size="auto", memory_limit="64MiB"
    )
    q = {"g": p["w"][:, :3]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gram(q, x, y)
        gram(q, x, y)
    said = [w for w in caught if issubclass(w.category, chunkvmap.GhostFallbackWarning)]
    assert len(said) == 1 and "runs as method='vmap'" in str(said[0].message)


def test_the_measurement_is_kept_per_shapes_and_chunk(measured):
    """A new number of examples with the same chunk reuses the measurement; a call
    whose chunk differs (fewer examples than the batch size) or whose examples
    have other shapes measures again."""
    timings, times = measured
    shapes = times(1e-3, 2e-3)
    f = chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5, method="ghost")
    p, x, y = _problem(13)
    f(p, x, y)
    # both programs run on one chunk: the parameters whole, 5 examples
    assert shapes == [[(32,), (32, 3), (6, 32), (5, 6), (5, 3)]] * 2
    f(p, *_problem(20)[1:])
    assert len(timings) == 1
    f(p, *_problem(3)[1:])  # one chunk of 3
    assert [t.chunk for t in timings] == [5, 3]
    f(p, jnp.ones((13, 6, 1)).squeeze(-1), jnp.ones((13, 3)))  # the same shapes
    assert len(timings) == 2
    q = {**p, "w": jnp.ones((6, 32), jnp.float32)}
    f(q, x, y)
    assert len(timings) == 2


def test_a_transform_built_at_every_call_measures_once(measured):
    """Written inside a loop, a transform is built anew at every call: the choice
    is measured at the first call only (measurements are kept by what the programs
    compute), and another clipping norm or loss is measured again."""
    timings, times = measured
    times(1e-3, 2e-3)
    p, x, y = _problem(13)
    for _ in range(3):
        chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5, method="ghost")(p, x, y)
        chunkvmap.per_example_grad_stats(_loss, batch_size=5, method="ghost")(p, x, y)
    assert len(timings) == 2
    chunkvmap.clipped_grad_sum(_loss, 0.5, batch_size=5, method="ghost")(p, x, y)
    assert len(timings) == 3

    def other(p, x, y):
        return _loss(p, x, y) * 2.0

    chunkvmap.clipped_grad_sum(other, 1.0, batch_size=5, method="ghost")(p, x, y)
    assert len(timings) == 4


@pytest.mark.parametrize("error", ["RESOURCE_EXHAUSTED: Out of memory", "other"])
def test_a_program_that_does_not_fit_is_never_chosen(measured, error):
    """A vmap program that runs out of device memory on the chunk leaves the ghost
    program (no warning); any other failure to measure leaves the model's verdict
    (here: the ghost program too), and nothing is raised."""
    timings, times = measured
    times(1.0, RuntimeError(error))
    p, x, y = _problem()
    f = chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5, method="ghost")
    with warnings.catch_warnings():
        warnings.simplefilter("error", chunkvmap.GhostFallbackWarning)
        total, count = f(p, x, y)
    want, _ = chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5)(p, x, y)
    tree_allclose(total, want, rtol=2e-5, atol=1e-5)
    if error == "other":
        assert timings == [None]
    else:
        assert timings[0].seconds[Method.VMAP] is None
        assert "RESOURCE_EXHAUSTED" in timings[0].failed[Method.VMAP]


def test_a_loss_closing_over_a_traced_value_keeps_the_model(measured):
    """Under `jax.grad` of a value the loss closes over, the program cannot be
    compiled on its own: the model decides, the result is right."""
    timings, _ = measured
    p, x, y = _problem()

    def outer(s):
        f = chunkvmap.clipped_grad_sum(
            lambda p, x, y: s * _loss(p, x, y), 1e3, batch_size=5, method="ghost"
        )
        return f(p, x, y)[0]["w"].sum()

    got = jax.grad(outer)(jnp.float32(2.0))
    want = jax.grad(
        lambda s: jax.vmap(jax.grad(_loss), (None, 0, 0))(p, x, y)["w"].sum() * s
    )(jnp.float32(2.0))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert timings == [None]


def test_typed_keys_and_float64_are_stood_in_for(measured):
    """`clipped_grad(prng_argnum=...)` splits a typed key per example; float64
    examples: the stand-ins have each leaf's type, and the result is the vmap
    method's."""
    timings, times = measured
    times(1e-3, 2e-3)

    def noisy(p, key, x, y):
        return _loss(p, x, y) + jnp.sum(jax.random.normal(key, ()) * 0) * p["b"][0]

    with jax.enable_x64(True):
        p, x, y = _problem(dtype=jnp.float64)
        key = jax.random.key(1)
        kw = dict(
            batch_argnums=(2, 3), prng_argnum=1, batch_size=5, keep_batch_dim=False
        )
        got = chunkvmap.clipped_grad(noisy, l2_clip_norm=1.0, method="ghost", **kw)(
            p, key, x, y
        )
        want = chunkvmap.clipped_grad(noisy, l2_clip_norm=1.0, **kw)(p, key, x, y)
    tree_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert timings and timings[0] is not None


def test_a_spread_call_keeps_the_model(measured):
    """A call spread over a mesh (`shard=True`) keeps the model's verdict: one
    device's chunk is not the call's program."""
    timings, _ = measured
    p, x, y = _problem(16)
    mesh = make_mesh((8,), ("d",), devices=jax.devices("cpu")[:8])
    f = chunkvmap.clipped_grad_sum(
        _loss, 1.0, batch_size=2, method="ghost", shard=True, mesh=mesh
    )
    total, _ = f(p, x, y)
    want, _ = chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=2)(p, x, y)
    tree_allclose(total, want, rtol=2e-5, atol=1e-5)
    assert timings == []


def test_ghost_report_measures_on_an_accelerator(measured):
    """`ghost_report` gives the verdict the clipping functions would measure, for
    chunks of 64 examples, where the choice is measured."""
    timings, times = measured
    times(5e-3, 1e-3)
    p, x, y = _problem()
    report = chunkvmap.ghost_report(_loss, p, x[0], y[0])
    assert report.runs == "vmap" and report.timing.chunk == 64
    assert f"measured on {_device_kind()} for a chunk of 64 examples" in str(report)
    assert report.rule("args[0]['w']") == "ghost"


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_equinox_model_is_measured(measured, how):
    """An Equinox MLP (a module holding its activation functions) as the
    parameters: the stand-ins keep what is not an array, both programs are
    measured, and the result is the vmap method's."""
    eqx = pytest.importorskip("equinox")
    timings, times = measured
    times(1e-3, 2e-3)
    model = eqx.nn.MLP(6, 3, 16, 2, key=jax.random.key(0))

    def loss(model, x, y):
        return jnp.sum((model(x) - y) ** 2)

    _, x, y = _problem()
    ghost = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=5, method="ghost")
    vmap = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=5)
    wrap = eqx.filter_jit if how == "jit" else (lambda f: f)
    got, count = wrap(ghost)(model, x, y)
    want, _ = vmap(model, x, y)
    tree_allclose(
        eqx.filter(got, eqx.is_array),
        eqx.filter(want, eqx.is_array),
        rtol=2e-5,
        atol=1e-5,
    )
    assert len(timings) == 1 and timings[0] is not None and int(count) == 13


def test_a_flax_linen_model_is_measured(measured):
    """A Flax linen MLP's variables (its apply in the loss), under jit: both
    programs measured, the result the vmap method's."""
    nn = pytest.importorskip("flax.linen")
    timings, times = measured
    times(1e-3, 2e-3)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(16)(x)))

    model = MLP()
    _, x, y = _problem()
    variables = model.init(jax.random.key(0), x[0])

    def loss(variables, x, y):
        return jnp.sum((model.apply(variables, x) - y) ** 2)

    ghost = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=5, method="ghost")
    got, _ = jax.jit(ghost)(variables, x, y)
    want, _ = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=5)(variables, x, y)
    tree_allclose(got, want, rtol=2e-5, atol=1e-5)
    assert len(timings) == 1 and timings[0] is not None


def test_an_unmeasured_accelerator_call_is_not_warned_slower(monkeypatch):
    """On an accelerator, a call the choice cannot measure (here: a mesh's, told
    it is not measured) keeps the model's program, the ghost program it predicts
    slower but smaller, without the CPU model's "slower" warning; on CPU the
    warning stays."""
    rng = np.random.default_rng(2)
    p = {"w": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(6, 64, 256)), jnp.float32)
    f = chunkvmap.clipped_grad_sum(
        _wide_over_positions, 1.0, batch_size=6, method="ghost"
    )
    with pytest.warns(chunkvmap.GhostFallbackWarning, match="predicted slower"):
        f(p, x)
    monkeypatch.setattr(_choice, "platform", lambda: "tpu")
    g = chunkvmap.clipped_grad_sum(
        _wide_over_positions, 1.0, batch_size=6, method="ghost"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total, _ = g(p, x)
    tree_allclose(total, f(p, x)[0])
    assert str(jax.make_jaxpr(g)(p, x)) == str(jax.make_jaxpr(f)(p, x))  # ghost


def test_a_measurement_that_fails_gives_no_slower_warning(measured):
    """Where the call cannot be measured (the loss closes over a value traced by
    an enclosing grad), a model's "predicted slower" is not said on a measured
    platform: the model's program runs, silently."""
    timings, _ = measured
    rng = np.random.default_rng(2)
    p = {"w": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(6, 64, 256)), jnp.float32)

    def outer(s):
        f = chunkvmap.clipped_grad_sum(
            lambda p, x: s * _wide_over_positions(p, x), 1.0, batch_size=6,
            method="ghost",
        )  # fmt: skip
        return f(p, x)[0]["w"].sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(outer)(jnp.float32(2.0))
    assert timings == [None]


def test_measuring_says_nothing_of_its_stand_ins(measured):
    """The measured programs see chunk-sized stand-ins: a table passed whole
    whose leading axis is the chunk's size is not taken for a batch (no warning
    that only the stand-ins would give)."""
    timings, times = measured
    times(1e-3, 2e-3)

    def loss(p, x, y, table):
        return _loss(p, x, y) + jnp.sum(table) * p["b"][0]

    p, x, y = _problem()
    table = jnp.ones((5, 4))
    kw = dict(batch_argnums=(1, 2), batch_size=5, method="ghost")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunkvmap.per_example_grad_stats(loss, **kw)(p, x, y, table)
        chunkvmap.clipped_grad_sum(loss, 1.0, **kw)(p, x, y, table)
    assert len(timings) == 2


def test_ghost_report_takes_what_it_took_before_where_it_measures(measured):
    """Measuring for the report never refuses an argument the report takes: a
    string option of the loss, a dict holding one, argnums overlapping the
    examples' (a clipping call would not map them: the verdict is then the
    model's, unmeasured)."""
    timings, times = measured
    times(1e-3, 2e-3)
    p, x, _ = _problem()

    def loss(p, x, cfg, mode="sum"):
        h = jnp.tanh(x @ p["w"])
        return jnp.sum(h) if cfg["mode"] == mode else jnp.mean(h)

    report = chunkvmap.ghost_report(loss, p, x[0], {"mode": "sum"}, mode="sum")
    assert report.rule("args[0]['w']") == "ghost" and report.timing is None
    both = chunkvmap.ghost_report(_loss, p, x[0], x[0, :3], batch_argnums=(0, 1, 2))
    assert isinstance(both, GhostReport) and both.timing is None


def test_several_processes_keep_the_model(measured, monkeypatch):
    """In a job of several processes no timing decides the program (each process
    would time its own): the model's choice, as before."""
    timings, _ = measured
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    p, x, y = _problem()
    chunkvmap.clipped_grad_sum(_loss, 1.0, batch_size=5, method="ghost")(p, x, y)
    assert chunkvmap.ghost_report(_loss, p, x[0], y[0]).timing is None
    assert timings == []
