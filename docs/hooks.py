"""mkdocs hooks for the benchmarks page.

1. The committed benchmark plots (`benchmarks/results/*.png`) are published next to
   the benchmarks page (`benchmarks/`), where the page and the result tables
   reference them.
2. The result files (`benchmarks/results/*.md`, written by `benchmarks/*.py`) each
   start with a `# Title` line, which reads well on its own (on GitHub) but would be a
   second H1 inside the page. A line of `docs/benchmarks/index.md` of the form

       --8<-- "benchmarks/results/core.md"

   is therefore expanded here, before pymdownx.snippets sees it, into a folded
   block (pymdownx.details): the file's H1 becomes the block's title and its other
   headings are demoted by two levels (`##` -> `####`, below the page's `###` line
   for that file), so the page keeps one H1 and its summary and plots come first.
"""

from __future__ import annotations

import pathlib
import re

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File


ROOT = pathlib.Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_MARKER = re.compile(r'^--8<-- "(benchmarks/results/[\w.-]+\.md)"\s*$', re.MULTILINE)


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png))
        )
    return files


def folded_results(relpath: str) -> str:
    """A result file as a collapsed `??? note` block, its H1 as the block's title."""
    path = ROOT / relpath
    if not path.is_file():
        raise PluginError(f"benchmarks page: {relpath} does not exist")
    lines = path.read_text().splitlines()
    title = f"Full tables: `{relpath}`"
    if lines and lines[0].startswith("# "):
        title = f"{lines[0][2:].strip()}: `{relpath}`"
        lines = lines[1:]
    body = []
    for line in lines:
        if re.match(r"^#{1,4} ", line):
            line = "##" + line
        body.append(f"    {line}" if line.strip() else "")
    title = title.replace('"', "'")
    return f'??? note "{title}"\n\n' + "\n".join(body).rstrip() + "\n"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "benchmarks/index.md":
        return markdown
    return _MARKER.sub(lambda m: folded_results(m.group(1)), markdown)
