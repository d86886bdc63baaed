"""The functions of `chunkvmap/` longer than a limit, in lines of code.

A function's lines of code are its lines that hold code: its docstring, blank lines
and comment lines are not counted (nested functions count in their parent too).

    .venv/bin/python dev/function_lengths.py            # over 60 lines
    .venv/bin/python dev/function_lengths.py --limit 40
"""

from __future__ import annotations

import argparse
import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]


def lengths(package: pathlib.Path = ROOT / "chunkvmap") -> list[tuple[int, str]]:
    """(lines of code, "path:line name") for every function, longest first."""
    rows = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = set(range(node.lineno, node.end_lineno + 1))
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            ):
                lines -= set(range(first.lineno, first.end_lineno + 1))
            code = [
                i
                for i in lines
                if source[i - 1].strip() and not source[i - 1].strip().startswith("#")
            ]
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            rows.append((len(code), where))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=60)
    args = parser.parse_args()
    over = [(n, where) for n, where in lengths() if n > args.limit]
    for n, where in over:
        print(f"{n:4d} {where}")
    print(f"{len(over)} functions over {args.limit} lines of code")


if __name__ == "__main__":
    main()
