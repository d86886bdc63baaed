"""The README's quick examples run as written and give what the README says."""

import ast
import io
import pathlib
import re
import tokenize

import jax
import jax.numpy as jnp
import numpy as np

from .helpers import temp_bytes, tree_allclose


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def quick_examples() -> str:
    text = README.read_text()
    section = text[text.index("## Quick examples") :]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    return block.group(1)


def run_like_a_repl(source: str) -> tuple[list[tuple[str, object, str | None]], dict]:
    """Run `source` statement by statement; for every expression statement keep its
    source (whitespace-normalised), its value and the comment ending its last line
    (where the README shows the result)."""
    comments = {
        tok.start[0]: tok.string[1:].strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    namespace: dict = {}
    shown = []
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Expr):
            code = compile(ast.Expression(stmt.value), "README.md", "eval")
            value = eval(code, namespace)
            text = " ".join(ast.get_source_segment(source, stmt).split())
            shown.append((text, value, comments.get(stmt.end_lineno)))
        else:
            exec(compile(ast.Module([stmt], []), "README.md", "exec"), namespace)
    return shown, namespace


def test_quick_examples_run_and_give_the_results_shown():
    shown, ns = run_like_a_repl(quick_examples())
    x = ns["x"]
    np.testing.assert_array_equal(x, np.arange(10.0, dtype=np.float32).reshape(5, 2))
    ones = jnp.ones((100_000, 64))
    # Every expression of the snippet, with what jax.vmap (or plain JAX) gives.
    expected = {
        "batch_vmap(jnp.sum, batch_size=2)(x)": jax.vmap(jnp.sum)(x),
        "batch_vmap(jnp.dot, in_axes=(1, None), batch_size=1)(x.T, jnp.ones(2))": (
            jax.vmap(jnp.dot, in_axes=(1, None))(x.T, jnp.ones(2))
        ),
        "batch_vmap(jnp.sum, batch_size=2, reduction=jnp.add, "
        "chunk_reduction=lambda y: y.sum(0))(x)": jax.vmap(jnp.sum)(x).sum(0),
        "batch_map(lambda chunk: chunk.sum(axis=1), x, batch_size=2)": x.sum(axis=1),
        "f(jnp.ones((100_000, 64)))": jnp.sin(ones),
    }
    assert [s for s, _, _ in shown] == [*expected, "last_batch_size(f)"], shown
    for source, value, comment in shown[:-1]:
        tree_allclose(value, expected[source])
        if comment is not None:  # the README shows the printed result
            assert comment == str(np.asarray(value)), (source, comment, value)
    comments = [c for _, _, c in shown if c is not None]
    assert comments == ["[ 1.  5.  9. 13. 17.]", "45.0"], comments
    # The chosen chunk fits the 256MiB budget; all 100_000 sines fit it, so the
    # largest chunk that fits is all of them.
    chosen = shown[-1][1]
    assert isinstance(chosen, int) and 1 <= chosen <= 100_000
    batch_vmap, budget = ns["batch_vmap"], 256 * 2**20
    assert temp_bytes(batch_vmap(jnp.sin, batch_size=chosen), ones) <= budget
    assert temp_bytes(batch_vmap(jnp.sin, batch_size=100_000), ones) <= budget
    assert chosen == 100_000
