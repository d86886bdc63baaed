"""The README's quick examples run as written."""

import pathlib
import re


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quick_examples_run():
    text = README.read_text()
    section = text[text.index("## Quick examples") :]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec"), {})
