"""`ghost_report`: which rule each differentiated leaf gets, and why."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from ..._core._cache import function_name
from ..._core._options import check_callable
from ..._transforms._grads import check_argnums, resolve_argnums
from ._plan import (
    GHOST,
    INSTANTIATED,
    PER_EXAMPLE,
    UNUSED,
    Method,
    Plan,
)
from ._rules import rule_kind
from ._traced import Traced, check_scalar_loss


class GhostReport:
    """Which rule `method="ghost"` uses for each differentiated leaf, and why; made
    by `ghost_report`.

    `print` it for a table and a summary, `rule(path)` for one leaf's rule,
    `as_dict()` for all of them, `shares()` for the share of the parameters under
    each rule.

    Attributes:
      rows: `(path, shape, rule, reason)` per floating-point leaf, where rule is
        `"ghost"` (ghost norm: the per-example gradient is never formed),
        `"instantiated"` (that leaf's per-example gradient is formed from the
        activations and cotangents of its uses, in the same backward pass: the
        mixed rule's choice when cheaper, and the rule of biases, scales and other
        elementwise parameters), `"per-example"` (no rule covers one of its uses:
        exact per-example gradients, as `method="vmap"`) or `"unused"` (zero
        gradient).
      uses: for each leaf's path, the kinds of its uses (`"dense"`, `"conv"`,
        `"embedding"`, `"elementwise"`, or a primitive's name).
      runs: `"ghost"` when the ghost program runs; `"vmap"` when no leaf has a
        ghost norm, or when the ghost program is predicted slower than
        `method="vmap"`'s and the vmap program's chunk fits in memory (or it saves
        little memory): `method="ghost"` then runs the per-example path of
        `method="vmap"` itself (the same result).
      slower: the ghost program runs though it is predicted slower than
        `method="vmap"`'s, for the memory it saves (the vmap program's chunk does
        not fit the memory budget).
      why: the reason for `runs`, with the predicted (or measured) costs.
      timing: on an accelerator, where a clipping function measured both programs
        for a chunk of its examples: `(chunk, device, seconds, failed)`, each
        program's seconds by method (None where it did not fit the device);
        else None.

    Examples:
      >>> from chunkvmap import GhostReport
      >>> report = GhostReport([("args[0]['w']", (3, 2), "ghost", "dense")])
      >>> report.rule("args[0]['w']"), report.runs
      ('ghost', 'ghost')
    """

    def __init__(
        self,
        rows: list[tuple[str, tuple, str, str]],
        uses: dict[str, list[str]] | None = None,
        *,
        runs: str | None = None,
        slower: bool = False,
        why: str = "",
        timing: Any = None,
        verdict: Any = None,
    ):
        self.rows = rows
        self.uses = uses or {}
        if runs is None:
            runs = (
                Method.GHOST if any(r == GHOST for _, _, r, _ in rows) else Method.VMAP
            )
        self.runs, self.slower, self.why = Method(runs), slower, why
        self.timing, self.verdict = timing, verdict

    def replace(self, **changes: Any) -> GhostReport:
        """This report with the verdict's fields (`runs`, `slower`, `why`,
        `timing`) changed."""
        fields = dict(
            runs=self.runs, slower=self.slower, why=self.why, timing=self.timing,
            verdict=self.verdict,
        )  # fmt: skip
        return GhostReport(self.rows, self.uses, **{**fields, **changes})

    def rule(self, path: str) -> str:
        """The rule of the leaf at key path `path` (as in `rows`)."""
        for p, _, rule, _ in self.rows:
            if p == path:
                return rule
        raise KeyError(f"ghost_report: no differentiated leaf at {path!r}")

    def as_dict(self) -> dict[str, str]:
        return {p: rule for p, _, rule, _ in self.rows}

    def shares(self) -> dict[str, float]:
        """The share of the parameters (entries of the differentiated leaves) under
        each rule, and under each kind of use (a leaf used in several ways counts
        under each kind: `"kind:dense"`, `"kind:embedding"`, ...)."""
        sizes = {p: math.prod(shape) for p, shape, _, _ in self.rows}
        total = sum(sizes.values()) or 1
        out: dict[str, float] = {}
        for p, _, rule, _ in self.rows:
            out[rule] = out.get(rule, 0.0) + sizes[p] / total
        for p, kinds in self.uses.items():
            if self.rule(p) == PER_EXAMPLE:
                continue
            for kind in kinds:
                key = f"kind:{kind}"
                out[key] = out.get(key, 0.0) + sizes[p] / total
        return out

    def fallback(self) -> list[str]:
        """The paths of the leaves that use per-example gradients."""
        return [p for p, _, rule, _ in self.rows if rule == PER_EXAMPLE]

    def __str__(self) -> str:
        width = max([len(p) for p, *_ in self.rows] + [4])
        lines = [f"{'leaf':<{width}}  {'shape':<14} {'rule':<13} why"]
        for p, shape, rule, reason in self.rows:
            lines.append(f"{p:<{width}}  {str(shape):<14} {rule:<13} {reason}")
        shares = self.shares()
        rules_line = ", ".join(
            f"{r} {100 * shares[r]:.1f}%"
            for r in (GHOST, INSTANTIATED, PER_EXAMPLE, UNUSED)
            if r in shares
        )
        lines.append(f"parameters by rule: {rules_line}")
        kinds = sorted(k for k in shares if k.startswith("kind:"))
        if kinds:
            lines.append(
                "parameters by use: "
                + ", ".join(f"{k[5:]} {100 * shares[k]:.1f}%" for k in kinds)
            )
        if self.runs is Method.VMAP:
            why = f": {self.why}" if self.why else ""
            lines.append(f"method='ghost' runs as method='vmap'{why}")
        elif self.slower:
            lines.append(f"predicted slower than method='vmap': {self.why}")
        return "\n".join(lines)

    __repr__ = __str__


def report_of(plan: Plan) -> GhostReport:
    """The report of a plan: each leaf's rule and why, the kinds of its uses, and
    the cost model's verdict (which `_choice.choose` checks: measured on an
    accelerator, the memory of a ghost program predicted slower on CPU)."""
    verdict = plan.verdict()
    runs, slower, why = verdict.runs, verdict.slower, verdict.why
    if runs is Method.GHOST and plan.stack_taps():
        why = f"{why}; {_TWO_PASSES}"
    return GhostReport(
        [(x.path, x.shape, x.rule, x.reason) for x in plan.leaves],
        {x.path: sorted({rule_kind(u) for u in x.uses}) for x in plan.leaves},
        runs=runs,
        slower=slower,
        why=why,
        verdict=verdict,
    )


_TWO_PASSES = (
    "a layer stack a scan reads through its xs: each dense layer's norm is taken in "
    "the backward pass, and the clipped sum by a second backward pass (weighted by "
    "the clip factors)"
)


def ghost_report(
    fun: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **kwargs: Any,
) -> GhostReport:
    """Which rule `method="ghost"` applies to each parameter leaf of `fun`, and why.

    `fun` is traced once on ONE example's arguments, exactly as it receives them
    (with `clipped_grad`'s default `keep_batch_dim=True`, pass the example with its
    leading axis of size 1). Every use of every floating-point leaf of the
    arguments `argnums` is found, through `jit`, `checkpoint`/remat, `scan` (a
    stacked leaf read through `xs`, or a leaf every iteration reads) and `cond`, and
    through example-independent linear steps between the leaf and its use
    (transposes, reshapes that keep axes, slices and splits, broadcasts, constant
    scales, casts, sharding constraints). The leaf gets one of the rules:

    * `"ghost"`: every use has a ghost norm (contractions: `@`, `einsum`,
      `dot_general`; convolutions, as patches; embedding lookups: `emb[tokens]`,
      `jnp.take`, `nn.Embed`, `eqx.nn.Embedding`), every pair of uses an exact cross
      term, and that costs fewer floating-point operations than forming the
      gradient: the per-example gradient is never formed;
    * `"instantiated"`: the per-example gradient is formed from the uses'
      activations and cotangents in the same backward pass (elementwise uses:
      biases, scales, position tables; `concatenate`, `select_n`, ...; and the
      mixed rule's choice when cheaper than the ghost norm);
    * `"per-example"`: some use has no rule (a nonlinearity applied to the leaf, a
      `custom_jvp`/`custom_vjp` function or a `while` loop it enters, a scan
      carry): exact per-example gradients, as `method="vmap"`;
    * `"unused"`: the loss does not use the leaf.

    Args:
      fun: the per-example loss.
      *args: one example's positional arguments (parameters included).
      argnums: the differentiated argument(s).
      batch_argnums: the arguments that hold the example (None: every argument not
        in `argnums`); keyword arguments always do.
      has_aux: `fun` returns `(loss, aux)`.
      **kwargs: one example's keyword arguments.

    Returns:
      A `GhostReport`: `print` it for a table and the share of the parameters under
      each rule; `.rows` holds `(path, shape, rule, reason)`, `.as_dict()` maps each
      leaf's key path to its rule, `.runs` says whether the ghost path runs.

    Raises:
      TypeError: when `fun` does not return a real scalar loss (as
        `clipped_grad_sum` requires), or for a keyword argument `fun` does not take
        (or an option of the chunked functions, such as `batch_size`, that `fun`
        does not name): the report takes no chunking options.

    Examples:
      >>> import jax.numpy as jnp
      >>> from chunkvmap import ghost_report
      >>> def loss(p, x):
      ...     return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))
      >>> report = ghost_report(loss, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
      ...                       jnp.ones(3))
      >>> report.as_dict()
      {"args[0]['b']": 'instantiated', "args[0]['w']": 'ghost'}
    """

    name = "ghost_report"
    check_callable(name, "fun", fun)
    _check_keywords(name, fun, kwargs)
    nums, _ = check_argnums(name, "argnums", argnums)
    diff = resolve_argnums(name, "argnums", nums, len(args))
    if batch_argnums is None:
        mapped = tuple(i for i in range(len(args)) if i not in diff)
    else:
        nums, _ = check_argnums(name, "batch_argnums", batch_argnums)
        mapped = resolve_argnums(name, "batch_argnums", nums, len(args))
    args = tuple(
        jnp.asarray(a) if i in diff and isinstance(a, (float, complex)) else a
        for i, a in enumerate(args)
    )
    traced = Traced(
        fun,
        args,
        kwargs,
        diff,
        mapped,
        strip=False,
        has_aux=has_aux,
        keep_batch_dim=False,
    )
    check_scalar_loss(name, traced)
    from .. import _clipping  # (which imports this module)

    return _clipping.report_for(fun, args, kwargs, diff, mapped, has_aux, traced=traced)


# The options of the chunked gradient functions, which ghost_report does not take.
_OPTIONS = frozenset(
    {
        "batch_size", "chunk_size", "shard", "remat", "memory_limit", "progress",
        "l2_clip_norm", "return_norms", "nan_safe", "keep_batch_dim",
        "microbatch_size", "rescale_to_unit_norm",
        "normalize_by", "return_values", "return_grad_norms", "prng_argnum",
        "pre_clipping_transform", "other_batch_size", "spmd_axis_name",
    }
)  # fmt: skip


def _check_keywords(name: str, fun: Callable[..., Any], kwargs: dict) -> None:
    """`ghost_report`'s other keyword arguments are `fun`'s: one it cannot take,
    or an option of the chunked functions that it does not name, is a mistake."""

    try:
        params = inspect.signature(fun).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    named = {
        k
        for k, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key in named or (takes_any and key not in _OPTIONS):
            continue
        option = (
            f" {key} is an option of the chunked functions (clipped_grad_sum, "
            f"clipped_grad, per_example_grad_norms, ...); the report does not depend "
            f"on it: pass it to those, not here."
            if key in _OPTIONS
            else ""
        )
        raise TypeError(
            f"{name} got the keyword argument {key!r}, which {function_name(fun)} "
            f"does not {'name' if takes_any else 'take'}. {name}(fun, *args, "
            f"argnums=0, batch_argnums=None, has_aux=False, **kwargs) takes one "
            f"example's arguments: *args and **kwargs are passed to fun as they "
            f"are.{option}"
        )
