"""Run the suite on an accelerator: in one process (one program at a time may hold
the chip), in groups of test files that each fit a 10-minute call.

    python3 dev/test_device.py --group 1/4      # the first of four groups
    python3 dev/test_device.py --list 4         # which files each group holds

The files are dealt into groups by their running time on CPU
(`tests/durations.txt`: seconds per file, from `pytest --durations=0`; a file not
listed counts as 10 s), the longest first, each to the group with the least so far.
Each test's outcome is printed as it finishes (`-v`), so that a call cut at its limit
still shows how far it got and what failed. The suite's `conftest.py` sets what an
accelerator needs (the highest matmul precision, meshes of the CPU devices on a
one-chip machine, child processes on the CPU).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.txt"


def durations() -> dict[str, float]:
    """Seconds per test file on CPU (`tests/durations.txt`: `seconds file` lines)."""
    out: dict[str, float] = {}
    if DURATIONS.exists():
        for line in DURATIONS.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                seconds, name = line.split()
                out[name] = float(seconds)
    return out


def groups(count: int) -> list[list[str]]:
    """The test files dealt into `count` groups of about equal running time."""
    known = durations()
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    files.sort(key=lambda f: -known.get(f, 10.0))
    dealt: list[list[str]] = [[] for _ in range(count)]
    totals = [0.0] * count
    for f in files:
        k = totals.index(min(totals))
        dealt[k].append(f)
        totals[k] += known.get(f, 10.0)
    return dealt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", help="i/k: the i-th of k groups (from 1)")
    parser.add_argument("--list", type=int, help="print the files of k groups")
    args, rest = parser.parse_known_args(argv)
    if args.list:
        for i, files in enumerate(groups(args.list), 1):
            print(f"{i}/{args.list}: {' '.join(files)}")
        return 0
    i, k = (int(x) for x in (args.group or "1/1").split("/"))
    files = [f"tests/{f}" for f in groups(k)[i - 1]]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rf"]
    return subprocess.call(cmd + rest + files, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
