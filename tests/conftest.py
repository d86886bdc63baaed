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
        # One process at a time holds the chip: the processes tests start (scripts,
        # examples, hosts) run on the CPU.
        os.environ["JAX_PLATFORMS"] = "cpu"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """On an accelerator with fewer devices than a test's mesh needs, the test runs
    with the CPU as the default device, so that its arrays meet its mesh of CPU
    devices: from its start where its module's constants or its fixtures hold such
    a mesh, else again from its start once it asks for one (`helpers.RunOnCpu`)."""
    import jax

    from . import helpers  # (imported on CPU too: an error shows in CI)

    if jax.default_backend() == "cpu":
        return None  # pytest calls the test as always
    args = {k: pyfuncitem.funcargs[k] for k in pyfuncitem._fixtureinfo.argnames}
    cpu = jax.devices("cpu")[0]
    module = getattr(pyfuncitem, "module", None)
    held = [*vars(module).values()] if module is not None else []
    if helpers.holds_cpu_mesh([*held, *args.values()]):
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
    from chunkvmap._dp import _choice

    monkeypatch.setattr(_choice, "MEASURED_PLATFORMS", frozenset())
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
    even where it is predicted no faster than the vmap program (for tests of the
    ghost program on models too small for it to pay)."""
    import math

    from chunkvmap._dp.ghost import _plan

    monkeypatch.setattr(_plan, "_GAIN", -math.inf)
