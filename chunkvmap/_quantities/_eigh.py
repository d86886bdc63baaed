"""Eigendecompositions of symmetric matrices (curvature factors), where they run
fast.

`eigh` is `jnp.linalg.eigh`, except on the platforms `ON_HOST`: there XLA's own
eigendecomposition of a factor of thousands of rows (an LM's vocabulary, a wide
layer's inputs) takes minutes to compile (measured on a TPU v5e: a 4096-row
factor not done after 300 s), so the host's LAPACK computes it through a
callback, eagerly or inside a traced program, with the derivative rule JAX's
`eigh` has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _memory


ON_HOST = frozenset({"tpu"})


def eigh(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(eigenvalues, eigenvectors)` of the symmetric `x` (`(..., n, n)`, its
    symmetric part taken, as `jnp.linalg.eigh` does), the values ascending."""
    if _memory.call_platform() not in ON_HOST:
        return jnp.linalg.eigh(x)
    x = (x + jnp.swapaxes(x, -1, -2).conj()) / 2
    if isinstance(x, jax.core.Tracer):
        return _on_host(x)
    # (an array: its decomposition placed where it lives, replicated on its mesh;
    # a callback's eager result would be a program's maximal sharding instead)
    where = x.sharding
    if isinstance(where, jax.sharding.NamedSharding):
        where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(_host_eigh(np.asarray(x), x.dtype), where)


def _host_eigh(a: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(a)
    return values.astype(_real(dtype)), vectors.astype(dtype)


def _real(dtype: np.dtype) -> np.dtype:
    """The eigenvalues' dtype: real, of `dtype`'s precision."""
    return np.empty(0, dtype).real.dtype


@jax.custom_jvp
def _on_host(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    shapes = (
        jax.ShapeDtypeStruct(x.shape[:-1], _real(x.dtype)),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    # (numpy's eigh takes a stack of matrices: a batch is one callback)
    on_host = functools.partial(_host_eigh, dtype=x.dtype)  # (the traced dtype)
    return jax.pure_callback(on_host, shapes, x, vmap_method="expand_dims")


@_on_host.defjvp
def _on_host_jvp(primals: tuple, tangents: tuple) -> tuple:
    """The derivative `eigh` has: with `D = V^T dX V`, `dw = diag(D)` and
    `dV = V (F * D)`, `F_ij = 1 / (w_j - w_i)` off the diagonal, 0 on it."""
    (x,), (dx,) = primals, tangents
    values, vectors = _on_host(x)
    gaps = values[..., None, :] - values[..., :, None]
    eye = jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=values.dtype), gaps.shape)
    f = 1 / (gaps + eye) - eye
    d = jnp.swapaxes(vectors, -1, -2).conj() @ dx @ vectors
    d_values = jnp.diagonal(d, axis1=-2, axis2=-1).real
    return (values, vectors), (d_values, vectors @ (f * d))
