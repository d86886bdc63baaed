"""Multi-host for real: 2 processes on localhost joined by jax.distributed."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from .helpers import users_environment


WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 90


def free_port() -> int | None:
    """A free port on the loopback, or None where no socket may be opened (the
    machines that lend an accelerator here allow none)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError:
        return None


def test_two_processes_get_the_single_process_answer():
    port = free_port()
    if port is None:
        pytest.skip("this machine allows no socket, so jax.distributed cannot run")
    env = users_environment()
    env["PYTHONPATH"] = str(WORKER.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"multi-host workers did not finish in {TIMEOUT_S}s")
    finally:
        for p in procs:  # clean up even when something failed
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: OK" in out, out[-4000:]
