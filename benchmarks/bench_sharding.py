"""Sharded chunking on 8 simulated CPU devices: per-device memory and collectives.

For a memory-heavy per-example function (a 64 x 64 outer product, tanh, then a sum or
a row mean) and N = 8 x {64, 512, 4096} examples (+3 for a global remainder), with
`batch_size=B` per device, it reports from the compiled SPMD program:

* per-device compiled temp memory (`memory_analysis()` of the partitioned program is
  per device) — it must be set by `batch_size`, not grow with N;
* the all-gathers in the optimised HLO and the bytes they produce — when D divides N
  a stacked output must not be all-gathered at all.

    python benchmarks/bench_sharding.py [--batch-size 16] [--out results.md]
"""

from __future__ import annotations

import argparse
import os
import re


os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from chunkvmap import batch_vmap  # noqa: E402


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}


def all_gathers(hlo: str) -> list[int]:
    """Bytes produced by each all-gather in an optimised HLO module."""
    sizes = []
    for line in hlo.splitlines():
        if "all-gather(" not in line and "all-gather-start(" not in line:
            continue
        match = re.search(r"=\s*\(?(\w+)\[([\d,]*)\]", line)
        if match:
            dims = [int(d) for d in match.group(2).split(",") if d]
            sizes.append(int(np.prod(dims)) * DTYPE_BYTES.get(match.group(1), 4))
    return sizes


def per_example_stacked(v):
    return jnp.tanh(jnp.outer(v, v)).mean(0)  # 64 values out, 64 x 64 inside


def per_example_scalar(v):
    return jnp.tanh(jnp.outer(v, v)).sum()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--per-device", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    b = args.batch_size
    lines = [
        "# chunkvmap sharding benchmark",
        "",
        f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices, mesh "
        f"('d': 8), batch_size={b} per device. Temp memory is XLA's per-device "
        "compiled estimate; all-gathers are read from the optimised HLO.",
        "",
        "| N | N % 8 | output | temp KiB / device | output KiB | all-gathers | "
        "all-gathered KiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        print(line)

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    for per_device in args.per_device:
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
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
