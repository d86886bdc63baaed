"""batch_jacfwd / batch_jacrev against jax.jacfwd / jax.jacrev."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_jacfwd, batch_jacrev

from .helpers import HostLog, TraceCounter, temp_bytes, tree_allclose


BATCH_SIZES = [None, 1, 3, 4, 100]
PAIRS = [(batch_jacfwd, jax.jacfwd), (batch_jacrev, jax.jacrev)]


def f_tree(p, x, *, scale=1.0):
    """A function of pytrees: dict + array in, tuple + dict out."""
    h = jnp.tanh(p["w"] @ x + p["b"])
    return (scale * h, {"s": jnp.sum(h**2) * p["b"][0], "m": jnp.outer(h, x)})


P = {
    "w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
    "b": jnp.array([0.1, -0.2, 0.3]),
}
X = jnp.linspace(-2.0, 2.0, 4)


# Each batch size with each transform, and each argnums with each transform, once
# (a Latin pairing of the two, shifted between the transforms).
ARGNUMS = [0, 1, (0, 1), -1, (1, 0)]
GRID = [
    (*pair, batch_size, ARGNUMS[(i + k) % len(ARGNUMS)])
    for k, pair in enumerate(PAIRS)
    for i, batch_size in enumerate(BATCH_SIZES)
]


@pytest.mark.parametrize("ours, theirs, batch_size, argnums", GRID)
def test_matches_jax(ours, theirs, batch_size, argnums):
    out = ours(f_tree, argnums, batch_size=batch_size)(P, X, scale=2.0)
    expected = jax.jit(theirs(f_tree, argnums))(P, X, scale=2.0)
    tree_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ours, theirs", PAIRS)
def test_has_aux_and_jit(ours, theirs):
    def f(x):
        return jnp.sin(x) * x[::-1], {"aux": x.sum()}

    x = jnp.linspace(0.0, 1.0, 7)
    out = jax.jit(ours(f, has_aux=True, batch_size=3))(x)
    tree_allclose(out, theirs(f, has_aux=True)(x))


@pytest.mark.parametrize("ours, theirs", PAIRS)
def test_holomorphic(ours, theirs):
    def f(z):
        return z**2 + 1j * z[::-1]

    z = jnp.array([1.0 + 2.0j, -0.5j, 3.0])
    out = ours(f, holomorphic=True, batch_size=2)(z)
    tree_allclose(out, theirs(f, holomorphic=True)(z))


def test_jacfwd_real_to_complex_and_matrix_inputs():
    def f(a):
        c = a.astype(jnp.complex64)
        return jnp.exp(1j * c) @ c

    a = jnp.linspace(0.0, 1.0, 9).reshape(3, 3)
    with pytest.raises(TypeError, match="real-valued outputs"):
        jax.jacrev(f)(a)  # jax refuses complex outputs in reverse mode ...
    with pytest.raises(TypeError, match="real-valued outputs"):
        batch_jacrev(f, batch_size=2)(a)  # ... and so do we
    tree_allclose(batch_jacfwd(f, batch_size=4)(a), jax.jacfwd(f)(a))


def test_jacrev_allow_int():
    def f(x, n):
        return x * n.sum().astype(x.dtype)

    x, n = jnp.ones(3), jnp.arange(4)
    out = batch_jacrev(f, (0, 1), allow_int=True, batch_size=2)(x, n)
    expected = jax.jacrev(f, (0, 1), allow_int=True)(x, n)
    tree_allclose(out, expected)
    with pytest.raises(TypeError, match="real-valued inputs"):
        batch_jacrev(f, (0, 1), batch_size=2)(x, n)
    with pytest.raises(TypeError, match="real-valued inputs"):
        batch_jacfwd(f, 1)(x, n)


@pytest.mark.parametrize("ours", [batch_jacfwd, batch_jacrev])
def test_linearises_once(ours):
    runs = HostLog()

    def f(x):
        jax.debug.callback(lambda: runs.append(1))
        return jnp.sin(x) * jnp.sum(x)

    counted = TraceCounter(f)
    x = jnp.linspace(0.0, 1.0, 10)
    out = ours(counted, batch_size=3)(x)  # 4 chunks of basis vectors
    jax.effects_barrier()
    assert counted.count == 1  # traced once
    assert len(runs) == 1  # the primal ran once, not once per chunk
    tree_allclose(out, jax.jacfwd(f)(x))


@pytest.mark.parametrize("ours", [batch_jacfwd, batch_jacrev])
def test_no_identity_basis_when_chunking(ours):
    n = 2048  # an n x n float32 identity would be 16 MiB

    def f(x):
        return jnp.sum(jnp.sin(x))[None]  # R^n -> R^1: the Jacobian is only n floats

    x = jnp.ones(n)
    if ours is batch_jacrev:  # reverse mode: n outputs, 1 input

        def f(x):  # noqa: F811
            return jnp.sin(x[0]) * jnp.arange(n, dtype=jnp.float32)

        x = jnp.ones(1)
    chunked = temp_bytes(ours(f, batch_size=16), x)
    whole = temp_bytes(ours(f), x)
    assert chunked < 16 * n * 4 * 4, chunked  # a few chunk-sized buffers
    assert whole > n * n * 4 / 2, whole  # the unchunked basis is n x n
    tree_allclose(ours(f, batch_size=16)(x), jax.jacfwd(f)(x))


def test_errors():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        batch_jacfwd(jnp.sin, batch_size=0)
    with pytest.raises(TypeError, match="argnums must be an int or a sequence"):
        batch_jacrev(jnp.sin, argnums=1.0)
    with pytest.raises(ValueError, match="argnums=2 is out of range"):
        batch_jacrev(lambda x, y: x, argnums=2)(1.0, 2.0)
    with pytest.raises(TypeError, match="holomorphic=True requires complex-valued"):
        batch_jacfwd(jnp.sin, holomorphic=True)(jnp.ones(2))
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        batch_jacfwd(jnp.sin, has_aux=None)
    with pytest.raises(
        TypeError,
        match="batch_jacrev fun must be a callable, but got fun=3 of type int",
    ):
        batch_jacrev(3)
    np.testing.assert_allclose(batch_jacrev(jnp.sin, -1)(0.5), np.cos(0.5), rtol=1e-6)


def test_jacfwd_integer_outputs_are_zeros_of_their_dtype():
    def f(x):
        return x * 2.0, jnp.argmax(x)

    x = jnp.array([0.5, 2.0, 1.0])
    tree_allclose(batch_jacfwd(f, batch_size=2)(x), jax.jacfwd(f)(x))
