"""The functions of `chunkvmap/` with more than a limit of positional parameters.

`self` and `cls` are not counted; keyword-only parameters (after `*`) are not
positional.

    .venv/bin/python dev/positional.py            # over 6
    .venv/bin/python dev/positional.py --limit 4
"""

from __future__ import annotations

import argparse
import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]


def positional(package: pathlib.Path = ROOT / "chunkvmap") -> list[tuple[int, str]]:
    """(positional parameters, "path:line name") for every function, most first."""
    rows = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [*node.args.posonlyargs, *node.args.args]
            if params and params[0].arg in ("self", "cls"):
                params = params[1:]
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            rows.append((len(params), where))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=6)
    limit = parser.parse_args().limit
    over = [(n, where) for n, where in positional() if n > limit]
    for n, where in over:
        print(f"{n:4d} {where}")
    print(f"{len(over)} functions with over {limit} positional parameters")


if __name__ == "__main__":
    main()
