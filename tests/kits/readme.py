"""The README's shell blocks, read where tests check that the README stays true."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_block(title: str) -> str:
    """The first ```bash block under the README heading `## title`, as written."""
    text = README.read_text()
    section = text[text.index(f"## {title}"):]
    start = section.index("```bash") + len("```bash")
    return section[start:section.index("```", start)]


def readme_commands(title: str) -> list[str]:
    """The logical command lines of that block: comments and blank lines dropped, backslash
    continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", readme_block(title))
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
