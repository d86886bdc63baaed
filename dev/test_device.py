"""Run the suite on an accelerator: in one process (one program at a time may hold
the chip), in groups of test files that each fit a 10-minute call.

    python3 dev/test_device.py --group 1/4      # the first of four groups
    python3 dev/test_device.py --list 4         # which files each group holds
    python3 dev/test_device.py tests/test_statistics.py   # named files or tests

The files are dealt into groups by their running time on CPU
(`tests/durations.txt`: seconds per file, from `pytest --durations=0`; a file not
listed counts as 10 s), the longest first, each to the group with the least so far.
Each test's outcome is printed as it finishes (`-v`); no test starts after
`--deadline` seconds (the summary of failures is then printed, not lost to a cut);
with `--progress FILE` each outcome is also appended to FILE, and `--resume` leaves
out the tests FILE holds as passed or skipped (a failed one runs again), so that a
group is finished over several calls:

    python3 dev/test_device.py --group 1/4 --progress $OUT/1.txt
    python3 dev/test_device.py --group 1/4 --progress done/1.txt --resume

`--resume-from FILE` reads a kept earlier log (read only, e.g. one committed under
`benchmarks/results/suite_tpu/`) as `--resume` reads the progress file, the new
outcomes going to `--progress`; given a folder, it reads every log in it, so the
whole suite less what has passed on the chip so far runs with

    python3 dev/test_device.py --resume-from benchmarks/results/suite_tpu \
        --progress $OUT/next.txt

The suite's `conftest.py` sets what an accelerator needs (the highest matmul
precision, meshes of the CPU devices on a one-chip machine, child processes on the
CPU).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time


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


# The lines of a failure's report printed (and kept in `<progress>.failures`) as the
# test fails.
FAILURE_LINES = 25


class Progress:
    """A pytest plugin: each finished test's id and outcome appended to `log` as it
    finishes (so that a later call can leave out what ran: `--resume`), a failure's
    report printed at once (and appended to `<log>.failures`), and the session
    stopped cleanly (its summary printed) once `deadline` seconds have passed."""

    def __init__(self, log: pathlib.Path | None, deadline: float) -> None:
        self.log, self.deadline = log, deadline
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        failed = report.failed and report.when != "call"
        if report.when == "call" or failed or report.skipped:
            if self.log is not None:
                with self.log.open("a") as fh:
                    fh.write(f"{report.outcome} {report.nodeid}\n")
        if report.failed:  # its reason now, not only in a summary a cut would lose
            tail = "\n".join(report.longreprtext.splitlines()[-FAILURE_LINES:])
            text = f"\n=== {report.nodeid} ({report.when})\n{tail}\n"
            print(text, flush=True)
            if self.log is not None:
                with self.log.with_name(self.log.name + ".failures").open("a") as fh:
                    fh.write(text)

    def pytest_runtest_teardown(self, item) -> None:
        if time.monotonic() - self.start > self.deadline:
            item.session.shouldstop = f"the deadline of {self.deadline:.0f} s passed"


def finished(*logs: pathlib.Path) -> set[str]:
    """The test ids progress logs hold as passed or skipped (by their latest
    outcome, the logs read in order; a folder's `*.txt` logs by their names): a
    failed test runs again on `--resume`."""
    latest: dict[str, str] = {}
    for log in [
        x for p in logs for x in (sorted(p.glob("*.txt")) if p.is_dir() else [p])
    ]:
        if not log.exists():
            continue
        for line in log.read_text().splitlines():
            if line:
                outcome, nodeid = line.split(" ", 1)
                latest[nodeid] = outcome
    return {t for t, outcome in latest.items() if outcome in ("passed", "skipped")}


def main(argv=None) -> int:
    import pytest

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", help="i/k: the i-th of k groups (from 1)")
    parser.add_argument("--list", type=int, help="print the files of k groups")
    parser.add_argument(
        "--deadline", type=float, default=540.0,
        help="seconds after which no further test starts (the summary is printed)",
    )  # fmt: skip
    parser.add_argument(
        "--progress", type=pathlib.Path, default=None,
        help="a file each finished test's outcome and id is appended to",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="leave out the tests the --progress file holds as passed or skipped",
    )  # fmt: skip
    parser.add_argument(
        "--resume-from", type=pathlib.Path, action="append", default=[],
        help="an earlier run's progress file (kept, read only), or a folder of them "
        "(its *.txt by name): their passed or skipped tests are left out too, "
        "unless a later log says they failed",
    )  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    if args.list:
        for i, files in enumerate(groups(args.list), 1):
            print(f"{i}/{args.list}: {' '.join(files)}")
        return 0
    i, k = (int(x) for x in (args.group or "1/1").split("/"))
    files = [f"tests/{f}" for f in groups(k)[i - 1]]
    if any(os.path.exists(r.split("::")[0]) for r in rest):  # tests named instead
        files = []
    logs = [*args.resume_from]
    if args.resume and args.progress:
        logs.append(args.progress)
    done = finished(*logs)
    plugins: list = [Progress(args.progress, args.deadline)]
    if done:
        plugins.append(Deselect(done))
    # -vv over the project's -q: one line per test as it finishes
    cmd = ["-p", "no:cacheprovider", "-vv", "-rfE", "--tb=short"]
    os.chdir(ROOT)
    return int(pytest.main(cmd + rest + files, plugins=plugins))


class Deselect:
    """A pytest plugin leaving out the tests of `ids`."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def pytest_collection_modifyitems(self, items, config) -> None:
        left = {item.nodeid for item in items if item.nodeid in self.ids}
        if any(i.startswith(HOSTILE) for i in left):  # (its tally needs every
            # hostile case in this process: with some left out it cannot hold)
            left |= {i.nodeid for i in items if i.nodeid.startswith(TALLY)}
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in left])
        items[:] = [item for item in items if item.nodeid not in left]


HOSTILE = "tests/test_hostile.py::"
TALLY = HOSTILE + "test_every_entry_point_matched_and_raised"


if __name__ == "__main__":
    sys.exit(main())
