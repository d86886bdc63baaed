"""Is `method="ghost"`'s choice the faster program? Six DP models, both programs timed.

For each model (the GPT-style LM untied, tied and with its blocks scanned, the
CIFAR-style convnet, a ViT and an MLP; `_dp_models.py`), one jitted
`clipped_grad_sum` step over N examples in chunks of B is timed three ways,
interleaved (median of `--repeats` rounds, each round running every program once):

  vmap     `method="vmap"`: per-example gradients;
  ghost    the ghost program, forced (the choice switched off);
  chosen   `method="ghost"` as a user calls it: the program it chooses (on an
           accelerator by measuring both programs on one chunk; on CPU by the cost
           model), and whether it warned (`GhostFallbackWarning`).

The choice is right where `chosen` takes at most 1.1x the faster program's time.
`chosen` times the chosen program a third time, so its ratio holds the noise of
timing one program twice; "its program / faster" reads the chosen program's own
column (vmap or ghost) against the faster, without that noise.

    python benchmarks/bench_choice.py [--quick] [--n N] [--batch B] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
import warnings

import _dp_models as models
import jax
import numpy as np
from _common import Table, interleaved

import chunkvmap
from chunkvmap._quantities import _choice
from chunkvmap._quantities.ghost import _plan


def cases(quick: bool) -> dict:
    """name -> (params, loss, batch maker) of the six models."""
    out = dict(models.models(quick))
    vit = dict(models.VIT, width=16, blocks=1, heads=2) if quick else models.VIT
    out[f"ViT (d={vit['width']}, {vit['blocks']} blocks, patch {vit['patch']})"] = (
        lambda rng: models.vit_params(rng, vit),
        lambda p, x, y: models.vit_loss(p, x, y, vit),
        lambda rng, n: models.vit_batch(rng, n, vit),
    )
    mlp = {"widths": (32, 64, 10)} if quick else models.MLP
    widths = "x".join(map(str, mlp["widths"][1:-1]))
    out[f"MLP {widths}"] = (
        lambda rng: models.mlp_params(rng, mlp),
        models.mlp_loss,
        lambda rng, n: models.mlp_batch(rng, n, mlp),
    )
    return out


@contextlib.contextmanager
def forced_ghost():
    """The ghost program, whatever the choice would be."""
    platforms, gain = _choice.MEASURED_PLATFORMS, _plan._GAIN
    _choice.MEASURED_PLATFORMS, _plan._GAIN = frozenset(), -math.inf
    try:
        yield
    finally:
        _choice.MEASURED_PLATFORMS, _plan._GAIN = platforms, gain


class Choice(logging.Handler):
    """The program the last call chose, from the library's log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "method='ghost' runs" in text:
            self.last = text


def build(loss, n_batch: int, args: tuple) -> dict:
    """The three jitted steps, compiled (the first call of each), with what the
    chosen one said."""
    log = logging.getLogger("chunkvmap")
    handler = Choice()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    steps, notes = {}, {}
    try:
        for label in ("vmap", "ghost", "chosen"):
            method = "vmap" if label == "vmap" else "ghost"
            f = jax.jit(
                chunkvmap.clipped_grad_sum(
                    loss, l2_clip_norm=1.0, method=method, batch_size=n_batch
                )
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with forced_ghost() if label == "ghost" else contextlib.nullcontext():
                    jax.block_until_ready(f(*args))
            steps[label] = f
            if label == "chosen":
                warned = [
                    str(w.message)
                    for w in caught
                    if issubclass(w.category, chunkvmap.GhostFallbackWarning)
                ]
                notes = {"said": handler.last, "warned": warned}
    finally:
        log.removeHandler(handler)
    return steps, notes


def chosen_program(notes: dict) -> str:
    """Which program the chosen step runs: the measured choice's log line (on an
    accelerator), else "vmap" where it warned that it runs as method='vmap'
    (the CPU's model), else "ghost"."""
    if notes["said"]:
        return notes["said"].split(" runs ")[1].split(":")[0]
    if any("runs as method='vmap'" in w for w in notes["warned"]):
        return "vmap"
    return "ghost"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = args.n or (16 if args.quick else 1024)
    b = args.batch or max(1, n // 4)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    table = Table(
        args.out,
        f"# method='ghost''s choice on {kind} (N={n}, B={b}, median of "
        f"{args.repeats} interleaved rounds)",
        "",
        "| model | params | vmap ms | ghost ms | chosen ms | chose | chosen / "
        "faster | its program / faster | warned |",
        "|---|---|---|---|---|---|---|---|---|",
    )
    worst = worst_picked = 0.0
    for name, (make, loss, batch) in cases(args.quick).items():
        rng = np.random.default_rng(0)
        params = make(rng)
        data = batch(rng, n)
        call = (params, *data)
        steps, notes = build(loss, b, call)
        seconds, _ = interleaved(
            list(steps.values()), call, args.repeats, values=0, jit=False
        )
        t = dict(zip(steps, seconds))
        faster = min(t["vmap"], t["ghost"])
        ratio = t["chosen"] / faster
        worst = max(worst, ratio)
        chose = chosen_program(notes)
        picked = t[chose] / faster
        worst_picked = max(worst_picked, picked)
        size = sum(x.size for x in jax.tree.leaves(params))
        table.add(
            f"| {name} | {size / 1e6:.2f}M | {1e3 * t['vmap']:.2f} | "
            f"{1e3 * t['ghost']:.2f} | {1e3 * t['chosen']:.2f} | {chose} | "
            f"{ratio:.2f} | {picked:.2f} | {'yes' if notes['warned'] else 'no'} |"
        )
        if notes["said"]:
            print(f"    ({notes['said']})", flush=True)
        for w in notes["warned"]:
            print(f"    warned: {w[:300]}", flush=True)
    table.add(
        "",
        f"Worst chosen / faster: {worst:.2f}x; the chosen program's own column / "
        f"faster: {worst_picked:.2f}x.",
    )


if __name__ == "__main__":
    sys.exit(main())
