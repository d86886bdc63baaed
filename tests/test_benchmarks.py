"""The accelerator benchmark script runs: `benchmarks/device.py --quick` on CPU, so
that a lent accelerator is never wasted on a script error (issue 17)."""

import importlib.util
import os
import pathlib
import subprocess
import sys


GPU = pathlib.Path(__file__).parent.parent / "benchmarks" / "device.py"


def _module(path=GPU):
    """The script at `path` (default `benchmarks/device.py`) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_quick(tmp_path):
    """Every workload gets a row for every method, all of them run and agree with
    jax.vmap, and nothing failed."""
    out = tmp_path / "gpu.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(GPU), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = out.read_text()
    assert "Traceback" not in text and "error:" not in text
    assert "jax 0." in text and "Device: cpu" in text
    gpu = _module()
    for name in gpu.WORKLOADS:
        assert f"## {name}" in text
        section = text.split(f"## {name}")[1].split("\n## ")[0]
        for method in gpu.method_names(name, gpu.QUICK):
            rows = [r for r in section.splitlines() if f"| {method} |" in r]
            assert rows, (name, method)
            for row in rows:
                cells = [c.strip() for c in row.strip("|").split("|")]
                if cells[3].startswith("n/a"):  # jax-privacy's microbatches
                    continue
                assert cells[3] == "ok", row
                if method in gpu.REFERENCES:
                    assert cells[-1].startswith("n/a"), row
                    continue
                assert float(cells[-1]) < 1e-4, row  # agrees with jax.vmap


def test_device_benchmark_keeps_what_a_child_measured_before_it_was_cut():
    """A child prints each row as it is measured: the rows of a child cut short
    are kept, and the device it reported."""
    gpu = _module()
    printed = (
        '{"row": {"workload": "ensemble", "method": "jax.vmap", "n": 16, '
        '"status": "ok"}}\nsome log line\n'
        '{"row": {"workload": "ensemble", "method": "jax.vmap", "n": 64, '
        '"status": "OOM"}}\n{"info": {"platform": "tpu"}}\n{"row": {"wor'
    )
    rows, info = gpu.parse_child(printed)
    assert [(r["n"], r["status"]) for r in rows] == [(16, "ok"), (64, "OOM")]
    assert info == {"platform": "tpu"}


def test_device_benchmark_marks_what_a_cut_child_did_not_reach():
    """The (method, N) a workload's child never reported are rows of the reason it
    stopped, over `jax.vmap`'s sizes up to its first OOM (the others' sizes); a
    method past its share of the time skips its sizes without running them."""
    gpu = _module()
    cfg = dict(gpu.QUICK, ensemble_sizes=[8, 16, 32])
    sizes = gpu.sizes_of("ensemble", cfg)
    rows = [
        {"workload": "ensemble", "method": "jax.vmap", "n": sizes[0], "status": "ok"},
        {"workload": "ensemble", "method": "jax.vmap", "n": sizes[1], "status": "OOM"},
    ]
    missing = gpu._missing("ensemble", cfg, rows, "cut (time budget)")
    methods = gpu.method_names("ensemble", cfg)
    assert methods[0] == "jax.vmap" and methods[1].startswith("chunkvmap")
    want = {(m, n) for m in methods[1:] for n in sizes[:2]}
    want |= {("jax.vmap", n) for n in sizes[2:]}
    assert {(r["method"], r["n"]) for r in missing} == want
    assert {r["status"] for r in missing} == {"cut (time budget)"}
    skipped = gpu.run_method("ensemble", "jax.vmap", sizes, cfg, until=0.0)
    assert [r["status"] for r in skipped] == ["skipped (time)"] * len(sizes)


def test_device_benchmark_measures_whole_sizes_until_the_frontier(monkeypatch):
    """A workload runs size by size, every method at each N (`jax.vmap` first): a
    size starts only where the time left holds what the previous one took (the
    rest are skipped, whole), and the sizes stop after the first where `jax.vmap`
    runs out of memory, the others measured there too."""
    gpu = _module()
    cfg = dict(gpu.QUICK, ensemble_sizes=[8, 16, 32, 64])
    methods = gpu.method_names("ensemble", cfg)
    clock = [0.0]
    monkeypatch.setattr(gpu.time, "monotonic", lambda: clock[0])

    def fake(name, method, sizes, cfg, emit=None, until=None, built=None):
        clock[0] += 10.0  # each method at each size takes 10 s
        (n,) = sizes
        oom = method == "jax.vmap" and n >= oom_from
        return [{"method": method, "n": n, "status": "OOM" if oom else "ok"}]

    monkeypatch.setattr(gpu, "run_method", fake)
    per_size = 10.0 * len(methods)

    def outcome(deadline):
        clock[0] = 0.0
        rows = gpu.run_workload("ensemble", cfg, lambda row: None, deadline)
        by_n: dict = {}
        for r in rows:
            by_n.setdefault(r["n"], []).append((r["method"], r["status"]))
        return by_n

    oom_from = 10**9
    # time for two sizes and a half: the third is not started
    got = outcome(2.5 * per_size)
    assert list(got) == [8, 16, 32, 64]
    for n, status in zip(
        [8, 16, 32, 64], ["ok", "ok", "skipped (time)", "skipped (time)"]
    ):
        assert [m for m, _ in got[n]] == methods, got[n]
        want = {status} if status != "ok" else {"ok"}
        assert {s for _, s in got[n]} == want, (n, got[n])
    oom_from = 16
    got = outcome(100 * per_size)
    assert list(got) == [8, 16]  # the frontier, then no larger size
    assert got[16] == [("jax.vmap", "OOM")] + [(m, "ok") for m in methods[1:]]


def test_device_benchmark_sizes_follow_the_device_memory():
    """The full sizes (for 139 GiB) scaled to a 15.75 GiB chip: powers of two, at
    least two chunks (B = 256: the loop runs at every size); unchanged without a
    reported limit and for the quick sizes."""
    gpu = _module()
    chip = gpu.scaled(gpu.FULL, int(15.75 * 2**30))
    assert chip["sizes"] == [512, 2048, 8192]
    assert chip["lm_sizes"] == [512, 2048]
    assert chip["ensemble_sizes"][0] == 2 * gpu.FULL["ensemble_batch"]
    assert gpu.scaled(gpu.FULL, None) is gpu.FULL
    assert gpu.scaled(gpu.QUICK, 2**30) is gpu.QUICK


def test_device_benchmark_ratios_need_both_figures():
    """A temp ratio where jax.vmap's figure is 0 (XLA:TPU reports 0 for programs
    that hold gigabytes) is not a ratio: shown as –."""
    import types

    gpu = _module()
    base = {"workload": "ensemble", "n": 64, "b": 16, "status": "ok", "run_s": 1.0}
    base.update(compile_s=1.0, fingerprint=[[1.0, 1.0]], peak_bytes=None)
    rows = [
        dict(base, method="jax.vmap", temp_bytes=0, compiled_peak_bytes=2**20),
        dict(base, method="batch_vmap", temp_bytes=3 * 2**20, compiled_peak_bytes=0),
    ]
    args = types.SimpleNamespace(quick=True, isolate=False)
    text = gpu.render(rows, {"device": "x"}, gpu.QUICK, args, 1.0)
    row = next(r for r in text.splitlines() if "| batch_vmap |" in r)
    assert [c.strip() for c in row.strip("|").split("|")][6] == "–"


def test_gpu_benchmark_sizes_stop_at_the_first_oom():
    gpu = _module()
    rows = [
        {"n": 1, "status": "ok"},
        {"n": 4, "status": "OOM"},
        {"n": 16, "status": "OOM"},
    ]
    assert gpu.sizes_until_oom(rows) == [1, 4]
    assert gpu.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"))
    assert not gpu.is_oom(ValueError("shapes do not match"))


def test_compile_benchmark_runs(tmp_path):
    """`benchmarks/bench_compile.py` on a tiny model: a row per mode, size and method,
    with lax.map as the baseline (ratio 1.00)."""
    script = GPU.parent / "bench_compile.py"
    out = tmp_path / "compile.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            *("--layers", "3", "--width", "4", "--sizes", "16", "12"),
            *("--batch-size", "4", "--repeats", "1", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        r
        for r in out.read_text().splitlines()
        if r.startswith("| forward") or r.startswith("| grad")
    ]
    methods = ["jax.vmap", "lax.map", "batch_vmap", "batch_vmap(remat=False)"]
    assert len(rows) == 2 * 2 * len(methods), rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] in methods
        assert all(float(c) > 0 for c in cells[4:])
        if cells[3] == "lax.map":
            assert cells[-3:] == ["1.00", "1.00", "1.00"]


def test_eager_benchmark_runs(tmp_path):
    """`benchmarks/bench_eager.py --quick`: a row per function, each checked against
    its reference (jax.vmap, eqx.filter_vmap, method="vmap") before it is timed."""
    script = GPU.parent / "bench_eager.py"
    out = tmp_path / "eager.md"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--repeats", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        r for r in out.read_text().splitlines() if r.startswith("| ") and "ms" not in r
    ]
    assert len(rows) == 10, rows  # (two of them built anew at every call)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[1:4])


def test_family_benchmark_runs(tmp_path):
    """`benchmarks/bench_families.py --quick` on its NCHW family with a depthwise
    convolution and group norms (the layout XLA:CPU is slow on inside loops, and
    the convolution the others' rules do not cover): five rows, every program
    checked against its reference before it is timed."""
    script = GPU.parent / "bench_families.py"
    out = tmp_path / "families.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--quick",
            "--rounds",
            "1",
            "--only",
            "depthwise",
            "--out",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    programs, ghost = out.read_text().split('## `method="ghost"`')
    rows = [r for r in programs.splitlines() if r.startswith("| ")][1:]
    assert len(rows) == 5, rows
    assert sum("depthwise" in r for r in rows) == 5, rows
    verdicts = [r for r in ghost.splitlines() if r.startswith("| ")][1:]
    assert len(verdicts) == 1 and "depthwise" in verdicts[0], verdicts
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:5]), row
        assert float(cells[7]) > 0, row


def test_runner_paths_benchmark_runs(tmp_path):
    """`benchmarks/bench_runner_paths.py --quick` on its MLP: the ghost program with
    every leaf forced per-example, checked equal to `method="vmap"` before both
    are timed, a row per quantity."""
    script = GPU.parent / "bench_runner_paths.py"
    out = tmp_path / "paths.md"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--repeats", "1", "--only", "MLP",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in out.read_text().splitlines() if r.startswith("| MLP")]
    assert [r.split("|")[2].strip() for r in rows] == ["clipped sum", "statistics"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:-1])
    # the clipped sum's forced program is method="vmap"'s: the same flops and bytes
    assert [r.strip("|").split("|")[-1].strip() for r in rows][0] == "yes"


def test_interleaved_times_each_call_after_one_of_its_own():
    """`interleaved` makes an untimed call of a function before each timed one:
    a timed call never follows another function's call; the rounds run the
    functions forwards and backwards in turn."""
    sys.path.insert(0, str(GPU.parent))
    import _common

    calls = []
    fns = [lambda x, k=k: calls.append(k) or x for k in range(3)]
    _common.interleaved(fns, (1,), 3, 0, jit=False)
    # every timed call (the second of each pair) repeats the call before it
    assert len(calls) == 3 * 3 * 2
    assert all(calls[i] == calls[i - 1] for i in range(1, len(calls), 2))
    assert calls[::2] == [0, 1, 2, 2, 1, 0, 0, 1, 2]


def test_the_chip_suites_resume_runs_failures_again(tmp_path):
    """`dev/test_device.py --resume` (and `--resume-from` kept logs) leaves out what
    passed or was skipped, by each test's latest outcome over the logs in order: a
    failure (fixed since) runs again."""
    runner = _module(GPU.parents[1] / "dev" / "test_device.py")
    log = tmp_path / "progress.txt"
    log.write_text(
        "passed tests/a.py::one\nfailed tests/a.py::two\nskipped tests/a.py::three\n"
        "failed tests/a.py::four\npassed tests/a.py::four\n"
        "passed tests/a.py::five\nfailed tests/a.py::five\n"
    )
    assert runner.finished(log) == {
        "tests/a.py::one", "tests/a.py::three", "tests/a.py::four"
    }  # fmt: skip
    assert runner.finished(tmp_path / "missing.txt") == set()
    later = tmp_path / "later.txt"  # (a later log, read after a kept one)
    later.write_text("failed tests/a.py::one\npassed tests/a.py::two\n")
    assert runner.finished(log, later) == {
        "tests/a.py::two", "tests/a.py::three", "tests/a.py::four"
    }  # fmt: skip
    # a folder of kept logs: its *.txt read by name (the .failures beside not read)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "a.txt").write_text(log.read_text())
    (kept / "b.txt").write_text(later.read_text())
    (kept / "b.txt.failures").write_text("passed tests/a.py::six\n")
    assert runner.finished(kept) == runner.finished(log, later)


def test_lds_benchmark_runs_every_method():
    """`benchmarks/bench_lds.py` at tiny sizes: a table row per method, each LDS a
    correlation (in [-1, 1])."""
    bench = _module(GPU.parent / "bench_lds.py")
    parser_args = bench.argparse.Namespace(
        train=40, test=6, models=6, steps=20, dims=[4], ensemble_batch=4,
        damping=0.1, out=None,
    )  # fmt: skip
    text = bench.run(parser_args)
    rows = [r for r in text.splitlines() if r.startswith("| ") and "method" not in r]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == [
        "grad dot", "grad cosine", "KFAC influence (exact)",
        "EK-FAC influence (exact)", "TRAK-style projected (dim 4)",
        "KFAC influence (dim 4)", "EK-FAC influence (dim 4)",
    ]  # fmt: skip
    for r in rows:
        assert -1.0 <= float(r.split("|")[2]) <= 1.0, r


def test_attribution_scale_benchmark_runs():
    """`benchmarks/bench_attribution_scale.py --quick`: every row measured, and the
    EK-FAC program's temporaries the same at N and 4N."""
    bench = _module(GPU.parent / "bench_attribution_scale.py")
    args = bench.argparse.Namespace(
        quick=True,
        n=8,
        batch=4,
        repeats=1,
        subset=2,
        no_memory=False,
        peak=True,
        no_parts=False,
        flops=True,
        out=None,
    )
    import jax

    # (the benchmark's model is written the ordinary way: rank promotion)
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        text = bench.run(args)
    for name in (
        "non-private step",
        "ekfac_factors",
        "build_store",
        "bases fitted on N/2",
        "part: the eigendecompositions of its factors",
        "ms per further example",
        "bases given (`factors=` an EK-FAC result: the second pass)",
        "XLA's flop count per sequence",
    ):
        assert name in text, text
    (row,) = [r for r in text.splitlines() if r.startswith("| ekfac_factors (ghost) |")]
    small, large = (float(c) for c in row.strip("|").split("|")[1:])
    assert small == large, row


def test_dp_scale_counts_the_products_flops(monkeypatch):
    """`bench_dp_scale.py --flops N --quick`: the products' flops of the non-private
    step and of the ghost program (held to it on the CPU), the skipped branches
    apart; the ghost program's products at least the step's (it makes them and the
    norms' Grams), on the tied LM (its program has a branch to skip)."""
    monkeypatch.syspath_prepend(str(GPU.parent))  # (its `_dp_models`)
    bench = _module(GPU.parent / "bench_dp_scale.py")
    import jax

    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        lines = bench.flop_table("gpt2", 2, quick=True)
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in lines if r[:2] == "| "}
    assert set(rows) >= {"non-private", "ghost"}, lines
    assert float(rows["non-private"][3]) == 1.0
    assert float(rows["ghost"][3]) > 1.0
    assert float(rows["non-private"][2]) == 0.0  # (no branch to skip)
    hlo = (
        "  %a = f32[4,8]{1,0} parameter(0)\n  %b = f32[8,3]{1,0} parameter(1)\n"
        "  %d = f32[4,3]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
        'rhs_contracting_dims={0}, metadata={op_name="jit(f)/cond/branch_1_fun/dot"}\n'
        "  %e = f32[4,3]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}\n"
    )
    assert bench.matmul_flops(hlo) == {"main": 192.0, "cond branches": 192.0}


def test_dp_scale_profiles_flat_and_names_the_lines(monkeypatch, tmp_path):
    """`bench_dp_scale.py --profile DIR`: each program's trace and optimised HLO
    lie flat in DIR (a device call brings back no nested folders), and
    `dev/profile_summary.py` finds the traces there and names the Python line that
    made each instruction of a ghost program (its norms' forms among them)."""
    monkeypatch.syspath_prepend(str(GPU.parent))  # (its `_dp_models`)
    bench = _module(GPU.parent / "bench_dp_scale.py")
    summary = _module(GPU.parent.parent / "dev" / "profile_summary.py")
    import jax
    import jax.numpy as jnp

    import chunkvmap

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)

    p = {"w": jnp.ones((6, 8)) / 8, "v": jnp.ones((8, 2)) / 4}
    lot = (jnp.ones((8, 6)), jnp.zeros((8, 2)))
    step = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=4, method="ghost")
    built = {"ghost": (jax.jit(step).lower(p, *lot).compile(), None)}
    bench.profile(str(tmp_path), built, p, lot)
    names = sorted(q.name for q in tmp_path.iterdir())
    assert names == ["ghost.hlo.txt", "ghost.trace.json.gz"]
    made = summary.sources(str(tmp_path / "ghost.hlo.txt"))
    files = {where.split(":")[0] for where, _ in made.values()}
    assert "_forms.py" in files, files
    assert not any(i in w for w, _ in made.values() for i in summary.INTERPRETERS)
    summary.main([str(tmp_path), "--by-source"])  # (finds the flat trace)


def test_dp_scale_tries_the_lots_in_turn_and_stops_at_the_first_failure(
    monkeypatch, tmp_path
):
    """`bench_dp_scale.py --lots ...`: each program tries the lots in turn, one row
    each, and stops at its first lot out of memory (rows past it are not tried)."""
    monkeypatch.syspath_prepend(str(GPU.parent))  # (its `_dp_models`)
    bench = _module(GPU.parent / "bench_dp_scale.py")
    real = bench.compiled

    def fits_to_8(step, params, lot):  # (a device of room for 8 examples)
        return (None, None) if lot[0].shape[0] > 8 else real(step, params, lot)

    monkeypatch.setattr(bench, "compiled", fits_to_8)
    out = tmp_path / "lots.md"
    argv = ["--quick", "--programs", "jax.vmap", "--sizes", "4", "--rounds", "1"]
    argv += ["--lots", "8", "16", "32", "--budget", "600", "--out", f"{out}"]
    import jax

    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        bench.main(argv)
    rows = [r for r in out.read_text().splitlines() if r.startswith("| jax.vmap | ")]
    assert [r.split(" | ")[1] for r in rows] == ["8", "16"], rows
    assert rows[1].split(" | ")[2] == "OOM" and rows[0].split(" | ")[2] != "OOM"
