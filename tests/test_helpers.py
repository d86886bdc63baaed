"""The test helpers themselves: a lenient helper would hide failures everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import jaxpr_eqns, tree_allclose


def test_bfloat16_tolerance_applies_to_its_own_leaf_only():
    bf16 = jnp.array([1.0, 2.0], jnp.bfloat16)
    f32 = np.array([1.0, 2.0], np.float32)
    # 5e-3 relative error: too much for float32 (also at an accelerator's
    # float32 tolerance, `conftest.BACKEND_TOLERANCE`), not for bfloat16
    off = f32 * np.float32(1.005)
    # A bfloat16 leaf is compared at 1e-2 ...
    tree_allclose(bf16 * jnp.bfloat16(1.0078125), bf16)
    # ... but a float32 leaf after it keeps the float32 tolerance.
    with pytest.raises(AssertionError):
        tree_allclose([bf16, off], [bf16, f32])
    with pytest.raises(AssertionError):
        tree_allclose({"a": bf16, "b": off}, {"a": bf16, "b": f32})
    tree_allclose([bf16, f32], [bf16, f32])


def test_structure_shape_and_dtype_must_match():
    x = np.ones(3, np.float32)
    with pytest.raises(AssertionError, match="structure"):
        tree_allclose([x], (x,))
    with pytest.raises(AssertionError):
        tree_allclose(x, np.ones(4, np.float32))
    with pytest.raises(AssertionError):
        tree_allclose(x, np.ones(3, np.float16))
    with pytest.raises(AssertionError):
        tree_allclose(np.arange(3), np.arange(3) + 1)


def test_jaxpr_eqns_walks_into_every_sub_jaxpr():
    @jax.jit
    def inner(v):
        return jax.lax.cond(v.sum() > 0, jnp.sin, jnp.cos, v)

    def body(carry, v):
        return carry + jax.checkpoint(inner)(v), None

    jaxpr = jax.make_jaxpr(lambda xs: jax.lax.scan(body, xs[0], xs)[0])(
        np.ones((4, 2), np.float32)
    )
    names = [e.primitive.name for e in jaxpr_eqns(jaxpr)]
    assert "sin" not in [e.primitive.name for e in jaxpr.eqns]  # only nested
    assert names.count("sin") == 1 and names.count("cos") == 1, names


def test_a_mesh_test_on_a_one_device_accelerator_runs_on_the_cpu(monkeypatch):
    """Where the default backend (here posed as a one-chip TPU) has fewer devices
    than a test's mesh: a test asking for one inside is stopped by `make_mesh` and
    run again from its start with the CPU as the default device, its mesh of CPU
    devices; a test whose module holds such a mesh (made at import, where
    `make_mesh` never stops anything) runs on the CPU from its start."""
    import types

    from . import conftest, helpers

    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: real(*a) if a else real()[:1])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    runs = []

    def a_mesh_test():
        runs.append(jax.config.jax_default_device)
        mesh = helpers.make_mesh((4,), ("data",))
        assert {d.platform for d in mesh.devices.flat} == {"cpu"}

    def item(test, module=None, marked=False):
        info = types.SimpleNamespace(argnames=())
        mark = pytest.mark.runs_on_cpu("its subject is the CPU's").mark
        return types.SimpleNamespace(
            obj=test, funcargs={}, _fixtureinfo=info, module=module,
            get_closest_marker=lambda name: mark if marked else None,
        )  # fmt: skip

    assert conftest.pytest_pyfunc_call(item(a_mesh_test)) is True
    assert len(runs) == 2 and runs[0] is None
    assert getattr(runs[1], "platform", runs[1]) == "cpu"
    assert jax.config.jax_default_device is None  # restored after the test

    token = helpers.IN_TEST.set(False)  # as at a module's import (on a real chip
    try:  # too, where this test itself runs as a test)
        module = types.SimpleNamespace(MESH=helpers.make_mesh((8,), ("d",)))  # no raise
    finally:
        helpers.IN_TEST.reset(token)
    runs.clear()
    test = lambda: runs.append(jax.config.jax_default_device)  # noqa: E731
    assert conftest.pytest_pyfunc_call(item(test, module)) is True
    assert len(runs) == 1 and getattr(runs[0], "platform", runs[0]) == "cpu"
    assert helpers.holds_cpu_mesh(vars(module).values())
    assert not helpers.holds_cpu_mesh([jax.sharding.AbstractMesh((2,), ("d",))])

    runs.clear()  # a test marked runs_on_cpu: on the CPU from its start
    assert conftest.pytest_pyfunc_call(item(test, marked=True)) is True
    assert len(runs) == 1 and getattr(runs[0], "platform", runs[0]) == "cpu"


def test_accelerator_comparisons_follow_the_backend():
    """Off CPU, `np.testing.assert_allclose` (as `conftest.py` wraps it there) takes
    a float32 or 16-bit comparison to the accelerator's precision, relative and as a
    share of the largest expected magnitude, and leaves float64 to the test's own."""
    from .conftest import BACKEND_TOLERANCE, _backend_allclose

    check = _backend_allclose(np.testing.assert_allclose)
    want = np.array([0.5, -0.25, 1e-3], np.float32)
    near = want + np.float32(0.5 * BACKEND_TOLERANCE[4]) * np.float32(0.5)
    check(near, want, rtol=1e-6)  # within the float32 figure
    with pytest.raises(AssertionError):
        check(want * 1.01, want, rtol=1e-6)  # beyond it
    with pytest.raises(AssertionError):
        check(near.astype(np.float64), want.astype(np.float64), rtol=1e-6)
    check(near, want.astype(np.float64), rtol=1e-6)  # the narrower type decides
    half = want.astype(jnp.bfloat16)
    check(half * 1.02, half, rtol=1e-6)
    check(np.array([np.nan, 1.0], np.float32), [np.nan, 1.0])  # NaN where expected
