"""The README's promises: its first lines are the two set-up commands, and its
embedding example runs as printed."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands():
    first = [line.strip() for line in README.read_text().splitlines()[:2]]
    assert first[0].startswith("make demo") and first[1].startswith("make test")


def test_embedding_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert len(out.tokens) == 2 and all(len(t) == 1 for t in out.tokens)
    assert out.seeds[1] == 1234
