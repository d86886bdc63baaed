"""Accelerator benchmark: the headline workloads as N grows until `jax.vmap` runs out
of memory.

One prepared script for an accelerator lent for a few minutes (`make bench-device`,
within 10 minutes: `--budget` seconds, 540 by default, shared fairly among the
workloads). Five workloads, each against `jax.vmap` (and
`lax.map(batch_size=B)` where it applies) on the same inputs:

  per_example_grads  per-example gradients of an MLP, stacked (N x params):
                     `chunkvmap.per_example_grads`;
  clipped_sum        DP-SGD's sum of per-example gradients clipped to L2 norm 1:
                     `chunkvmap.clipped_grad_sum`, `chunkvmap.clipped_grad`, and
                     jax-privacy's `clipping.clipped_grad` (whole batch, and with
                     `microbatch_size=B`, which needs B to divide N);
  ensemble           the forward pass of N stacked models on one shared batch:
                     `chunkvmap.batch_vmap` over the stacked parameters;
  grad_through_map   `jax.grad` through a chunked forward pass (per-example sequences):
                     `jax.grad` of a mean over `chunkvmap.batch_vmap`;
  lm_clipped_sum     DP-SGD's clipped sum on a GPT-style language model (token and
                     position embeddings read by `gather`, pre-norm blocks, an untied
                     head; `_dp_models.py`): `chunkvmap.clipped_grad_sum` with
                     `method="vmap"` and `method="ghost"`, and the non-private
                     `jax.grad` of the mean loss.

For each workload, `jax.vmap` runs first over growing N; the sizes stop at the first N
where it runs out of memory (its error is caught and recorded as OOM), and every other
method then runs over the same sizes. Each method is compiled (compile time), checked
against `jax.vmap` when both ran, then timed (median of `--repeats` runs after one
warm-up). Reported: XLA's compiled memory (`memory_analysis()`: the temporaries, and
the peak of arguments, outputs and temporaries live at once, which on a TPU is the
figure that predicts what the device holds), the device's
`memory_stats()["peak_bytes_in_use"]` where the backend has it (None on CPU; on a
TPU it counts the buffers the process allocated, not a program's temporaries), and
throughput in examples per second, as ratios against `jax.vmap` measured in the same
run. The sizes are those for 139 GiB of device memory (one H200), scaled to the
device's `bytes_limit` (powers of two). Each child prints every row as soon as it
is measured, and results go to `benchmarks/results/<platform>.md` (or `--out`),
rewritten after every workload, so that a run cut short keeps what it measured.

Time: each workload gets a fair share of the budget left, and runs size by size: at
each N every method, `jax.vmap` first, then chunkvmap's, then the other comparators,
so that a run short of time ends with whole sizes measured, each with its ratios. A
size starts only where the time left holds what the previous size took.

Off CPU, each workload runs in its own process (`--isolate`), so that the peak-memory
counter (a running maximum per process) belongs to that workload and an out-of-memory
failure cannot disturb the next workload. (Not one process per method: on a TPU v5e,
starting and stopping the runtime costs tens of seconds a process, which left most
methods of a 540-second run unmeasured.) `--quick` runs tiny sizes, one repeat, in one
process on CPU in a few seconds: the suite runs it so that a lent accelerator is never
wasted on a script error. Nothing here needs the network.

    python benchmarks/device.py [--quick] [--out benchmarks/results/tpu.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import is_oom  # noqa: E402


# Sizes: (examples N, chunk size B, model). The full sizes are for one H200 (139 GiB):
# jax.vmap's stacked gradients of the 1.6M-parameter MLP need ~6 MiB per example, so
# its clipped sum runs out of memory between N = 4096 and 65536; the ensemble's and
# the sequence model's activations likewise.
FULL = {
    "mlp": [512, 1024, 1024, 10],
    "sizes": [1024, 4096, 16384, 65536],
    "batch": 256,
    "ensemble_mlp": [256, 512, 512, 10],
    "ensemble_inputs": 4096,
    "ensemble_sizes": [256, 1024, 4096, 16384],
    "ensemble_batch": 256,
    "seq_mlp": [256, 1024, 1024, 1024, 1],
    "seq_len": 256,
    "lm": {"vocab": 2048, "width": 256, "positions": 32, "blocks": 2, "heads": 4},
    "lm_sizes": [1024, 4096, 16384],
    "lm_batch": 256,
    "repeats": 5,
}
QUICK = {
    "mlp": [8, 16, 4],
    "sizes": [40],
    "batch": 16,
    "ensemble_mlp": [4, 8, 2],
    "ensemble_inputs": 6,
    "ensemble_sizes": [40],
    "ensemble_batch": 16,
    "seq_mlp": [4, 8, 1],
    "seq_len": 3,
    "lm": {"vocab": 16, "width": 8, "positions": 4, "blocks": 1, "heads": 2},
    "lm_sizes": [24],
    "lm_batch": 8,
    "repeats": 1,
}

WORKLOADS = [
    "per_example_grads",
    "clipped_sum",
    "ensemble",
    "grad_through_map",
    "lm_clipped_sum",
]


# --------------------------------------------------------------------------------------
# The workloads (jax is imported lazily: the parent of isolated runs never starts a
# backend, which would take the GPU's memory from its children).


def _mlp_fns():
    import jax.numpy as jnp

    def init(rand, sizes, count=None):
        """MLP parameters (a list of (w, b)); `count` stacked models when given."""
        lead = () if count is None else (count,)
        return [
            (rand.normal((*lead, a, b)) / a**0.5, rand.zeros((*lead, b)))
            for a, b in zip(sizes[:-1], sizes[1:])
        ]

    def mlp(params, x):
        for w, b in params[:-1]:
            x = jnp.tanh(x @ w + b)
        w, b = params[-1]
        return x @ w + b

    return init, mlp


class Rand:
    """Random inputs: `jax.random` on the device (inside one jitted function per
    size), or NumPy on the host for the quick sizes (no compile at all)."""

    def __init__(self, host: bool):
        import jax

        self.host = host
        self.key = None if host else jax.random.key(0)
        self.rng = __import__("numpy").random.default_rng(0) if host else None

    @classmethod
    def make(cls, cfg: dict) -> Rand:
        return cls(host=cfg is QUICK)

    def _next(self):
        import jax

        self.key, key = jax.random.split(self.key)
        return key

    def normal(self, shape):
        import jax
        import jax.numpy as jnp

        if self.host:
            return self.rng.standard_normal(shape).astype("float32")
        return jax.random.normal(self._next(), shape, jnp.float32)

    def zeros(self, shape):
        import jax.numpy as jnp
        import numpy as np

        return np.zeros(shape, "float32") if self.host else jnp.zeros(shape)

    def randint(self, shape, high):
        import jax

        if self.host:
            return self.rng.integers(0, high, shape).astype("int32")
        return jax.random.randint(self._next(), shape, 0, high)


def jax_privacy_clipping():
    """jax-privacy's `clipping` module, or None when it is not importable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax_privacy import clipping
    except Exception:  # not installed, or broken against this jax
        return None
    return clipping


def _under_jax_privacy_settings(fn):
    """`fn` run as jax-privacy needs: standard dtype promotion (it adds booleans to
    floats) and its DeprecationWarnings silenced."""
    import jax

    def run(*args):
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore", DeprecationWarning)
            return fn(*args)

    return run


# Methods measured for comparison that compute another quantity than jax.vmap's (the
# non-private gradient of the mean loss): not checked against it.
REFERENCES = {"non-private jax.grad"}


def batch_of(name: str, cfg: dict) -> int:
    """The chunk size B of a workload."""
    return cfg.get({"ensemble": "ensemble_batch", "lm_clipped_sum": "lm_batch"}.get(
        name, "batch"
    ))  # fmt: skip


def sizes_of(name: str, cfg: dict) -> list[int]:
    """The sizes N of a workload."""
    return cfg[{"ensemble": "ensemble_sizes", "lm_clipped_sum": "lm_sizes"}.get(
        name, "sizes"
    )]  # fmt: skip


def workload(name: str, cfg: dict) -> tuple[Callable[[int], tuple], dict]:
    """`(make_inputs(n), methods)`: the inputs for N = n and name -> fn(*inputs)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import chunkvmap

    init, mlp = _mlp_fns()
    b = batch_of(name, cfg)

    if name in ("per_example_grads", "clipped_sum"):
        sizes = cfg["mlp"]

        def loss(p, x, y):
            return -jax.nn.log_softmax(mlp(p, x))[y]

        grad = jax.grad(loss)

        def make(n):
            rand = Rand.make(cfg)
            x, y = rand.normal((n, sizes[0])), rand.randint((n,), sizes[-1])
            return init(rand, sizes), x, y

        if name == "per_example_grads":
            return make, {
                "jax.vmap": lambda p, x, y: jax.vmap(grad, (None, 0, 0))(p, x, y),
                "lax.map": lambda p, x, y: lax.map(
                    lambda xy: grad(p, *xy), (x, y), batch_size=b
                ),
                "chunkvmap.per_example_grads": chunkvmap.per_example_grads(
                    loss, batch_argnums=(1, 2), batch_size=b
                ),
            }

        def clip(g):
            norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
            return jax.tree.map(lambda leaf: leaf / jnp.maximum(norm, 1.0), g)

        def sum0(tree):
            return jax.tree.map(lambda leaf: leaf.sum(0), tree)

        def clipped(p, x, y):
            return clip(grad(p, x, y))

        summed = chunkvmap.clipped_grad_sum(
            loss, 1.0, batch_argnums=(1, 2), batch_size=b
        )

        def loss_xy(p, xy):
            return loss(p, *xy)

        drop_in = chunkvmap.clipped_grad(
            loss_xy, l2_clip_norm=1.0, keep_batch_dim=False, microbatch_size=b
        )
        methods = {
            "jax.vmap": lambda p, x, y: sum0(jax.vmap(clipped, (None, 0, 0))(p, x, y)),
            "lax.map": lambda p, x, y: sum0(
                lax.map(lambda xy: clipped(p, *xy), (x, y), batch_size=b)
            ),
            "chunkvmap.clipped_grad_sum": lambda p, x, y: summed(p, x, y)[0],
            "chunkvmap.clipped_grad": lambda p, x, y: drop_in(p, (x, y)),
        }
        clipping = jax_privacy_clipping()
        if clipping is not None:
            whole = clipping.clipped_grad(
                loss_xy, l2_clip_norm=1.0, keep_batch_dim=False
            )
            micro = clipping.clipped_grad(
                loss_xy, l2_clip_norm=1.0, keep_batch_dim=False, microbatch_size=b
            )
            methods["jax_privacy.clipped_grad"] = _under_jax_privacy_settings(
                lambda p, x, y: whole(p, (x, y))
            )
            methods["jax_privacy.clipped_grad(microbatch)"] = (
                _under_jax_privacy_settings(lambda p, x, y: micro(p, (x, y)))
            )
        return make, methods

    if name == "ensemble":
        sizes, m = cfg["ensemble_mlp"], cfg["ensemble_inputs"]

        def make(n):
            rand = Rand.make(cfg)
            return init(rand, sizes, count=n), rand.normal((m, sizes[0]))

        return make, {
            "jax.vmap": lambda p, x: jax.vmap(mlp, (0, None))(p, x),
            "lax.map": lambda p, x: lax.map(lambda q: mlp(q, x), p, batch_size=b),
            "chunkvmap.batch_vmap": chunkvmap.batch_vmap(mlp, (0, None), batch_size=b),
        }

    if name == "grad_through_map":
        sizes, t = cfg["seq_mlp"], cfg["seq_len"]

        def f(p, x):  # one example: a sequence of t vectors
            return jnp.mean(mlp(p, x) ** 2)

        def make(n):
            rand = Rand.make(cfg)
            return init(rand, sizes), rand.normal((n, t, sizes[0]))

        chunked = chunkvmap.batch_vmap(f, (None, 0), batch_size=b)
        return make, {
            "jax.vmap": jax.grad(lambda p, x: jax.vmap(f, (None, 0))(p, x).mean()),
            "lax.map": jax.grad(
                lambda p, x: lax.map(lambda xi: f(p, xi), x, batch_size=b).mean()
            ),
            "chunkvmap.batch_vmap": jax.grad(lambda p, x: chunked(p, x).mean()),
        }

    if name == "lm_clipped_sum":
        import numpy as np

        sys.path.insert(0, HERE)
        from _dp_models import lm_batch, lm_loss, lm_params

        lm, b = cfg["lm"], cfg["lm_batch"]

        def loss(p, tokens, targets):
            return lm_loss(p, tokens, targets, lm["heads"])

        grad = jax.grad(loss)

        def make(n):
            rng = np.random.default_rng(0)
            return (lm_params(rng, lm), *lm_batch(rng, n, lm))

        def clipped(p, tokens, targets):
            g = grad(p, tokens, targets)
            norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
            return jax.tree.map(lambda leaf: leaf / jnp.maximum(norm, 1.0), g)

        def summed(method):
            fn = chunkvmap.clipped_grad_sum(loss, 1.0, batch_size=b, method=method)
            return lambda p, tokens, targets: fn(p, tokens, targets)[0]

        return make, {
            "jax.vmap": lambda p, t, y: jax.tree.map(
                lambda leaf: leaf.sum(0), jax.vmap(clipped, (None, 0, 0))(p, t, y)
            ),
            'chunkvmap.clipped_grad_sum(method="vmap")': summed("vmap"),
            'chunkvmap.clipped_grad_sum(method="ghost")': summed("ghost"),
            "non-private jax.grad": jax.grad(
                lambda p, t, y: jnp.mean(jax.vmap(loss, (None, 0, 0))(p, t, y))
            ),
        }

    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def method_names(name: str, cfg: dict) -> list[str]:
    """The methods of a workload: `jax.vmap` first (it decides the sizes), then
    chunkvmap's, then the other comparators (a run short of time measures what the
    table is for first)."""
    names = list(workload(name, cfg)[1])
    return sorted(names, key=lambda m: (m != "jax.vmap", not m.startswith("chunkvmap")))


# --------------------------------------------------------------------------------------
# Measuring one method at one size.


def measure(fn, args, repeats: int) -> dict:
    """Compile, run and time `fn(*args)`; a dict of the numbers, and `result`."""
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    temp = getattr(analysis, "temp_size_in_bytes", None)
    compiled_peak = getattr(analysis, "peak_memory_in_bytes", None)
    result = jax.block_until_ready(compiled(*args))  # the warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "status": "ok",
        "compile_s": compile_s,
        "temp_bytes": temp,
        "compiled_peak_bytes": compiled_peak,
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "run_s": statistics.median(times),
        "result": result,
    }


def fingerprint(tree) -> list[list[float]]:
    """Per leaf: its L2 norm and a fixed pseudo-random projection (fused by XLA, so
    nothing of the leaf's size is built): comparable across processes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def one(leaf, xp=jnp):
        leaf = leaf.astype(xp.float32)
        phase = sum(
            xp.indices(leaf.shape, sparse=True)[k] * (0.7 + 0.31 * k)
            for k in range(leaf.ndim)
        )
        return [xp.sqrt(xp.sum(leaf**2)), xp.sum(leaf * xp.cos(phase))]

    leaves = jax.tree.leaves(tree)
    if sum(x.size for x in leaves) < 2**20:  # small: NumPy on the host, no compile
        values = [one(np.asarray(x), np) for x in jax.device_get(leaves)]
    else:
        values = jax.jit(lambda xs: [one(x) for x in xs])(leaves)
    return [[float(v) for v in pair] for pair in values]


def fingerprint_err(a: list, b: list) -> float:
    """The largest difference of two fingerprints, relative to `b`'s leaf norms."""
    if len(a) != len(b):
        return float("inf")
    return max(
        (
            max(abs(x[0] - y[0]), abs(x[1] - y[1])) / (y[0] + 1e-30)
            for x, y in zip(a, b)
        ),
        default=0.0,
    )


def run_method(
    name, method, sizes, cfg, emit=lambda row: None, until=math.inf, built=None
) -> list[dict]:
    """One method of workload `name` over `sizes` (ascending); after an OOM the
    larger sizes are recorded as OOM without running, and after `until` (a
    `time.monotonic()` value) as skipped. `emit(row)` is called with each row as
    soon as it is measured. `built`: the workload's `(make_inputs, methods)`,
    where already built."""
    import jax

    make, methods = built or workload(name, cfg)
    if cfg is QUICK:  # NumPy inputs, moved to the device
        make = (lambda mk: lambda n: jax.device_put(mk(n)))(make)
    else:
        make = jax.jit(make, static_argnums=0)  # one compile per size, not per op
    fn = methods[method]
    b = batch_of(name, cfg)
    rows, failed = [], None
    for n in sizes:
        row = {"workload": name, "method": method, "n": n, "b": b}
        rows.append(row)
        if failed is None and time.monotonic() > until:
            failed = "skipped (time)"
        if failed is not None:
            row["status"] = failed
            emit(row)
            continue
        if method.endswith("(microbatch)") and n % b:
            row["status"] = "n/a (B must divide N)"
            emit(row)
            continue
        try:
            args = make(n)
            row.update(measure(fn, args, cfg["repeats"]))
            row["fingerprint"] = fingerprint(row.pop("result"))
            del args
        except Exception as error:  # noqa: BLE001 - every failure is recorded
            if is_oom(error):
                row["status"] = failed = "OOM"
            else:
                first = (str(error).strip().splitlines() or [""])[0][:120]
                row["status"] = f"error: {type(error).__name__}: {first}"
                print(traceback.format_exc(), file=sys.stderr, flush=True)
        emit(row)
    return rows


def device_info() -> dict:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {
        "device": f"{device.device_kind} ({jax.default_backend()}, "
        f"{jax.device_count()} device(s))",
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "memory_stats": bool(stats),
        "bytes_limit": stats.get("bytes_limit"),
    }


# The full sizes are for this much device memory (one H200).
FULL_BYTES = 139 * 2**30


def config(args, info: dict) -> dict:
    """The run's sizes: the quick ones, or the full ones scaled to the device
    `info` describes."""
    return scaled(QUICK if args.quick else FULL, info.get("bytes_limit"))


def scaled(cfg: dict, bytes_limit: int | None) -> dict:
    """`cfg` with its sizes scaled to a device of `bytes_limit` bytes (powers of
    two): jax.vmap then runs out of memory within them as on the device they were
    chosen for. Each size is at least two of its workload's chunks, so that the
    chunk loop runs at every size measured."""
    if not bytes_limit or cfg is QUICK:
        return cfg
    factor = bytes_limit / FULL_BYTES
    out = dict(cfg)
    for key, batch in (
        ("sizes", "batch"), ("ensemble_sizes", "ensemble_batch"),
        ("lm_sizes", "lm_batch"),
    ):  # fmt: skip
        least = 2 * cfg[batch]
        out[key] = sorted(
            {max(least, 2 ** round(math.log2(n * factor))) for n in cfg[key]}
        )
    return out


# --------------------------------------------------------------------------------------
# Orchestration: in one process (`--quick`, CPU), or one child process per method.


def sizes_until_oom(rows: list[dict]) -> list[int]:
    """jax.vmap's sizes up to and including its first OOM."""
    out = []
    for row in rows:
        out.append(row["n"])
        if row.get("status") == "OOM":
            break
    return out


def run_workload(name, cfg, emit, deadline) -> list[dict]:
    """Every method of workload `name`, size by size: at each N `jax.vmap` first,
    then the others, so that a run short of time ends with whole sizes measured
    (each with its ratios), not with each method at sizes the others did not
    reach. The sizes stop after the first where `jax.vmap` runs out of memory (the
    others run there too: the frontier). A size starts only where the time left
    until `deadline` (`time.monotonic()`) holds what the previous size took; the
    sizes not started are recorded as skipped."""
    sizes = sizes_of(name, cfg)
    methods = method_names(name, cfg)
    built = workload(name, cfg)
    rows: list[dict] = []
    took = 0.0
    for k, n in enumerate(sizes):
        start = time.monotonic()
        if start + took > deadline:
            rows += _skipped(name, methods, sizes[k:], cfg, emit)
            break
        print(f"{name}: N = {n}: {', '.join(methods)}", file=sys.stderr, flush=True)
        at_n = [run_method(name, m, [n], cfg, emit, built=built)[0] for m in methods]
        rows += at_n
        took = time.monotonic() - start
        if any(r["method"] == "jax.vmap" and r.get("status") == "OOM" for r in at_n):
            break  # the frontier: jax.vmap ran out of memory at n
    return rows


def _skipped(name, methods, sizes, cfg, emit) -> list[dict]:
    rows = [
        {"workload": name, "method": m, "n": n, "b": batch_of(name, cfg)}
        | {"status": "skipped (time)"}
        for n in sizes
        for m in methods
    ]
    for row in rows:
        emit(row)
    return rows


def child(args) -> None:
    """`--child WORKLOAD`: print the device, then one JSON line per row as it is
    measured, stopping by `--until` (a `time.monotonic()` value: the clock is the
    system's, shared with the parent)."""
    info = device_info()
    print(json.dumps({"info": info}), flush=True)
    cfg = config(args, info)

    def emit(row: dict) -> None:
        print(json.dumps({"row": row}), flush=True)

    run_workload(args.child, cfg, emit, args.until)


def parse_child(stdout: str) -> tuple[list[dict], dict]:
    """The rows and the device a child printed (all it printed before it was
    cut short)."""
    rows, info = [], {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                out = json.loads(line)
            except json.JSONDecodeError:  # the line it was printing when cut
                continue
            if "row" in out:
                rows.append(out["row"])
            info.update(out.get("info", {}))
    return rows, info


def run_isolated(name, cfg, args, deadline) -> tuple[list[dict], dict]:
    """Workload `name` in a child process until `deadline`; the rows it measured
    and the device it reported (the rows it did not reach: cut by the time
    budget, or by the crash that ended it)."""
    left = deadline - time.monotonic()
    if left < 5:
        return _missing(name, cfg, [], "skipped (time)"), {}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    # the child stops starting sizes a little before the parent's hard limit
    cmd += ["--until", repr(deadline - min(15.0, left / 10))]
    cmd += ["--quick"] if args.quick else []
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=left, cwd=HERE,
            env=args.child_env,
        )  # fmt: skip
        stdout, stderr, cut = proc.stdout, proc.stderr, None
    except subprocess.TimeoutExpired as e:
        stdout, stderr, cut = _text(e.stdout), _text(e.stderr), "cut (time budget)"
    sys.stderr.write(stderr)
    rows, info = parse_child(stdout)
    if cut is None:
        status = "OOM" if "RESOURCE_EXHAUSTED" in stderr else "crashed"
        cut = f"{status} (exit {proc.returncode})"
    if info:  # (the child scaled its sizes to the device it found)
        cfg = config(args, info)
    return rows + _missing(name, cfg, rows, cut), info


def _missing(name, cfg, rows, status) -> list[dict]:
    """Rows of `status` for the (method, N) of workload `name` absent from `rows`
    (`jax.vmap` decides the others' sizes: up to its first OOM)."""
    sizes = sizes_of(name, cfg)
    seen = {(r["method"], r["n"]) for r in rows}
    vmap = [r for r in rows if r["method"] == "jax.vmap"]
    if any(r.get("status") == "OOM" for r in vmap):
        others = sizes_until_oom(sorted(vmap, key=lambda r: r["n"]))
    else:
        others = sizes
    return [
        {"workload": name, "method": m, "n": n, "status": status}
        for m in method_names(name, cfg)
        for n in (sizes if m == "jax.vmap" else others)
        if (m, n) not in seen
    ]


def _text(out: bytes | str | None) -> str:
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _mib(x):
    return "–" if x is None else f"{x / 2**20:.4g}"


def render(rows: list[dict], info: dict, cfg: dict, args, seconds: float) -> str:
    import platform

    lines = [
        "# chunkvmap on one accelerator: the headline workloads until jax.vmap "
        "runs out of memory",
        "",
        f"Device: {info.get('device', '?')}; jax {info.get('jax', '?')}; "
        f"host: {platform.machine()}, {os.cpu_count()} CPU core(s); "
        f"{'quick sizes (CPU smoke test)' if args.quick else 'full sizes'}; "
        f"{seconds:.0f} s in all. Throughput is examples (ensemble: models) per "
        "second, median of "
        f"{cfg['repeats']} run(s) after a warm-up; ratios are against `jax.vmap` "
        "at the same N in the same run (throughput / vmap > 1: faster; "
        "temp / vmap < 1: less memory; – where either figure is 0). temp: XLA's "
        "compiled temp memory; compiled peak: XLA's peak of arguments, outputs and "
        "temporaries (`peak_memory_in_bytes`; on a TPU the figure that predicts "
        "what the device holds); device peak: `memory_stats()['peak_bytes_in_use']` "
        "of the process that ran the method ("
        + (
            "one process per workload: a running maximum, so that a method's figure "
            "includes the methods run before it in that workload"
            if args.isolate
            else "one process for all: a running maximum"
        )
        + "; on a TPU the buffers it allocated, not a program's temporaries; – "
        "where the backend has no memory stats). Sizes: "
        + ("the quick ones" if args.quick else "scaled to the device's bytes_limit")
        + ". Float32 matrix products at the backend's default precision (on a TPU "
        "a bfloat16 pass: the error column compares with jax.vmap at that "
        "precision). "
        f"MLP {cfg['mlp']}, ensemble MLP {cfg['ensemble_mlp']} on "
        f"{cfg['ensemble_inputs']} shared inputs, sequence model {cfg['seq_mlp']} "
        f"over {cfg['seq_len']} steps per example.",
    ]
    if jax_privacy_note := info.get("jax_privacy"):
        lines += ["", jax_privacy_note]
    for name in WORKLOADS:
        mine = [r for r in rows if r["workload"] == name]
        if not mine:
            continue
        vmap = {r["n"]: r for r in mine if r["method"] == "jax.vmap"}
        lines += [
            "",
            f"## {name}",
            "",
            "| N | B | method | status | compile s | temp MiB | temp / vmap "
            "| compiled peak MiB | device peak MiB | examples/s | throughput / vmap "
            "| max rel err vs vmap |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(mine, key=lambda r: r["n"]):
            ok = r.get("status") == "ok"
            ref = vmap.get(r["n"], {})
            ref_ok = ref.get("status") == "ok"
            tput = r["n"] / r["run_s"] if ok else None
            cells = [
                r["n"],
                r.get("b", "–"),
                r["method"],
                r.get("status", "?"),
                f"{r['compile_s']:.2f}" if ok else "–",
                _mib(r.get("temp_bytes")) if ok else "–",
                f"{r['temp_bytes'] / ref['temp_bytes']:.3f}"
                if ok and ref_ok and r.get("temp_bytes") and ref.get("temp_bytes")
                else "–",
                _mib(r.get("compiled_peak_bytes")) if ok else "–",
                _mib(r.get("peak_bytes")) if ok else "–",
                f"{tput:.4g}" if ok else "–",
                f"{ref['run_s'] / r['run_s']:.2f}" if ok and ref_ok else "–",
                "n/a (another quantity)"
                if r["method"] in REFERENCES
                else f"{fingerprint_err(r['fingerprint'], ref['fingerprint']):.1e}"
                if ok and ref_ok
                else "–",
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, CPU")
    parser.add_argument(
        "--out", default=None, help="markdown file (default: results/<platform>.md)"
    )
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one process per workload (default: on, except with --quick)",
    )
    parser.add_argument(
        "--budget", type=float, default=540.0, help="seconds for the whole run"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.isolate is None:
        args.isolate = not args.quick
    start = time.monotonic()
    deadline = start + args.budget
    if args.isolate:
        # This process only orchestrates: it must never start the accelerator's
        # backend (which would take its memory from the children).
        args.child_env = dict(os.environ)
        os.environ["JAX_PLATFORMS"] = "cpu"
        info: dict = {}
    else:
        info = device_info()
    cfg = config(args, info)
    rows: list[dict] = []
    if jax_privacy_clipping() is None:
        info["jax_privacy"] = (
            "jax-privacy is not importable here: its `clipped_grad` rows are skipped."
        )
        print(info["jax_privacy"], flush=True)
    for k, name in enumerate(args.workloads):
        # a fair share of the time left for each workload still to run
        until = time.monotonic() + (deadline - time.monotonic()) / (
            len(args.workloads) - k
        )
        print(f"{name}: until {until - start:.0f} s", flush=True)
        if args.isolate:
            got, child_info = run_isolated(name, cfg, args, until)
            info.update(child_info)
            cfg = config(args, info)
        else:
            got = run_workload(name, cfg, lambda row: None, until)
        rows += got
        text = render(rows, info, cfg, args, time.monotonic() - start)
        out = args.out or os.path.join(
            HERE, "results", f"{info.get('platform', 'device')}.md"
        )
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
