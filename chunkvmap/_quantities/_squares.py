"""Sums of squared per-example products, `sum_e (a_e^T d_e)^2`, without each
example's product in memory where a kernel runs (EK-FAC's second moments).

`squared_products(a, d)` with `a` of shape `(L, E, P, I)` and `d` of `(L, E, P,
J)` is `sum_e (a[l, e]^T d[l, e])^2`, of shape `(L, I, J)`: for EK-FAC, each
example's gradient of a weight rotated into its eigenbases is `a^T d`, the
rotated activations and output gradients of its `P` positions, and their squares
summed over the examples are the eigenvalues' corrections. XLA forms each
example's `(I, J)` product in memory before squaring it (for a 10M-parameter LM,
40 MB written and read per example); on the platforms `IN_KERNEL` (the TPU) a
Pallas kernel keeps each tile of the products in the core's memory and adds its
squares to the sum there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._core import _memory


IN_KERNEL = frozenset({"tpu"})
TILES = (512, 384, 256, 128)  # (an output tile's rows or columns: the largest that
# divides the size rounded up to the lanes, 128, so that no tile is mostly padding)
EXAMPLES = 8  # (examples per kernel step, fewer where long positions would not fit)
BLOCKS_BYTES = 12 * 2**20  # (the operands' blocks, double-buffered, in the core's
# memory: within the 16 MiB a kernel may use by default)
INTERPRET = False  # (the kernel interpreted: where the platform has no compiler)


def squared_products(a: jax.Array, d: jax.Array) -> jax.Array:
    """`sum_e (a[l, e]^T d[l, e])^2`: `a` `(L, E, P, I)`, `d` `(L, E, P, J)`, the
    result `(L, I, J)` in their (common) dtype."""
    if _in_kernel(a, d):
        return _by_kernel(a, d)
    return jnp.sum(jnp.square(_products(a, d)), 1)


def _products(a: jax.Array, d: jax.Array) -> jax.Array:
    return jnp.einsum("lepi,lepj->leij", a, d)


@jax.custom_jvp
def _by_kernel(a: jax.Array, d: jax.Array) -> jax.Array:
    return _kernel_sum(a, d, interpret=INTERPRET)


@_by_kernel.defjvp
def _by_kernel_jvp(primals: tuple, tangents: tuple) -> tuple:
    """The kernel's derivative (it has none of its own): `2 sum_e X_e * dX_e`,
    `dX_e = da_e^T d_e + a_e^T dd_e`, each example's product formed (as XLA's
    program forms it)."""
    (a, d), (da, dd) = primals, tangents
    dx = _products(da, d) + _products(a, dd)
    return _by_kernel(a, d), 2 * jnp.sum(_products(a, d) * dx, 1)


def _in_kernel(*xs: jax.Array) -> bool:
    if _memory.call_platform() not in IN_KERNEL:
        return False
    for x in xs:
        if x.dtype != jnp.float32:  # (the kernel's: no float64 on the TPU)
            return False
        typed = jax.typeof(x).sharding  # (a sharded operand: XLA's own program)
        if any(e is not None for e in getattr(typed, "spec", ())):
            return False
    return True


def _precision() -> lax.Precision:
    """The products' precision, the caller's (`jax.default_matmul_precision`):
    full float32 for "highest", three bfloat16 passes for "high", else the
    platform's default."""
    wanted = str(jax.config.jax_default_matmul_precision or "").lower()
    if wanted in ("highest", "float32", "f32_f32_f32", "bf16_bf16_f32_x6",
                  "bf16_bf16_f32_x9", "f64_f64_f64"):  # fmt: skip
        return lax.Precision.HIGHEST
    if wanted in ("high", "tensorfloat32", "bf16_bf16_f32_x3", "tf32_tf32_f32",
                  "tf32_tf32_f32_x3"):  # fmt: skip
        return lax.Precision.HIGH
    return lax.Precision.DEFAULT


def _kernel_sum(a: jax.Array, d: jax.Array, *, interpret: bool) -> jax.Array:
    """`squared_products` by the Pallas kernel: examples and columns padded with
    zeros (whose products are 0) to whole tiles, the padding cut off after."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    layers, examples, positions, rows = a.shape
    cols = d.shape[-1]
    ti, tj = _tile(rows), _tile(cols)
    precision = _precision()
    narrow = precision == lax.Precision.DEFAULT and not interpret  # (the TPU's
    # default for float32 products, as XLA's: one pass of bfloat16 operands)
    size = 2 if narrow else 4
    fits = BLOCKS_BYTES // (2 * size * positions * (ti + tj))
    te = max(1, min(EXAMPLES, examples, fits))
    big_i, big_j, big_e = _up(rows, ti), _up(cols, tj), _up(examples, te)
    a_t = jnp.swapaxes(a, -1, -2)  # (L, E, I, P): each example's a^T
    a_t = jnp.pad(a_t, ((0, 0), (0, big_e - examples), (0, big_i - rows), (0, 0)))
    d = jnp.pad(d, ((0, 0), (0, big_e - examples), (0, 0), (0, big_j - cols)))
    if narrow:
        a_t, d = a_t.astype(jnp.bfloat16), d.astype(jnp.bfloat16)
    grid = (layers, big_i // ti, big_j // tj, big_e // te)
    kernel = functools.partial(_kernel, examples=te, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, te, ti, positions), lambda s, i, j, e: (s, e, i, 0)),
            pl.BlockSpec((None, te, positions, tj), lambda s, i, j, e: (s, e, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, ti, tj), lambda s, i, j, e: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((layers, big_i, big_j), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(a_t, d)
    return out[:, :rows, :cols]


def _kernel(a_ref, d_ref, out_ref, *, examples: int, precision) -> None:
    """One output tile: the squares of `te` examples' products added to it (set
    to 0 at the first step over the examples)."""
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(3) == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    total = out_ref[...]
    for e in range(examples):  # (unrolled: one matmul per example)
        x = jnp.dot(
            a_ref[e], d_ref[e], precision=precision, preferred_element_type=jnp.float32
        )
        total = total + x * x
    out_ref[...] = total


def _tile(n: int) -> int:
    """An output tile's side for `n` rows (or columns): the largest of `TILES`
    that divides `n` rounded up to 128."""
    whole = _up(n, 128)
    return next(t for t in TILES if whole % t == 0)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
