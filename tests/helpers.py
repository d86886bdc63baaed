"""Shared test helpers."""

from __future__ import annotations

import contextlib
import contextvars
import functools as ft
import os
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


@contextlib.contextmanager
def compiled_as_users():
    """Compile with LLVM's optimisations inside, as users do (the suite compiles
    without them: the root conftest.py). For claims that are bitwise against another
    program. JAX's caches are cleared on both sides, so that no program compiled one
    way is reused by a caller that asked for the other."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


def users_environment() -> dict[str, str]:
    """This process's environment for a script run as a user would run it: no JAX or
    XLA settings (no device count, no promotion rules), except the compile settings
    the suite runs with (the root conftest.py: the script compiles as fast)."""
    keep = ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")
    env = {
        k: v
        for k, v in os.environ.items()
        if k in keep or not k.startswith(("XLA_", "JAX_"))
    }
    if jax.default_backend() != "cpu":  # one process at a time holds the chip
        env["JAX_PLATFORMS"] = "cpu"
    return env


class RunOnCpu(Exception):
    """Raised by `mesh_devices` inside a test on an accelerator with fewer devices
    than the test's mesh needs: `conftest.py` runs the test again from its start
    with the CPU as the default device, so that its arrays and its mesh (of the CPU
    devices) meet."""


# Whether a test function is running (set by `conftest.py` on an accelerator):
# outside one (a module's constants, a fixture) `mesh_devices` never raises.
IN_TEST = contextvars.ContextVar("in_test", default=False)


def mesh_devices(n: int) -> list:
    """`n` devices for a test's mesh: the default backend's where it has `n` (the
    8 simulated CPU devices of `conftest.py` on CPU), else the CPU devices, the
    whole test then running on the CPU (on a one-chip accelerator; `RunOnCpu`)."""
    devices = jax.devices()
    if len(devices) >= n:
        return devices[:n]
    default = jax.config.jax_default_device
    if IN_TEST.get() and getattr(default, "platform", default) != "cpu":
        raise RunOnCpu(f"a mesh of {n} devices, the default backend has {len(devices)}")
    return jax.devices("cpu")[:n]


def holds_cpu_mesh(values: Any) -> bool:
    """Whether `values` (a module's constants, a test's fixtures) hold a mesh of CPU
    devices, directly or in a list, tuple or dict."""
    for v in values:
        if isinstance(v, (list, tuple)) and holds_cpu_mesh(v):
            return True
        if isinstance(v, dict) and holds_cpu_mesh(v.values()):
            return True
        if isinstance(v, jax.sharding.Mesh) and v.devices.size:
            if v.devices.flat[0].platform == "cpu":
                return True
    return False


def make_mesh(shape, names, axis_types=None, *, devices=None) -> jax.sharding.Mesh:
    """`jax.make_mesh` over `mesh_devices` (or `devices`)."""
    n = int(np.prod(shape))
    return jax.make_mesh(
        shape,
        names,
        axis_types,
        devices=mesh_devices(n) if devices is None else devices,
    )


def tree_allclose(actual: Any, expected: Any, *, rtol=1e-5, atol=1e-6) -> None:
    """Assert equal structure, shapes and dtypes, then values to tolerance."""
    ta, te = jax.tree.structure(actual), jax.tree.structure(expected)
    assert ta == te, f"tree structure differs:\n  {ta}\n  {te}"
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert jnp.shape(a) == jnp.shape(e), (jnp.shape(a), jnp.shape(e))
        assert jnp.result_type(a) == jnp.result_type(e), (a.dtype, e.dtype)
        if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        leaf_rtol, leaf_atol = rtol, atol  # loosened for this leaf only
        if a.dtype == jnp.bfloat16:
            a, e = a.astype(np.float32), e.astype(np.float32)
            leaf_rtol, leaf_atol = max(rtol, 1e-2), max(atol, 1e-2)
        if np.issubdtype(a.dtype, np.inexact):
            np.testing.assert_allclose(a, e, rtol=leaf_rtol, atol=leaf_atol)
        else:
            np.testing.assert_array_equal(a, e)


def temp_bytes(f, *args) -> int:
    """XLA's compiled estimate of the temporary memory of `jax.jit(f)(*args)`, on
    CPU: the suite's memory figures are XLA:CPU's (an accelerator's compiler
    reports another figure under that name), so off CPU the program is traced and
    compiled as a call on the CPU would be (the CPU its default device, arguments
    not already on CPU devices placed on the first): the library lays a program
    out for the platform it runs on."""
    with jax.default_device(jax.devices("cpu")[0]):
        compiled = jax.jit(f).lower(*on_cpu(args)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


class HostLog(list):
    """A list that host callbacks (`jax.debug.callback`) append to, read only after
    every callback issued so far has run (`jax.effects_barrier`): on an accelerator
    they run asynchronously to the program, and may not all have run when its
    result is back."""

    def __len__(self) -> int:
        jax.effects_barrier()
        return super().__len__()

    def __iter__(self):
        jax.effects_barrier()
        return super().__iter__()

    def __getitem__(self, k):
        jax.effects_barrier()
        return super().__getitem__(k)

    def __eq__(self, other) -> bool:
        jax.effects_barrier()
        return super().__eq__(other)

    __hash__ = None

    def clear(self) -> None:
        jax.effects_barrier()
        super().clear()


def program_bytes(f, *args) -> int:
    """The figure `batch_size="auto"` holds to its budget for `jax.jit(f)(*args)` on
    the default backend (XLA's temporaries on CPU; its peak less the arguments on an
    accelerator): for tests of the choice itself, which hold on any backend."""
    from chunkvmap._core import _memory

    compiled = jax.jit(f).lower(*args).compile()
    return _memory.program_bytes(
        compiled.memory_analysis(), _memory.platform_of(compiled)
    )


def on_cpu(tree: Any) -> Any:
    """`tree` as the CPU would hold it: each array not on CPU devices as an
    abstract array on the first CPU device (off CPU; unchanged on CPU)."""
    if jax.default_backend() == "cpu":
        return tree
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array) and all(
            d.platform == "cpu" for d in x.sharding.device_set
        ):
            return x
        if isinstance(x, (jax.Array, np.ndarray)) or (
            isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
        ):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu)
        return x

    return jax.tree.map(place, tree)


def record_auto_searches(monkeypatch) -> list[dict]:
    """Record every `batch_size="auto"` search: its N (`size`), budget (`limit`), the
    probes it measured (`seen`: batch size -> temp bytes) and its choice (`chosen`)."""
    from chunkvmap._core import _memory

    searches: list[dict] = []
    original = _memory.choose_batch_size

    def spy(name, measure, size, limit):
        seen: dict[int, int] = {}

        def recording(b):
            seen[b] = measure(b)
            return seen[b]

        chosen = original(name, recording, size, limit)
        searches.append(dict(size=size, limit=limit, seen=seen, chosen=chosen))
        return chosen

    monkeypatch.setattr(_memory, "choose_batch_size", spy)
    return searches


def check_auto_choice(search: dict, chosen: int, n: int, budget: int, measure) -> None:
    """What `batch_size="auto"` guarantees about its `chosen` size for `n` examples.

    `measure(b)` is the compiled temp memory of the same program with the fixed int
    `batch_size=b`. The search (`chunkvmap._core._memory.choose_batch_size`) finds
    the largest probed size that fit, and stops only when that is N, when it fills
    >= 95% of the budget, or when a larger probed size did not fit (or when its 8
    probes are spent, or when linear extrapolation from the first two probes says
    the next size would not fit: neither happens in these tests, which then fail,
    as they should for a search that gives up early). It then takes the fewest
    chunks that fit, each as short as they allow (the fewest examples evaluated
    for that many chunks) where that size fits too, else the largest. A search that
    returned, say, 1 fails here.
    """
    assert search["size"] == n and search["limit"] == budget, search
    assert search["chosen"] == chosen, search
    seen = search["seen"]
    fitting = [b for b, m in seen.items() if m <= budget]
    largest = max(fitting)
    # It measured the very program that then runs with batch_size=largest.
    assert measure(largest) == seen[largest], (largest, seen)
    chunks = -(-n // largest)
    balanced = -(-n // chunks)
    fits = measure(balanced) <= budget  # not always: the estimate is not monotone
    assert chosen == (balanced if fits else largest), (chosen, largest, n)
    assert measure(chosen) <= budget, (chosen, budget)
    larger_failed = any(b > largest and m > budget for b, m in seen.items())
    assert largest == n or seen[largest] >= 0.95 * budget or larger_failed, seen
    # Not needlessly small, measured independently: temp memory grows with the chunk
    # size (about affinely), so a chunk twice as large (or all N) does not fit.
    if largest < n:
        bigger = min(n, 2 * largest)
        assert measure(bigger) > budget, (largest, bigger, measure(bigger), budget)


class TraceCounter:
    """Wraps a function and counts how often JAX traces (calls) it in Python."""

    def __init__(self, f):
        self.f = f
        self.count = 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.f(*args, **kwargs)


class CompileCounter:
    """Counts the XLA compilations made while it is entered (JAX's monitoring
    events), as `with CompileCounter() as compiles: ...; compiles.count`. A
    program loaded from the persistent compilation cache (the suite keeps one:
    the root conftest) counts too: JAX times the load as a compilation."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def jaxpr_eqns(jaxpr) -> list:
    """Every equation of `jaxpr`, recursively: also those in the sub-jaxprs held in
    equation parameters (scan and while bodies, cond branches, jit, remat,
    custom_jvp/vjp calls, ...), depth first."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(
                    sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)
                ):
                    found.extend(jaxpr_eqns(sub))
    return found


def init_mlp(key, sizes):
    """Parameters of an MLP with layer widths `sizes`: a list of (w, b) pairs."""
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b)))
    return params


def mlp(params, x, activation=jnp.tanh):
    """The MLP's output for one example `x`."""
    for w, b in params[:-1]:
        x = activation(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def clipped_sum(
    fun, clip, args, *, in_axes=None, argnums=0, kwargs=None, finite_only=False,
    pad=None,
):  # fmt: skip
    """The oracle of every clipped sum: DP-SGD's clipped sum written out with
    `jax.vmap(jax.grad)` over all N examples at once.

    Each example's gradient g_i (every leaf of the `argnums` arguments of `fun`, on
    `args` mapped along `in_axes`: by default the first argument unmapped and the
    others along axis 0; `kwargs`, not differentiated, mapped along axis 0 as
    `jax.vmap` maps keyword arguments) is clipped and summed by `clip_and_sum`.
    Leaves that are not arrays (a string passed whole to every example) are passed
    as they are, as `jax.vmap` passes them. Returns the sum (structured like
    `jax.grad(fun, argnums)`) and the N norms, from one compiled program.
    """
    args = tuple(args)
    if in_axes is None:
        in_axes = (None,) + (0,) * (len(args) - 1)
    argnums = tuple(argnums) if isinstance(argnums, list) else argnums
    leaves, tree = jax.tree.flatten((args, kwargs or {}))
    fixed = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
    traced = [x for x in leaves if _is_array(x)]
    return _clipped_sum(
        fun, in_axes, argnums, finite_only, tree, fixed, clip, traced, pad
    )


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


@ft.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _clipped_sum(fun, in_axes, argnums, finite_only, tree, fixed, clip, traced, pad):
    fixed, traced = dict(fixed), iter(traced)
    leaves = [fixed[i] if i in fixed else next(traced) for i in range(tree.num_leaves)]
    args, kwargs = jax.tree.unflatten(tree, leaves)
    grads = jax.vmap(jax.grad(fun, argnums), in_axes)(*args, **kwargs)
    return clip_and_sum(grads, clip, finite_only=finite_only, pad=pad)


def clip_and_sum(grads, clip, *, finite_only=False, pad=None):
    """`clipped_sum`'s clipping and sum, of per-example gradients already stacked
    (every leaf of `grads` holds the N examples along axis 0).

    Each example's gradient g_i is scaled by min(1, clip / ||g_i||) and the scaled
    gradients are summed. ||g_i|| is accumulated in at least float32 (float64 for
    double-precision leaves). `finite_only` zeroes non-finite gradient entries first
    (`nan_safe`'s definition); otherwise a NaN norm stays NaN and scales its example
    by 0 (jax-privacy's rule with `nan_safe=False`), and an infinite norm scales it by
    clip / inf = 0. `pad` (N booleans) scales padding examples by 0. The norm and the
    scale use the double-`where` idiom, so that the oracle itself has finite
    derivatives where g_i = 0 (it is differentiated to check second order). Returns
    the sum and the N norms.
    """
    if finite_only:
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0), grads)
    leaves = jax.tree.leaves(grads)
    reals = [jnp.finfo(g.dtype).dtype for g in leaves]  # complex64 -> float32
    acc = max([jnp.dtype(jnp.float32), *reals], key=lambda dtype: dtype.itemsize)
    squares = sum(
        jnp.sum(jnp.square(jnp.abs(g).astype(acc)), axis=tuple(range(1, g.ndim)))
        for g in leaves
    )
    positive = squares > 0
    norms = jnp.where(positive, jnp.sqrt(jnp.where(positive, squares, 1)), 0)
    norms = jnp.where(jnp.isnan(squares), squares, norms)
    clip = jnp.asarray(clip, norms.dtype)
    clipped = norms > clip
    scale = jnp.where(clipped, clip / jnp.where(clipped, norms, 1), 1)
    scale = jnp.where(jnp.isnan(norms), 0, scale)
    if pad is not None:
        scale = jnp.where(pad, 0, scale)

    # A contraction over the examples; where their axis is sharded over an Explicit
    # mesh (JAX refuses to type that contraction), a product and a sum (which
    # XLA:CPU runs many times slower on large leaves: a strided reduction).
    def scaled_sum(g):
        spec = getattr(getattr(jax.typeof(g), "sharding", None), "spec", None)
        if not spec or spec[0] is None:
            return jnp.tensordot(scale.astype(g.dtype), g, 1)
        factor = jnp.expand_dims(scale.astype(g.dtype), tuple(range(1, g.ndim)))
        return jnp.sum(factor * g, 0)

    return jax.tree.map(scaled_sum, grads), norms


def projected_grads(loss, params, batch, dim, seed=0):
    """The oracle of `per_example_grad_projections`: `jax.vmap(jax.grad(loss))` over
    `batch` (`params` unmapped), each leaf of each gradient contracted axis by axis
    with its Gaussian matrix (as the projection is defined: axis `j` of the `k`-th
    differentiated leaf, of size `d > dim`, by `normal(fold_in(fold_in(key(seed), k),
    j), (d, dim)) / sqrt(dim)`), flattened and concatenated: an `(N, K)` array."""
    grads = jax.jit(jax.vmap(jax.grad(loss), (None, *[0] * len(batch))))(params, *batch)
    columns = []
    for k, g in enumerate(jax.tree.leaves(grads)):
        x = np.asarray(g, np.float64)
        for j, d in enumerate(g.shape[1:]):
            if d > dim:
                p = _axis_matrix(seed, k, j, d, dim)
                x = np.moveaxis(np.tensordot(x, p, (j + 1, 0)), -1, j + 1)
        columns.append(x.reshape(x.shape[0], -1))
    return np.concatenate(columns, 1)


def projected_rows(grads, dim, seed=0):
    """`projected_grads`' projection of per-example gradients `grads` (a tree,
    examples first) in JAX, differentiable in `grads` and traceable: for the
    grids that call the oracle under `jax.jit`, `jax.grad` and `jax.vmap`."""
    columns = []
    for k, g in enumerate(jax.tree.leaves(grads)):
        for j, d in enumerate(g.shape[1:]):
            if d > dim:
                with jax.ensure_compile_time_eval():
                    p = jnp.asarray(_axis_matrix(seed, k, j, d, dim), g.dtype)
                g = jnp.moveaxis(jnp.tensordot(g, p, (j + 1, 0)), -1, j + 1)
        columns.append(g.reshape(g.shape[0], -1))
    return jnp.concatenate(columns, 1)


def _axis_matrix(seed, k, j, d, dim):
    """The projection's matrix of axis `j` (of `d > dim` entries) of the `k`-th
    differentiated leaf, as it is defined, in float64."""
    with jax.default_device(jax.devices("cpu")[0]):  # (drawn on the CPU)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), k), j)
        draws = jax.random.normal(key, (d, dim), jnp.float32)  # (x64 on or not)
    return np.asarray(draws, np.float64) / dim**0.5


def preconditioned_rows(rows, shapes, curvatures, dim, damping, seed=0):
    """The oracle of `per_example_grad_projections(..., precondition=)`: `rows` of
    `projected_grads` (leaves of `shapes`), each leaf's part times `(H + lambda
    I)^(-1/2)`, with `H = P^T F P`, `F` the leaf's dense curvature (`curvatures`:
    one `(n, n)` matrix per leaf, in its row-major order), `P` the dense Kronecker
    product of the leaf's axis matrices (the identity on an axis kept whole) and
    `lambda` `damping` times the mean eigenvalue of `H`; in float64."""
    out, start = [], 0
    for k, (shape, f) in enumerate(zip(shapes, curvatures)):
        proj = np.ones((1, 1))
        for j, d in enumerate(shape):
            p = _axis_matrix(seed, k, j, d, dim) if d > dim else np.eye(d)
            proj = np.kron(proj, p)
        h = proj.T @ np.asarray(f, np.float64) @ proj
        s, u = np.linalg.eigh((h + h.T) / 2)
        s = np.maximum(s, 0)
        root = u @ np.diag(1 / np.sqrt(s + damping * s.mean())) @ u.T
        part = rows[:, start : start + proj.shape[1]]
        out.append(part @ root)  # (root is symmetric)
        start += proj.shape[1]
    assert start == rows.shape[1]
    return np.concatenate(out, 1)


# -- curvature -------------------------------------------------------------------------


def nll(likelihood, f, y):
    """The negative log-likelihood of output `f` at label `y`: softmax
    cross-entropy over the last axis (summed over positions) or the halved
    squared error."""
    if likelihood == "categorical":
        logp = jax.nn.log_softmax(f, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, y[..., None], axis=-1))
    return 0.5 * jnp.sum((f - y) ** 2)


def output_cotangents(likelihood, fisher, f, label=None, key=None, samples=1):
    """The oracle's cotangents `(M, *f.shape)` of one example's output `f`, made
    without the library: `"exact"`, the columns of a square root of the loss's
    Hessian in `f` (`jax.hessian`, eigendecomposed); `"empirical"`, `jax.grad` of
    the loss at `label`; `"mc"`, `jax.grad` at labels drawn as documented
    (`drawn_by_hand`, or `f` plus
    `jax.random.normal(key, (samples, *f.shape))`), over `sqrt(samples)`."""
    f = np.asarray(f, np.float64)
    if fisher == "exact":
        y0 = np.zeros(f.shape[:-1], np.int32) if likelihood == "categorical" else f
        flat = lambda v: nll(likelihood, v.reshape(f.shape), y0)  # noqa: E731
        with jax.enable_x64():
            h = np.asarray(jax.hessian(flat)(jnp.asarray(f.reshape(-1))))
        vals, vecs = np.linalg.eigh(h)
        root = vecs * np.sqrt(np.clip(vals, 0, None))
        return root.T.reshape(-1, *f.shape)
    grad = jax.grad(lambda v, y: nll(likelihood, v, y))
    fj = jnp.asarray(f, jnp.float32)
    if fisher == "empirical":
        return np.asarray(grad(fj, label), np.float64)[None]
    if likelihood == "categorical":
        drawn = drawn_by_hand(key, f, samples)
    else:
        drawn = fj[None] + jax.random.normal(key, (samples, *f.shape))
    cots = [np.asarray(grad(fj, y), np.float64) for y in drawn]
    return np.stack(cots) / np.sqrt(samples)


def drawn_by_hand(key, f, samples, margins=False):
    """The classes drawn as documented from logits `f` (last axis), by NumPy in
    float64: `u = jax.random.uniform(key, (samples, *positions))`, each the first
    class whose cumulative probability exceeds `u` times the total. With
    `margins`, also each draw's distance from the nearest cumulative probability
    (a draw that close to a class's edge may fall on either side of it in
    float32 sums taken in another order)."""
    u = np.asarray(jax.random.uniform(key, (samples, *f.shape[:-1])), np.float64)
    z = np.exp(f - f.max(-1, keepdims=True))
    cdf = np.cumsum(z / z.sum(-1, keepdims=True), -1)
    cdf, v = cdf.reshape(-1, f.shape[-1]), u.reshape(samples, -1)
    drawn = [
        [np.searchsorted(c, t * c[-1], side="right") for c, t in zip(cdf, row)]
        for row in v
    ]
    drawn = np.minimum(np.array(drawn), f.shape[-1] - 1)
    drawn = drawn.reshape(u.shape).astype(np.int32)
    if not margins:
        return drawn
    edge = [[np.min(np.abs(c - t * c[-1])) for c, t in zip(cdf, row)] for row in v]
    return drawn, np.array(edge).reshape(u.shape)


def example_cotangents(likelihood, fisher, outputs, labels=None, key=None, samples=1):
    """`output_cotangents` of every example's output (`outputs` stacked), with
    example `i`'s key `jax.random.fold_in(key, i)` (as documented: with JAX's
    default generator, `jax.random.split(key, N)[i]`)."""
    n = len(outputs)
    keys = [None] * n if key is None else [jax.random.fold_in(key, i) for i in range(n)]
    labels = [None] * n if labels is None else labels
    return [
        output_cotangents(likelihood, fisher, f, y, k, samples)
        for f, y, k in zip(outputs, labels, keys)
    ]


def ggn_diagonal_dense(model, params, xs, cotangents):
    """The oracle of `ggn_diagonal`: each example's dense Jacobian of the output
    in the flattened parameters (`jax.jacfwd`), `sum_m (J^T c_m)^2` over its
    cotangents `c_m`: an `(N, P)` float64 array (and the unravel function)."""
    flat, unravel = ravel_pytree(params)
    jacobian = jax.jit(jax.jacfwd(lambda p, x: model(unravel(p), x)))
    rows = []
    for x, cots in zip(xs, cotangents):
        jac = np.asarray(jacobian(flat, x), np.float64)
        jac = jac.reshape(-1, flat.size)
        rows.append(np.sum((cots.reshape(len(cots), -1) @ jac) ** 2, 0))
    return np.stack(rows), unravel


def kfac_by_hand(tapped, params, xs, cotangents, variant="expand", biased=()):
    """The oracle of `kfac_factors`, from activations and output gradients
    captured by hand. `tapped(params, x, probes)` is the model written with each
    tapped product's output `y` returned as `y + probes[name]` (as is, when
    `probes` is None); it returns `(output, acts, ys)`, `acts[name]` the
    activation the product read (positions first, its input features flattened
    last, as the leaf's input axes are) and `ys[name]` the product's output
    (positions first, output features last). The output gradients are `jax.vjp`
    of the output in the probes, at each cotangent. The products named in
    `biased` have a bias added to their output: their activations get a last
    entry 1 (kfac-jax's dense and convolution blocks). Returns `{name: (A, G,
    count)}` in float64, `count` the terms summed into `A`."""
    factors = {}
    for x, cots in zip(xs, cotangents):
        _, acts, ys = tapped(params, x, None)
        zero = {k: jnp.zeros_like(y) for k, y in ys.items()}
        _, pull = jax.vjp(lambda p: tapped(params, x, p)[0], zero)
        grads = [pull(jnp.asarray(c, jnp.float32))[0] for c in cots]
        for k in acts:
            a = np.asarray(acts[k], np.float64).reshape(-1, acts[k].shape[-1])
            if k in biased:
                a = np.concatenate([a, np.ones((len(a), 1))], 1)
            gs = [np.asarray(g[k], np.float64) for g in grads]
            gs = [g.reshape(-1, g.shape[-1]) for g in gs]
            if variant == "expand":
                pair = (a.T @ a, sum(g.T @ g for g in gs))
            else:
                am = a.mean(0)
                pair = (np.outer(am, am), sum(np.outer(g.sum(0), g.sum(0)) for g in gs))
            pair = (*pair, len(a) if variant == "expand" else 1)
            old = factors.get(k, (0.0, 0.0, 0))
            factors[k] = tuple(o + q for o, q in zip(old, pair))
    return factors


def ekfac_by_hand(tapped, params, xs, cotangents, biased=(), bases_from=None):
    """The oracle of `ekfac_factors`: each tapped product's dense block of the
    eigenvalue-corrected curvature, `K diag(vec(L)) K^T` with `K = kron(Q_A,
    Q_G)`, `Q_A`, `Q_G` the eigenvectors of `kfac_by_hand`'s factors (the
    identity for a diagonal `A`: an embedding's counts) and `L = sum (Q_A^T G
    Q_G)^2` over the examples and cotangents of the product's gradient `G =
    a^T g` (activations by output gradients over the positions, captured by
    hand; a bias's row of ones joined), in float64; `bases_from`: other
    `(xs, cotangents)` whose factors give the bases. Returns `{name: block}`."""
    factors = kfac_by_hand(
        tapped, params, *(bases_from or (xs, cotangents)), biased=biased
    )
    bases = {}
    for k, (a, g, _) in factors.items():
        q_a = np.eye(len(a)) if np.allclose(a, np.diag(np.diag(a))) else None
        bases[k] = (np.linalg.eigh(a)[1] if q_a is None else q_a, np.linalg.eigh(g)[1])
    values = {k: 0.0 for k in factors}
    for x, cots in zip(xs, cotangents):
        _, acts, ys = tapped(params, x, None)
        zero = {k: jnp.zeros_like(y) for k, y in ys.items()}
        _, pull = jax.vjp(lambda p: tapped(params, x, p)[0], zero)
        for c in cots:
            grads = pull(jnp.asarray(c, jnp.float32))[0]
            for k in factors:
                a = np.asarray(acts[k], np.float64).reshape(-1, acts[k].shape[-1])
                if k in biased:
                    a = np.concatenate([a, np.ones((len(a), 1))], 1)
                d = np.asarray(grads[k], np.float64)
                gradient = a.T @ d.reshape(-1, d.shape[-1])
                q_a, q_g = bases[k]
                values[k] = values[k] + (q_a.T @ gradient @ q_g) ** 2
    blocks = {}
    for k, (q_a, q_g) in bases.items():
        basis = np.kron(q_a, q_g)
        blocks[k] = basis @ np.diag(values[k].reshape(-1)) @ basis.T
    return blocks


def ekfac_block(factor, block=None):
    """The dense block `K diag(vec(eigenvalues)) K^T` of an `EigenKronecker`
    (block `block` of a blocked leaf), in float64."""
    pick = (lambda x: x) if block is None else (lambda x: x[block])
    q_out = np.asarray(pick(factor.output_basis), np.float64)
    values = np.asarray(pick(factor.eigenvalues), np.float64)
    if factor.input_basis is None:
        q_in = np.eye(values.shape[0])
    else:
        q_in = np.asarray(pick(factor.input_basis), np.float64)
    basis = np.kron(q_in, q_out)
    return basis @ np.diag(values.reshape(-1)) @ basis.T
