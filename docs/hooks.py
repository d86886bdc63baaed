"""mkdocs hook: publish the committed benchmark plots next to the benchmarks page.

The tables in `benchmarks/results/*.md` are pulled into `docs/benchmarks/index.md`
with snippets; their images (`core_*.png`, ...) are referenced relative to that page,
so the PNG files are added to the site under `benchmarks/`.
"""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File


RESULTS = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png))
        )
    return files
