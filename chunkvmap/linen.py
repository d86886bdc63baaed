"""Flax linen adapter: `batch_vmap`, a chunked lifted transform, drop-in for `nn.vmap`.

`nn.vmap` is `flax.core.lift.vmap` (a `jax.vmap` over the lifted variable collections,
the split RNG streams and the arguments) applied to a Module class or method through
`flax.linen.transforms.lift_transform`. This module builds the same lifted transform
with `chunkvmap.batch_vmap` in place of `jax.vmap`:

1. `flax.core.lift.pack` hands over the scope's variable collections and RNG streams,
   grouped by the filters of `variable_axes` and `split_rngs`;
2. the RNG streams marked for splitting are split into one key per example *before*
   chunking, exactly as `nn.vmap` splits them, so every example sees the key it would
   see under `nn.vmap` whatever the chunk size;
3. the collections, keys and arguments, each with its axis, go to the core, which
   evaluates the scope function chunk by chunk; the mutable collections come back with
   the axes of `variable_axes` and are published to the parent scope.

Variables, RNG keys and outputs are therefore those of `nn.vmap` with the same
arguments: same `init`, same `apply`, same gradients.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Mapping
from typing import Any, Unpack


try:
    from flax.linen import FrozenDict, meta
    from flax.typing import In, Out
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "chunkvmap.linen needs Flax: install it with `pip install chunkvmap[flax]` "
        "(or `pip install flax`)."
    ) from e
import jax
import numpy as np

from ._adapters._flax import lift_transform, pack
from ._adapters._stateful import stateful_map
from ._core import _axes, _memory
from ._core._options import VmapChunking, takes
from ._transforms._batch_vmap import Transform, check_outputs


_NAME = "chunkvmap.linen.batch_vmap"


# --------------------------------------------------------------------------------------
# Argument checks (when the transform is built).


def _check_mapping(arg: str, value: Any, what: str) -> None:
    """A TypeError unless `value` (the argument `arg`) is a mapping (`what`: of
    what, with an example)."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{_NAME} {arg} must be a mapping {what}, but got {arg}={value!r} of "
            f"type {type(value).__name__}."
        )


def _check_variable_axes(variable_axes: Any) -> tuple[dict, dict]:
    """`variable_axes` split into `{filter: axis}` for the way in and the way out."""
    _check_mapping(
        "variable_axes", variable_axes,
        "from collection filters to an axis (an int, None, In(axis) or Out(axis)), "
        "e.g. {'params': 0}",
    )  # fmt: skip
    ins, outs = {}, {}
    for col, axis in variable_axes.items():
        inner = axis.axis if isinstance(axis, (In, Out)) else axis
        if not _axes.is_axis(inner):
            raise TypeError(
                f"{_NAME} variable_axes[{col!r}] must be an int, None, In(axis) or "
                f"Out(axis), but got {axis!r} of type {type(axis).__name__}."
            )
        inner = None if inner is None else int(inner)
        if not isinstance(axis, Out):
            ins[col] = inner
        if not isinstance(axis, In):
            outs[col] = inner
    return ins, outs


def _check_split_rngs(split_rngs: Any) -> dict:
    _check_mapping(
        "split_rngs", split_rngs, "from RNG stream filters to a bool, e.g. "
        "{'params': True}",
    )  # fmt: skip
    for name, split in split_rngs.items():
        if not isinstance(split, (bool, np.bool_)):
            raise TypeError(
                f"{_NAME} split_rngs[{name!r}] must be a bool (True: one key per "
                f"example, False: the same key for all), but got {split!r} of type "
                f"{type(split).__name__}."
            )
    return {name: bool(split) for name, split in split_rngs.items()}


# --------------------------------------------------------------------------------------
# RNG counters: Python state that a trace mutates.


def _copy_counters(counters: dict) -> dict:
    return {
        k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()
    }


def _restore_counters(counters: dict, saved: dict) -> None:
    """Reset `counters` in place (nested dicts too, keeping their identity)."""
    for k in [k for k in counters if k not in saved]:
        del counters[k]
    for k, v in saved.items():
        if isinstance(v, dict):
            if isinstance(counters.get(k), dict):
                _restore_counters(counters[k], v)
            else:
                counters[k] = _copy_counters(v)
        else:
            counters[k] = v


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _split_keys(group: Any, size: int) -> Any:
    """One key per example for every stream of `group`, as `nn.vmap` splits them."""

    def split(key):
        return jax.random.split(jax.random.clone(key), size)

    return jax.tree.map(split, group, is_leaf=_is_key)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _kwarg_axes(kwargs: dict) -> Any:
    """Keyword arguments: arrays mapped over their leading axis, the rest passed on."""
    return jax.tree.map(lambda x: 0 if _is_array(x) else None, kwargs)


def _mapped_length(
    groups: tuple, group_axes: tuple, args: tuple, in_axes: Any, kwargs: dict, size
) -> int:
    """The mapped length from the mapped collections, arguments and `axis_size`."""
    paths, leaves, axes = [], [], []

    def add(root, tree, spec, what):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for axis, (path, leaf) in zip(
            _axes.broadcast_axes("in_axes", spec, tree, what, transform=_NAME), flat
        ):
            p = root + jax.tree_util.keystr(path)
            paths.append(p)
            leaves.append(leaf)
            axes.append(_axes.canonical_in_axis(axis, leaf, p, transform=_NAME))

    add("variables", groups, group_axes, "variable collections")
    add("args", args, in_axes, "positional arguments")
    add("kwargs", kwargs, _kwarg_axes(kwargs), "keyword arguments")
    return _axes.mapped_size(paths, leaves, axes, size, transform=_NAME)


def _method_name(target: Any, methods: Any) -> str:
    """The user's method, as messages name it (`Dense.__call__`)."""
    if isinstance(target, ft.partial):
        target = target.func
    owner = getattr(target, "__qualname__", None) or repr(target)
    if not isinstance(target, type):  # a method, decorated in its class body
        return owner
    names = ["__call__"] if methods is None else list(methods)
    return owner + "." + (names[0] if len(names) == 1 else "{" + ",".join(names) + "}")


# --------------------------------------------------------------------------------------
# The lifted transform (the counterpart of flax.core.lift.vmap).


def _lifted(
    fn: Callable[..., Any],
    variable_axes: Mapping[Any, Any],
    split_rngs: Mapping[Any, bool],
    *,
    in_axes: Any,
    out_axes: Any,
    axis_size: int | None,
    metadata_params: Mapping[Any, Any],
    chunked: Transform,
    method: str,
) -> Callable[..., Any]:
    """A scope function `fn(scope, *args, **kwargs)` vectorised in chunks (`method`
    names the user's method in messages)."""
    var_in, var_out = _check_variable_axes(variable_axes)
    in_filters, in_group_axes = tuple(var_in), tuple(var_in.values())
    out_filters, out_group_axes = tuple(var_out), tuple(var_out.values())
    splits = _check_split_rngs(split_rngs)
    rng_filters = tuple(splits)
    rng_split = tuple(splits.values())
    rng_axes = tuple(0 if s else None for s in rng_split)
    params = dict(metadata_params)

    def body(restore, scope_fn, repack_fn, variable_groups, rng_groups, *args, **kw):
        variable_groups = tuple(
            g if a is None else meta.remove_axis(g, a, params)
            for g, a in zip(variable_groups, in_group_axes)
        )
        # The user's in_axes against the method's arguments, before the core sees
        # them regrouped (collections, RNG keys, arguments, keyword arguments).
        _axes.check_arity(
            _NAME, in_axes, args, "the method was called (after the module)"
        )
        size = _mapped_length(
            variable_groups, in_group_axes, args, in_axes, kw, axis_size
        )
        rng_groups = tuple(
            _split_keys(g, size) if s else g for g, s in zip(rng_groups, rng_split)
        )
        kw_axes = _kwarg_axes(kw)

        def per_example(variable_groups, rng_groups, args, kw):
            restore()  # every trace starts from the same RNG counters
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kw)
            check_outputs(_NAME, per_example, y)
            return y, repack_fn(scope)

        # Messages (the core's and JAX's) name the user's method.
        per_example.__name__ = per_example.__qualname__ = method

        y, vars_out = stateful_map(
            chunked, per_example, (variable_groups, rng_groups, args, kw),
            (in_group_axes, rng_axes, in_axes, kw_axes), out_axes, out_group_axes,
            state_root="variables",
        )  # fmt: skip
        vars_out = tuple(
            g if a is None else meta.add_axis(g, a, params)
            for g, a in zip(vars_out, out_group_axes)
        )
        return y, vars_out

    def transformed(scope_tree: Any, *args: Any, **kwargs: Any) -> Any:
        packed = pack(
            ft.partial(body, _counters_restorer(scope_tree)), in_filters, out_filters,
            rng_filters, name="batch_vmap", enable_kwargs=True,
        )  # fmt: skip
        return packed(scope_tree, *args, **kwargs)

    return transformed


def _counters_restorer(scope_tree: Any) -> Callable[[], None]:
    """A function that puts the scopes' RNG counters back to what they are now."""
    counters = [s.rng_counters for s in jax.tree.leaves(scope_tree)]
    saved = [_copy_counters(c) for c in counters]

    def restore() -> None:
        for c, s in zip(counters, saved):
            _restore_counters(c, s)

    return restore


# Named like `flax.core.lift.vmap`: `lift_transform` names the transformed Module class
# after it ("VmapDense"), and the class name decides auto-generated submodule names and
# therefore the RNG streams their parameters are drawn from.
_lifted.__name__ = "vmap"


@takes(VmapChunking)
def batch_vmap(
    target: Any,
    variable_axes: Mapping[Any, Any] = FrozenDict(),
    split_rngs: Mapping[Any, bool] = FrozenDict(),
    in_axes: Any = 0,
    out_axes: Any = 0,
    *,
    axis_size: int | None = None,
    axis_name: Any = None,
    methods: Any = None,
    metadata_params: Mapping[Any, Any] = FrozenDict(),
    **options: Unpack[VmapChunking],
) -> Any:
    """`nn.vmap`, evaluated `batch_size` examples at a time.

    A lifted transform built like `nn.vmap` (on `flax.core.lift` and
    `flax.linen.transforms`), with `chunkvmap.batch_vmap` in place of `jax.vmap`. It
    applies to a Module class or to a method, standalone or as a submodule inside a
    parent's `@nn.compact`, and takes the arguments of `nn.vmap` with the same meaning,
    so swapping the name gives the same variables from `init` with the same key, the
    same outputs from `apply` and the same gradients:

    * `variable_axes` lifts variable collections: an int maps a collection over that
      axis (e.g. one set of parameters per ensemble member), None shares it across
      examples (e.g. one model over a batch of data);
    * `split_rngs` chooses the RNG streams that get one key per example. The keys are
      split once for all `N` examples, exactly as `nn.vmap` splits them, and chunks
      take their slices, so random draws (parameter initialisation, dropout masks) do
      not depend on `batch_size` (with threefry keys, JAX's default: `rbg` keys draw
      differently in batches of different sizes, under `nn.vmap` too);
    * mutable collections (`batch_stats`, `intermediates` from `sow`, ...) come back
      with the axes of `variable_axes`; `metadata_params` is passed to boxed
      variables such as `nn.Partitioned` when the mapped axis is removed and added.

    `f` runs on chunks of `batch_size` examples: a `jax.vmap` inside a `lax.scan`, so
    activation memory scales with `batch_size`, not `N` (see `chunkvmap.batch_vmap`
    for the remainder, `remat` and `batch_size="auto"`). With `reduction`, the method's
    outputs are folded chunk by chunk instead of stacked, e.g. a loss summed over the
    batch (`reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)`); collections that
    come back (`init`, `mutable=[...]`) are stacked beside them, in the same pass.

    Unlike `nn.vmap`, which warns and drops them, keyword arguments of the transformed
    method are supported: array leaves are mapped over their leading axis (as
    `jax.vmap` maps keyword arguments) and other leaves (Python bools, numbers,
    strings, e.g. `deterministic=True`) are passed unchanged to every example.

    Args:
      target: a `nn.Module` class, or a method (a function whose first argument is
        the Module) when used as a decorator inside a class body.
      variable_axes: a mapping from collection filters to the mapped axis of those
        variables: an int, None (shared), or `flax.typing.In(axis)` /
        `flax.typing.Out(axis)` for one direction only.
      split_rngs: a mapping from RNG stream filters to a bool: True gives every
        example its own key, False the same key to all.
      in_axes: the mapped axis of each positional argument (after the Module): an
        int, None, or a tuple of pytree prefixes, as in `jax.vmap`.
      out_axes: where the mapped axis goes in the outputs, as in `jax.vmap`.
      axis_size: the mapped length, needed when nothing mapped is passed in (e.g.
        `init` of an ensemble whose inputs are shared).
      axis_name: a name for collectives over the mapped axis (unchunked evaluation
        only, as in `chunkvmap.batch_vmap`).
      methods: the methods to transform when `target` is a class (default
        `__call__`), as in `nn.vmap`.
      metadata_params: passed to `AxisMetadata` boxes (e.g. `nn.Partitioned`) when
        the mapped axis is removed or added, e.g. `{nn.PARTITION_NAME: "batch"}`.
      batch_size: examples per chunk: a positive int, None for one `jax.vmap` call,
        or `"auto"` to choose it from `memory_limit` (made when the model is traced).
      reduction: None (stack the outputs, as `nn.vmap` does), or an associative
        binary function folding chunk summaries leaf by leaf (e.g. `jnp.add`).
      chunk_reduction: summarises one chunk's outputs along the mapped axis (with
        `reduction`), or post-processes the whole output (without it).
      shard: spread the examples over the devices of `mesh` first (see
        `chunkvmap.batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk for reverse mode (True, False or a
        `jax.checkpoint` policy), see `chunkvmap.batch_vmap`.
      memory_limit: the budget for `batch_size="auto"`, e.g. `"1GiB"`.
      progress: a host progress bar over the chunks (see `chunkvmap.batch_vmap`);
        False by default.
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      The transformed Module class (named like `nn.vmap`'s, e.g. `VmapDense`) or
      method.

    Raises:
      TypeError: for a malformed `variable_axes`, `split_rngs`, `in_axes`,
        `out_axes` or chunking option, or a target that is neither a Module class
        nor a method.
      ValueError: (when called) for mapped inputs of different lengths, an `in_axes`
        that does not match the arguments, or no mapped input without `axis_size`.

    Examples:
      An ensemble of 7 dense layers, evaluated 3 members at a time:

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from chunkvmap.linen import batch_vmap
      >>> Ensemble = batch_vmap(nn.Dense, variable_axes={"params": 0},
      ...                       split_rngs={"params": True}, in_axes=None,
      ...                       axis_size=7, batch_size=3)
      >>> model = Ensemble(features=2)
      >>> x = jnp.ones(4)
      >>> variables = model.init(jax.random.key(0), x)
      >>> variables["params"]["kernel"].shape
      (7, 4, 2)
      >>> reference = nn.vmap(nn.Dense, variable_axes={"params": 0},
      ...                     split_rngs={"params": True}, in_axes=None,
      ...                     axis_size=7)(features=2)
      >>> bool((reference.init(jax.random.key(0), x)["params"]["kernel"]
      ...       == variables["params"]["kernel"]).all())
      True
      >>> model.apply(variables, x).shape
      (7, 2)

      A loss summed over a batch, one shared model, 4 examples at a time:

      >>> class Loss(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, y):
      ...         return ((nn.Dense(1)(x)[0] - y) ** 2)
      >>> SummedLoss = batch_vmap(Loss, variable_axes={"params": None},
      ...                         split_rngs={"params": False}, batch_size=4,
      ...                         reduction=jnp.add,
      ...                         chunk_reduction=lambda l: l.sum(0))
      >>> xs, ys = jnp.ones((10, 3)), jnp.zeros(10)
      >>> params = SummedLoss().init(jax.random.key(1), xs, ys)
      >>> SummedLoss().apply(params, xs, ys).shape
      ()
    """
    _check_variable_axes(variable_axes)
    _check_split_rngs(split_rngs)
    # As jax.vmap: a list reads as a tuple (check_axes_spec's top_level_tuple).
    in_axes = _axes.check_axes_spec(
        "in_axes", in_axes, top_level_tuple=True, transform=_NAME
    )
    out_axes = _axes.check_axes_spec(
        "out_axes", out_axes, top_level_tuple=False, transform=_NAME
    )
    _check_mapping(
        "metadata_params", metadata_params, "(e.g. {nn.PARTITION_NAME: 'batch'})"
    )
    transform = Transform.make(
        _NAME, axis_name=axis_name, axis_size=axis_size, **options
    )
    if not callable(target):
        raise TypeError(
            f"{_NAME} target must be a linen Module class or a method, but got "
            f"{target!r} of type {type(target).__name__}."
        )
    transformed = lift_transform(
        _lifted, target, variable_axes, split_rngs, methods=methods, in_axes=in_axes,
        out_axes=out_axes, axis_size=transform.axis_size,
        metadata_params=metadata_params, chunked=transform,
        method=_method_name(target, methods),
    )  # fmt: skip
    return _memory.attach(transformed, transform.auto)  # for last_batch_size


__all__ = ["batch_vmap"]
