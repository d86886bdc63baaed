import ast, pathlib, sys
rows = []
for p in pathlib.Path("chunkvmap").rglob("*.py"):
    src = p.read_text().splitlines()
    tree = ast.parse("\n".join(src))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = set(range(node.lineno, node.end_lineno + 1))
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
            code = [i for i in lines if src[i-1].strip() and not src[i-1].strip().startswith("#")]
            rows.append((len(code), f"{p}:{node.lineno} {node.name}"))
rows.sort(reverse=True)
for n, name in rows:
    if n > 60: print(n, name)
print(sum(1 for n, _ in rows if n > 60), "functions over 60")
