"""Per-example gradients in chunks: `per_example_grads`, and the argument handling
and filtered gradients it shares with the clipped sums (`_clipping`).

`per_example_grads` is the `batch_vmap` pipeline (`_batch_vmap.vmap_call`) over the
gradient of one example, stacked.

Parameters may be any pytree: floating-point arrays and Python floats in plain
containers (dicts, lists, tuples) are differentiated, as by `jax.grad`; other leaves
(integer arrays, Python ints and bools, functions, strings, the static parts and float
hyperparameters of an Equinox module) are not, and get `None` in the gradient, as with
`equinox.filter_grad`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _axes, _cache
from .._core._options import (
    AllChunking,
    Chunking,
    check_bool,
    check_callable,
    decorator_form,
    takes,
)
from ._batch_vmap import Transform, function_name


# --------------------------------------------------------------------------------------
# Argument numbers.


def check_argnums(name: str, arg: str, argnums: Any) -> tuple[tuple[int, ...], bool]:
    """`argnums` as a tuple of ints, and whether it was a single int."""
    single = not isinstance(argnums, (tuple, list))
    values = (argnums,) if single else tuple(argnums)
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(
                f"{name} {arg} must be an int or a sequence of ints, but got "
                f"{arg}={argnums!r}."
            )
    if not values:
        if arg == "batch_argnums":  # jax-privacy's phrase, for code that matches it
            raise ValueError(
                f"{name} batch_argnums must name the argument(s) holding the examples "
                f"(Batch Argnums must not be empty), but got batch_argnums="
                f"{argnums!r}; e.g. batch_argnums=1 for fun(params, batch)."
            )
        raise ValueError(f"{name} {arg} must not be empty, but got {arg}={argnums!r}.")
    return tuple(operator.index(v) for v in values), single


def check_overlap(name: str, argnums: Any, batch_argnums: Any, diff, mapped) -> None:
    """An argument is differentiated or holds the examples, never both."""
    shared = sorted(set(diff) & set(mapped))
    if shared:
        raise ValueError(
            f"{name} got argnums={argnums!r} and batch_argnums={batch_argnums!r}, "
            f"which overlap on argument(s) {shared}: an argument is either "
            f"differentiated (argnums) or holds the examples (batch_argnums), not both."
        )


def resolve_argnums(name: str, arg: str, argnums: Sequence[int], nargs: int):
    """Non-negative argument numbers, checked against the call's `nargs`."""
    resolved = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"{name} {arg}={a} is out of range for a call with {nargs} positional "
                f"argument(s): expected -{nargs} <= {arg} < {nargs}."
            )
        resolved.append(a % nargs)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"{name} {arg}={tuple(argnums)} repeats an argument.")
    return tuple(resolved)


# --------------------------------------------------------------------------------------
# Gradients of single examples, with non-differentiable leaves filtered out.


def describe(value: Any) -> str:
    """A value as messages describe it: arrays by shape and dtype, sequences by
    length, anything else by type."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} element(s)"
    return f"a value of type {type(value).__name__}"


def check_loss(name: str, fun: Any, out: Any, has_aux: bool) -> None:
    """`out` must be a real scalar (or `(scalar, aux)` with `has_aux`), as `jax.grad`
    requires; the error names the entry point and the user's function."""
    fun_name = function_name(fun)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"{name} has_aux=True expects {fun_name} to return a pair (loss, aux), "
            f"but it returned {describe(out)}."
        )
    loss = out[0] if has_aux else out
    ok = isinstance(loss, (jax.Array, np.ndarray, np.generic, float))
    if ok and not isinstance(loss, float):
        ok = np.shape(loss) == () and jnp.issubdtype(loss.dtype, jnp.floating)
    if not ok:
        raise TypeError(
            f"{name} differentiates {fun_name}, which must return a real scalar loss "
            f"(a float array of shape ()){' as the first of (loss, aux)' * has_aux}, "
            f"but it returned {describe(loss)}. Per-example gradients need one "
            f"scalar per example: reduce the loss to a scalar inside the function."
        )


def floats_to_arrays(tree: Any) -> Any:
    """`tree` with its Python float (and complex) leaves as JAX scalars, weakly
    typed as `jax.grad` makes them (so they are differentiated), in plain containers
    (dicts, lists, tuples): the float fields of other pytree nodes, such as an
    Equinox module's hyperparameters, stay constants (as with
    `equinox.filter_grad`)."""

    def plain(x: Any) -> bool:
        return x is None or isinstance(x, (dict, list, tuple))

    def convert(x: Any) -> Any:
        return jnp.asarray(x) if isinstance(x, (float, complex)) else x

    return jax.tree.map(convert, tree, is_leaf=lambda x: not plain(x))


def differentiable_floats(args: Sequence[Any], diff: Sequence[int], in_axes) -> tuple:
    """The call's arguments with the Python floats of the differentiated ones (not
    mapped) as JAX scalars (`floats_to_arrays`): differentiated, as by `jax.grad`."""
    return tuple(
        floats_to_arrays(a) if i in diff and in_axes[i] is None else a
        for i, a in enumerate(args)
    )


def one_example_note(name: str, fun: Any) -> str:
    """The note on an error raised inside `fun` called on one example: a loss
    written for a whole batch is the usual cause."""
    return (
        f"{name} calls {function_name(fun)} on one example at a time, with the "
        f"batch axis removed (as jax.vmap does). If {function_name(fun)} was written "
        f"for a whole batch (jax-privacy style: loss(params, batch) averaging over "
        f"the batch, or reading batch['x'].shape[0]), write it for one example, or "
        f"use chunkvmap.clipped_grad, which takes a loss of a whole batch, as "
        f"jax-privacy's clipped_grad does."
    )


@contextlib.contextmanager
def noting_errors(note: str | None):
    """A shape-type error (`TypeError`, `ValueError`, `IndexError`; not JAX's
    tracer errors) raised inside gets `note` added, and is raised as it was."""
    try:
        yield
    except (TypeError, ValueError, IndexError) as e:
        tracer_error = isinstance(
            e, (jax.errors.JAXTypeError, jax.errors.JAXIndexError)
        )
        if note and not tracer_error and note not in getattr(e, "__notes__", ()):
            e.add_note(note)
        raise


def filtered_value_and_grad(
    fun: Callable[..., Any],
    argnums: tuple[int, ...],
    single: bool,
    has_aux: bool,
    name: str = "per_example_grads",
    note: str | None = None,
) -> Callable[..., Any]:
    """`jax.value_and_grad(fun, argnums, has_aux)` w.r.t. the floating-point leaves
    only.

    `argnums` are non-negative here. The gradient has the structure of the
    differentiated arguments, with None at every leaf that is not differentiated.
    `fun`'s output is checked first (`check_loss`: errors name `name` and `fun`);
    an error `fun` raises gets `note` (`noting_errors`).
    """

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        floats = FloatLeaves(args, argnums)

        def inner(diff: list[list[Any]]) -> Any:
            with noting_errors(note):
                out = fun(*floats.args_with(diff), **kwargs)
            check_loss(name, fun, out, has_aux)
            return out

        value, grads = jax.value_and_grad(inner, has_aux=has_aux)(floats.diff)
        return value, floats.trees(grads, single)

    return value_and_grad_fn


class FloatLeaves:
    """The floating-point leaves of the arguments `argnums` of a call (`diff`,
    a list per argument), which `jax.grad` differentiates, as Equinox's filtered
    transforms do; a bare Python number is differentiated, as `jax.grad` does."""

    def __init__(self, args: Sequence[Any], argnums: Sequence[int]):
        self.args, self.argnums, self.parts = list(args), tuple(argnums), []
        for i in argnums:
            leaves, treedef = jax.tree.flatten(args[i])
            mask = [_axes.is_inexact_array(x) for x in leaves]
            if isinstance(args[i], (float, complex)):  # in a pytree: a constant
                mask = [True]
            self.parts.append((leaves, treedef, mask))
        self.diff = [[x for x, m in zip(lv, mask) if m] for lv, _, mask in self.parts]

    def args_with(self, diff: Sequence[Sequence[Any]]) -> list[Any]:
        """The arguments with `diff` in place of the floating-point leaves."""
        new_args = list(self.args)
        for i, (leaves, treedef, mask), values in zip(self.argnums, self.parts, diff):
            it = iter(values)
            full = [next(it) if m else x for x, m in zip(leaves, mask)]
            new_args[i] = jax.tree.unflatten(treedef, full)
        return new_args

    def trees(self, diff: Sequence[Sequence[Any]], single: bool) -> Any:
        """`diff` (as `self.diff`) in the arguments' structures, None at every
        other leaf: one tree when `single`, else a tuple of them."""
        trees = []
        for (leaves, treedef, mask), g in zip(self.parts, diff):
            it = iter(g)
            trees.append(
                jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])
            )
        return trees[0] if single else tuple(trees)


def _filtered_grad(
    fun: Callable[..., Any],
    argnums: tuple[int, ...],
    single: bool,
    has_aux: bool,
    note: str | None = None,
) -> Callable[..., Any]:
    """`jax.grad(fun, argnums, has_aux)` w.r.t. the floating-point leaves only (see
    `filtered_value_and_grad`)."""
    value_and_grad_fn = filtered_value_and_grad(
        fun, argnums, single, has_aux, note=note
    )

    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grad_fn(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn


def grad_transform(
    name: str,
    fun: Any,
    argnums: Any,
    batch_argnums: Any,
    spmd_axis_name: Any = None,
    exclusive: bool = False,
    **options: Unpack[AllChunking],
) -> Transform:
    """The transform of a gradient entry point (`per_example_grads`, the clipped
    sums, the statistics): its arguments resolved by `GradArgs`."""
    check_callable(name, "fun", fun)
    args = GradArgs.make(name, argnums, batch_argnums, exclusive)
    return Transform.make(
        name,
        spmd_axis_name=spmd_axis_name,
        axes_arg="batch_argnums",
        args=args,
        **options,
    )


@dataclasses.dataclass(frozen=True)
class GradArgs:
    """How a gradient transform's call resolves its arguments: `argnums` (checked;
    `single`: a bare int, one gradient) are differentiated, `batch_argnums` (None:
    every other argument) hold the examples. With `exclusive` (the clipped sums),
    an argument is differentiated or holds the examples, never both;
    `per_example_grads` allows it (input gradients). `given`: both as the user
    wrote them, for messages."""

    name: str
    argnums: tuple[int, ...]
    single: bool
    batch_argnums: tuple[int, ...] | None
    exclusive: bool
    given: tuple[Any, Any]

    @classmethod
    def make(
        cls, name: str, argnums: Any, batch_argnums: Any, exclusive: bool
    ) -> GradArgs:
        checked, single = check_argnums(name, "argnums", argnums)
        batch = (
            None
            if batch_argnums is None
            else check_argnums(name, "batch_argnums", batch_argnums)[0]
        )
        if exclusive and batch is not None:  # seen before a call
            check_overlap(
                name,
                argnums,
                batch_argnums,
                [a for a in checked if a >= 0],
                [a for a in batch if a >= 0],
            )
        return cls(name, checked, single, batch, exclusive, (argnums, batch_argnums))

    def resolve(
        self, transform: Transform, args: tuple
    ) -> tuple[tuple[int, ...], tuple]:
        """The differentiated argument numbers and the `in_axes` of a call of
        `transform` (which warns once, `_warn_if_ambiguous`)."""
        nargs = len(args)
        diff = resolve_argnums(self.name, "argnums", self.argnums, nargs)
        for i in diff:  # a bare non-float array: an error, as with jax.grad
            x = args[i]
            if isinstance(x, (jax.Array, np.ndarray, np.generic, int)):
                dtype = jnp.result_type(x)
                if not jnp.issubdtype(dtype, jnp.inexact):
                    raise TypeError(
                        f"{self.name} differentiates args[{i}] (argnums), which "
                        f"has dtype {dtype.name}: like jax.grad it needs real- or "
                        f"complex-valued inputs. Pass a float array, or leave "
                        f"args[{i}] out of argnums. (Inside a pytree argument, "
                        f"non-float leaves are simply not differentiated.)"
                    )
        self._check_some_float(args, diff)
        if self.batch_argnums is None:  # every argument not differentiated
            mapped = tuple(i for i in range(nargs) if i not in diff)
            self._check_examples_not_differentiated(args, diff, mapped)
            if not self.exclusive:
                self._warn_if_examples_differentiated(transform, args, diff, mapped)
        else:
            mapped = resolve_argnums(
                self.name, "batch_argnums", self.batch_argnums, nargs
            )
            if self.exclusive:
                check_overlap(self.name, *self.given, diff, mapped)
            self._warn_if_ambiguous(transform, args, diff, mapped)
        return diff, tuple(0 if i in mapped else None for i in range(nargs))

    def _check_some_float(self, args: tuple, diff: tuple) -> None:
        """A TypeError, as `jax.grad` raises, where the differentiated arguments
        hold leaves but no floating-point one: their gradients would all be
        None, and a training loop would train nothing."""
        leaves = [x for i in diff for x in jax.tree.leaves(args[i])]
        dtypes = [jnp.result_type(x) for x in leaves if _axes.is_arraylike(x)]
        if not leaves or any(jnp.issubdtype(d, jnp.inexact) for d in dtypes):
            return
        named = ", ".join(f"args[{i}]" for i in diff)
        found = sorted({d.name for d in dtypes}) or sorted(
            {type(x).__name__ for x in leaves}
        )
        raise TypeError(
            f"{self.name} differentiates {named} (argnums={self.given[0]!r}), "
            f"which hold no floating-point leaf (only {', '.join(found)}): every "
            f"gradient would be None. Like jax.grad it needs real- or "
            f"complex-valued parameters: pass them as float arrays."
        )

    def _check_examples_not_differentiated(
        self, args: tuple, diff: tuple, mapped: tuple
    ) -> None:
        """With the default `batch_argnums`, `argnums` pointing at the examples
        instead of the parameters maps the parameters: the leaves of a mapped
        argument disagree on their leading size, none of them has the size on which
        the differentiated arguments' leaves all agree (as a batch's do), and the
        mapping would fail. Said so, where it would report inconsistent sizes."""

        def leading(i: int) -> list[tuple[str, int | None]]:
            out = []
            for path, x in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                if _axes.is_array(x):
                    size = np.shape(x)[0] if np.ndim(x) else None
                    out.append((f"args[{i}]{jax.tree_util.keystr(path)}", size))
            return out

        batch = {n for i in diff for _, n in leading(i)}
        if len(batch) != 1 or None in batch:
            return
        (n,) = batch
        params = [
            i
            for i in mapped
            if len(sizes := {size for _, size in leading(i)}) > 1 and n not in sizes
        ]
        if not params:
            return
        examples = sorted({*diff, *(i for i in mapped if i not in params)})
        shown = [f"{path} has {size}" for i in params for path, size in leading(i)]
        named = ", ".join(f"args[{i}]" for i in diff)

        def nums(values: list[int]) -> Any:
            return values[0] if len(values) == 1 else tuple(values)

        raise ValueError(
            f"{self.name} differentiates {named} "
            f"(argnums={self.given[0]!r}), whose leaves all have size {n} along "
            f"axis 0, as a batch of examples has, and maps every other argument "
            f"(batch_argnums=None), the parameters included: "
            f"{'; '.join(shown[:4])}{'; ...' if len(shown) > 4 else ''}. argnums "
            f"selects the parameters to differentiate, passed whole to every "
            f"example (not mapped); batch_argnums selects the arguments holding the "
            f"examples, mapped over their leading axis (by default every argument "
            f"not in argnums). Here the examples are differentiated and the "
            f"parameters mapped: if {named} "
            f"hold{'s' * (len(diff) == 1)} the examples, pass argnums="
            f"{nums(params)!r} and "
            f"batch_argnums={nums(examples)!r}."
        )

    def _warn_if_examples_differentiated(
        self, transform: Transform, args: tuple, diff: tuple, mapped: tuple
    ) -> None:
        """Warn (once per transform) where the default `batch_argnums` maps every
        argument but the differentiated ones, the parameters (argument 0 by
        convention) among them, and the differentiated ones look like examples
        too (every leaf of them and of the mapped ones has one leading size):
        gradients of each example's inputs (saliency) need them mapped."""
        if transform.warned("examples differentiated") or 0 in diff or not mapped:
            return  # (arguments 0, the parameters by convention, differentiated)
        sizes = {
            np.shape(x)[0] if np.ndim(x) else None
            for i in (*diff, *mapped)
            for x in jax.tree.leaves(args[i])
            if _axes.is_array(x)
        }
        if len(sizes) != 1 or None in sizes or (n := sizes.pop()) < 2:
            return
        named = ", ".join(f"args[{i}]" for i in diff)
        suggest = tuple(sorted({*diff, *(i for i in mapped if i != 0)}))
        transform.warn_once(
            "examples differentiated",
            f"{self.name} differentiates {named} (argnums={self.given[0]!r}) "
            f"whole for every example, and maps "
            f"{', '.join(f'args[{i}]' for i in mapped)} (batch_argnums=None maps "
            f"every argument not in argnums), but {named} has the examples' "
            f"leading size, {n}, too. For the gradients of each example's own "
            f"inputs, pass the arguments holding the examples as batch_argnums "
            f"(batch_argnums={suggest} where args[0] holds the parameters). "
            f"Warned once.",
            stacklevel=4,
        )

    def _warn_if_ambiguous(
        self, transform: Transform, args: tuple, diff: tuple, mapped: tuple
    ) -> None:
        """Warn (once per transform) when an argument left out of `batch_argnums`
        looks like one value per example: a leading axis of the examples' size."""
        if transform.warned("ambiguous"):
            return
        sizes = {
            np.shape(x)[0]
            for i in mapped
            for x in jax.tree.leaves(args[i])
            if np.ndim(x) > 0
        }
        if len(sizes) != 1 or (n := sizes.pop()) <= 1:
            return
        shared = [
            i
            for i, a in enumerate(args)
            if i not in mapped
            and i not in diff
            and any(np.ndim(x) > 0 and np.shape(x)[0] == n for x in jax.tree.leaves(a))
        ]
        if shared:
            suggest = tuple(sorted({*mapped, *shared}))
            transform.warn_once(
                "ambiguous",
                f"{self.name} passes {', '.join(f'args[{i}]' for i in shared)} "
                f"whole to every example (it is not in batch_argnums="
                f"{self.batch_argnums!r}), but its leading axis has the size of the "
                f"examples' axis, {n}. If it holds one value per example, map it: "
                f"batch_argnums={suggest}. Warned once.",
                stacklevel=4,
            )


@decorator_form("fun")
@takes(Chunking)
def per_example_grads(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] | None = None,
    **options: Unpack[Chunking],
) -> Callable[..., Any]:
    """Per-example gradients, `batch_size` examples at a time.

    `per_example_grads(fun, argnums, batch_argnums=b)(*args, **kwargs)` equals
    `jax.vmap(jax.grad(fun, argnums), in_axes)(*args, **kwargs)` where `in_axes` maps
    the arguments in `batch_argnums` over their leading axis and broadcasts the
    others. By default (`batch_argnums=None`) every positional argument that is not
    differentiated is mapped: `loss(params, x, y)` gets one `(x, y)` pair per
    example. Keyword arguments are mapped over their leading axis, as `jax.vmap`
    maps them (pass values shared by every example positionally, outside
    `batch_argnums`). `fun` is the loss of a single example, and the result
    holds one gradient per example along a new leading axis. The examples are
    evaluated in chunks of `batch_size` (see `chunkvmap.batch_vmap`), so the working
    memory is that of `batch_size` gradients plus the `N` stacked results.

    Floating-point arrays and Python floats in plain containers (dicts, lists,
    tuples) are differentiated, as by `jax.grad`; any other leaf of a differentiated
    argument (integer arrays, Python ints and bools, functions, an Equinox module's
    static parts and float hyperparameters) gets None in the gradient, as with
    `equinox.filter_grad`, so Equinox modules and Flax variable dicts work as
    parameters directly.

    Usable as a decorator too, with its options as keywords and without `fun`:
    `@per_example_grads(batch_size=8)` over a `def`.

    Args:
      fun: the per-example function; it must return a scalar (or `(scalar, aux)` with
        `has_aux`).
      argnums: which positional argument(s) to differentiate: an int or a sequence of
        ints (negative counts from the end).
      has_aux: `fun` returns `(loss, aux)`; the per-example `aux` is returned too.
      batch_argnums: which positional argument(s) hold the examples along their
        leading axis; the others are passed to every example unchanged. None (the
        default): every positional argument not in `argnums`.
      batch_size: examples per chunk (None: one `jax.vmap`; `"auto"`: from
        `memory_limit`).
      shard: spread the examples over the devices of `mesh` (see `batch_vmap`).
      mesh: the mesh for `shard` (see `batch_vmap`).
      remat: checkpoint each chunk (matters only when differentiating the result).
      memory_limit: the budget for `batch_size="auto"`.
      progress: a host progress bar over the chunks (see `batch_vmap`).
      chunk_size: an alias of `batch_size` (pass one of them).

    Returns:
      A function of `fun`'s arguments returning the stacked per-example gradients
      (with the structure of the argument, or a tuple of them for a sequence
      `argnums`), and with `has_aux` a pair `(grads, aux)`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import per_example_grads
      >>> def loss(w, x):
      ...     return 0.5 * jnp.sum((w * x) ** 2)
      >>> x = jnp.arange(6.0).reshape(3, 2)
      >>> per_example_grads(loss, batch_size=2)(jnp.ones(2), x)
      Array([[ 0.,  1.],
             [ 4.,  9.],
             [16., 25.]], dtype=float32)
    """
    name = "per_example_grads"
    check_bool(name, "has_aux", has_aux)
    transform = grad_transform(
        name,
        fun,
        argnums,
        batch_argnums,
        **options,
    )

    def call(args: tuple, kwargs: dict, known: _cache.Known) -> Any:
        diff, in_axes = transform.resolve(args)
        args = differentiable_floats(args, diff, in_axes)
        note = one_example_note(name, fun)
        grad_fn = _filtered_grad(fun, diff, transform.args.single, has_aux, note)
        return transform.map(grad_fn, args, kwargs, in_axes, 0, known=known)

    return transform.public(call, fun)
