"""Convolutions inside the chunk loop (`chunkvmap._core._conv`), against jax.vmap.

On the CPU every chunk's float16/float32 convolutions are rewritten as transposes
around a canonical NHWC/HWIO convolution (a custom_jvp whose tangents transpose to
canonical convolutions too). The values and derivatives of every entry point must be
those of jax.vmap for any layout, dimension and convolution option, and the compiled
loop must hold only canonical convolutions (the layout XLA:CPU runs with Eigen).
"""

from __future__ import annotations

import re
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import chunkvmap
from chunkvmap import batch_vmap, clipped_grad_sum, per_example_grads
from chunkvmap.eqx import filter_batch_vmap

from .helpers import clipped_sum, jaxpr_eqns, make_mesh, mesh_devices, tree_allclose


N, B = 7, 3  # examples in chunks of 3: two full chunks and a remainder


@pytest.fixture(autouse=True)
def _every_kernel_laid_out(request, monkeypatch):
    """The rewrite applies from 64 (input x output) channels on, where it runs
    faster; this file's small kernels (fast to compile) are laid out too, so that
    every layout's rewrite is checked. `test_small_kernels_keep_their_layout`
    checks the threshold itself."""
    if request.node.originalname != "test_small_kernels_keep_their_layout":
        from chunkvmap._core import _conv

        monkeypatch.setattr(_conv, "_MIN_CHANNELS", 0)


# The tests of the rewrite itself, which is XLA:CPU's: on an accelerator's machine
# they run as CPU calls (`jax.default_device`), as a user there runs a CPU program.
CPU_REWRITE_TESTS = {
    "test_small_kernels_keep_their_layout",
    "test_the_chunk_function_is_rewritten",
    "test_sub_jaxprs",
    "test_bfloat16_is_left_alone",
    "test_compiled_loop_convolutions_are_canonical",
    "test_compiled_loop_is_as_canonical_as_vmap",
    "test_the_check_fails_on_a_plain_scan",
}


@pytest.fixture(autouse=True)
def _the_rewrite_on_the_cpu(request):
    if request.node.originalname not in CPU_REWRITE_TESTS:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_an_accelerator_call_is_not_rewritten(monkeypatch):
    """Off the CPU the chunk function's convolutions are left as written (the
    rewrite is XLA:CPU's), whatever their size."""
    from chunkvmap._core import _conv

    monkeypatch.setattr(_conv, "default_platform", lambda: "tpu")
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(N)
    eqns = jaxpr_eqns(jax.make_jaxpr(batch_vmap(case.f, (None, 0), batch_size=B))(w, x))
    assert any(e.primitive.name == "conv_general_dilated" for e in eqns)
    assert not any(e.primitive.name == "custom_jvp_call" for e in eqns)


def close(actual, expected, rtol=1e-5):
    """Equal structure, shapes and dtypes, and values to float32 summation-order
    differences: each leaf to `rtol` relative to its largest entry (a gradient entry
    sums terms as large as the largest; its own value may be near 0)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        scale = max(1.0, float(np.max(np.abs(np.asarray(e, np.float64)), initial=0)))
        tree_allclose(a, e, rtol=rtol, atol=rtol * scale)


# XLA:CPU's canonical (Eigen) convolution, by number of spatial dimensions.
CANONICAL = {1: "b0f_0io->b0f", 2: "b01f_01io->b01f", 3: "b012f_012io->b012f"}


# The depthwise exception: channels first, where XLA:CPU's naive path runs it (its
# forward convolution, and its input gradient's, whose kernel swaps I and O).
def channels_first(nd: int) -> tuple[str, str]:
    sp = "".join(map(str, range(nd)))
    return f"bf{sp}_oi{sp}->bf{sp}", f"bf{sp}_io{sp}->bf{sp}"


# Sizes by letter of a dimension_numbers string (the per-example lhs batch, "N",
# is 2: each example holds two images, merged with the mapped axis by vmap).
SPATIAL = {"H": 8, "W": 7, "D": 4}


def normal(seed, shape, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((scale * rng.normal(size=shape)).astype(dtype))


class Case:
    """One convolution: dimension_numbers strings and lax.conv_general_dilated's
    options; `arrays(n)` gives a kernel and `n` examples, each in the lhs layout."""

    def __init__(self, name, dn, *, cin=4, cout=4, k=3, **options):
        self.name, self.dn, self.cin, self.cout, self.k = name, dn, cin, cout, k
        self.options = dict(window_strides=None, padding="SAME") | options
        self.nd = len(dn[0]) - 2

    def __repr__(self):
        return self.name

    def f(self, w, x):
        opts = dict(self.options)
        strides = opts.pop("window_strides") or (1,) * self.nd
        return lax.conv_general_dilated(
            x, w, strides, dimension_numbers=self.dn, **opts
        )

    def arrays(self, n, seed=0, dtype=np.float32):
        groups = self.options.get("feature_group_count", 1)
        batch_groups = self.options.get("batch_group_count", 1)
        lhs_sizes = {"N": 2 * batch_groups, "C": self.cin, **SPATIAL}
        rhs_sizes = {"O": self.cout, "I": self.cin // groups}
        x_shape = [lhs_sizes[c] for c in self.dn[0]]
        w_shape = [rhs_sizes.get(c, self.k) for c in self.dn[1]]
        w = normal(seed, w_shape, dtype, scale=0.3)
        x = normal(seed + 1, (n, *x_shape), dtype)
        return w, x


# A thin grid: each layout family, dimension and option appears, not every product.
CASES = [
    Case("nchw2d", ("NCHW", "OIHW", "NCHW")),
    Case("nhwc2d_stride_valid", ("NHWC", "HWIO", "NHWC"), window_strides=(2, 2),
         padding="VALID"),
    Case("odd2d_explicit_rhs_dilation", ("NWCH", "WIOH", "CHWN"),
         window_strides=(2, 1), padding=((1, 0), (2, 1)), rhs_dilation=(2, 1)),
    Case("nchw1d_lhs_dilation", ("NCH", "OIH", "NCH"), window_strides=(2,),
         padding=((1, 2),), lhs_dilation=(2,), cout=3),
    Case("nhwc1d_grouped_rhs_dilation", ("NHC", "HIO", "NHC"), rhs_dilation=(2,),
         feature_group_count=2, cout=6),
    Case("nchw3d_valid", ("NCDHW", "OIDHW", "NCDHW"), padding="VALID", k=2,
         cin=2, cout=3),
    Case("ndhwc3d_stride", ("NDHWC", "DHWIO", "NDHWC"), window_strides=(1, 2, 1),
         k=2, cin=3, cout=2),
    Case("odd3d", ("CDNWH", "DOIWH", "WHNDC"), padding=((0, 1), (1, 1), (1, 0)),
         k=2, cin=2, cout=3),
    Case("nchw2d_grouped", ("NCHW", "OIHW", "NCHW"), feature_group_count=2,
         cout=6),
    Case("nhwc2d_depthwise", ("NHWC", "HWIO", "NHWC"), feature_group_count=4,
         cout=8, window_strides=(2, 2)),
    Case("nchw2d_transposed", ("NCHW", "OIHW", "NCHW"), lhs_dilation=(2, 2),
         padding=((2, 1), (2, 2)), window_strides=(1, 1)),
    Case("nchw2d_batch_groups", ("NCHW", "OIHW", "NCHW"), batch_group_count=2,
         cout=6, padding="VALID"),
]  # fmt: skip
BY_NAME = {c.name: c for c in CASES}


# 1. Values.


@pytest.mark.parametrize("in_axes", [(None, 0), (0, 0)], ids=["shared", "per_example"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_values_match_vmap(case, in_axes):
    w, x = case.arrays(N)
    if in_axes[0] == 0:  # a kernel per example: vmap's rule makes feature groups
        w = jnp.stack([w * (1.0 + 0.1 * i) for i in range(N)])
    expected = jax.vmap(case.f, in_axes)(w, x)
    actual = batch_vmap(case.f, in_axes, batch_size=B)(w, x)
    close(actual, expected)


def test_conv_transpose_matches_vmap():
    w = normal(2, (3, 3, 4, 5), scale=0.3)  # HWIO
    x = normal(3, (N, 1, 6, 6, 4))  # NHWC

    def f(w, x):
        a = lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=None)
        b = lax.conv_transpose(
            x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (2, 1), "VALID",
            dimension_numbers=("NCHW", "IOHW", "NCHW"), transpose_kernel=True,
        )  # fmt: skip
        return a, b

    close(batch_vmap(f, (None, 0), batch_size=B)(w, x), jax.vmap(f, (None, 0))(w, x))


@pytest.mark.parametrize("n, b", [(7, 2), (6, 3), (3, 5), (1, 1)])
def test_batch_sizes_jit_and_eager(n, b):
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(n, seed=4)
    expected = jax.vmap(case.f, (None, 0))(w, x)
    chunked = batch_vmap(case.f, (None, 0), batch_size=b)
    close(chunked(w, x), expected)
    close(jax.jit(chunked)(w, x), expected)


@pytest.mark.parametrize(
    "nd, cin, cout, laid_out",
    [(1, 2, 4, False), (2, 4, 4, False), (3, 2, 4, False), (3, 4, 16, True),
     (2, 8, 8, True), (1, 32, 2, True)],
)  # fmt: skip
def test_small_kernels_keep_their_layout(nd, cin, cout, laid_out):
    """Kernels of fewer than 64 (input x output) channels run faster on XLA:CPU's
    own path inside the loop (a 3-D 2 -> 4 convolution 7x slower laid out), and
    are left as they are; larger ones are laid out. Values match jax.vmap."""
    sp = "DHW"[-nd:]
    case = Case("c", ("NC" + sp, "OI" + sp, "NC" + sp), cin=cin, cout=cout)
    w, x = case.arrays(N)
    chunked = batch_vmap(case.f, (None, 0), batch_size=B)
    eqns = jaxpr_eqns(jax.make_jaxpr(chunked)(w, x))
    assert any(e.primitive.name == "custom_jvp_call" for e in eqns) == laid_out
    close(chunked(w, x), jax.vmap(case.f, (None, 0))(w, x))


def test_the_chunk_function_is_rewritten():
    """The traced program holds the canonical convolution in a custom_jvp (the
    positive control of the dtype tests below)."""
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(N)
    eqns = jaxpr_eqns(jax.make_jaxpr(batch_vmap(case.f, (None, 0), batch_size=B))(w, x))
    convs = [e for e in eqns if e.primitive.name == "conv_general_dilated"]
    assert any(e.primitive.name == "custom_jvp_call" for e in eqns)
    canonical = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
    assert {e.params["dimension_numbers"] for e in convs} == {canonical}


# Convolutions in sub-jaxprs: the rewrite recurses into them.


def nchw(w, x):
    return BY_NAME["nchw2d"].f(w, x)


@jax.custom_jvp
def conv_custom_jvp(w, x):
    return nchw(w, x)


@conv_custom_jvp.defjvp
def _conv_custom_jvp_rule(primals, tangents):
    return jax.jvp(nchw, primals, tangents)


@jax.custom_vjp
def conv_custom_vjp(w, x):
    return nchw(w, x)


def _conv_custom_vjp_fwd(w, x):
    return nchw(w, x), (w, x)


def _conv_custom_vjp_bwd(residuals, g):
    return jax.vjp(nchw, *residuals)[1](g)


conv_custom_vjp.defvjp(_conv_custom_vjp_fwd, _conv_custom_vjp_bwd)


def scanned(w, x):
    return lax.scan(lambda h, _: (jnp.tanh(nchw(w, h)), None), x, None, length=2)[0]


SUB_JAXPRS = {
    "jit": jax.jit(nchw),
    "checkpoint": jax.checkpoint(nchw),
    "checkpoint_dots": jax.checkpoint(
        nchw, policy=jax.checkpoint_policies.checkpoint_dots
    ),
    "scan": scanned,
    "cond": lambda w, x: lax.cond(
        jnp.sum(w) > 0, lambda: nchw(w, x), lambda: -nchw(w, 2.0 * x)
    ),
    "nested": jax.jit(jax.checkpoint(scanned)),
    # custom_linear_solve, whose jaxprs are a namedtuple
    "cg": lambda w, x: jax.scipy.sparse.linalg.cg(
        lambda v: v + 0.05 * nchw(w, v), x, maxiter=3
    )[0],
    "custom_jvp": conv_custom_jvp,
    "custom_vjp": conv_custom_vjp,
    "precision_highest": lambda w, x: lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        precision=lax.Precision.HIGHEST,
    ),
    "closed_over_constant": lambda w, x: (
        nchw(w, x) + nchw(jnp.asarray(np.full((4, 4, 3, 3), 0.1, np.float32)), x)
    ),
}


@pytest.mark.parametrize("name", SUB_JAXPRS)
def test_sub_jaxprs(name):
    """Values and gradients; and (except in a user's own derivative rule, below)
    the compiled loop's convolutions, forward and backward, are canonical."""
    f = SUB_JAXPRS[name]
    w, x = BY_NAME["nchw2d"].arrays(N, seed=17)

    def loss(mapper):
        return lambda w, x: jnp.sum(jnp.sin(mapper(f, (None, 0))(w, x)))

    chunked = loss(lambda f, a: batch_vmap(f, a, batch_size=B))
    expected = jax.vmap(f, (None, 0))(w, x)
    close(batch_vmap(f, (None, 0), batch_size=B)(w, x), expected)
    grad = jax.jit(jax.grad(chunked, (0, 1)))
    close(grad(w, x), jax.grad(loss(jax.vmap), (0, 1))(w, x))
    if not name.startswith("custom"):
        labels = conv_labels(jax.grad(chunked, (0, 1)), w, x)
        assert labels and set(labels) == {CANONICAL[2]}, labels


# 2. Derivatives through the loop.


GRAD_CASES = [
    (c.name, argnums)
    for c in CASES
    for argnums in ([(0,), (1,), (0, 1)] if c.name == "nchw2d" else [(0, 1)])
]


@pytest.mark.parametrize("name, argnums", GRAD_CASES)
def test_grad_matches_vmap(name, argnums):
    case = BY_NAME[name]
    w, x = case.arrays(N, seed=5)

    def loss(mapper):
        return lambda w, x: jnp.sum(jnp.tanh(mapper(case.f, (None, 0))(w, x)) ** 2)

    expected = jax.grad(loss(jax.vmap), argnums)(w, x)
    chunked = loss(lambda f, a: batch_vmap(f, a, batch_size=B))
    close(jax.grad(chunked, argnums)(w, x), expected)


@pytest.mark.parametrize("name", ["nchw2d", "odd2d_explicit_rhs_dilation"])
def test_per_example_kernels_grad(name):
    case = BY_NAME[name]
    w, x = case.arrays(N, seed=6)
    ws = jnp.stack([w * (1.0 - 0.05 * i) for i in range(N)])

    def loss(mapper):
        return lambda w, x: jnp.sum(jnp.sin(mapper(case.f, (0, 0))(w, x)))

    expected = jax.grad(loss(jax.vmap), (0, 1))(ws, x)
    actual = jax.grad(loss(lambda f, a: batch_vmap(f, a, batch_size=B)), (0, 1))(ws, x)
    close(actual, expected)


@pytest.mark.parametrize("name", ["nchw2d", "nhwc1d_grouped_rhs_dilation", "odd3d"])
def test_forward_mode(name):
    """jvp (both tangents and each alone) and jacfwd w.r.t. the kernel."""
    case = BY_NAME[name]
    w, x = case.arrays(N, seed=7)
    dw, dx = normal(8, w.shape), normal(9, x.shape)
    ref = jax.vmap(case.f, (None, 0))
    chunked = batch_vmap(case.f, (None, 0), batch_size=B)
    for tangents in [(dw, dx), (dw, jnp.zeros_like(dx)), (jnp.zeros_like(dw), dx)]:
        close(jax.jvp(chunked, (w, x), tangents), jax.jvp(ref, (w, x), tangents))
    close(jax.jit(jax.jacfwd(chunked))(w, x), jax.jit(jax.jacfwd(ref))(w, x))


def test_jvp_of_a_function_of_the_kernel_only():
    """A closed-over input: only the kernel has a tangent (a symbolic zero)."""
    case = BY_NAME["nhwc2d_stride_valid"]
    w, x = case.arrays(N, seed=10)
    dw = normal(11, w.shape)

    def chunked(w):
        return batch_vmap(lambda xi: case.f(w, xi), batch_size=B)(x)

    def ref(w):
        return jax.vmap(lambda xi: case.f(w, xi))(x)

    close(jax.jvp(chunked, (w,), (dw,)), jax.jvp(ref, (w,), (dw,)))


def tiny_conv(w, x):
    """2 x 2 kernel of one input and output channel (4 parameters), NCHW."""
    y = lax.conv_general_dilated(
        x[None], w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    return jnp.tanh(y[0])


def test_hessian_wrt_the_kernel():
    w = normal(12, (1, 1, 2, 2), scale=0.5)
    x = normal(13, (N, 1, 5, 5))

    def loss(mapper):
        return lambda w: jnp.sum(mapper(tiny_conv, (None, 0))(w, x) ** 3)

    expected = jax.jit(jax.hessian(loss(jax.vmap)))(w)
    hessian = jax.hessian(loss(lambda f, a: batch_vmap(f, a, batch_size=B)))
    close(jax.jit(hessian)(w), expected, rtol=1e-4)


def test_grad_of_grad_of_a_scalar():
    """Reverse over reverse: the second derivative w.r.t. a scale of the input."""
    w = normal(14, (1, 1, 2, 2), scale=0.5)
    x = normal(15, (N, 1, 5, 5))

    def loss(mapper):
        def of_scale(s):
            return jnp.sum(mapper(lambda xi: tiny_conv(w, s * xi))(x) ** 2)

        return of_scale

    chunked = loss(lambda f: batch_vmap(f, batch_size=B))
    s = jnp.float32(0.7)
    expected = jax.grad(jax.grad(loss(jax.vmap)))(s)
    close(jax.grad(jax.grad(chunked))(s), expected, rtol=1e-4)


def test_vmap_over_batch_vmap_and_its_grad():
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(N, seed=16)
    ws = jnp.stack([w, -0.5 * w])

    def outer(mapper):
        return jax.vmap(lambda w: mapper(case.f, (None, 0))(w, x))

    chunked = outer(lambda f, a: batch_vmap(f, a, batch_size=B))
    close(chunked(ws), outer(jax.vmap)(ws))
    close(
        jax.grad(lambda ws: jnp.sum(jnp.tanh(chunked(ws))))(ws),
        jax.grad(lambda ws: jnp.sum(jnp.tanh(outer(jax.vmap)(ws))))(ws),
    )


# 3. The other entry points, on a small conv net.


def net_params(layout, seed=20):
    """Two 3 x 3 convolutions (3 -> 4 -> 4 channels, the second strided) and a
    dense head: OIHW kernels for NCHW, HWIO for NHWC."""
    p = {
        "c1": normal(seed, (3, 3, 3, 4), scale=0.3), "b1": normal(seed + 1, (4,)),
        "c2": normal(seed + 2, (3, 3, 4, 4), scale=0.3),
        "fc": normal(seed + 3, (4, 2), scale=0.5),
    }  # fmt: skip
    if layout == "NCHW":
        p["c1"], p["c2"] = p["c1"].transpose(3, 2, 0, 1), p["c2"].transpose(3, 2, 0, 1)
    return p


def net(layout):
    dn = ("NCHW", "OIHW", "NCHW") if layout == "NCHW" else ("NHWC", "HWIO", "NHWC")
    spatial = (2, 3) if layout == "NCHW" else (1, 2)

    def apply(p, img):
        h = lax.conv_general_dilated(
            img[None], p["c1"], (1, 1), "SAME", dimension_numbers=dn
        )
        b = p["b1"]
        bias = b[None, :, None, None] if layout == "NCHW" else b[None, None, None]
        h = jnp.tanh(h + bias)
        h = lax.conv_general_dilated(h, p["c2"], (2, 2), "VALID", dimension_numbers=dn)
        return jnp.tanh(h.mean(spatial)[0]) @ p["fc"]

    def loss(p, img, y):
        return jnp.sum((apply(p, img) - y) ** 2)

    return apply, loss


def net_data(layout, n=N, seed=30):
    img = normal(seed, (n, 3, 8, 8) if layout == "NCHW" else (n, 8, 8, 3))
    return img, normal(seed + 1, (n, 2))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_per_example_grads(layout):
    _, loss = net(layout)
    p, (img, y) = net_params(layout), net_data(layout)
    expected = jax.vmap(jax.grad(loss), (None, 0, 0))(p, img, y)
    close(per_example_grads(loss, batch_size=B)(p, img, y), expected)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_clipped_grad_sum(layout, method, always_ghost):
    _, loss = net(layout)
    p, (img, y) = net_params(layout), net_data(layout)
    clip = float(np.median(clipped_sum(loss, 1.0, (p, img, y))[1]))
    expected_sum, expected_norms = clipped_sum(loss, clip, (p, img, y))
    assert 0 < int((expected_norms > clip).sum()) < N  # some clipped, some not
    chunked = clipped_grad_sum(
        loss, clip, batch_size=B, return_norms=True, method=method
    )
    total, count, norms = jax.jit(chunked)(p, img, y)
    close(total, expected_sum)
    close(norms, expected_norms)
    assert int(count) == N


# 4. Frameworks.


def test_equinox_conv2d():
    model = eqx.nn.Conv2d(3, 4, 3, stride=2, padding=1, key=jax.random.key(0))
    img, _ = net_data("NCHW")  # Equinox's images are CHW

    def apply(m, x):
        return jnp.tanh(m(x))

    in_axes = (None, 0)
    expected = eqx.filter_vmap(apply, in_axes=in_axes)(model, img)
    close(filter_batch_vmap(apply, in_axes=in_axes, batch_size=B)(model, img), expected)

    def loss(mapper):
        return lambda m: jnp.sum(mapper(apply, in_axes=in_axes)(m, img) ** 2)

    chunked = loss(lambda f, **kw: filter_batch_vmap(f, **kw, batch_size=B))
    close(
        eqx.filter(eqx.filter_grad(chunked)(model), eqx.is_array),
        eqx.filter(eqx.filter_grad(loss(eqx.filter_vmap))(model), eqx.is_array),
    )


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Conv(4, (3, 3), strides=(2, 2))(x))
        return nn.Conv(2, (3, 3), feature_group_count=2, padding="VALID")(x)


def test_flax_linen_conv():
    model = LinenNet()
    img, _ = net_data("NHWC")  # linen's images are HWC
    variables = jax.jit(model.init)(jax.random.key(1), img[0])

    def apply(v, x):
        return model.apply(v, x)

    expected = jax.vmap(apply, (None, 0))(variables, img)
    chunked = batch_vmap(apply, (None, 0), batch_size=B)
    close(chunked(variables, img), expected)

    def loss(mapper):
        return lambda v: jnp.sum(jnp.sin(mapper(v, img)))

    close(
        jax.grad(loss(chunked))(variables),
        jax.grad(loss(jax.vmap(apply, (None, 0))))(variables),
    )


# 5. Dtypes the rewrite leaves alone.


def rewritten(fn, *args) -> bool:
    """Whether the traced program holds a custom_jvp (the rewrite's mark)."""
    eqns = jaxpr_eqns(jax.make_jaxpr(fn)(*args))
    assert any(e.primitive.name == "conv_general_dilated" for e in eqns)
    return any(e.primitive.name == "custom_jvp_call" for e in eqns)


def test_bfloat16_is_left_alone():
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(N, seed=40, dtype=jnp.bfloat16)
    chunked = batch_vmap(case.f, (None, 0), batch_size=B)
    assert not rewritten(chunked, w, x)
    assert rewritten(chunked, *case.arrays(N, seed=40))  # f32: the positive control
    tree_allclose(chunked(w, x), jax.vmap(case.f, (None, 0))(w, x))


@pytest.mark.parametrize("name", ["nchw2d", "odd2d_explicit_rhs_dilation"])
def test_float64_is_left_alone(name):
    case = BY_NAME[name]
    with jax.enable_x64(True):
        w, x = case.arrays(N, seed=41, dtype=np.float64)
        chunked = batch_vmap(case.f, (None, 0), batch_size=B)
        assert not rewritten(chunked, w, x)
        ref = jax.vmap(case.f, (None, 0))
        tree_allclose(chunked(w, x), ref(w, x), rtol=1e-12, atol=1e-12)

        def loss(f):
            return lambda w, x: jnp.sum(jnp.tanh(f(w, x)))

        tree_allclose(
            jax.grad(loss(chunked), (0, 1))(w, x),
            jax.grad(loss(ref), (0, 1))(w, x),
            rtol=1e-12,
            atol=1e-12,
        )


# 6. The speed property: the compiled loop holds only canonical convolutions.


def conv_labels(fn, *args) -> list[str]:
    """The dim_labels of every convolution of `jax.jit(fn)`'s optimised HLO."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    lines = [line for line in text.splitlines() if " convolution(" in line]
    labels = [re.search(r"dim_labels=([^,}\s]+)", line) for line in lines]
    assert all(labels), lines
    return [m.group(1) for m in labels]


def programs(layout, mapper):
    """The chunked programs of a 2-convolution net: forward, grad of the summed
    output, per-example grads and clipped sums (vmap and ghost), by `mapper`."""
    apply, loss = net(layout)
    out = {
        "forward": lambda p, img, y: mapper(apply)(p, img),
        "grad": jax.grad(lambda p, img, y: jnp.sum(mapper(apply)(p, img)), (0, 1)),
    }
    if mapper is chunked_mapper:
        out |= {
            "per_example_grads": per_example_grads(loss, batch_size=B),
            "clipped_vmap": clipped_grad_sum(loss, 1.0, batch_size=B),
            "clipped_ghost": clipped_grad_sum(loss, 1.0, batch_size=B, method="ghost"),
        }
    return out


def chunked_mapper(f):
    return batch_vmap(f, (None, 0), batch_size=B)


def scan_mapper(f):
    """A plain lax.scan over jax.vmap chunks (no chunkvmap), for N = 6 = 2 x B."""

    def mapped(p, img):
        def step(carry, chunk):
            return carry, jax.vmap(f, (None, 0))(p, chunk)

        chunks = img[:6].reshape(2, B, *img.shape[1:])
        return lax.scan(step, None, chunks)[1].reshape(6, -1)

    return mapped


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_compiled_loop_convolutions_are_canonical(layout, always_ghost):
    args = (net_params(layout), *net_data(layout))
    with warnings.catch_warnings():  # no ghost fallback is expected: fail on one
        warnings.simplefilter("error", chunkvmap.GhostFallbackWarning)
        for name, fn in programs(layout, chunked_mapper).items():
            labels = conv_labels(fn, *args)
            assert labels, name  # not vacuous: the program has convolutions
            assert set(labels) == {CANONICAL[2]}, (name, labels)


def group_expanded(nd: int) -> str:
    """XLA's expansion of a batch-grouped `nd`-D convolution (the kernel gradient of
    a grouped one): the groups as one more spatial dimension, which XLA then
    canonicalises outside a loop only (inside one, measured no slower than
    jax.vmap's canonical form: depthwise and 4 groups, 32 x 32 x 32, N = 64)."""
    sp = "".join(map(str, range(nd)))
    return f"{nd}b{sp}f_{sp}i{nd}o->b{sp}{nd}f"


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_compiled_loop_is_as_canonical_as_vmap(case):
    """Every case's forward and backward convolutions in the loop are canonical
    (a depthwise one's forward and input gradient channels first), except those
    jax.vmap's program (no loop) has in another layout too (XLA swaps the operands
    of a kernel gradient whose output is larger than its input: asymmetric padding,
    lhs dilation) and XLA's expansion of batch groups."""
    w, x = case.arrays(N, seed=50)

    def grad(mapper):
        def loss(w, x):
            return jnp.sum(mapper(case.f, (None, 0))(w, x) ** 2)

        return jax.grad(loss, (0, 1))

    chunked = conv_labels(grad(lambda f, a: batch_vmap(f, a, batch_size=B)), w, x)
    assert len(chunked) == 3, chunked  # forward, input and kernel gradients
    if case.options.get("feature_group_count", 1) == case.cin:  # depthwise
        assert chunked[:2] == list(channels_first(case.nd)), chunked
        chunked = chunked[2:]
    allowed = set(CANONICAL.values()) | set(conv_labels(grad(jax.vmap), w, x))
    grouped = {"feature_group_count", "batch_group_count"} & set(case.options)
    if grouped:
        allowed.add(group_expanded(case.nd))
    assert set(chunked) <= allowed, (chunked, allowed)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_check_fails_on_a_plain_scan(layout):
    """The negative control: a lax.scan of jax.vmap chunks, the same net, has
    convolutions XLA:CPU left in a slow layout (forward for NCHW; the backward
    pass in either layout)."""
    args = (net_params(layout), *net_data(layout))
    found = {
        name: conv_labels(fn, *args)
        for name, fn in programs(layout, scan_mapper).items()
    }
    assert all(found.values()), found
    assert set(found["grad"]) - {CANONICAL[2]}, found
    if layout == "NCHW":
        assert set(found["forward"]) - {CANONICAL[2]}, found


# 7. Examples sharded over the 8 CPU devices.


@pytest.mark.skipif(len(mesh_devices(8)) < 8, reason="needs 8 simulated CPU devices")
def test_sharded_over_a_mesh():
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    case = BY_NAME["nchw2d"]
    w, x = case.arrays(20, seed=60)  # 20 = 8 x 2 + 4: a remainder
    chunked = batch_vmap(case.f, (None, 0), batch_size=2, shard=True, mesh=mesh)
    ref = jax.vmap(case.f, (None, 0))
    close(chunked(w, x), ref(w, x))

    def loss(f):
        return lambda w, x: jnp.sum(jnp.tanh(f(w, x)))

    close(
        jax.jit(jax.grad(loss(chunked), (0, 1)))(w, x),
        jax.grad(loss(ref), (0, 1))(w, x),
    )


# Gaps found by this file in `_conv.py` (these fail until it is changed).


def explicit_inputs(n=16, layout="NCHW"):
    """A mesh with an Explicit "data" axis, a kernel replicated on it and `n`
    examples sharded over it."""
    mesh = make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    p, (img, y) = net_params(layout), net_data(layout, n=n)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    p = jax.device_put(p, replicated)
    img, y = jax.device_put((img, y), sharded)
    return mesh, p, img, y


def nchw1(w, x):
    """One NCHW example (C, H, W)."""
    y = lax.conv_general_dilated(
        x[None], w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    return y[0]


@pytest.mark.skipif(len(mesh_devices(8)) < 8, reason="needs 8 simulated CPU devices")
def test_grad_on_an_explicit_mesh():
    """Reverse mode with the examples sharded over an Explicit axis. The
    kernel-gradient tangent convolution is mapped over the devices' shares; laid out
    with the input's batch dimension last (`_for_kernel_grad`), JAX's batching rule
    would merge the sharded share axis into it, a reshape Explicit sharding rejects
    (ShardingTypeError), so under an Explicit mesh `_conv_jvp` keeps JAX's layout."""
    mesh, p, img, _ = explicit_inputs()
    w = p["c1"]

    def loss(mapper):
        return lambda w, x: jnp.sum(jnp.tanh(mapper(nchw1, (None, 0))(w, x)))

    with jax.set_mesh(mesh):
        expected = jax.jit(jax.grad(loss(jax.vmap), (0, 1)))(w, img)
        chunked = loss(lambda f, a: batch_vmap(f, a, batch_size=1))
        close(jax.jit(jax.grad(chunked, (0, 1)))(w, img), expected)


@pytest.mark.skipif(len(mesh_devices(8)) < 8, reason="needs 8 simulated CPU devices")
def test_ghost_clipping_on_an_explicit_mesh(always_ghost):
    """method="ghost" with the examples sharded over an Explicit axis. The ghost
    chunk traces some equations under the Auto form of the mesh; bound in the
    caller's (Explicit) context they would fail (ValueError: context mesh ... should
    match the aval mesh), so `_conv._evaluate` enters each equation's own context
    (`eqn.ctx.manager`, as `jax.core.eval_jaxpr` does)."""
    mesh, p, img, y = explicit_inputs()
    _, loss = net("NCHW")
    host = jax.device_get((p, img, y))
    expected = clipped_sum(loss, 1.0, host)[0]
    with jax.set_mesh(mesh):
        ghost = clipped_grad_sum(loss, 1.0, batch_size=1, method="ghost")
        total, count = jax.jit(ghost)(p, img, y)
    close(jax.device_get(total), expected)
    assert int(count) == 16
