"""Where a profiled program's device time goes: the operations of each trace written
by `jax.profiler.trace` (e.g. `bench_dp_scale.py --profile DIR`: `DIR/<program>.
trace.json.gz`, or JAX's own `DIR/<program>/plugins/profile/*/`), summed by name,
largest first, each with the HLO instruction it ran (from `DIR/<program>.hlo.txt`,
where present) and its share of the device's busy time.

With `--by-source`, the time is summed instead by the line of Python that made each
instruction (the HLO's stack frames: the innermost frame outside the code that
re-evaluates a program equation by equation, e.g. ghost clipping's interpreter) and
its JAX operation; loops and branches (`while`, `conditional`, `call`), whose own
events span their bodies' operations, are left out of every sum.

    python dev/profile_summary.py DIR [--top K] [--by-source]
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


# Frames of the code that re-evaluates a user's program equation by equation: the
# line that made an instruction is the first frame outside them.
INTERPRETERS = ("_context.py", "_primitives.py", "Plan.bind", "Plan.run_jaxpr")
CONTAINERS = ("while", "conditional", "call")


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the HLO text's tables (`FileNames`, `StackFrames`...)."""
    start = text.find("\n" + name + "\n")
    if start < 0:
        return []
    lines = []
    for line in text[start + len(name) + 2 :].splitlines():
        if not re.match(r"^\d+ ", line):
            break
        lines.append(line)
    return lines


def sources(path: str) -> dict:
    """HLO instruction name -> (the Python line that made it, its JAX operation),
    from the stack frames and metadata of an HLO text."""
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        text = fh.read()
    files = {int(x.split()[0]): x.split('"')[1] for x in _table(text, "FileNames")}
    funcs = {int(x.split()[0]): x.split('"')[1] for x in _table(text, "FunctionNames")}
    locations = {}
    for x in _table(text, "FileLocations"):
        d = dict(re.findall(r"(\w+)=(\d+)", x))
        name = os.path.basename(files[int(d["file_name_id"])])
        fn = funcs[int(d["function_name_id"])]
        locations[int(x.split()[0])] = f"{name}:{d['line']} {fn}"
    frames = {}
    for x in _table(text, "StackFrames"):
        d = dict(re.findall(r"(\w+)=(\d+)", x))
        # (printed one above the parent's id; 0 or itself: none)
        parent = int(d["parent_frame_id"]) - 1
        frames[int(x.split()[0])] = (int(d["file_location_id"]), parent)

    def line_of(frame: int) -> str:
        first = None
        while frame in frames:
            where = locations.get(frames[frame][0], "?")
            first = first or where
            if not any(i in where for i in INTERPRETERS):
                return where
            parent = frames[frame][1]
            frame = parent if 0 < parent != frame else -1
        return first or "?"

    out = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?stack_frame_id=(\d+)")
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            op = op.group(1).rsplit("/", 1)[-1] if op else "?"
            out.setdefault(m.group(1), (line_of(int(m.group(2))), op))
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
    parser.add_argument("--by-source", action="store_true")
    args = parser.parse_args(argv)
    traces = sorted(glob.glob(f"{args.folder}/*.trace.json.gz")) + sorted(
        glob.glob(f"{args.folder}/*/plugins/profile/*/*.trace.json.gz")
    )
    for trace in traces:
        program = trace[len(args.folder) :].strip("/").split("/")[0]
        program = program.removesuffix(".trace.json.gz")
        time, count, device = device_ops(trace)
        hlo = instructions(f"{args.folder}/{program}.hlo.txt")
        if args.by_source:
            path = f"{args.folder}/{program}.hlo.txt"
            by_source(program, device, time, hlo, path, args.top)
            continue
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


def by_source(program, device, time, hlo, path, top) -> None:
    """The table of `--by-source`: time per (Python line, JAX operation)."""
    made = sources(path)
    summed, runs = collections.Counter(), collections.Counter()
    for name, us in time.items():
        if kind(hlo.get(name, "")) in CONTAINERS:
            continue
        key = made.get(name, ("?", "?"))
        summed[key] += us
        runs[key] += 1
    total = sum(summed.values())
    print(f"## {program} on {device}: {total / 1e3:.2f} ms of operations (loops apart)")
    print("| line | operation | ms | share | instructions |")
    print("|---|---|---|---|---|")
    for (where, op), us in summed.most_common(top):
        print(
            f"| {where} | {op} | {us / 1e3:.3f} | {100 * us / total:.1f}% | "
            f"{runs[(where, op)]} |"
        )
    print()


if __name__ == "__main__":
    sys.exit(main())
