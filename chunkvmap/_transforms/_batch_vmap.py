"""`batch_vmap`: the `jax.vmap` front end of the chunked pipeline.

`batch_vmap` validates its options once (`_options`), and each call flattens the
arguments to leaves with one canonical mapped axis each (`_axes`), traces the user's
function once to learn its outputs, describes one chunk of it as a `_loop.Body`, and
hands that to `_chunked.evaluate`. `vmap_call` is that pipeline for one call; the
gradient, Jacobian, vectorize and adapter front ends reuse it with their own options.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from .._core import (
    _axes,
    _cache,
    _chunked,
    _conv,
    _loop,
    _memory,
    _padding,
    _program,
)
from .._core._cache import function_name
from .._core._options import (
    AllChunking,
    ChunkOptions,
    VmapChunking,
    check_bool,
    check_callable,
    decorator_form,
    identity,
    shown,
    takes,
)


F = TypeVar("F", bound=Callable[..., Any])


@decorator_form("f")
@takes(VmapChunking)
def batch_vmap(
    f: F,
    /,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    *,
    padded: bool = False,
    **options: Unpack[VmapChunking],
) -> F:
    """Vectorise `f` like `jax.vmap`, evaluating the examples `batch_size` at a time.

    `batch_vmap(f, in_axes, out_axes, batch_size=B)(*args)` gives the same result as
    `jax.vmap(f, in_axes, out_axes)(*args)`, but maps `jax.vmap(f)` over chunks of `B`
    examples inside a `lax.scan`, so the working memory of `f` scales with `B`, not with
    the number of examples `N`. The result is exact for every `N`; when `B >= N` (or
    `B` is None) it is a single `jax.vmap` call. As pseudo-code::

        vf = jax.vmap(f, in_axes, out_axes)
        chunks = [vf(*args[i:i + B]) for i in range(0, N, B)]
        out = concatenate(chunks, axis=out_axes)

    When `B` does not divide `N`, the last chunk is the window of the last `B` examples
    (it overlaps the previous chunk, and its first `B - N % B` results are discarded):
    `f` appears once in the compiled program and is traced once per call, and no padded
    example is ever evaluated. The cost is at most `B - 1` recomputed examples. The
    chunks are written straight into the output (no concatenation), and the inputs are
    sliced in place along their own mapped axes (no transpose, no copy).

    With `reduction`, the chunk outputs are folded instead of stacked, so nothing of
    size `N` is ever built: each chunk's output pytree `y` is summarised by
    `chunk_reduction(y)`, which must remove the mapped axis (e.g. `lambda y: y.sum(0)`),
    and the summaries are combined in order, leaf by leaf, with the associative
    `reduction` (e.g. `jnp.add`, `jnp.maximum`, `jnp.matmul`): the result is
    `chunk_reduction(jax.vmap(f)(*args))` for reductions compatible with it. No identity
    element is assumed. `chunk_reduction` receives each chunk's outputs exactly as
    `jax.vmap` returns them for that chunk, so outputs with `out_axes=None` appear once
    per chunk: summarise only the mapped ones, or the result depends on `B`. Without
    `reduction`, `chunk_reduction` is applied once to the full output.

    Compared with `jax.lax.map(f, xs, batch_size=B)`: any `in_axes`/`out_axes` (not just
    axis 0 of every argument), keyword arguments, reductions that never materialise the
    `N` outputs, one trace of `f` instead of two, and no copy of the inputs or of the
    output for the remainder. Compared with `optax.microbatching.micro_vmap`: `N` need
    not be divisible by `B`, and any associative reduction is allowed.

    Reverse mode stays bounded too: with `remat=True` (the default) each chunk is
    checkpointed, so `jax.grad` through `batch_vmap` saves one index per chunk instead
    of every chunk's activations, and recomputes a chunk's forward pass during the
    backward pass (about one extra forward evaluation in total). `remat=False` keeps the
    residuals instead: faster, with memory growing with `N`. Where to put `grad`:
    `batch_vmap(jax.grad(loss))` (per-example gradients, chunked) needs no remat at all
    and is usually the better shape; `jax.grad(lambda p: batch_vmap(...)(p, x).sum())`
    is the one that relies on remat.

    Called eagerly (no argument is a tracer), every call traces `f`, so that it
    sees `f` as it is now (its closure's arrays, Python constants, callbacks), as
    `jax.vmap` does, and the chunked program is compiled once per distinct program:
    a new array (in the arguments or in `f`'s closure) compiles nothing, and a
    changed Python constant or callback, a new argument structure or type is a
    new program. Under an outer `jax.jit` the caller's cache does that.

    `batch_size="auto"` picks the fewest chunks whose temporary memory, by XLA's
    compiled estimate for the actual argument shapes, fits `memory_limit`, each as
    short as they allow (`N=256` that fits 255 at once runs two chunks of 128, not
    two of 255 overlapping by 254). It compiles
    a few probe programs on the first call for each set of shapes and caches the
    choice; `chunkvmap.last_batch_size(fn)` shows it, and the `chunkvmap` logger
    reports it at INFO level. The budget covers the evaluation as called: under
    `jax.grad` the backward pass adds its own working set, and under an outer
    `jax.vmap` the choice is made for one outer example.

    Usable as a decorator too, with options: `@batch_vmap(batch_size=8)` (or
    `@functools.partial(batch_vmap, batch_size=8)`).

    Args:
      f: the function to vectorise; it receives single examples, as with `jax.vmap`.
      in_axes: an int, None, or a tuple with one entry per positional argument of the
        returned function, each a pytree prefix of that argument whose leaves are ints
        (the mapped axis, negative counts from the end) or None (not mapped). Keyword
        arguments are always mapped over their leading axis.
      out_axes: an int, None, or a pytree prefix of `f`'s output: where the mapped axis
        goes in each output (None: the output does not depend on the mapped axis).
      axis_name: a name for the mapped axis, for collectives inside `f`. Collectives
        would only see one chunk, so it is an error when the evaluation is chunked.
      axis_size: the mapped length, needed when no argument is mapped.
      batch_size: examples per chunk: a positive int, None for one `jax.vmap` call, or
        `"auto"` to choose it from `memory_limit`. `chunk_size` is accepted as an
        alias.
      reduction: None (stack the outputs, as `jax.vmap` does), or an associative binary
        function folding two chunk summaries into one, applied to each leaf of the
        summaries (`jax.tree.map(reduction, a, b)`).
      chunk_reduction: summarises one chunk's output along the mapped axis (with
        `reduction`), or post-processes the whole output (without it).
      padded: whether the examples are a padded buffer: the returned function then
        takes `is_padding_example=` at call time (a boolean vector, one entry per
        example, not passed to `f`). The padding's outputs are zeros: its rows of
        stacked outputs, and what `chunk_reduction` sees of it (exact for sums).
        The real examples are evaluated first wherever the padding sits, and
        chunks of padding alone are skipped at run time, so one compiled program
        serves every number of real examples at about their cost (split over a
        mesh, every device skips its own).
      shard: which mesh axes the examples are split over, when the inputs do not
        show it: False (the default: follow the inputs' sharding, if visible), True
        (the one axis of a 1-D mesh), a mesh axis name such as `"data"`, or a tuple
        of names. Needed for inputs on `Auto` meshes under `jax.jit` (their layout is
        not in their types); `Explicit`-typed inputs (`jax.make_mesh`'s default) and
        concrete inputs of eager calls are followed without it. Either way each
        device evaluates only its own examples, `batch_size` at a time (its own
        remainder window included), mapped inputs are never gathered, stacked
        outputs keep the layout `jax.vmap` gives them, and the mesh's other axes
        (model parallelism) are left as they are. On `Auto` meshes the global
        remainder (N % D examples for D devices) is evaluated once, by one device,
        and the output then comes back replicated. Reductions fold the per-device
        results in device order. Runs multi-host under `jax.distributed` unchanged.
        `f` is traced once per call there too, at each device's chunk length and
        types (the global remainder runs in chunks of that length, or one window
        of it ending with the remainder: its earlier examples are evaluated again
        but counted once); once more only for an unmapped input committed and
        sharded over the mesh's `Explicit` axes.
      mesh: the `jax.sharding.Mesh` that `shard` names axes of (any shape, any axis
        types). None means the ambient mesh of `jax.set_mesh` (inside or outside
        `jax.jit`), else, for `shard=True`, one 1-D mesh over all devices (built
        once). Concrete inputs on other devices are moved onto the mesh.
      remat: checkpoint each chunk for reverse mode: True (the default; save nothing,
        recompute the chunk), False (save every chunk's residuals), or a
        `jax.checkpoint` policy such as `jax.checkpoint_policies.dots_saveable`.
        Custom JVP rules hold at every order with True, and through four
        derivatives with the others (`lax.map` loses them at the second).
      memory_limit: the memory budget of `batch_size="auto"`: bytes, or a string
        such as `"2GiB"` or `"512MB"`, for XLA's compiled estimate of the program
        (on CPU its temporary memory; on an accelerator its peak less its
        arguments). None means 90% of the device's free memory where the
        backend reports it (it is required on CPU).
      progress: show a host-side progress bar over the chunks: False (the default),
        True (a `tqdm` bar when tqdm is installed, else a line on stderr), a
        callable `progress(done, total)` called after each chunk, or a tqdm-like
        object whose `update(1)` is called after each chunk (its `total` is set when
        it has none). It works under `jax.jit` (one `jax.debug.callback` per chunk,
        no other synchronisation) and on meshes, where only the first device of the
        layout reports its own chunks (JAX runs no host callback inside a
        computation left automatic over other Explicit mesh axes: that is an
        error). Results are unchanged. The callback
        runs with the forward pass: recomputing it (an outer `jax.checkpoint`,
        `nn.remat`, `nnx.remat`) reports the chunks again; chunkvmap's own `remat`
        does not.
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      A function with the signature of `f`, vectorised over the mapped axes.

    Raises:
      TypeError: for a non-callable `f`, `reduction` or `chunk_reduction`, a
        non-integer `batch_size`, or a malformed `in_axes`/`out_axes`.
      ValueError: for `shard` with `axis_name`, `shard` naming axes the mesh lacks
        (or `shard=True` with an N-D mesh), or (when
        the returned function is called) for mapped arguments of
        different sizes, axes out of range, specs that do not match the arguments, a
        `chunk_reduction` that keeps the mapped axis, a reduction over zero examples,
        or a `memory_limit` too small for one example.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from chunkvmap import batch_vmap
      >>> x = jnp.arange(10.0).reshape(5, 2)
      >>> batch_vmap(jnp.sum, batch_size=2)(x)
      Array([ 1.,  5.,  9., 13., 17.], dtype=float32)
      >>> batch_vmap(jnp.dot, in_axes=(0, None), batch_size=3)(x, jnp.ones(2))
      Array([ 1.,  5.,  9., 13., 17.], dtype=float32)
      >>> batch_vmap(jnp.sum, batch_size=2, reduction=jnp.add,
      ...            chunk_reduction=lambda y: y.sum(0))(x)
      Array(45., dtype=float32)
      >>> batch_vmap(jnp.sum, batch_size=2, reduction=jnp.maximum,
      ...            chunk_reduction=lambda y: y.max(0))(x)
      Array(17., dtype=float32)
    """
    checked = ChunkOptions.make("batch_vmap", **options)
    check_bool("batch_vmap", "padded", padded)
    return vmap_transform(
        f, in_axes, out_axes, axis_name, axis_size, checked, padded=padded
    )


def vmap_transform(
    f: Callable[..., Any],
    in_axes: Any,
    out_axes: Any,
    axis_name: Any,
    axis_size: Any,
    options: ChunkOptions,
    *,
    padded: bool = False,
) -> Any:
    """The function `batch_vmap` returns, for validated `options` (errors name
    `options.name`); `padded`: its calls take `is_padding_example=`."""
    name = options.name
    check_callable(name, "f", f)
    in_axes = _axes.check_axes_spec(
        "in_axes", in_axes, top_level_tuple=True, transform=name
    )
    out_axes = _axes.check_axes_spec(
        "out_axes", out_axes, top_level_tuple=False, transform=name
    )
    transform = Transform(options, axis_name, axis_size)

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        if padded:
            return _padded_call(
                transform, f, args, kwargs, in_axes, out_axes, known=known
            )
        return transform.map(f, args, kwargs, in_axes, out_axes, known=known)

    # A plain vmap (nothing to chunk, fold or report) runs eagerly, as jax.vmap does.
    return transform.public(call, f)


def _padded_call(transform, f, args, kwargs, in_axes, out_axes, *, known) -> Any:
    """A `padded` call: the flags `is_padding_example=` become one more mapped
    argument, which marks the padding for the loop (`Transform.map(padding=)`), and
    each flagged example's outputs are zeros."""
    name = transform.options.name
    kwargs = dict(kwargs)
    flags = kwargs.pop("is_padding_example", None)
    if flags is None or not _padding.flag_type(flags):
        raise TypeError(
            f"{name} was built with padded=True: call it with is_padding_example=, "
            f"a boolean (or 0/1 integer) vector with one entry per example, but got "
            f"{'nothing' if flags is None else shown('is_padding_example', flags)}."
        )
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)

    @_cache.wraps(f)
    def zeroed(*inputs: Any, **kw: Any) -> Any:
        *xs, pad = inputs
        out = f(*xs, **kw)  # of one example: `pad` is its flag
        return jax.tree.map(lambda o: jnp.where(pad, jnp.zeros((), o.dtype), o), out)

    return transform.map(
        zeroed, (*args, jnp.asarray(flags).astype(bool)), kwargs, (*axes, 0), out_axes,
        known=known, padding=len(args),
        arg_names=[*(f"args[{i}]" for i in range(len(args))), "is_padding_example"],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class Transform:
    """One chunked transform: what every entry point and adapter builds.

    What it computes is fixed and validated when built (static errors name the
    public function then; its fields are frozen): the chunking `options`;
    `jax.vmap`'s `axis_name`, `axis_size` and `spmd_axis_name`; and `args`, how a
    call's arguments resolve to what is mapped and what is differentiated, for
    transforms that take argument numbers rather than `in_axes`
    (`_grads.GradArgs`, `_jacobians.JacArgs`: `resolve`). It also owns what its
    calls share, the only state that changes: the `"auto"` chunk-size state
    (`auto`, which `last_batch_size` reads), the warnings it has given
    (`warn_once`) and its front end's kept values (`memo`, `cache_for`). `map` is
    one chunked `jax.vmap` (`vmap_call`); `cache` and `public` run a call under the
    call's mesh (`placement`) through an eager cache.
    """

    options: ChunkOptions
    axis_name: Any = None
    axis_size: int | None = None
    spmd_axis_name: Any = None
    args: Any = None
    auto: _memory.AutoBatch = dataclasses.field(init=False, repr=False)
    _warned: set[str] = dataclasses.field(init=False, repr=False)
    _caches: Any = dataclasses.field(init=False, repr=False)

    @classmethod
    def make(
        cls,
        name: str,
        *,
        axis_name: Any = None,
        axis_size: Any = None,
        spmd_axis_name: Any = None,
        axes_arg: str = "in_axes",
        args: Any = None,
        **options: Unpack[AllChunking],
    ) -> Transform:
        """The transform of the public function `name`, its chunking `options`
        validated (`ChunkOptions.make`); `axes_arg` names the argument that maps
        the inputs in messages."""
        checked = ChunkOptions.make(name, **options).replace(axes_arg=axes_arg)
        return cls(checked, axis_name, axis_size, spmd_axis_name, args)

    def __post_init__(self) -> None:
        name = self.options.name
        for arg in ("axis_name", "spmd_axis_name"):
            value = getattr(self, arg)
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{name} {arg} must be a hashable name (a str, as in jax.vmap), "
                    f"but got {arg}={value!r} of type {type(value).__name__}."
                ) from None
        size = _axes.check_positive_int(
            "axis_size", self.axis_size, allow_zero=True, transform=name
        )
        if self.axis_name is not None and self.options.shard:
            raise ValueError(
                f"{name} got axis_name={self.axis_name!r} with shard=True: "
                f"collectives over {self.axis_name!r} inside f would only see one "
                f"device's chunk."
            )
        object.__setattr__(self, "axis_size", size)
        object.__setattr__(self, "auto", self.options.new_auto())
        object.__setattr__(self, "_warned", set())
        object.__setattr__(self, "_caches", _cache.LRU())

    @property
    def name(self) -> str:
        """The public function's name, as messages give it."""
        return self.options.name

    def resolve(self, call_args: tuple) -> Any:
        """What a call with positional arguments `call_args` differentiates and
        maps (`args.resolve`)."""
        return self.args.resolve(self, call_args)

    @property
    def placement(self) -> _cache.Placement:
        """Where its calls run: its `shard=` and `mesh=`."""
        return _cache.Placement(self.options.shard, self.options.mesh)

    def map(
        self,
        f: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        in_axes: Any,
        out_axes: Any,
        *,
        known: _cache.Known | None = None,
        arg_names: Any = None,
        out_names: Callable[[Any], list[str]] | None = None,
        options: ChunkOptions | None = None,
        accumulator: Any = None,
        check_unmapped: bool = True,
        padding: int | None = None,
    ) -> Any:
        """`jax.vmap(f, in_axes, out_axes)(*args, **kwargs)`, chunked by this
        transform's options (or `options`, a variant of them); a front end's own
        `accumulator` combines the chunks' outputs, and `check_unmapped=False`
        skips the check of outputs `out_axes` leaves unmapped (its own, known to
        be). `arg_names` names the arguments in messages, and `out_names(out)` the
        leaves of `f`'s output `out` (default `out_paths`); `known`: what the call
        knows (`_cache.Known`)."""
        call = Mapping(
            f, in_axes, out_axes, options or self.options, self.axis_name,
            self.axis_size, self.spmd_axis_name, arg_names, out_names, accumulator,
            check_unmapped, padding,
        )  # fmt: skip
        return vmap_call(call, args, kwargs, self.auto, known)

    def cache(self, call: _cache.Call, whole: bool = False) -> _cache.EagerCache:
        """`call` run under each call's mesh (`whole`: see `_cache.EagerCache`)."""
        return _cache.EagerCache(call, placement=self.placement, whole=whole)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()`, kept by this transform for `key` (a front end's own state of
        its calls, e.g. a loss's ghost plan; at most `_program.MAX_ENTRIES`)."""
        return self._caches.get_or_build(key, build)

    def cache_for(self, key: Any, call: Callable[[], _cache.Call]) -> _cache.EagerCache:
        """The eager cache (`cache`) of the call `call()` that this transform keeps
        for `key` (e.g. an adapter's axis specs; at most `_cache.MAX_ENTRIES`)."""
        return self._caches.get_or_build(key, lambda: self.cache(call()))

    def public(
        self, call: _cache.Call, wrapped: Callable[..., Any], whole: bool = False
    ) -> Callable[..., Any]:
        """The function a user gets: `call(args, kwargs, known)` through `cache`,
        with `wrapped`'s name and docstring, holding the `"auto"` state for
        `last_batch_size`."""
        run = self.cache(call, whole)

        @_cache.wraps(wrapped)
        def transformed(*args: Any, **kwargs: Any) -> Any:
            check_backend_dtypes(self.name, args, kwargs)
            try:
                return run(args, kwargs)
            finally:  # nothing a call's state holds outlives the call's arrays
                for kept in list(self._caches.values()):
                    release = getattr(kept, "release", None)
                    if release is not None:
                        release()

        return _memory.attach(transformed, self.auto)

    def warned(self, key: str) -> bool:
        """Whether this transform gave its `key` warning already."""
        return key in self._warned

    def warn_once(
        self, key: str, message: str, category: type = UserWarning, stacklevel=1
    ) -> None:
        """`warnings.warn(message, category)` at the first call with `key` only
        (`stacklevel` counted from the caller)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, category, stacklevel=stacklevel + 1)


# The dtypes a backend has no arrays of (its compiler aborts the process on them).
_MISSING_DTYPES = {"tpu": (np.dtype(np.complex128),)}


def check_backend_dtypes(name: str, args: tuple, kwargs: dict) -> None:
    """A clear error for an argument of a dtype the default backend lacks (the TPU
    has no complex128), before its compiler meets it."""
    platform = _memory.default_platform()
    missing = _MISSING_DTYPES.get(platform)
    if not missing:
        return
    leaves = jax.tree.leaves((args, kwargs))
    if not any(getattr(x, "dtype", None) in missing for x in leaves):
        return  # (the paths only for the message)
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and dtype in missing:
            where = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(
                path[1:]
            )
            raise TypeError(
                f"{name} got {where} of dtype {dtype}, which the "
                f"{platform} backend does not have; cast it to "
                f"{np.dtype(np.complex64) if dtype.kind == 'c' else 'a narrower dtype'}"
                f" (or run on the CPU)."
            )


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One chunked `jax.vmap(f, in_axes, out_axes)` as `Transform.map` was asked
    for it: built once per call and handed whole down the pipeline (`vmap_call`,
    `_ChunkTrace`).

    `in_axes` and `out_axes` are checked specs (`out_axes` may also be a function of
    the output's abstract pytree returning the spec, for adapters whose output axes
    depend on the output), chunked by `options`; `axis_name`, `axis_size` and
    `spmd_axis_name` are `jax.vmap`'s (each chunk's mapped axis is sharded over the
    last). `arg_names` names the positional arguments in messages (default
    `args[i]`), `out_names(out)` the leaves of an output `out` of `f` (default
    `out_paths`: adapters whose `f` wraps the user's function name the user's
    outputs). A front end's own `accumulator` (`_loop.Accumulator`, or
    `_accumulators.compose`d: clipping's sums, the statistics' rows) combines the
    chunks' outputs instead of the user's reduction, unchecked; `check_unmapped=False`
    skips the check that outputs given out_axes None do not vary across examples (a
    front end's own, unmapped by construction). `padding`: the positional argument
    (a boolean vector, mapped along axis 0) that marks examples of a padded buffer
    as padding: with an accumulator, chunks of padding alone are then skipped at
    run time.
    """

    f: Callable[..., Any]
    in_axes: Any
    out_axes: Any
    options: ChunkOptions
    axis_name: Any = None
    axis_size: int | None = None
    spmd_axis_name: Any = None
    arg_names: Any = None
    out_names: Callable[[Any], list[str]] | None = None
    accumulator: Any = None
    check_unmapped: bool = True
    padding: int | None = None

    @property
    def name(self) -> str:
        """The public function's name, as messages give it."""
        return self.options.name

    def names_of(self, out: Any) -> list[str]:
        """The names of the leaves of an output `out` of `f`, in messages."""
        return (self.out_names or out_paths)(out)

    @property
    def vmap_args(self) -> dict:
        """`jax.vmap`'s own keywords besides the axes."""
        return dict(
            axis_name=self.axis_name,
            axis_size=self.axis_size,
            spmd_axis_name=self.spmd_axis_name,
        )


class _Flat(NamedTuple):
    """A call's arguments as leaves: each leaf's mapped axis (`axes`), the leaves
    that are arguments of the jitted chunk (`dyn`: arrays and every mapped leaf),
    and the structure of `(args, kwargs)`."""

    leaves: list
    axes: list
    dyn: list
    treedef: Any


def vmap_call(
    call: Mapping, args: tuple, kwargs: dict, auto: Any, known: Any = None
) -> Any:
    """`jax.vmap(call.f, call.in_axes, call.out_axes)(*args, **kwargs)`, chunked by
    `call.options`; keyword arguments are mapped over their leading axis. `auto`:
    the transform's `"auto"` chunk-size state; `known`: the concrete shardings of an
    eager call's arguments (`_cache.Call`)."""
    name, options = call.name, call.options
    leaves, paths, axes, treedef = _flatten_inputs(
        name, call.in_axes, args, kwargs, call.arg_names, options.axes_arg
    )
    size = _axes.mapped_size(paths, leaves, axes, call.axis_size, transform=name)
    if options.plain and call.accumulator is None and not callable(call.out_axes):
        return _plain(call, args, kwargs)
    # Array leaves (and every mapped leaf) become arguments of one jitted function;
    # everything else (Python scalars, strings, objects with in_axes=None) is closed
    # over unchanged, exactly as jax.vmap hands it to f.
    dyn = [
        i
        for i, (x, a) in enumerate(zip(leaves, axes))
        if a is not None or isinstance(x, jax.Array)
    ]
    if size == 0 and options.reduction is not None:
        raise _chunked.zero_examples(name)
    key = (treedef, tuple((jax.typeof(leaves[i]), axes[i]) for i in dyn))
    key += (_static_key(leaves, dyn),)
    padded = None
    if call.padding is not None:
        padded = len(jax.tree.leaves(args[: call.padding]))
    inputs = _axes.Inputs(
        leaves, paths, dyn, size, key, known or _axes.NOTHING_KNOWN, padded
    )
    lay = _chunked.layout(options, inputs, axes)
    with _chunked.tracing(lay):
        chunk = _chunked.chunk_types(options, inputs, axes, lay)
        body = _ChunkTrace(call, _Flat(leaves, axes, dyn, treedef)).body(chunk)
    return _chunked.evaluate(body, inputs, options, auto, lay, call.axis_name)


def _plain(call: Mapping, args: tuple, kwargs: dict) -> Any:
    """A plain call (nothing to chunk, fold or report): one `jax.vmap`, with the
    chunked path's checks of f's output (made while `jax.vmap` traces f, so they
    cost no extra trace; an output left unmapped is checked first, by a trace of
    its own)."""
    checked = _checked(call.f, call.name, call.out_axes)
    if _has_none(call.out_axes):
        _check_unmapped_plain(call, checked, args, kwargs)
    out = jax.vmap(checked, call.in_axes, call.out_axes, **call.vmap_args)(
        *args, **kwargs
    )
    reduce = call.options.chunk_reduction
    return out if reduce is identity else reduce(out)


class _ChunkTrace:
    """One chunk of `jax.vmap(f)` for `call` over the leaves `flat`, traced once (at
    the length and types the loop's chunks will have: `_chunked.chunk_types`) to
    learn its outputs, as a `_loop.Body` whose chunk function reuses that trace
    (`body`).

    One chunk is `jax.vmap(f_flat)` at the loop's length, traced once (`first`);
    the loop evaluates that trace, the arrays it reads passed in as unmapped inputs
    (`Body.params`), so that a compiled program holds none of them. With every
    output along axis 0 (the usual case) the chunk is traced directly, and so it is
    with other axes given as a prefix that leaves no output unmapped (or needs no
    check of one): `jax.vmap` broadcasts the prefix itself (`_direct`). Otherwise
    the output axes are known only from the output's structure: `f_flat` is then
    jitted on its own (inlined) and traced on one example first, so that the chunk,
    its unmapped outputs left unmapped, batches that cached trace instead of
    tracing `f` again. Another length, or inputs with other sharding types, is
    traced again, the first trace's arrays standing for its own where it reads
    them.
    """

    def __init__(self, call: Mapping, flat: _Flat) -> None:
        self.call, self.flat, self.out_box = call, flat, []
        f = call.f

        @_cache.wraps(f)  # named after it, so that JAX's own messages point at it
        def f_tree(*dyn_leaves):
            full = _axes.combine(flat.leaves, flat.dyn, dyn_leaves)
            f_args, f_kwargs = jax.tree.unflatten(flat.treedef, full)
            out = f(*f_args, **f_kwargs)
            check_outputs(call.name, f, out)
            self.out_box[:] = [jax.tree.structure(out)]
            return out

        self.f_tree = f_tree
        self.f_flat = _cache.wraps(f)(lambda *leaves: jax.tree.leaves(f_tree(*leaves)))
        self.dyn_axes = tuple(flat.axes[i] for i in flat.dyn)
        self.vmap_flat = _GroupedVmap(
            f, self.dyn_axes, (call.axis_name, call.spmd_axis_name)
        )
        self.all_zero = isinstance(call.out_axes, int) and call.out_axes == 0
        self.inner = self.f_flat if self.all_zero else jax.jit(self.f_flat, inline=True)

    def mapped_at(self, length: int, leading: Any = 0, fn: Any = None) -> Any:
        """`jax.vmap` of `fn` (default the traced function `inner`) at `length`
        examples, its outputs along `leading`."""
        mapped = self.vmap_flat(self.inner if fn is None else fn, leading, length)
        return _cache.wraps(self.call.f)(mapped)

    def body(self, chunk: tuple) -> _loop.Body:
        """The chunk as the loop's `_loop.Body`, `chunk` its `(length, types)`."""
        call, length = self.call, chunk[0]
        first, flat_axes, signature = self.first(chunk)
        leading = [None if a is None else 0 for a in flat_axes]
        # (a retrace, in the loop's context, traces `f` there: not the cached trace
        # of another context, so that what `f` does per context (ghost's plans)
        # happens)
        retraced = _program.Retraced(
            _program.Trace.of(first),
            (length, tuple(first.in_avals)),
            lambda n: jax.jit(self.mapped_at(n, leading, self.f_flat), inline=True),
            lambda: self.out_box[0],
        )
        chunk_fn = _chunk_fn(call.f, retraced, self.flat.dyn, flat_axes)
        convolutions = _conv.has_convolution(first)
        return _chunked.body(
            call.options, call.accumulator, chunk_fn, self.flat.axes, signature,
            length=length, convolutions=convolutions, traced=retraced,
        )  # fmt: skip

    def first(self, chunk: tuple) -> tuple[Any, list, _loop.Signature]:
        """The chunk's first trace, each flat output's axis and the outputs'
        `_loop.Signature`, the unmapped ones checked. At the length the loop's
        chunks will have, in plain shapes but where the loop's chunks carry
        sharding types (Explicit axes: the mapped leaves' own, their examples' axis
        unsharded; an unmapped leaf's with the examples' mesh axes removed, as the
        loop lays it out: `_sharding.chunk_type`)."""
        call, (length, chunk_avals) = self.call, chunk
        out_axes, all_zero = call.out_axes, self.all_zero
        direct = not (all_zero or call.axis_name is not None or callable(out_axes))
        direct = direct and not (_has_none(out_axes) and call.check_unmapped)
        if all_zero or call.axis_name is not None:
            first, mapped_avals = _program.traced(self.mapped_at(length), chunk_avals)
            out_avals = [_axes.per_example(a) for a in mapped_avals]
        elif direct:
            first, out_avals = _direct(
                call.name, self.vmap_flat, self.f_tree, out_axes, length, chunk_avals
            )
        else:  # one example's outputs first (collectives need the vmap's axis name)
            example = [_axes.sized(self.flat.leaves[i], None, 0) for i in self.flat.dyn]
            example = [_axes.unmapped(x, a) for x, a in zip(example, self.dyn_axes)]
            out_avals = _program.traced(self.inner, example)[1]
        flat_axes = _flat_out_axes(call.name, out_axes, self.out_box[0], out_avals)
        if None in flat_axes and call.check_unmapped:  # before jax.vmap is asked
            self.check_unmapped(flat_axes, out_avals, chunk)
        signature = _loop.Signature(self.out_box[0], out_avals, flat_axes)
        if not (all_zero or direct):  # the chunk, its unmapped outputs unmapped
            leading = [None if a is None else 0 for a in flat_axes]
            first = _program.traced(self.mapped_at(length, leading), chunk_avals)[0]
        return first, flat_axes, signature

    def check_unmapped(self, flat_axes: list, out_avals: list, chunk: tuple) -> None:
        """`_check_unmapped` of the outputs `flat_axes` leaves unmapped, by a
        shape-only trace of the chunk."""
        length, chunk_avals = chunk
        probe, batched = _batched_probe()
        probed = self.vmap_flat(lambda *xs: probe(self.inner(*xs)), 0, length)
        jax.eval_shape(probed, *chunk_avals)
        names = self.call.names_of(self.out_box[0].unflatten(out_avals))
        _check_unmapped(self.call.name, self.call.f, flat_axes, batched, names)


def _direct(
    name: str, vmap_flat: _GroupedVmap, f_tree: Callable[..., Any], out_axes: Any,
    length: int, chunk_avals: list,
) -> tuple[Any, list]:  # fmt: skip
    """The chunk traced with `jax.vmap`'s own `out_axes` prefix (mapped outputs at
    axis 0, unmapped ones unmapped), its outputs flat: `(trace, one example's
    output types)`."""
    spec = jax.tree.map(
        lambda a: None if a is None else 0, out_axes, is_leaf=lambda a: a is None
    )
    axes: list[Any] = []  # each output's axis, as the prefix gives it

    @_cache.wraps(f_tree)
    def checked(*dyn_leaves: Any) -> Any:  # our message where the prefix misfits
        out = f_tree(*dyn_leaves)
        axes[:] = _axes.broadcast_axes(
            "out_axes", out_axes, out, "function's output", transform=name
        )
        return out

    mapped = vmap_flat(checked, spec, length)
    first, avals = _program.traced(
        lambda *xs: jax.tree.leaves(mapped(*xs)), chunk_avals
    )
    return first, [
        a if s is None else _axes.per_example(a) for a, s in zip(avals, axes)
    ]


class _GroupedVmap:
    """`self(fn, out_axes, length)`: `jax.vmap` of `fn`, a function of the dynamic
    leaves (mapped along `dyn_axes`), with `jax.vmap`'s axis names. The leaves go
    to `jax.vmap` in one list per input axis (`in_axes` one entry per list), not
    one argument each: broadcasting a per-argument `in_axes` costs `jax.vmap` time
    per leaf, noticeable on models of hundreds of leaves."""

    def __init__(self, f: Any, dyn_axes: tuple, axis_names: tuple) -> None:
        groups: dict[int | None, list[int]] = {}
        for k, a in enumerate(dyn_axes):
            groups.setdefault(a, []).append(k)
        self.f, self.count, self.axis_names = f, len(dyn_axes), axis_names
        self.axes, self.index = tuple(groups), list(groups.values())
        self.no_mapped_arg = all(a is None for a in dyn_axes)

    def __call__(self, fn: Callable[..., Any], out_axes: Any, length: int) -> Any:
        def grouped(*lists):
            flat = [None] * self.count
            for index, values in zip(self.index, lists):
                for k, v in zip(index, values):
                    flat[k] = v
            return fn(*flat)

        axis_name, spmd_axis_name = self.axis_names
        mapped = jax.vmap(
            _cache.wraps(self.f)(grouped),
            in_axes=self.axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=length if self.no_mapped_arg else None,
            spmd_axis_name=spmd_axis_name,
        )

        def call(*dyn_leaves):
            return mapped(*[[dyn_leaves[k] for k in index] for index in self.index])

        return call


def _chunk_fn(
    f: Any, retraced: _program.Retraced, dyn: list, flat_axes: list
) -> Callable[..., Any]:
    """The loop's chunk function: the chunk's trace evaluated on the chunk's
    leaves (the trace's arrays first), its outputs moved to their axes, in the
    structure that trace gave them."""
    moved = [a not in (0, None) for a in flat_axes]
    k = len(retraced.params)

    def chunk_fn(chunk_leaves: list[Any], length: int) -> Any:
        params, values = chunk_leaves[:k], [chunk_leaves[k + i] for i in dyn]
        if not any(moved):
            return retraced(params, values, length)
        # Behind a call boundary, where XLA keeps the chunk's own layout: the move
        # is then one transpose (inside, XLA lays the per-example computation out
        # for the moved outputs: on the statistics' gradients, examples last, a
        # quarter more memory on a transformer).
        call = jax.jit(_cache.wraps(f)(lambda p, *v: retraced(p, list(v), length)))
        outs, tree = jax.tree.flatten(call(params, *values))
        return tree.unflatten(
            [
                jnp.moveaxis(o, 0, a) if m else o
                for o, a, m in zip(outs, flat_axes, moved)
            ]
        )

    return chunk_fn


def check_outputs(name: str, f: Any, out: Any) -> None:
    """A TypeError naming the user's function `f` and the output's path when `out`
    has a leaf that is not a JAX type (as `jax.vmap` raises, in its terms)."""
    if all(isinstance(leaf, _axes.JAX_TYPES) for leaf in jax.tree.leaves(out)):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, _axes.JAX_TYPES):
            raise TypeError(
                f"{name}: the function {function_name(f)} returned a value of type "
                f"{type(leaf).__name__} at out{jax.tree_util.keystr(path)}, which "
                f"is not a valid JAX type: return arrays, numbers, or pytrees of "
                f"them."
            )


def out_paths(out: Any, root: str = "out") -> list[str]:
    """`out[...]`, the path of each leaf of an output, as messages show it."""
    return [
        root + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]
    ]


def _checked(f: Callable[..., Any], name: str, out_axes: Any) -> Callable[..., Any]:
    """`f` with its output checked as the chunked path checks it (JAX types only,
    `out_axes` a prefix of the output with axes in range), for one plain
    `jax.vmap`."""

    @_cache.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = f(*args, **kwargs)
        check_outputs(name, f, out)
        if not (isinstance(out_axes, int) and out_axes == 0):  # 0 fits any output
            leaves, out_tree = jax.tree.flatten(out)
            avals = [jax.typeof(y) for y in leaves]
            _flat_out_axes(name, out_axes, out_tree, avals)
        return out

    return checked


def _has_none(out_axes: Any) -> bool:
    """Whether an `out_axes` spec leaves some output unmapped."""
    return any(a is None for a in jax.tree.leaves(out_axes, is_leaf=_axes.is_none))


def _batched_probe() -> tuple[Callable[[list], list], list[bool]]:
    """An identity on a list of values and a list it fills, once it is traced
    under `jax.vmap`, with whether `jax.vmap` sees each value as batched (varying
    across the examples, which `out_axes` None rejects): each value's batching as
    `jax.custom_batching.custom_vmap` is told it. Used in shape-only traces only
    (a custom_vmap is not differentiable everywhere)."""
    batched: list[bool] = []

    @jax.custom_batching.custom_vmap
    def probe(values: list) -> list:
        return values

    @probe.def_vmap
    def _rule(axis_size: int, in_batched: list, values: list):
        batched[:] = in_batched[0]
        return values, in_batched[0]

    def identity(values: list) -> list:
        return probe(
            [v if isinstance(v, jax.Array) else jnp.asarray(v) for v in values]
        )

    return identity, batched


def _check_unmapped_plain(
    call: Mapping, checked: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    """`_check_unmapped` for one plain `jax.vmap(checked)` of `call`'s axes over
    `args`: a shape-only trace of its own."""
    name, f, out_axes = call.name, call.f, call.out_axes
    probe, batched = _batched_probe()
    out_box: list[Any] = []

    def probed(*args: Any, **kwargs: Any) -> list:
        leaves, tree = jax.tree.flatten(checked(*args, **kwargs))
        out_box[:] = [tree, [jax.typeof(jnp.asarray(y)) for y in leaves]]
        return probe(leaves)

    mapped = jax.vmap(probed, call.in_axes, 0, **call.vmap_args)
    jax.eval_shape(mapped, *args, **kwargs)
    tree, avals = out_box
    flat_axes = _flat_out_axes(name, out_axes, tree, avals)
    _check_unmapped(name, f, flat_axes, batched, call.names_of(tree.unflatten(avals)))


def _check_unmapped(
    name: str, f: Any, flat_axes: list, batched: list[bool], names: list[str]
) -> None:
    """A ValueError when an output that `out_axes` leaves unmapped (`flat_axes`
    None) varies across the examples (`batched`, from `_batched_probe`), in the
    user's terms (`names`: each flat output's name)."""
    where = [
        n for n, a, b in zip(names, flat_axes, batched or [False] * len(names))
        if a is None and b
    ]  # fmt: skip
    if where:
        raise ValueError(
            f"{name} out_axes gives {' or '.join(where)} the axis None (the same "
            f"value for every example), but the function {function_name(f)} "
            f"returns a value there that depends on the mapped arguments. Give it "
            f"an int axis in out_axes (e.g. 0), or return a value that does not "
            f"vary across examples."
        )


def _flat_out_axes(name: str, out_axes: Any, out_tree: Any, out_avals: list) -> list:
    """One canonical output axis per output leaf, from the `out_axes` prefix."""
    out = out_tree.unflatten(out_avals)
    if callable(out_axes):
        out_axes = out_axes(out)
    paths = out_paths(out)
    spec = _axes.broadcast_axes(
        "out_axes", out_axes, out, "function's output", transform=name
    )
    return [
        _axes.canonical_out_axis(a, len(aval.shape), p, transform=name)
        for a, aval, p in zip(spec, out_avals, paths)
    ]


def _flatten_inputs(
    name: str,
    in_axes: Any,
    args: tuple,
    kwargs: dict,
    arg_names: Any = None,
    axes_arg: str = "in_axes",
) -> tuple:
    """Flatten `(args, kwargs)` to leaves, key paths and canonical per-leaf axes.

    Paths read `args[i]...` and `kwargs['k']...`, or `arg_names[i]...` for positional
    argument `i` when given (adapters that regroup the user's arguments name them as
    the user passed them)."""
    _axes.check_arity(name, in_axes, args)
    arg_axes = _axes.broadcast_axes(
        "in_axes", in_axes, args, "positional arguments", transform=name
    )
    kw_axes = [0] * len(jax.tree.leaves(kwargs))
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    paths = []
    for path, _ in path_leaves:
        head, rest = path[0], path[1:]
        if head.idx == 0 and arg_names is not None:  # pyright: ignore
            root, rest = arg_names[rest[0].idx], rest[1:]  # pyright: ignore
        else:
            root = "args" if head.idx == 0 else "kwargs"  # pyright: ignore
        paths.append(root + jax.tree_util.keystr(rest))
    leaves = [leaf for _, leaf in path_leaves]
    axes = [
        _axes.canonical_in_axis(a, x, p, transform=name, arg=axes_arg)
        for a, x, p in zip(arg_axes + kw_axes, leaves, paths)
    ]
    leaves = [
        x if a is None or isinstance(x, jax.Array) else jnp.asarray(x)
        for x, a in zip(leaves, axes)
    ]
    return leaves, paths, axes, treedef


def _static_key(leaves: list[Any], dyn: list[int]) -> tuple[Any, ...]:
    """A key for the non-array arguments (their value when hashable)."""
    dynamic = set(dyn)
    key = []
    for i, x in enumerate(leaves):
        if i in dynamic:
            continue
        try:
            hash(x)
            key.append((type(x), x))
        except TypeError:
            key.append((type(x), id(x)))
    return tuple(key)
