"""jax-privacy 2.0.0's own `clipped_grad` tests pass against `chunkvmap.clipped_grad`.

The file `tests/gradient_clipping_test.py` of jax-privacy's source distribution is
fetched from PyPI (`pip download`, kept under `.venv/` once fetched) and run, in a
fresh process, with one line changed: the module it tests (`from jax_privacy import
clipping as gradient_clipping`) becomes a shim that is jax-privacy's `clipping` module
with chunkvmap's `clipped_grad` in place of its own. Nothing of jax-privacy is kept in
this repository.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from .helpers import users_environment


ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = "2.0.0"
TESTS = f"jax_privacy-{VERSION}/tests/gradient_clipping_test.py"
IMPORT = "from jax_privacy import clipping as gradient_clipping"
SHIM = (
    "from jax_privacy.clipping import *  # noqa\nfrom chunkvmap import clipped_grad\n"
)
TIMEOUT_S = 300


def their_tests() -> str:
    """The source of jax-privacy's clipped_grad tests (downloaded once)."""
    cache = ROOT / ".venv" / "peer-tests"
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"jax_privacy-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"jax-privacy=={VERSION}",
             "--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(cache)],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    with tarfile.open(sdist) as archive:
        return archive.extractfile(TESTS).read().decode()


def test_jax_privacy_clipped_grad_tests_pass(tmp_path):
    source = their_tests()
    assert source.count(IMPORT) == 1  # the one line the shim replaces
    (tmp_path / "shim_clipping.py").write_text(SHIM)
    (tmp_path / "test_jax_privacy_clipped_grad.py").write_text(
        source.replace(IMPORT, "import shim_clipping as gradient_clipping")
    )
    env = users_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-p", "no:xdist", "test_jax_privacy_clipped_grad.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"jax-privacy's tests did not finish in {TIMEOUT_S}s")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "28 passed" in out, out[-4000:]
