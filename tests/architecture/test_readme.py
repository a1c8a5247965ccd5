"""The README stays a front page: at most 150 lines, `make demo` and `make test` its first
commands (`.ci/run` runs the README's test command), every doc it names exists and every
doc in docs/ is named in its index."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def test_the_readme_is_at_most_150_lines():
    assert len(README.read_text().splitlines()) <= 150


def test_its_first_commands_are_make_demo_then_make_test():
    block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci/run").read_text().splitlines()


def test_every_doc_it_names_exists_and_every_doc_is_in_its_index():
    named = set(re.findall(r"docs/[\w./-]+\.md", README.read_text()))
    assert named, "the README names no doc"
    missing = sorted(d for d in named if not (REPO / d).is_file())
    assert not missing, missing
    docs = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert not docs - named, sorted(docs - named)
