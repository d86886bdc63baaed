"""Convolutions inside the chunk loop in the layout XLA:CPU runs fast.

XLA:CPU evaluates a convolution with Eigen only when it is *canonical*: input
`(N, spatial..., C)`, kernel `(spatial..., I, O)`, output `(N, spatial..., O)`, in
float16 or float32. Its pass that transposes other convolutions into that form visits
the entry computation only, so a convolution inside a while loop (every chunk of
chunkvmap's loop) in any other layout runs on a naive path 10-90x slower: NCHW/OIHW
(lax's default, Equinox's `Conv2d`), and in every layout the backward pass, whose
input- and kernel-gradient convolutions JAX writes in transposed layouts.

`canonical(fn)` evaluates a chunk function with each such convolution rewritten:
transposes around a canonical convolution (what XLA does outside loops), as a
`jax.custom_jvp` whose tangent convolutions are laid out so that *their transposes*,
the convolutions reverse mode runs, are canonical too. Values are those of the same
convolution; only the order of its floating-point sums follows Eigen's, as it does
outside a loop. Other backends are left alone, and so are the derivative rules of a
user's own `custom_jvp`/`custom_vjp` (Python callables, not jaxprs): a convolution
inside one is right but keeps JAX's layout under `grad`.

A depthwise convolution (one input channel per group) is the exception: Eigen runs
it slowly anywhere (in jax.vmap's program too) and the naive path 6-12x faster, so
it and its input gradient are laid out `(N, C, spatial...)` / `(O, I, spatial...)`,
which XLA:CPU leaves to that path inside the loop.
"""

from __future__ import annotations

import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _axes
from ._jaxprs import bind, evaluate, rebuilt, sub_jaxprs
from ._memory import default_platform


_FAST_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
# A kernel with fewer (input channels per group) x (output channels) runs faster on
# XLA:CPU's naive path inside the loop than laid out: measured with 1-D, 2-D and
# 3-D convolutions from 2 -> 4 to 32 -> 32 channels, the layout wins from 64 on
# (0.1-0.5x the time), loses below 32 (1.3-11x), and is about even between.
_MIN_CHANNELS = 64

# Layouts as (batch or output-feature, feature or input-feature, spatial...) axis
# positions, ConvDimensionNumbers' order, for `nd` spatial dimensions.


def _canonical(nd: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Eigen's layouts: images `(N, spatial..., C)` and kernels `(spatial..., I, O)`."""
    image = (0, nd + 1, *range(1, nd + 1))
    kernel = (nd + 1, nd, *range(nd))
    return image, kernel


def _for_input_grad(nd: int) -> tuple[int, ...]:
    """The kernel as `(spatial..., O, I)`: JAX transposes a convolution with respect
    to its input into one whose kernel swaps I and O, then canonical."""
    return (nd, nd + 1, *range(nd))


def _for_kernel_grad(nd: int) -> tuple[tuple[int, ...], ...]:
    """Input `(C, spatial..., N)`, kernel `(I, spatial..., O)`, output
    `(spatial..., N, O)`. JAX transposes a convolution with respect to its kernel
    into one whose input is this input with N and C swapped, whose kernel is this
    output with N and O swapped and whose output is this kernel with I and O
    swapped: laid out like this, all three are canonical."""
    swapped = (nd + 1, 0, *range(1, nd + 1))
    return swapped, swapped, (nd, nd + 1, *range(nd))


def _laid_out(
    lhs: Any, rhs: Any, params: dict, lhs_at: Sequence[int], rhs_at: Sequence[int],
    out_at: Sequence[int],
) -> Any:  # fmt: skip
    """The convolution `params` describe, evaluated with its operands transposed so
    that each role (batch, feature, spatial...) sits at the `*_at` positions, and
    its output transposed back to the layout `params` give it."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    rank = len(lhs_spec)
    lhs_perm, rhs_perm, out_perm = [0] * rank, [0] * rank, [0] * rank
    for role in range(rank):
        lhs_perm[lhs_at[role]] = lhs_spec[role]
        rhs_perm[rhs_at[role]] = rhs_spec[role]
        out_perm[out_spec[role]] = out_at[role]
    numbers = lax.ConvDimensionNumbers(tuple(lhs_at), tuple(rhs_at), tuple(out_at))
    y = lax.conv_general_dilated_p.bind(
        _transpose(lhs, lhs_perm),
        _transpose(rhs, rhs_perm),
        **{**params, "dimension_numbers": numbers},
    )
    return _transpose(y, out_perm)


def _transpose(x: Any, perm: Sequence[int]) -> Any:
    return x if list(perm) == list(range(len(perm))) else lax.transpose(x, perm)


def _channels_first(nd: int) -> tuple[int, ...]:
    """`(N, C, spatial...)` images, `(O, I, spatial...)` kernels."""
    return tuple(range(nd + 2))


@ft.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _conv(lhs: Any, rhs: Any, params: dict, depthwise: bool) -> Any:
    nd = len(params["dimension_numbers"][0]) - 2
    if depthwise:
        first = _channels_first(nd)
        return _laid_out(lhs, rhs, params, first, first, first)
    image, kernel = _canonical(nd)
    return _laid_out(lhs, rhs, params, image, kernel, image)


@ft.partial(_conv.defjvp, symbolic_zeros=True)
def _conv_jvp(
    params: dict, depthwise: bool, primals: Sequence[Any], tangents: Sequence[Any]
):
    lhs, rhs = primals
    d_lhs, d_rhs = tangents
    nd = len(params["dimension_numbers"][0]) - 2
    image, kernel = _canonical(nd)
    out = _conv(lhs, rhs, params, depthwise)
    parts = []
    if not isinstance(d_lhs, SymbolicZero):
        # (JAX transposes it into a depthwise convolution too)
        at = (
            (_channels_first(nd),) * 3
            if depthwise
            else (image, _for_input_grad(nd), image)
        )
        parts.append(_laid_out(d_lhs, rhs, params, *at))
    if not isinstance(d_rhs, SymbolicZero):
        # Under Explicit sharding a batched tangent (the shares of a mesh, a user's
        # vmap) would fold a sharded axis into the input's last (batch) dimension,
        # which sharding in types refuses: there the kernel gradient keeps JAX's
        # layout (right, and as slow inside a loop as it was).
        mesh = jax.sharding.get_abstract_mesh()
        laid = image, kernel, image
        if mesh.empty or not mesh.explicit_axes:
            laid = _for_kernel_grad(nd)
        parts.append(_laid_out(lhs, d_rhs, params, *laid))
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return out, tangent


def _rewritten(eqn: Any) -> bool:
    """Whether `eqn` is a convolution chunkvmap lays out for XLA:CPU."""
    if eqn.primitive is not lax.conv_general_dilated_p:
        return False
    lhs, rhs = (v.aval for v in eqn.invars)
    nd = len(eqn.params["dimension_numbers"][0]) - 2
    out_dim, in_dim = eqn.params["dimension_numbers"][1][:2]
    return (
        1 <= nd <= 3
        and lhs.dtype in _FAST_DTYPES
        and rhs.dtype == lhs.dtype
        and lhs.size > 0
        and rhs.size > 0
        and rhs.shape[out_dim] * rhs.shape[in_dim] >= _MIN_CHANNELS
    )


def _depthwise(eqn: Any) -> bool:
    """Whether the convolution `eqn` is depthwise: one input channel per group, and a
    window smaller than its output (the grouped convolution that a per-example
    kernel gradient is written as slides an image-sized window over a kernel-sized
    output; Eigen runs that one faster)."""
    groups = eqn.params["feature_group_count"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    return (
        groups > 1
        and lhs[lhs_spec[1]] == groups
        and window < math.prod(out[d] for d in out_spec[2:])
    )


def has_convolution(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it) has a convolution to rewrite."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if _rewritten(eqn):
            return True
        for value in eqn.params.values():
            if any(has_convolution(sub) for sub in sub_jaxprs(value)):
                return True
    return False


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """`jaxpr` evaluated with its convolutions (and those of its sub-jaxprs) laid
    out for XLA:CPU."""
    return evaluate(jaxpr, consts, args, _equation)


def _equation(eqn: Any, ins: list[Any]) -> list[Any]:
    """`eqn` on `ins`: a convolution laid out, any other primitive bound with its
    sub-jaxprs rewritten where they hold convolutions."""
    if _rewritten(eqn):
        return [_conv(*ins, dict(eqn.params), _depthwise(eqn))]
    params = dict(eqn.params)
    for key, value in eqn.params.items():
        subs = sub_jaxprs(value)
        if not subs or not any(has_convolution(s) for s in subs):
            continue
        if isinstance(value, (tuple, list)):
            params[key] = rebuilt(value, [_rewrite(v) for v in value])
        else:
            params[key] = _rewrite(value)
    return bind(eqn, ins, params)


def _rewrite(sub: Any) -> Any:
    """A sub-jaxpr (open or closed, as it came) with its convolutions rewritten; an
    open one that would need constants is kept as it is."""
    if not isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        return sub
    closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
    avals = [_struct(v.aval) for v in closed.jaxpr.invars]
    new = jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a))(*avals)
    if isinstance(sub, jcore.ClosedJaxpr):
        return new
    return sub if new.consts else new.jaxpr


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and getattr(sharding, "mesh", None) is not None:
        sharding = None if sharding.mesh.empty else sharding
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding
    )


def canonical(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a chunk function: flat leaves to its outputs) with its convolutions
    laid out for XLA:CPU when the call runs on the CPU (`default_platform`); `fn`
    itself otherwise."""

    @ft.wraps(fn)
    def laid_out(leaves: list[Any], length: int) -> Any:
        if default_platform() != "cpu":
            return fn(leaves, length)
        # Arrays are traced; anything else (static leaves) is closed over as it is.
        traced = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)]

        def flat(*arrays: Any) -> list[Any]:
            return fn(_axes.combine(leaves, traced, arrays), length)

        arrays = [leaves[k] for k in traced]
        closed, shape = jax.make_jaxpr(flat, return_shape=True)(*arrays)
        tree = jax.tree.structure(shape)
        if not has_convolution(closed.jaxpr):
            return tree.unflatten(
                jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
            )
        return tree.unflatten(_evaluate(closed.jaxpr, closed.consts, arrays))

    return laid_out
