"""The main job (`python -m chunkvmap.demo`) and the DP-SGD example, run small."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from chunkvmap import demo


ROOT = pathlib.Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def standard_promotion():
    # optax's Adam mixes Python floats and int32 step counts, which the suite's strict
    # promotion setting (tests/conftest.py) refuses; users run with the default.
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_demo_trains_compares_and_plots(tmp_path, capsys):
    plot = tmp_path / "memory.png"
    argv = ["--epochs", "2", "--examples", "256", "--plot-up-to", "256"]
    argv += ["--lot-size", "128", "--batch-size", "32", "--repeats", "1"]
    argv += ["--method", "vmap", "--plot", str(plot)]  # vmap: compiles faster
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    accuracy = float(out.split("test accuracy after 2 epochs: ")[1].split()[0])
    assert accuracy > 0.3  # 2 noisy epochs: far above chance (0.1)
    assert "each padded to [" in out and ": 1 compiled program" in out
    assert "P(a lot exceeds it) = " in out
    padded = [line.split("|") for line in out.splitlines() if line.count("|") == 6]
    padded = [r for r in padded if r[1].strip().isdigit()]  # the padded/exact table
    assert padded and all(float(r[4].strip().rstrip("x")) > 0 for r in padded)
    epsilon = float(out.split("privacy: epsilon = ")[1].split()[0])
    assert 0 < epsilon < 100
    rows = {
        line.split("|")[0].strip(): line.split("|")
        for line in out.splitlines()
        if line.count("|") == 6 and not line.startswith("|")
    }
    assert len(rows) == 7  # the header and six methods
    # Against jax.vmap: chunkvmap needs less memory, ghost less still.
    chunked = float(rows["chunkvmap.clipped_grad"][3].strip().rstrip("x"))
    ghost = float(rows["method='ghost'"][3].strip().rstrip("x"))
    assert 1.0 < chunked < ghost
    assert "'auto' chose" in out
    assert plot.stat().st_size > 10_000


def test_padded_buffers_hold_every_example_of_a_lot_once():
    """A lot padded to the capacity (several buffers when larger, never truncated):
    every example in exactly one buffer, unpadded; the capacity is the expected lot
    plus four standard deviations in whole chunks, rarely exceeded."""
    rng = np.random.default_rng(0)
    for size in [0, 1, 63, 64, 65, 200, 300]:
        idx = rng.permutation(1000)[:size]
        buffers = demo.padded_buffers(idx, 64)
        assert all(len(rows) == len(pad) == 64 for rows, pad in buffers)
        real = np.concatenate([rows[~pad] for rows, pad in buffers])
        np.testing.assert_array_equal(real, idx)
    capacity = demo.lot_capacity(1437, 256 / 1437, 64)
    assert capacity % 64 == 0 and 256 + 4 * (256 * (1 - 256 / 1437)) ** 0.5 <= capacity
    assert demo.overflow_probability(1437, 256 / 1437, capacity) < 1e-4
    assert demo.overflow_probability(1437, 256 / 1437, 256) > 0.4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
        (["--epochs", "two"], "--epochs: expected a positive integer, got 'two'"),
        (["--clip", "-1"], "--clip: expected a finite number >= 0, got -1.0"),
        (["--noise", "nan"], "--noise: expected a finite number >= 0, got nan"),
        (["--examples", "100"], "--examples must be at least 256, got 100"),
        (["--method", "fast"], "--method: invalid choice: 'fast'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "chunkvmap.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for flag in ("--examples", "--batch-size", "--epochs"):
        assert flag in out


def test_dp_sgd_example_matches_optax_with_less_memory(capsys):
    spec = importlib.util.spec_from_file_location("dp_sgd", ROOT / "examples/dp_sgd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Two steps: optax's step compiles once per lot size.
    argv = ["--epochs", "1", "--lot-size", "512", "--batch-size", "64"]
    result = module.main([*argv, "--learning-rate", "3e-2"])
    assert "padded to" in capsys.readouterr().out
    assert result["memory_ratio"] > 3
    # Same initialisation, same batches, same noise: the two trainings agree.
    assert abs(result["acc_optax only"] - result["acc_chunkvmap"]) < 0.02
    assert result["acc_chunkvmap"] > 0.3
