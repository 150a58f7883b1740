"""The README's "Running it for real" block defines every variable it uses and keeps the join
token off the command line (the block itself runs in tests/system/test_readme.py)."""

from __future__ import annotations

import re

from kits.readme import readme_block


def test_readme_defines_every_variable_it_uses():
    block = readme_block("Running it for real")
    commands = "\n".join(line.split("#")[0] for line in block.splitlines())
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", commands))
    defined = set(re.findall(r"(?:export\s+)?([A-Z_][A-Z0-9_]*)=", commands))
    assert used <= defined, used - defined
    assert "SHOAL_JOIN_TOKEN=$(" in block and "shoal token create" in block
    assert "--join-token " not in block  # the token stays off the command line
