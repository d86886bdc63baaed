"""Sharded chunking on 8 simulated CPU devices: per-device memory, FLOPs, collectives.

Two parts, both read from the compiled SPMD program (`memory_analysis()` and
`cost_analysis()` of the partitioned program are per device):

1. Layouts that follow the data, on `Explicit` meshes of shape (8,) and (4, 2): the
   batch sharded over "data" (and, on the 2-D mesh, an MLP's hidden layer over
   "model"), N = 512 ... 32768 (doubling), chunkvmap with a fixed `batch_size` against
   `jax.vmap` on the same mesh, for a stacked forward pass and for DP-SGD's clipped
   per-example gradient sum. Per device: temp memory (chunkvmap's must be flat in N),
   FLOPs (~N/D for both) and all-gathered bytes. XLA's cost analysis counts a
   while loop's body once, so the FLOPs here are that figure times the loop's known
   trip count (read from the optimised HLO; an upper bound, as it also multiplies the
   little work outside the loop); the raw figure is shown too.
2. The global remainder, on a 1-D `Auto` mesh with `shard=True`: for a memory-heavy
   per-example function (a 64 x 64 outer product, tanh, then a sum or a row mean) and
   N = 8 x {64, 512, 4096} examples (+3 for a global remainder), the per-device temp
   memory and the all-gathers (when D divides N a stacked output is not all-gathered
   at all; otherwise it comes back replicated).

    python benchmarks/bench_sharding.py [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import os
import re


os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402


# 8 simulated devices: set before JAX starts its backends.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

from chunkvmap import batch_vmap, clipped_grad_sum  # noqa: E402


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}
SIZES = [512 * 2**k for k in range(7)]  # 512 ... 32768
QUICK_SIZES = [512, 4096, 32768]


def gathered(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """Dtype and shape of the result of each all-gather in an optimised HLO module."""
    results = []
    for line in hlo.splitlines():
        if "all-gather(" not in line and "all-gather-start(" not in line:
            continue
        match = re.search(r"=\s*\(?(\w+)\[([\d,]*)\]", line)
        if match:
            dims = tuple(int(d) for d in match.group(2).split(",") if d)
            results.append((match.group(1), dims))
    return results


def all_gathers(hlo: str) -> list[int]:
    """Bytes produced by each all-gather in an optimised HLO module."""
    return [int(np.prod(s)) * DTYPE_BYTES.get(t, 4) for t, s in gathered(hlo)]


# --------------------------------------------------------------------------------------
# FLOPs with loops counted: XLA's cost analysis costs a while loop's body once.


def flops_with_loops(compiled) -> float:
    """Per-device FLOPs of a compiled program with its chunk loop counted: the public
    `cost_analysis()['flops']` (the loop body once, plus what runs once) times the
    largest known trip count of a while loop in the optimised HLO. An upper bound:
    it also multiplies the (small) work outside the loop."""
    raw = float(compiled.cost_analysis()["flops"])
    pattern = r'known_trip_count":\{"n":"(\d+)"'
    trips = [int(n) for n in re.findall(pattern, compiled.as_text())]
    return raw * max(trips, default=1)


# --------------------------------------------------------------------------------------
# Part 1: Explicit meshes, chunkvmap against jax.vmap.

IN, HIDDEN, OUT = 64, 1000, 16  # HIDDEN != any N: a gathered w2 is not y


def mlp(params, x):
    """One example through a hidden layer split over "model" (when the mesh has it)."""
    h = jnp.tanh(x @ params["w1"])
    return jnp.dot(h, params["w2"], out_sharding=P())


def loss(params, x, y):
    return jnp.sum((mlp(params, x) - y) ** 2)


def vmap_clipped_sum(params, x, y, clip=1.0):
    """DP-SGD's clipped sum from every per-example gradient at once."""
    grads = jax.vmap(jax.grad(loss), (None, 0, 0))(params, x, y)
    leaves = jax.tree.leaves(grads)
    norms = jnp.sqrt(sum(jnp.sum(g**2, axis=tuple(range(1, g.ndim))) for g in leaves))
    scale = clip / jnp.maximum(norms, clip)
    return jax.tree.map(
        lambda g: jnp.sum(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), grads
    )


def explicit_cases(batch_size: int):
    """(name, chunkvmap function, jax.vmap function, uses labels) per workload."""
    clipped = clipped_grad_sum(loss, 1.0, batch_argnums=(1, 2), batch_size=batch_size)
    return [
        (
            "forward, stacked",
            batch_vmap(mlp, in_axes=(None, 0), batch_size=batch_size),
            jax.vmap(mlp, (None, 0)),
            False,
        ),
        (
            "clipped grad sum",
            lambda p, x, y: clipped(p, x, y)[0],
            vmap_clipped_sum,
            True,
        ),
    ]


def measure(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    flops = compiled.cost_analysis()
    flops = (flops[0] if isinstance(flops, (list, tuple)) else flops)["flops"]
    hlo = compiled.as_text()
    return {
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "flops": flops_with_loops(compiled),
        "raw": flops,
        "gathered": sum(all_gathers(hlo)),
        # Whether any all-gather produces a global mapped input (the batch).
        "batch": any(s == np.shape(a) for _, s in gathered(hlo) for a in args[1:]),
    }


def explicit_part(sizes, batch_size, emit):
    emit("## Layouts that follow the data: Explicit meshes, chunkvmap vs jax.vmap")
    emit("")
    emit(
        f"The batch sharded over 'data' (`jax.make_mesh`'s default Explicit axes); "
        f"on the (4, 2) mesh the MLP's hidden layer ({IN} -> {HIDDEN} -> {OUT}) is "
        f"sharded over 'model' (`w1`'s columns, `w2`'s rows), on the (8,) mesh it is "
        f"replicated. chunkvmap: `batch_size={batch_size}`, no other argument; "
        f"jax.vmap on the same mesh. All figures per device. GFLOP: "
        f"`cost_analysis()['flops']` times the chunk loop's trip count (an upper "
        f"bound: it also multiplies the little work outside the loop); 'raw' is "
        f"`cost_analysis()['flops']` alone, which counts chunkvmap's loop body once."
    )
    emit("")
    emit(
        "| mesh | workload | N | examples / device | temp KiB: chunkvmap | "
        "temp KiB: vmap | GFLOP: chunkvmap | GFLOP: vmap | raw GFLOP: chunkvmap | "
        "all-gathered KiB: chunkvmap | all-gathered KiB: vmap | batch all-gathered |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for shape, names in (((8,), ("data",)), ((4, 2), ("data", "model"))):
        mesh = jax.make_mesh(shape, names)
        model = "model" if "model" in names else None
        label = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
        with jax.set_mesh(mesh):
            key1, key2 = jax.random.split(jax.random.key(0))
            params = {
                "w1": jax.device_put(
                    jax.random.normal(key1, (IN, HIDDEN)) / IN**0.5, P(None, model)
                ),
                "w2": jax.device_put(
                    jax.random.normal(key2, (HIDDEN, OUT)) / HIDDEN**0.5, P(model)
                ),
            }
            for case, chunked, vmapped, labels in explicit_cases(batch_size):
                rows = []
                for n in sizes:
                    x = jax.device_put(jnp.ones((n, IN)), P("data"))
                    y = jax.device_put(jnp.ones((n, OUT)), P("data"))
                    args = (params, x, y) if labels else (params, x)
                    c, v = measure(chunked, args), measure(vmapped, args)
                    rows.append((n, c, v))
                    emit(
                        f"| {label} | {case} | {n} | {n // mesh.shape['data']} | "
                        f"{c['temp'] / 1024:.0f} | {v['temp'] / 1024:.0f} | "
                        f"{_gflop(c['flops'])} | {_gflop(v['flops'])} | "
                        f"{_gflop(c['raw'])} | {c['gathered'] / 1024:.0f} | "
                        f"{v['gathered'] / 1024:.0f} | "
                        f"{'yes' if c['batch'] or v['batch'] else 'no'} |"
                    )
                summary.append(_summarise(label, case, rows))
    emit("")
    for line in summary:
        emit(line)
    emit("")
    emit(
        "On Explicit meshes chunkvmap has no manual axes: the examples' axis is "
        "split as (devices, N / devices) and the chunks of every device's share "
        "are evaluated together, so sharding-in-types places the work; like "
        "jax.vmap it gathers nothing (the clipped sum is one reduction over the "
        "sharded axis), on the (4, 2) mesh too."
    )
    emit("")


def _gflop(value):
    return "n/a" if value is None else f"{value / 1e9:.3f}"


def _summarise(label, case, rows):
    (n0, c0, v0), (n1, c1, v1) = rows[0], rows[-1]
    growth = n1 / n0
    text = (
        f"* {label}, {case}: from N={n0} to N={n1} ({growth:.0f}x), chunkvmap's temp "
        f"memory x{c1['temp'] / max(c0['temp'], 1):.2f}, jax.vmap's "
        f"x{v1['temp'] / max(v0['temp'], 1):.1f}"
    )
    if c0["flops"] and c1["flops"]:
        text += (
            f"; FLOPs x{c1['flops'] / c0['flops']:.1f} (chunkvmap) and "
            f"x{v1['flops'] / v0['flops']:.1f} (jax.vmap), chunkvmap / jax.vmap "
            f"{c1['flops'] / v1['flops']:.3f} at N={n1}"
        )
    return text + "."


# --------------------------------------------------------------------------------------
# Part 2: the global remainder on a 1-D Auto mesh with shard=True.


def per_example_stacked(v):
    return jnp.tanh(jnp.outer(v, v)).mean(0)  # 64 values out, 64 x 64 inside


def per_example_scalar(v):
    return jnp.tanh(jnp.outer(v, v)).sum()


def remainder_part(per_device_sizes, batch_size, emit):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    b = batch_size
    emit("## The global remainder: a 1-D Auto mesh with shard=True")
    emit("")
    emit(
        f"Mesh ('d': 8), `batch_size={b}` per device, a 64 x 64 outer product per "
        "example. Temp memory is XLA's per-device compiled estimate; all-gathers are "
        "read from the optimised HLO."
    )
    emit("")
    emit(
        "| N | N % 8 | output | temp KiB / device | output KiB | all-gathers | "
        "all-gathered KiB |"
    )
    emit("|---|---|---|---|---|---|---|")
    for per_device in per_device_sizes:
        for extra in (0, 3):
            n = 8 * per_device + extra
            x = jnp.ones((n, 64), jnp.float32)
            cases = {
                "stacked": batch_vmap(
                    per_example_stacked, batch_size=b, shard=True, mesh=mesh
                ),
                "reduced": batch_vmap(
                    per_example_scalar,
                    batch_size=b,
                    shard=True,
                    mesh=mesh,
                    reduction=jnp.add,
                    chunk_reduction=lambda y: y.sum(0),
                ),
            }
            for kind, fn in cases.items():
                compiled = jax.jit(fn).lower(x).compile()
                mem = compiled.memory_analysis()
                gathers = all_gathers(compiled.as_text())
                emit(
                    f"| {n} | {extra} | {kind} | {mem.temp_size_in_bytes / 1024:.1f} | "
                    f"{mem.output_size_in_bytes / 1024:.1f} | {len(gathers)} | "
                    f"{sum(gathers) / 1024:.1f} |"
                )
    emit("")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"N in {QUICK_SIZES} only (part 1)"
    )
    parser.add_argument("--chunk", type=int, default=64, help="batch_size, part 1")
    parser.add_argument("--batch-size", type=int, default=16, help="batch_size, part 2")
    parser.add_argument("--per-device", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    lines: list[str] = []

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    emit("# chunkvmap sharding benchmark")
    emit("")
    emit(
        f"{machine()}; {jax.device_count()} simulated devices. Memory and FLOPs are "
        "XLA's per-device compiled estimates (nothing is run)."
    )
    emit("")
    explicit_part(QUICK_SIZES if args.quick else SIZES, args.chunk, emit)
    per_device = args.per_device[:2] if args.quick else args.per_device
    remainder_part(per_device, args.batch_size, emit)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines).rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
