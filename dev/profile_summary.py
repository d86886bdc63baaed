"""Where a profiled program's device time goes: the operations of each trace written
by `jax.profiler.trace` (e.g. `bench_dp_scale.py --profile DIR`), summed by name,
largest first, each with the HLO instruction it ran (from `DIR/<program>.hlo.txt`,
where present) and its share of the device's busy time.

    python dev/profile_summary.py DIR [--top K]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys


def device_ops(path: str) -> tuple[collections.Counter, collections.Counter, str]:
    """Microseconds per operation name on the first accelerator of a trace (the
    host's threads where it has none), per-name counts, and the device's name."""
    events = json.load(gzip.open(path))["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    devices = sorted(p for p, n in names.items() if "/device:" in n)
    pid = devices[0] if devices else None
    time, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["pid"] != pid:
            continue
        thread = threads.get((e["pid"], e["tid"]), "")
        if "XLA Ops" not in thread:
            continue
        time[e["name"]] += e["dur"]
        count[e["name"]] += 1
    if not time:  # say what the trace holds instead
        print("no device operations; processes:", sorted(set(names.values())))
        print("threads:", sorted(set(threads.values()))[:40])
    return time, count, names.get(pid, "host")


def instructions(path: str) -> dict:
    """HLO instruction name -> its line (shape and operation), of an HLO text."""
    out = {}
    if not os.path.exists(path):
        return out
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
    with open(path) as fh:
        for line in fh:
            m = pattern.match(line)
            if m:
                out.setdefault(m.group(1), m.group(2))
    return out


def kind(line: str) -> str:
    for k in ("convolution", "dot", "kind=kOutput", "kind=kLoop", "kind=kInput"):
        if k in line:
            return k
    m = re.search(r"\) (\w[\w-]*)\(", line)
    return m.group(1) if m else "?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for trace in sorted(
        glob.glob(f"{args.folder}/*/plugins/profile/*/*.trace.json.gz")
    ):
        program = trace[len(args.folder) :].strip("/").split("/")[0]
        time, count, device = device_ops(trace)
        hlo = instructions(f"{args.folder}/{program}.hlo.txt")
        total = sum(time.values())
        print(f"## {program} on {device}: {total / 1e3:.2f} ms of operations")
        by_kind = collections.Counter()
        for name, us in time.items():
            by_kind[kind(hlo.get(name, ""))] += us
        print("by kind: " + ", ".join(
            f"{k} {100 * v / total:.1f}%" for k, v in by_kind.most_common()
        ))  # fmt: skip
        print("| op | ms | share | runs | instruction |")
        print("|---|---|---|---|---|")
        for name, us in time.most_common(args.top):
            line = hlo.get(name, "")[:160].replace("|", "/")
            print(
                f"| {name} | {us / 1e3:.3f} | {100 * us / total:.1f}% | "
                f"{count[name]} | {line} |"
            )
        print()


if __name__ == "__main__":
    sys.exit(main())
