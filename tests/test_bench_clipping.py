"""`benchmarks/bench_clipping.py --quick` runs and writes every method's rows (its
time is its compiles and the imports: 20 s on a 2-core CPU)."""

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
        timeout=240,  # 20 s alone, 40 s beside another worker; shared machines
        check=True,
    )
    a, b = out.read_text().split("## (b)")
    for method in ("jax-privacy", "chunkvmap vmap", "chunkvmap ghost"):
        assert f"| 16 | 8 | {method} | " in a, method
    assert "n/a" not in a  # 16 % 8 == 0: jax-privacy runs
    for row in (
        "| whole batch | non-private jax.grad |",
        '| 8 | method="vmap" |',
        '| 8 | method="ghost" |',
    ):
        assert f"| MLP 16-32-32-4 | 16 {row}" in b, row
    b, c = b.split("## (c)")
    lm = "GPT-style LM (V=64, d=16, T=4, 2 blocks), untied head"
    for method in (
        "non-private jax.grad",
        'method="vmap"',
        'method="ghost"',
        "jax-privacy",
    ):
        assert f"| {lm} | {method} | " in c, method
    assert f"| {lm} | 94.1% | 5.9% | 0.0% |" in c
