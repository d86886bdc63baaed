"""Every ```python block of README.md and docs/ runs as written, printing what it shows.

The blocks of a page run in order, in this process (tests/conftest.py gives it the 8
CPU devices that the sharding snippets use), each in a fresh namespace, as a reader
copying it would run it, under JAX's default promotion rules. An HTML comment on the
last non-blank line before the fence changes that:

* `<!-- continues the block above -->`: the block runs in the namespace of the block
  before it on the page (the text before it says which names it takes from there);
* `<!-- not run: why -->`: the block is a fragment and is not run (kept rare: a test
  lists them, and each must say why).

Every `print(...)` shows its output in the comment ending its line (`print(y.shape)  #
(64, 1)`), and that is checked; nothing else may write to stdout. After a page has run,
what its comments claim (`# == jax.vmap(...)`, "bit-identical to nn.vmap's variables",
the chunk `batch_size="auto"` chose) is checked against the oracles below.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import io
import pathlib
import re
import subprocess
import sys
import tokenize
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import clipped_sum, compiled_as_users, temp_bytes, tree_allclose


ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
)
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(not run|continues the block above)\s*(?::\s*(.*?))?-->")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # the page's line number of the block's first line of code
    source: str
    marker: str | None  # "not run", "continues the block above" or None
    reason: str  # for "not run"


@dataclasses.dataclass
class Printed:
    """One execution of a `print(...)` call of a page."""

    source: str  # its arguments' source, whitespace-normalised: "grads.shape"
    args: tuple  # their values
    output: str  # what it printed, without the final newline
    comment: str | None  # the comment ending the call's last line
    where: str  # page:line


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        marker = MARKER.fullmatch(before[-1].strip()) if before else None
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start(1)) + 1,
                source=match.group(1),
                marker=marker.group(1) if marker else None,
                reason=(marker.group(2) or "").strip() if marker else "",
            )
        )
    return found


class Page:
    """Runs a page's blocks; its `print` records every call with the call's source."""

    def __init__(self, page: str):
        self.page = page
        self.calls: list[tuple[ast.Call, str, dict[int, str]]] = []
        self.printed: list[Printed] = []
        self.namespaces: list[tuple[Block, dict]] = []

    def print(self, *args, **kwargs):
        out = io.StringIO()
        builtins.print(*args, **{**kwargs, "file": out})
        line = sys._getframe(1).f_lineno
        if sys._getframe(1).f_code.co_filename != self.page or kwargs.get("file"):
            builtins.print(*args, **kwargs)  # not a doc snippet's print to stdout
            return
        node, source, comments = min(
            (c for c in self.calls if c[0].lineno <= line <= c[0].end_lineno),
            key=lambda c: c[0].end_lineno - c[0].lineno,
        )
        text = ", ".join(ast.get_source_segment(source, a) for a in node.args)
        self.printed.append(
            Printed(
                source=" ".join(text.split()),
                args=args,
                output=out.getvalue().removesuffix("\n"),
                comment=comments.get(node.end_lineno),
                where=f"{self.page}:{node.end_lineno}",
            )
        )

    def run(self, block: Block, namespace: dict) -> None:
        source = "\n" * (block.line - 1) + block.source  # tracebacks show page lines
        tree = ast.parse(source, self.page)
        comments = {
            tok.start[0]: tok.string[1:].strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
        self.calls += [
            (node, source, comments)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
        ]
        namespace.setdefault("print", self.print)
        stray = io.StringIO()
        with contextlib.redirect_stdout(stray):
            exec(compile(tree, self.page, "exec"), namespace)
        assert not stray.getvalue(), (
            f"{self.page}:{block.line} wrote {stray.getvalue()}"
        )


def run_page(page: str) -> Page:
    run = Page(page)
    # The readers' defaults, not the suite's strict ones (tests/conftest.py).
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        for block in blocks(page):
            if block.marker == "not run":
                continue
            if block.marker == "continues the block above":
                assert run.namespaces, f"{page}:{block.line} continues no block"
                namespace = run.namespaces[-1][1]
            else:
                namespace = {"__name__": "__main__"}
            run.run(block, namespace)
            run.namespaces.append((block, namespace))
    return run


# --------------------------------------------------------------------------------------
# What the pages' comments claim, checked against the oracles.


def printed(run: Page, source: str):
    """The value printed by the one `print(source)` of the page."""
    matches = [p for p in run.printed if p.source == source]
    assert len(matches) == 1, (source, [p.source for p in run.printed])
    return matches[0].args[0]


def namespace(run: Page, text: str) -> dict:
    """The namespace of the one block of the page containing `text`."""
    matches = [ns for block, ns in run.namespaces if text in block.source]
    assert len(matches) == 1, text
    return matches[0]


def check_auto_choice(fn, xs, chosen: int, budget: int) -> None:
    """`batch_size="auto"` chunked: `chosen` examples fit the budget by XLA's
    estimate (as the page says), no fewer chunks would (the shortest size that
    takes one chunk fewer does not fit), and `chosen` is the shortest size that
    takes as few."""
    from chunkvmap import batch_vmap

    n = xs.shape[0]
    assert isinstance(chosen, int) and 1 < chosen < n, chosen
    assert temp_bytes(batch_vmap(fn, batch_size=chosen), xs) <= budget
    chunks = -(-n // chosen)
    assert chosen == -(-n // chunks), (chosen, chunks)
    fewer = -(-n // (chunks - 1))
    assert temp_bytes(batch_vmap(fn, batch_size=fewer), xs) > budget


# The oracles are jitted: run op by op, they would take longer than the snippets.


def per_example_grads_of(ns: dict):
    """`jax.vmap(jax.grad(loss))` of the snippet's loss, parameters and examples."""
    grads = jax.jit(jax.vmap(jax.grad(ns["loss"]), (None, 0, 0)))
    return grads(ns["params"], ns["x"], ns["y"])


def reference_clipped_sum(loss, clip, params, *batch):
    """`jax.vmap(jax.grad(loss))` over `batch`, each gradient clipped to global L2
    norm `clip`, summed: all N gradients at once."""
    return clipped_sum(loss, clip, (params, *batch))[0]


def check_same_init(shown: Any, chunked: Any, reference: Any, *args: Any) -> Any:
    """A page's claim that `chunked.init(*args)` equals `reference.init(*args)` bit
    for bit, checked as users compile; the page's own `shown` variables (compiled by
    the suite, conftest.py) to rounding. Returns the reference's variables."""
    with compiled_as_users():
        variables = chunked.init(*args)
        expected = jax.jit(reference.init)(*args)
    tree_allclose(variables, expected, rtol=0, atol=0)
    tree_allclose(shown, expected)
    return expected


def check_readme(run: Page) -> None:
    ns = namespace(run, "x = jnp.arange(10.0)")
    x = ns["x"]
    quick = {
        "batch_vmap(jnp.sum, batch_size=2)(x)": jax.vmap(jnp.sum)(x),
        "dots": jax.vmap(jnp.dot, in_axes=(1, None))(x.T, jnp.ones(2)),
        "batch_vmap(jnp.sum, batch_size=2, reduction=jnp.add, "
        "chunk_reduction=lambda y: y.sum(0))(x)": jax.vmap(jnp.sum)(x).sum(0),
        "rows": x.sum(axis=1),
    }
    for source, expected in quick.items():
        tree_allclose(printed(run, source), expected)  # (tiny: op by op is fast)
    chosen = printed(run, "last_batch_size(f)")
    check_auto_choice(ns["per_example"], ns["big"], chosen, budget=16 * 2**20)
    some = ns["big"][:100]  # jax.vmap of all 1_000 would build 250 MiB of matrices
    tree_allclose(ns["out"][:100], jax.jit(jax.vmap(ns["per_example"]))(some))

    ns = namespace(run, "per_example_grads = batch_vmap(")
    tree_allclose(ns["grads"], per_example_grads_of(ns))

    ns = namespace(run, "total, count = clipped_grad_sum(")
    tree_allclose(ns["grads"], per_example_grads_of(ns))
    total = reference_clipped_sum(ns["loss"], 1.0, ns["params"], ns["x"], ns["y"])
    tree_allclose(ns["total"], total, rtol=1e-4, atol=1e-5)

    ns = namespace(run, "filter_batch_vmap(lambda m, x: m(x)")
    eqx = ns["eqx"]
    expected = eqx.filter_vmap(lambda m, x: m(x), in_axes=(eqx.if_array(0), None))
    tree_allclose(ns["logits"], eqx.filter_jit(expected)(ns["models"], ns["x"]))

    ns = namespace(run, "import chunkvmap.linen as cl")
    nn = ns["nn"]
    vmapped = nn.vmap(
        nn.Dense,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=None,
        axis_size=7,
    )
    check_same_init(ns["variables"], ns["Ensemble"](4), vmapped(4), ns["key"], ns["x"])

    ns = namespace(run, "grads, count = jax.jit(clipped_grad_sum(")
    assert int(ns["count"]) == ns["x"].shape[0]
    # The reference, unsharded (the page printed that `grads` is sharded like `w`).
    w, x = np.asarray(ns["w"]), np.asarray(ns["x"])
    tree_allclose(ns["grads"], reference_clipped_sum(ns["loss"], 1.0, w, x), rtol=1e-4)

    ns = namespace(run, "total = batch_vmap(per_example_loss")
    args = ns["params"], ns["x"], ns["y"]
    losses = jax.jit(jax.vmap(ns["per_example_loss"], (None, 0, 0)))(*args)
    assert float(printed(run, "total(params, x, y)")) == float(losses.sum())


def check_index(run: Page) -> None:
    ns = namespace(run, "per_example = batch_vmap(")
    tree_allclose(ns["grads"], per_example_grads_of(ns))
    tree_allclose(ns["total"], ns["grads"].sum(0), rtol=1e-5, atol=1e-3)
    ns = namespace(run, 'batch_size="auto"')
    xs = jnp.ones((500, 512))
    chosen = printed(run, "last_batch_size(f)")
    check_auto_choice(ns["features"], xs, chosen, budget=32 * 2**20)
    ns = namespace(run, "shard=True")
    predict = jax.jit(jax.vmap(ns["predict"], (None, 0)))
    tree_allclose(ns["out"], predict(ns["params"], ns["x"]))


def check_per_example_gradients(run: Page) -> None:
    ns = namespace(run, "grads = per_example_grads(")
    tree_allclose(ns["grads"], per_example_grads_of(ns))
    total = reference_clipped_sum(ns["loss"], 1.0, ns["params"], ns["x"], ns["y"])
    tree_allclose(ns["total"], total, rtol=1e-4, atol=1e-5)
    ns = namespace(run, "grad_fn = clipped_grad(")  # jax-privacy's conventions
    x, y, grad_fn = ns["x"], ns["y"], ns["grad_fn"]

    def one(w, x, y):  # the snippet's loss of a batch of one example
        return ns["loss"](w, (x[None], y[None]))

    total = reference_clipped_sum(one, 5.0, jnp.zeros(2), x, y)
    tree_allclose(ns["total"], total, rtol=1e-5, atol=1e-6)
    tree_allclose(ns["aux"].grad_norms, jnp.linalg.norm(x, axis=1), rtol=1e-6)
    assert grad_fn.l2_norm_bound == 5.0  # as the page says of the relations
    assert grad_fn.sensitivity("ADD_OR_REMOVE_ONE") == 5.0
    assert grad_fn.sensitivity("REPLACE_ONE") == 10.0
    ns = namespace(run, "batch_jacrev(")
    tree_allclose(ns["J"], jax.jit(jax.jacrev(ns["f"]))(ns["x"]))
    ns = namespace(run, "batch_vectorize(")
    expected = jax.jit(jnp.vectorize(ns["matvec"], signature="(n,k),(k)->(n)"))
    tree_allclose(ns["out"], expected(ns["ms"], ns["v"]))


def check_equinox(run: Page) -> None:
    ns = namespace(run, "@filter_batch_vmap(")
    eqx = ns["eqx"]
    expected = eqx.filter_vmap(lambda m, x: m(x), in_axes=(eqx.if_array(0), None))
    tree_allclose(ns["y"], eqx.filter_jit(expected)(ns["ensemble"], jnp.ones(8)))


def check_linen(run: Page) -> None:
    ns = namespace(run, "cl.batch_vmap(")
    nn, x = ns["nn"], ns["x"]
    kwargs = dict(variable_axes={"params": 0}, split_rngs={"params": True})
    model = nn.vmap(nn.Dense, in_axes=None, axis_size=7, **kwargs)(features=4)
    expected = check_same_init(
        ns["variables"], ns["model"], model, jax.random.key(0), x
    )
    tree_allclose(ns["y"], jax.jit(model.apply)(expected, x))


def check_nnx(run: Page) -> None:
    ns = namespace(run, "cnnx.batch_vmap(")
    nnx = ns["nnx"]
    forward = nnx.jit(nnx.vmap(lambda m, x: m(x), in_axes=(0, None)))
    expected = forward(ns["ensemble"], ns["x"])
    tree_allclose(ns["y"], expected)


CHECKS: dict[str, Callable[[Page], None]] = {
    "README.md": check_readme,
    "docs/index.md": check_index,
    "docs/per-example-gradients.md": check_per_example_gradients,
    "docs/adapters/equinox.md": check_equinox,
    "docs/adapters/linen.md": check_linen,
    "docs/adapters/nnx.md": check_nnx,
}
PAGES_WITH_CODE = [page for page in PAGES if blocks(page)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_snippets_run_and_print_what_they_show(page):
    """Each page's snippets run in order and print what their comments show. The
    pages show the CPU's output over its 8 devices (their meshes are built from
    `jax.devices()`): on an accelerator's machine the test runs in a process of
    its own on the CPU (`conftest.py` sets `JAX_PLATFORMS=cpu` for children)."""
    if jax.default_backend() != "cpu":
        test = f"{__file__}::test_page_snippets_run_and_print_what_they_show[{page}]"
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
        assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
        return
    run = run_page(page)
    assert run.printed, f"{page}: its snippets show no output"
    for p in run.printed:
        assert p.comment == p.output, (
            f"{p.where}: print({p.source}) printed {p.output!r}, but the comment "
            f"ending its line shows {p.comment!r}"
        )
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        CHECKS.get(page, lambda run: None)(run)


def test_every_snippet_is_run_or_says_why_not():
    every = [b for page in PAGES for b in blocks(page)]
    assert len(blocks("README.md")) >= 5, blocks("README.md")  # the extractor works
    skipped = [b for b in every if b.marker == "not run"]
    for block in skipped:
        assert block.reason, f"{block.page}:{block.line}: `<!-- not run: why -->`"
    assert len(skipped) <= 2, [(b.page, b.line, b.reason) for b in skipped]
    assert set(CHECKS) <= set(PAGES_WITH_CODE)
