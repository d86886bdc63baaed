"""The main job (`python -m chunkvmap.demo`) and the DP-SGD example, run small."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import jax
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
    assert "none padded" in out
    epsilon = float(out.split("privacy: epsilon = ")[1].split()[0])
    assert 0 < epsilon < 100
    rows = {
        line.split("|")[0].strip(): line.split("|")
        for line in out.splitlines()
        if line.count("|") == 6
    }
    assert len(rows) == 7  # the header and six methods
    # Against jax.vmap: chunkvmap needs less memory, ghost less still.
    chunked = float(rows["chunkvmap.clipped_grad"][3].strip().rstrip("x"))
    ghost = float(rows["method='ghost'"][3].strip().rstrip("x"))
    assert 1.0 < chunked < ghost
    assert "'auto' chose" in out
    assert plot.stat().st_size > 10_000


def test_sub_lots_cover_every_size_with_powers_of_eight():
    for size in range(600):
        parts = demo.sub_lots(size)
        assert sum(parts) == size
        assert set(parts) <= {1, 8, 64, 512}
    assert demo.sub_lots(259) == [64, 64, 64, 64, 1, 1, 1]


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
    assert "no padding" in capsys.readouterr().out
    assert result["memory_ratio"] > 3
    # Same initialisation, same batches, same noise: the two trainings agree.
    assert abs(result["acc_optax only"] - result["acc_chunkvmap"]) < 0.02
    assert result["acc_chunkvmap"] > 0.3
