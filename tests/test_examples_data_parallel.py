"""examples/data_parallel.py runs as a script, on 8 simulated CPU devices."""

import os
import pathlib
import subprocess
import sys

import pytest

from .helpers import users_environment


ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "data_parallel.py"
TIMEOUT_S = 120


def test_data_parallel_example_trains_and_checks_itself():
    # A fresh process: the script sets its own device count, and its own (standard)
    # dtype promotion, as a user running it would have.
    env = users_environment()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        result = subprocess.run(
            [sys.executable, str(SCRIPT)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/data_parallel.py did not finish in {TIMEOUT_S}s")
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert "OK: data_parallel example passed" in out, out[-4000:]
    assert "mesh {'data': 4, 'model': 2}" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if "  loss " in line]
    assert len(losses) >= 3 and losses[-1] < losses[0], out
