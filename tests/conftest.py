"""Make mistakes loud: several CPU devices, no implicit rank or dtype promotion."""

import os

import pytest


def pytest_configure(config):
    # Before JAX initialises its backends (collection happens before any test); not in
    # the xdist controller, which runs no test and so never needs JAX.
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    if jax.default_backend() != "cpu":
        # An accelerator's default float32 matrix product is a bfloat16 pass (three
        # digits); the suite compares with jax.vmap and float64 oracles, at the
        # precision of float32.
        jax.config.update("jax_default_matmul_precision", "highest")
        # Even so an accelerator's float32 is not the CPU's: its transcendental
        # functions and its sums' order differ (measured on a TPU v5e: up to 3e-4
        # relative between two programs of the same result, where the CPU's agree to
        # 1e-6). Comparisons of 16- and 32-bit floats follow the backend there.
        import numpy as np

        np.testing.assert_allclose = _backend_allclose(np.testing.assert_allclose)
        # One process at a time holds the chip: the processes tests start (scripts,
        # examples, hosts) run on the CPU.
        os.environ["JAX_PLATFORMS"] = "cpu"


# Accelerator tolerances (relative, and absolute as a share of the expected
# values' largest magnitude) of float32 and 16-bit comparisons; float64 keeps the
# test's own.
BACKEND_TOLERANCE = {4: 1e-3, 2: 3e-2}


def _backend_allclose(check):
    """`np.testing.assert_allclose` at the accelerator's precision: a comparison
    where either side is float32 or 16-bit within `BACKEND_TOLERANCE` (or the
    test's own, if looser)."""
    import functools

    import jax.numpy as jnp
    import numpy as np

    @functools.wraps(check)
    def allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
        a, d = np.asarray(actual), np.asarray(desired)
        sizes = [
            x.dtype.itemsize for x in (a, d) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        tol = BACKEND_TOLERANCE.get(min(sizes, default=8), 0.0)  # the narrower
        if tol and d.size:
            scale = float(np.nanmax(np.abs(d.astype(np.float64)), initial=0.0))
            if np.isfinite(scale):
                rtol, atol = max(rtol, tol), max(atol, tol * scale)
        return check(actual, desired, rtol, atol, *args, **kwargs)

    return allclose


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """On an accelerator with fewer devices than a test's mesh needs, the test runs
    with the CPU as the default device, so that its arrays meet its mesh of CPU
    devices: from its start where its module's constants or its fixtures hold such
    a mesh, else again from its start once it asks for one (`helpers.RunOnCpu`).
    A test marked `runs_on_cpu(reason)` (its subject is the CPU's: XLA:CPU's memory
    figures, a page's printed CPU output) runs on the CPU from its start."""
    import jax

    from . import helpers  # (imported on CPU too: an error shows in CI)

    if jax.default_backend() == "cpu":
        return None  # pytest calls the test as always
    args = {k: pyfuncitem.funcargs[k] for k in pyfuncitem._fixtureinfo.argnames}
    cpu = jax.devices("cpu")[0]
    module = getattr(pyfuncitem, "module", None)
    held = [*vars(module).values()] if module is not None else []
    marked = pyfuncitem.get_closest_marker("runs_on_cpu") is not None
    if marked or helpers.holds_cpu_mesh([*held, *args.values()]):
        with jax.default_device(cpu):
            pyfuncitem.obj(**args)
        return True
    token = helpers.IN_TEST.set(True)
    try:
        pyfuncitem.obj(**args)
    except helpers.RunOnCpu:
        with jax.default_device(cpu):
            pyfuncitem.obj(**args)
    finally:
        helpers.IN_TEST.reset(token)
    return True


@pytest.fixture(autouse=True)
def _modelled_choice(monkeypatch):
    """`method="ghost"`'s choice by the cost model on every backend, as on CPU (on
    an accelerator it is measured, and an unmeasured call drops the model's
    "slower": `test_choice.py` tests both where it runs), so that a test of the
    model's verdict holds on the chip too."""
    from chunkvmap._core import _program
    from chunkvmap._quantities import _choice

    monkeypatch.setattr(_choice, "MEASURED_PLATFORMS", frozenset())
    # each test measures its own choices (kept by what they compute, they would
    # otherwise be an earlier test's)
    monkeypatch.setattr(_choice, "MEASURED", _program.LRU())
    monkeypatch.setattr(_choice, "platform", lambda: "cpu")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


# A script run in subprocesses by test_multihost.py; importing it would join a cluster.
collect_ignore = ["multihost_worker.py"]


@pytest.fixture
def always_ghost(monkeypatch):
    """`method="ghost"` runs the ghost program wherever some leaf has a ghost norm,
    even where it is predicted no faster than the vmap program; the projections,
    the Gram matrix and curvature run theirs even where it takes no parameter's
    share from its operands (for tests of the ghost program on models too small
    for it to pay, or that it does not help)."""
    import math

    from chunkvmap._quantities import _choice
    from chunkvmap._quantities.ghost import _plan

    monkeypatch.setattr(_plan, "_GAIN", -math.inf)
    ruled = _choice.ruled
    monkeypatch.setattr(
        _choice, "ruled", lambda report, helped, what: ruled(report, True, what)
    )


@pytest.fixture
def in_passes(monkeypatch):
    """A NaN-safe clipped sum of formed gradients runs as it does on the TPU, in
    passes (norms, then the sum as one backward pass, then the non-finite examples),
    on every platform."""
    from chunkvmap._quantities import _clipping

    monkeypatch.setattr(_clipping, "IN_PASSES", frozenset({"cpu", "tpu", "gpu"}))


# The hostile cases' outcomes, tallied where the test reports are collected (the
# xdist controller: the cases run on several workers), checked at the end.
HOSTILE_OUTCOME = "hostile_outcome"  # a report's property: [entry, outcome, count]
HOSTILE_CHECK = "hostile_check"  # the report of the test that asks for the check
_HOSTILE_TALLY: dict = {}
_HOSTILE_CHECKED: list = []


def lacking_outcome(tally: dict) -> tuple[dict, list[str]]:
    """`(summary, entries)`: each entry point's `[matched, raised]` count in `tally`
    (keyed `(entry, outcome)`), and those whose cases ran without both outcomes."""
    entries = sorted({entry for entry, _ in tally})
    summary = {
        e: [tally.get((e, o), 0) for o in ("matched", "raised")] for e in entries
    }
    return summary, [e for e in entries if 0 in summary[e]]


def pytest_runtest_logreport(report):
    if report.when != "teardown":  # (a test's properties, the fixtures' included)
        return
    for name, value in report.user_properties:
        if name == HOSTILE_OUTCOME:
            entry, outcome, count = value
            _HOSTILE_TALLY[entry, outcome] = count + _HOSTILE_TALLY.get(
                (entry, outcome), 0
            )
        elif name == HOSTILE_CHECK:
            _HOSTILE_CHECKED.append(True)


def pytest_sessionfinish(session, exitstatus):
    """Under xdist, in the controller: every entry point whose hostile cases ran had
    cases of both outcomes, when `test_hostile.test_every_entry_point_matched_and_
    raised` ran (on any worker); else the session fails, saying which."""
    if getattr(session.config, "workerinput", None) is not None:
        return  # a worker: the controller tallies every worker's cases
    if not _HOSTILE_CHECKED:
        return  # one process (the test checked its own tally), or not selected
    summary, bad = lacking_outcome(_HOSTILE_TALLY)
    if bad:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = (
            f"FAILED test_hostile.py::test_every_entry_point_matched_and_raised: "
            f"entry points whose cases ran without both outcomes: {bad} "
            f"((matched, raised): {summary})"
        )
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def squares_in_kernel(monkeypatch):
    """EK-FAC's sums of squared products by the Pallas kernel (interpreted), as on
    the TPU, on every platform; yields the kernel's calls, each as its operands'
    shapes."""
    import jax

    from chunkvmap._core import _memory, _program
    from chunkvmap._quantities import _squares

    calls = []
    kernel = _squares._kernel_sum

    def counted(a, d, **kw):
        calls.append((a.shape, d.shape))
        return kernel(a, d, **kw)

    monkeypatch.setattr(_squares, "IN_KERNEL", frozenset({"cpu", "tpu", "gpu"}))
    monkeypatch.setattr(_squares, "INTERPRET", jax.default_backend() != "tpu")
    monkeypatch.setattr(_squares, "_kernel_sum", counted)
    # (the eager programs compiled before, without the kernel, not reused)
    monkeypatch.setattr(_memory, "PROGRAMS", _program.LRU(limit=256))
    yield calls


@pytest.fixture
def eigh_on_host(monkeypatch):
    """Curvature factors' eigendecompositions computed by the host through a
    callback, as on the TPU, on every platform; yields the host's calls, each as
    its matrix's `(shape, dtype)`."""
    from chunkvmap._quantities import _eigh

    calls = []
    host = _eigh._host_eigh

    def counted(a, dtype):
        calls.append((a.shape, a.dtype))
        return host(a, dtype)

    monkeypatch.setattr(_eigh, "ON_HOST", frozenset({"cpu", "tpu", "gpu"}))
    monkeypatch.setattr(_eigh, "_host_eigh", counted)
    yield calls
