"""batch_size="auto": the fewest chunks whose compiled temp memory fits a budget,
each as short as they allow."""

import types

import jax
import jax.numpy as jnp
import pytest

import chunkvmap
from chunkvmap import (
    batch_map,
    batch_vmap,
    last_batch_size,
    per_example_grads,
)
from chunkvmap._core import _memory

from .helpers import (
    check_auto_choice,
    init_mlp,
    mlp,
    program_bytes,
    record_auto_searches,
    temp_bytes,
    tree_allclose,
)


PARAMS = init_mlp(jax.random.key(0), (32, 256, 256, 10))
X = jnp.linspace(-1.0, 1.0, 2000 * 32, dtype=jnp.float32).reshape(2000, 32)


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
@pytest.mark.parametrize("limit", ["256KiB", 3_000_000])
def test_chosen_size_fits_the_budget_by_the_same_estimate(limit, monkeypatch):
    searches = record_auto_searches(monkeypatch)
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit=limit)
    tree_allclose(fn(PARAMS, X), jax.vmap(mlp, (None, 0))(PARAMS, X), rtol=1e-5)
    chosen = last_batch_size(fn)
    assert chosen is not None and 1 <= chosen <= X.shape[0]
    budget = _memory.parse_memory("test", limit)
    used = temp_bytes(batch_vmap(mlp, (None, 0), batch_size=chosen), PARAMS, X)
    assert used <= budget
    # Not needlessly small (check_auto_choice): a chunk twice as large as the
    # largest that fits would not have fitted.
    (search,) = searches
    check_auto_choice(
        search,
        chosen,
        X.shape[0],
        budget,
        lambda b: temp_bytes(batch_vmap(mlp, (None, 0), batch_size=b), PARAMS, X),
    )


@pytest.mark.parametrize("examples", [25, 400])
def test_chosen_size_fits_a_budget_by_the_backends_figure(examples, monkeypatch):
    """The same guarantees on whatever backend runs (the chip's peak less the
    arguments off CPU, XLA:CPU's temporaries on CPU): a budget of so many examples'
    chunk, by that backend's own figure, is met and not needlessly small."""
    searches = record_auto_searches(monkeypatch)

    def figure(b):
        return program_bytes(batch_vmap(mlp, (None, 0), batch_size=b), PARAMS, X)

    budget = figure(examples)
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit=budget)
    tree_allclose(fn(PARAMS, X), jax.vmap(mlp, (None, 0))(PARAMS, X), rtol=1e-5)
    chosen = last_batch_size(fn)
    assert chosen >= examples // 2, (chosen, examples)
    (search,) = searches
    check_auto_choice(search, chosen, X.shape[0], budget, figure)


def test_generous_budget_picks_everything(monkeypatch):
    searches = record_auto_searches(monkeypatch)
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit="1GiB")
    fn(PARAMS, X)
    assert last_batch_size(fn) == X.shape[0]
    assert last_batch_size() == X.shape[0]
    (search,) = searches
    assert search["seen"][X.shape[0]] <= 2**30  # all N was measured, and fits


def test_budget_too_small_for_one_example():
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit=64)
    with pytest.raises(
        ValueError, match="cannot fit even one example in memory_limit=64"
    ):
        fn(PARAMS, X)


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_choice_is_cached_per_shapes(monkeypatch):
    calls = []
    original = _memory.temp_bytes

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_memory, "temp_bytes", counting)
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit="1MiB")
    fn(PARAMS, X)
    probes = len(calls)
    assert 2 <= probes <= _memory._MAX_PROBES
    fn(PARAMS, X + 1.0)  # same shapes: no new probes
    assert len(calls) == probes
    fn(PARAMS, X[:1000])  # new shapes: probes again
    assert len(calls) > probes


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_auto_under_jit_grad_and_with_reduction(monkeypatch):
    searches = record_auto_searches(monkeypatch)
    reduce = dict(reduction=jnp.add, chunk_reduction=lambda y: (y**2).sum(0))

    def loss(p):
        fn = batch_vmap(
            mlp, (None, 0), batch_size="auto", memory_limit="512KiB", **reduce
        )
        return fn(p, X).sum()

    def ref(p):
        return (jax.vmap(mlp, (None, 0))(p, X) ** 2).sum()

    tree_allclose(
        jax.jit(jax.grad(loss))(PARAMS),
        jax.jit(jax.grad(ref))(PARAMS),
        rtol=1e-4,
        atol=2e-4,
    )
    assert 1 <= last_batch_size() < X.shape[0]
    # The search measures the forward chunked program (with its reduction) that the
    # traced call runs; its guarantee holds for that program with a fixed size.
    (search,) = searches
    check_auto_choice(
        search,
        last_batch_size(),
        X.shape[0],
        512 * 2**10,
        lambda b: temp_bytes(
            batch_vmap(mlp, (None, 0), batch_size=b, **reduce), PARAMS, X
        ),
    )


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_batch_map_auto(monkeypatch):
    searches = record_auto_searches(monkeypatch)

    def fun(chunk):
        return jnp.tanh(chunk @ PARAMS[1][0][:32, :])

    out = batch_map(fun, X, "auto", memory_limit="300KiB")
    tree_allclose(out, fun(X), rtol=1e-5)
    assert 1 <= last_batch_size(fun) <= X.shape[0]
    (search,) = searches

    # The program an eager call runs takes the arrays `fun` reads as arguments
    # (the whole matrix, sliced in the program), as here.
    def program(b):
        return lambda xs, w: batch_map(lambda c: jnp.tanh(c @ w[:32, :]), xs, b)

    check_auto_choice(
        search,
        last_batch_size(fun),
        X.shape[0],
        300 * 2**10,
        lambda b: temp_bytes(program(b), X, PARAMS[1][0]),
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 2**30),
        ("512 MB", 512 * 10**6),
        ("1.5kib", 1536),
        ("100", 100),
        ("1e6", 10**6),
        (4096, 4096),
        (2.5e3, 2500),
    ],
)
def test_parse_memory(text, expected):
    assert _memory.parse_memory("test", text) == expected


@pytest.mark.parametrize(
    "value, exc, match",
    [
        ("lots", ValueError, "is not a memory size"),
        ("2 GiBs", ValueError, "is not a memory size"),
        (0, ValueError, "positive, finite"),
        (-5, ValueError, "positive, finite"),
        (True, TypeError, "of type bool"),
        ([1], TypeError, "of type list"),
    ],
)
def test_bad_memory_limit(value, exc, match):
    with pytest.raises(exc, match=match):
        batch_vmap(mlp, batch_size="auto", memory_limit=value)


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_memory_limit_needs_auto_and_auto_needs_a_limit_on_cpu():
    with pytest.raises(ValueError, match="only used with batch_size='auto'"):
        batch_vmap(mlp, batch_size=4, memory_limit="1GiB")
    with pytest.raises(TypeError, match="positive int, None, or 'auto'"):
        batch_vmap(mlp, batch_size="automatic")
    fn = batch_vmap(mlp, (None, 0), batch_size="auto")
    with pytest.raises(ValueError, match="does not report its device memory"):
        fn(PARAMS, X)


def test_default_limit_is_a_fraction_of_device_memory(monkeypatch):
    fake = types.SimpleNamespace(
        platform="gpu", memory_stats=lambda: {"bytes_limit": 8 * 2**30}
    )
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [fake])
    assert _memory.default_limit("batch_vmap") == int(
        8 * 2**30 * _memory.DEFAULT_DEVICE_FRACTION
    )


def test_last_batch_size_of_unknown_function_is_none():
    assert last_batch_size(lambda x: x) is None
    assert chunkvmap.last_batch_size(batch_vmap(mlp, batch_size=3)) is None


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_each_transform_keeps_its_own_choice():
    """The choice belongs to the transform that made it: two transforms of the same
    function with different budgets report their own, and the argument-free form the
    most recent of any."""
    x = X[:64]
    tight = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit="64KiB")
    roomy = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit="1GiB")
    roomy(PARAMS, x)
    tight(PARAMS, x)
    assert last_batch_size(roomy) == 64
    assert 1 <= last_batch_size(tight) < 64
    assert last_batch_size() == last_batch_size(tight)
    assert last_batch_size(mlp) is None  # the function itself holds nothing


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_batch_map_auto_with_a_builtin_function(monkeypatch):
    searches = record_auto_searches(monkeypatch)
    out = batch_map(jnp.sin, X, "auto", memory_limit="1MiB")
    tree_allclose(out, jnp.sin(X))
    assert last_batch_size() is not None
    (search,) = searches
    # An elementwise function needs next to no temporary memory: all N fit.
    assert last_batch_size() == X.shape[0]
    check_auto_choice(
        search,
        last_batch_size(),
        X.shape[0],
        2**20,
        lambda b: temp_bytes(lambda xs: batch_map(jnp.sin, xs, b), X),
    )


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_auto_cache_accounts_for_static_arguments(monkeypatch):
    searches = record_auto_searches(monkeypatch)
    x = jnp.ones((256, 64), jnp.float32)

    def g(a, n):
        big = jnp.ones((n, 64)) * a[None, :]
        return jnp.sort((big @ big.T).ravel())[::7].sum()

    fn = batch_vmap(g, (0, None), batch_size="auto", memory_limit="4MiB")
    fn(x, 4)
    small_n = last_batch_size(fn)
    fn(x, 256)
    large_n = last_batch_size(fn)
    assert large_n < small_n
    used = temp_bytes(lambda a: batch_vmap(g, (0, None), batch_size=large_n)(a, 256), x)
    assert used <= 4 * 2**20
    assert len(searches) == 2  # one search per static value
    for search, n, chosen in zip(searches, (4, 256), (small_n, large_n)):
        check_auto_choice(
            search,
            chosen,
            256,
            4 * 2**20,
            lambda b, n=n: temp_bytes(
                lambda a: batch_vmap(g, (0, None), batch_size=b)(a, n), x
            ),
        )


@pytest.mark.runs_on_cpu("XLA:CPU's temporary figures set its budgets")
def test_auto_finds_the_largest_size_below_one_that_does_not_fit(monkeypatch):
    # One chunk of all N examples drops the loop and needs far more memory than
    # N - 1 examples in chunks; the search used to stop at the size it had
    # interpolated to (26 of 128) after that probe, deep in CPU's slow small-chunk
    # range, though 127 fits. It finds 127, then takes two chunks of 64 (two
    # chunks of 127 would evaluate 254 examples).
    keys = jax.random.split(jax.random.key(0), 3)
    widths = [32, 64, 64, 10]
    params = [
        (jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b))
        for k, a, b in zip(keys, widths[:-1], widths[1:])
    ]

    def loss(params, x, y):
        for w, b in params[:-1]:
            x = jnp.tanh(x @ w + b)
        w, b = params[-1]
        return -jax.nn.log_softmax(x @ w + b)[y]

    x, y = jnp.ones((128, 32)), jnp.zeros(128, jnp.int32)

    def temp(b):
        return temp_bytes(per_example_grads(loss, batch_size=b), params, x, y)

    below, whole = temp(127), temp(128)
    assert whole > 4 * below  # the jump the search must not be misled by
    searches = record_auto_searches(monkeypatch)
    f = per_example_grads(loss, batch_size="auto", memory_limit=2 * below)
    f(params, x, y)
    (search,) = searches
    assert max(b for b, m in search["seen"].items() if m <= 2 * below) == 127
    assert last_batch_size(f) == 64


@pytest.mark.parametrize(
    "n, fits, chosen",
    [(256, 255, 128), (256, 256, 256), (257, 256, 129), (1000, 300, 250),
     (7, 3, 3), (13, 1, 1), (100, 99, 50)],
)  # fmt: skip
def test_auto_takes_the_fewest_chunks_each_as_short_as_they_allow(n, fits, chosen):
    """Of the sizes that fit, the fewest chunks, and of those the size that
    evaluates the fewest examples (ceil(N / B) * B, the last window included): 255
    of 256 would evaluate 510 examples, 128 evaluates 256."""

    def measure(b):  # fits up to `fits`
        return 1000 * b

    got = _memory.choose_batch_size("test", measure, n, 1000 * fits)
    assert got == chosen
    evaluated = -(-n // got) * got
    assert all(
        -(-n // b) > -(-n // got) or -(-n // b) * b >= evaluated
        for b in range(1, fits + 1)
    )


def test_auto_keeps_the_largest_size_where_the_shorter_one_does_not_fit():
    """The estimate is not monotone in the chunk size (the last window's length
    changes with it): the shorter size is measured, and where it does not fit,
    the largest that does is kept."""

    def measure(b):  # 255 fits; 128, the shorter size for two chunks, does not
        return 10**9 if b == 128 else 1000 * b

    assert _memory.choose_batch_size("test", measure, 256, 1000 * 255) == 255


@pytest.mark.parametrize("backend", ["cpu", "tpu", "gpu"])
def test_the_figure_auto_reads_follows_the_backend(monkeypatch, backend):
    """On CPU the compiled temporary memory; on an accelerator the compiled peak
    less the arguments (XLA:TPU reports temporaries of 0 for programs that hold
    gigabytes), or the temporaries where no peak is reported."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    analysis = types.SimpleNamespace(
        temp_size_in_bytes=0, peak_memory_in_bytes=900, argument_size_in_bytes=300
    )
    assert _memory.program_bytes(analysis) == (0 if backend == "cpu" else 600)
    analysis.peak_memory_in_bytes = 0
    analysis.temp_size_in_bytes = 50
    assert _memory.program_bytes(analysis) == 50


def test_a_program_on_the_cpu_is_measured_as_the_cpus_beside_an_accelerator(
    monkeypatch,
):
    """On a machine whose default backend is an accelerator (posed here), a
    program whose arrays are on the CPU devices is measured by the CPU's figure
    (its temporaries), as `batch_size="auto"` then measures it."""
    compiled = jax.jit(batch_vmap(mlp, (None, 0), batch_size=8)).lower(PARAMS, X)
    compiled = compiled.compile()
    assert _memory.platform_of(compiled) == "cpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    analysis = compiled.memory_analysis()
    got = _memory.program_bytes(analysis, _memory.platform_of(compiled))
    assert got == analysis.temp_size_in_bytes
    searches = record_auto_searches(monkeypatch)
    budget = 4 * got
    fn = batch_vmap(mlp, (None, 0), batch_size="auto", memory_limit=budget)
    tree_allclose(fn(PARAMS, X), jax.vmap(mlp, (None, 0))(PARAMS, X), rtol=1e-5)
    (search,) = searches
    check_auto_choice(
        search, last_batch_size(fn), X.shape[0], budget,
        lambda b: temp_bytes(batch_vmap(mlp, (None, 0), batch_size=b), PARAMS, X),
    )  # fmt: skip


def test_the_default_budget_is_a_share_of_the_free_device_memory(monkeypatch):
    """90% of what the device has free: its limit less what it holds."""
    fake = types.SimpleNamespace(
        platform="tpu",
        memory_stats=lambda: {"bytes_limit": 16 * 2**30, "bytes_in_use": 6 * 2**30},
    )
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [fake])
    assert _memory.default_limit("batch_vmap") == int(0.9 * 10 * 2**30)
