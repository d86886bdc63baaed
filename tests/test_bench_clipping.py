"""`benchmarks/bench_clipping.py --quick` runs and writes every method's rows."""

from __future__ import annotations

import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_run_has_every_method(tmp_path):
    out = tmp_path / "clipping.md"
    subprocess.run(
        [sys.executable, "bench_clipping.py", "--quick", "--out", str(out)],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    table = out.read_text()
    a, b = table.split("## (b)")
    for method in ("jax-privacy", "chunkvmap vmap", "chunkvmap ghost"):
        assert f"| 16 | 8 | {method} |" in a, method
    for model in ("MLP 16-32-32-4", "transformer block T=4"):
        for method in ("non-private jax.grad", 'method="vmap"', 'method="ghost"'):
            assert f"| {model}" in b and f"| {method} |" in b, (model, method)
        assert b.count(f"| {model}") == 3, model
    assert "n/a" not in a  # 16 % 8 == 0: jax-privacy runs
