"""Redraw the core benchmark's plots from its committed table (no re-measuring).

    python benchmarks/replot.py [--results benchmarks/results]

`bench_core.py --plots` draws them as it measures; this draws them again from
`core.md`, for a change of the plots alone: the temp memory of each method at the
first batch size of each task, a method drawn only where it ran.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from _common import plot_lines


def tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Each `## task` section's table rows, as dicts of column -> cell."""
    out: dict[str, list[dict[str, str]]] = {}
    task, header = None, None
    for line in text.splitlines():
        if line.startswith("## "):
            task, header = line[3:].strip(), None
        elif task and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            else:
                out.setdefault(task, []).append(dict(zip(header, cells)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results")
    args = parser.parse_args()
    results = pathlib.Path(args.results)
    text = (results / "core.md").read_text()
    backend = re.search(r"backend (\w+)", text)
    for task, rows in tables(text).items():
        first = rows[0]["B"]
        series: dict[str, tuple[list, list]] = {}
        for row in rows:
            if row["B"] == first:
                xs, ys = series.setdefault(row["method"], ([], []))
                xs.append(int(row["N"]))
                ys.append(max(float(row["temp MiB"]), 2**-20))
        plot_lines(
            results / f"core_{task}.png",
            f"{task}: XLA compiled temp memory, B={first} "
            f"({backend.group(1) if backend else 'cpu'})",
            "examples N",
            "temp memory (MiB)",
            series,
        )
        print(f"core_{task}.png: {sorted(series)}")


if __name__ == "__main__":
    main()
