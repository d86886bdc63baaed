"""`dev/test_device.py`, the suite's runner on an accelerator: which tests its kept
progress logs leave out of a later run."""

import importlib.util
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location(
        "test_device", ROOT / "dev" / "test_device.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kept_logs_leave_out_what_passed_last(tmp_path):
    """Files and a folder of logs: a test is left out where its latest outcome (the
    logs in order, a folder's by name) is passed or skipped; one that failed last
    runs again; files that are not logs in the folder are not read."""
    runner = _runner()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "a.txt").write_text("passed t::a\nfailed t::b\nfailed t::c\n")
    (kept / "b.txt").write_text("passed t::b\nskipped t::d\nfailed t::a\n")
    (kept / "b.txt.failures").write_text("passed t::e\n")
    assert runner.finished(kept) == {"t::b", "t::d"}
    later = tmp_path / "later.txt"
    later.write_text("passed t::a\n")
    assert runner.finished(kept, later) == {"t::a", "t::b", "t::d"}
    assert runner.finished(tmp_path / "missing.txt") == set()
