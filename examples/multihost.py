r"""Multi-host chunked maps with `shard=True` under `jax.distributed`.

The same script runs on one process per host. Each process joins the cluster with
`jax.distributed.initialize`; `jax.devices()` then lists every device of every host,
and `batch_vmap(..., shard=True)` spreads the examples over all of them: each device
evaluates its share in chunks of `batch_size`, and the global remainder is evaluated
once. Every process must call it with the same (global) inputs.

On a real cluster (say 2 hosts, one process each; host 0 is the coordinator):

    # on host 0                                     # on host 1
    python examples/multihost.py \                    python examples/multihost.py \
      --coordinator host0:1234 \                        --coordinator host0:1234 \
      --num-processes 2 --process-id 0                  --num-processes 2 --process-id 1

(On Cloud TPU, or under SLURM / Open MPI, `jax.distributed.initialize()` with no
arguments finds all of this by itself: pass `--auto`.)

Locally on CPU, two processes with two CPU devices each, over gloo collectives:

    python examples/multihost.py --local 2
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys


def worker(args: argparse.Namespace) -> None:
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )

    import jax.numpy as jnp
    import numpy as np

    from chunkvmap import batch_vmap

    def per_example_loss(params, x, y):
        logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return -jax.nn.log_softmax(logits)[y]

    key = jax.random.key(0)  # the same on every process
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) / 4.0,
        "w2": jax.random.normal(k2, (32, 10)) / 6.0,
    }
    n = 1001  # any N: the global remainder (N % device count) is handled
    x = jax.random.normal(k3, (n, 16))
    y = jnp.arange(n) % 10

    mean_loss = batch_vmap(
        per_example_loss,
        in_axes=(None, 0, 0),
        batch_size=64,  # per device
        shard=True,
        reduction=jnp.add,
        chunk_reduction=lambda losses: losses.sum(0),
    )
    total = mean_loss(params, x, y)
    grads = jax.grad(lambda p: mean_loss(p, x, y) / n)(params)
    local_total = float(np.asarray(total.addressable_data(0)))
    reference = float(jnp.sum(jax.vmap(per_example_loss, (None, 0, 0))(params, x, y)))
    grad_norm = float(np.abs(np.asarray(grads["w1"].addressable_data(0))).sum())
    print(
        f"process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.device_count()} devices ({jax.local_device_count()} local), "
        f"total loss {local_total:.4f} (single-process {reference:.4f}), "
        f"|grad w1| {grad_norm:.4f}",
        flush=True,
    )
    jax.distributed.shutdown()


def launch_local(num_processes: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(num_processes),
                "--process-id",
                str(i),
                "--cpu-devices",
                "2",
            ]
        )
        for i in range(num_processes)
    ]
    try:
        return max(p.wait(timeout=300) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--auto", action="store_true", help="cluster auto-detection")
    parser.add_argument("--cpu-devices", type=int, default=0, help="CPU devices each")
    parser.add_argument("--local", type=int, metavar="P", help="run P local processes")
    args = parser.parse_args()
    if args.local:
        sys.exit(launch_local(args.local))
    if not args.auto and None in (
        args.coordinator,
        args.num_processes,
        args.process_id,
    ):
        parser.error("give --coordinator, --num-processes and --process-id (or --auto)")
    worker(args)


if __name__ == "__main__":
    main()
