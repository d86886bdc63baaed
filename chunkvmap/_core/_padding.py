"""What a padded buffer means to the front ends: the flags `is_padding_example=`
(checked once, for every entry point that takes them), and the padding's outputs,
which are zeros. The loop skips the chunks of padding alone (`_loop.Chunks.padded`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def flag_type(flags: Any) -> bool:
    """Whether `flags` is a vector of booleans, or of integers (0 or 1, as
    jax-privacy's convention allows)."""
    dtype = jnp.result_type(flags)
    return np.ndim(flags) == 1 and (
        jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.integer)
    )


def check(name: str, flags: Any, size: int) -> jax.Array:
    """`flags` as a boolean vector of `size` entries (`flag_type`)."""
    shape, dtype = np.shape(flags), jnp.result_type(flags)
    if shape != (size,) or not flag_type(flags):
        raise ValueError(
            f"{name} is_padding_example must be a boolean vector with one entry per "
            f"example, shape ({size},), but got shape {shape} and dtype {dtype}."
        )
    return jnp.asarray(flags).astype(bool)


def zeroed(flags: jax.Array, rows: Any) -> Any:
    """Each leaf of `rows` (one row per example along axis 0) with zeros in the
    rows `flags` marks."""

    def zero(r: jax.Array) -> jax.Array:
        shape = (-1,) + (1,) * (np.ndim(r) - 1)
        return jnp.where(flags.reshape(shape), jnp.zeros((), r.dtype), r)

    return jax.tree.map(zero, rows)
