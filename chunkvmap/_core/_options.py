"""The chunking options every entry point takes, validated once, in the caller's terms.

`ChunkOptions.make(name, ...)` checks `batch_size` (or its alias `chunk_size`),
`memory_limit`, `reduction` / `chunk_reduction`, `remat`, `shard` / `mesh` and
`progress` when a transform is built, and remembers the public name of the function the
user called (`name`) and the spelling of the batch-size argument they used, so that
every later message names them. Nothing here traces or evaluates anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools as ft
import inspect
from collections.abc import Callable
from typing import Any, TypedDict, Unpack

import numpy as np
from jax.sharding import Mesh

from . import _axes, _memory, _progress


def identity(x: Any) -> Any:
    """The default `chunk_reduction`: returns its argument unchanged.

    Without a `reduction` it leaves the stacked output as it is; with one it is an error
    (it does not remove the mapped axis), so a summarising `chunk_reduction` must be
    given. Compared by identity, so `chunk_reduction=chunkvmap.identity` is the same as
    leaving it out.

    Args:
      x: any pytree.

    Returns:
      `x` itself.

    Examples:
      >>> from chunkvmap import identity
      >>> identity((1, 2))
      (1, 2)
    """
    return x


def shown(arg: str, value: Any) -> str:
    """An argument as messages show it: arrays by shape and dtype, other values by a
    short repr and their type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{arg}: an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{arg}={text} of type {type(value).__name__}"


def decorator_form(fun_arg: str) -> Callable[[Callable[..., Any]], Any]:
    """Let a transform `t(fun, **options)` also be called with its options alone,
    returning a decorator (`@t(batch_size=8)` over a `def`), as `batch_vmap` and
    Equinox's filter transforms are: without `fun` (positionally, or as the keyword
    `fun_arg`), `t(**options)` is `functools.partial(t, **options)`."""

    def wrap(transform: Callable[..., Any]) -> Any:
        @ft.wraps(transform)
        def accepting(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # (pytest and IPython leave this frame out)
            if args or fun_arg in kwargs:
                return transform(*args, **kwargs)
            return ft.partial(transform, **kwargs)

        return accepting

    return wrap


def check_callable(name: str, arg: str, value: Any, *, allow_none: bool = False):
    """`value` if it is callable (or None, when allowed), else a TypeError."""
    if (value is None and allow_none) or callable(value):
        return value
    raise TypeError(
        f"{name} {arg} must be a callable{' or None' if allow_none else ''}, but "
        f"got {shown(arg, value)}."
    )


def check_choice(name: str, arg: str, value: Any, kind: type) -> Any:
    """`value` as a member of the string enum `kind`, or a ValueError naming the
    values it takes."""
    values = [m.value for m in kind]
    if not isinstance(value, str) or value not in values:
        raise ValueError(
            f"{name} {arg} must be one of {', '.join(map(repr, values))}, but got "
            f"{arg}={value!r}."
        )
    return kind(value)


def check_bool(name: str, arg: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} {arg} must be a bool, but got {arg}={value!r} of type "
            f"{type(value).__name__}."
        )
    return bool(value)


def check_bools(name: str, **flags: Any) -> None:
    """`check_bool` for each keyword."""
    for arg, value in flags.items():
        check_bool(name, arg, value)


def _batch_option(
    name: str, batch_size: Any, chunk_size: Any, microbatch_size: Any
) -> tuple[str, Any]:
    """The chunk size's option as the user gave it (`batch_size` or one of its
    aliases: at most one) and its checked value."""
    given = {
        arg: value
        for arg, value in (
            ("batch_size", batch_size),
            ("chunk_size", chunk_size),
            ("microbatch_size", microbatch_size),
        )
        if value is not None
    }
    if len(given) > 1:
        (a, value_a), (b, value_b) = list(given.items())[:2]
        raise TypeError(
            f"{name} got both {a}={value_a!r} and its alias {b}={value_b!r}; pass "
            f"only one."
        )
    arg, value = next(iter(given.items()), ("batch_size", None))
    return arg, _check_batch_size(name, arg, value)


def _check_batch_size(name: str, arg: str, value: Any) -> int | str | None:
    if isinstance(value, str):
        if value == "auto":
            return value
        raise TypeError(
            f"{name} {arg} must be a positive int, None, or 'auto', but got "
            f"{arg}={value!r} of type str."
        )
    return _axes.check_positive_int(arg, value, transform=name)


def _check_remat(name: str, remat: Any) -> Any:
    if not (isinstance(remat, bool) or callable(remat)):
        raise TypeError(
            f"{name} remat must be True, False, or a jax.checkpoint policy (e.g. "
            f"jax.checkpoint_policies.dots_saveable), but got remat={remat!r} of type "
            f"{type(remat).__name__}."
        )
    return remat


def _check_shard(name: str, shard: Any, mesh: Any) -> Any:
    """`shard` as False, True or a tuple of mesh axis names, checked with `mesh`."""
    if isinstance(shard, str):
        shard = (shard,)
    elif isinstance(shard, list):
        shard = tuple(shard)
    ok = isinstance(shard, bool) or (
        isinstance(shard, tuple) and shard and all(isinstance(a, str) for a in shard)
    )
    if not ok:
        raise TypeError(
            f"{name} shard must be a bool, a mesh axis name, or a tuple of mesh axis "
            f"names (the axes the examples are split over), but got shard={shard!r} "
            f"of type {type(shard).__name__}."
        )
    if isinstance(shard, tuple) and len(set(shard)) != len(shard):
        raise ValueError(
            f"{name} got shard={shard!r}, which names a mesh axis more than once: "
            f"name each axis the examples are split over once."
        )
    if mesh is None:
        return shard
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{name} mesh must be a jax.sharding.Mesh or None, but got "
            f"mesh={mesh!r} of type {type(mesh).__name__}."
        )
    if shard is False:
        raise ValueError(
            f"{name} got mesh={mesh!r} with shard=False: the mesh is only used "
            f"to shard the mapped axis. Pass shard=True (a 1-D mesh) or the names of "
            f"the axes to split the examples over, or drop mesh."
        )
    shard_axes(name, shard, mesh)
    return shard


def shard_axes(name: str, shard: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes `shard` (True, or checked axis names) splits the examples
    over, on `mesh` (the one passed, or the one a call resolves): checked when the
    transform is built where `mesh=` is given, and when called otherwise."""
    names = tuple(mesh.axis_names)
    if shard is True and len(names) != 1:
        raise ValueError(
            f"{name} got shard=True with a mesh of axes {names} (shape "
            f"{dict(mesh.shape)}): name the axes the examples are split over, e.g. "
            f"shard={names[0]!r} or shard={names}."
        )
    if shard is True:
        return names
    missing = [a for a in shard if a not in names]
    if missing:
        raise ValueError(
            f"{name} got shard={shard!r}, but the mesh has no axis "
            f"{', '.join(map(repr, missing))}: its axes are {names}."
        )
    return tuple(shard)


# The chunking keyword arguments, each declared once (its type here, its default in
# `DEFAULTS`). A public entry point takes the set that applies to it as
# `**options: Unpack[...]` and is decorated with `takes(...)`, which lists them in its
# signature (for `help`, `inspect` and editors) and rejects any other keyword.


class Evaluating(TypedDict, total=False):
    """What every entry point takes: where and how its examples are evaluated."""

    chunk_size: int | str | None
    shard: bool | str | tuple[str, ...]
    mesh: Mesh | None
    remat: bool | Callable[..., Any]
    memory_limit: int | str | None
    progress: Any


class Chunking(Evaluating, total=False):
    """The transforms of a function (gradients, Jacobians, statistics)."""

    batch_size: int | str | None


class Folding(TypedDict, total=False):
    """A user's reduction of the chunks' outputs."""

    reduction: Callable[[Any, Any], Any] | None
    chunk_reduction: Callable[[Any], Any]


class VmapChunking(Chunking, Folding, total=False):
    """`batch_vmap` and the adapters' transforms."""


class MapChunking(Evaluating, Folding, total=False):
    """`batch_map` (its `batch_size` is positional, as `lax.map`'s)."""


class ClipChunking(Chunking, total=False):
    """`clipped_grad` (`microbatch_size`: jax-privacy's name of the chunk size)."""

    microbatch_size: int | str | None


class AllChunking(VmapChunking, ClipChunking, total=False):
    """Every chunking keyword: what `ChunkOptions.make` takes."""


# Each keyword's default, in the order signatures list them.
DEFAULTS: dict[str, Any] = dict(
    batch_size=None, microbatch_size=None, reduction=None, chunk_reduction=identity,
    shard=False, mesh=None, remat=True, memory_limit=None, progress=False,
    chunk_size=None,
)  # fmt: skip


def _written(annotation: Any) -> Any:
    """An annotation as its source writes it (a TypedDict's are forward references)."""
    return getattr(annotation, "__forward_arg__", annotation)


def takes(kind: type) -> Callable[[Any], Any]:
    """Declares that an entry point `fn(..., **options: Unpack[kind])` takes the
    chunking keywords of `kind`: its signature lists them (keyword-only, with
    their defaults), and a call with any other keyword its own parameters do not
    name is a TypeError naming `fn` (with the closest valid name)."""
    names = [k for k in DEFAULTS if k in kind.__annotations__]

    def decorate(fn: Any) -> Any:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        named = {p.name for p in own}  # (batch_map names batch_size itself)
        valid = named | set(names)
        extra = [
            inspect.Parameter(
                k, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[k],
                annotation=_written(kind.__annotations__[k]),
            )
            for k in names
            if k not in named
        ]  # fmt: skip

        @ft.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            for k in kwargs:
                if k not in valid:
                    close = difflib.get_close_matches(k, sorted(valid), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else "."
                    raise TypeError(
                        f"{fn.__name__}() got an unexpected keyword argument "
                        f"{k!r}{hint}"
                    )
            return fn(*args, **kwargs)

        checked.__signature__ = sig.replace(parameters=own + extra)  # pyright: ignore
        # (`__wrapped__` kept: `inspect.getsource` shows `fn`; the API pages read
        # this signature through `docs/griffe_signatures.py`)
        return checked

    return decorate


@dataclasses.dataclass(frozen=True)
class ChunkOptions:
    """How to chunk one transform's evaluation (see `batch_vmap` for each option).

    Built by `make`, which validates everything; immutable and hashable (so it can key
    caches). `name` is the public function the user called, `batch_arg` the argument
    they gave the chunk size with (`"batch_size"` or `"chunk_size"`).
    """

    name: str
    batch_size: int | str | None = None
    batch_arg: str = "batch_size"
    reduction: Callable[[Any, Any], Any] | None = None
    chunk_reduction: Callable[[Any], Any] = identity
    remat: Any = True
    shard: bool | tuple[str, ...] = False
    mesh: Any = None
    memory_limit: int | None = None
    progress: Any = False
    # The host reporter made from `progress` (one per transform, not compared).
    reporter: Any = dataclasses.field(default=None, compare=False, repr=False)
    # The argument that maps the inputs, in messages (`batch_argnums` for the
    # gradient functions).
    axes_arg: str = "in_axes"

    @classmethod
    def make(cls, name: str, **options: Unpack[AllChunking]) -> ChunkOptions:
        """The validated options of the transform `name` (errors name `name`)."""
        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"{name} got unknown chunking options {sorted(unknown)}.")
        o: dict[str, Any] = {**DEFAULTS, **options}
        batch_size, chunk_size = o["batch_size"], o["chunk_size"]
        microbatch_size, reduction = o["microbatch_size"], o["reduction"]
        chunk_reduction, remat, shard = o["chunk_reduction"], o["remat"], o["shard"]
        mesh, memory_limit, progress = o["mesh"], o["memory_limit"], o["progress"]
        arg, batch_size = _batch_option(name, batch_size, chunk_size, microbatch_size)
        check_callable(name, "reduction", reduction, allow_none=True)
        check_callable(name, "chunk_reduction", chunk_reduction)
        _check_remat(name, remat)
        shard = _check_shard(name, shard, mesh)
        limit = None
        if memory_limit is not None:
            if batch_size != "auto":
                raise ValueError(
                    f"{name} memory_limit={memory_limit!r} is only used with "
                    f"{arg}='auto', but got {arg}={batch_size!r}."
                )
            limit = _memory.parse_memory(name, memory_limit)
        _progress.check_progress(name, progress)
        return cls(
            name,
            batch_size,
            arg,
            reduction,
            chunk_reduction,
            remat,
            shard,
            mesh,
            limit,
            progress,
            _progress.reporter(progress),
        )

    def new_auto(self) -> _memory.AutoBatch:
        """A new chunk-size state for one transform (a search when "auto")."""
        return _memory.AutoBatch(self.name, self.memory_limit, search=self.auto)

    def replace(self, **changes: Any) -> ChunkOptions:
        return dataclasses.replace(self, **changes)

    def quiet(self) -> ChunkOptions:
        """These options reporting no progress (a call's further passes over its
        examples: its first pass reports)."""
        return dataclasses.replace(self, progress=False, reporter=None)

    @property
    def auto(self) -> bool:
        return self.batch_size == "auto"

    @property
    def plain(self) -> bool:
        """Nothing to chunk, fold, shard or report: one `jax.vmap` does it all."""
        return (
            self.batch_size is None
            and self.reduction is None
            and self.shard is False
            and self.reporter is None
        )

    def batch_str(self) -> str:
        """The chunk size as the user gave it, for messages (`chunk_size=4`)."""
        return f"{self.batch_arg}={self.batch_size!r}"
