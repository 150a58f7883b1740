"""The `shoal` command as a user runs it: a fresh process of this interpreter on the tree under
test, from the repository root, its output captured as text."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from kits.procs import run_to_end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def shoal(*argv: str, cwd: pathlib.Path = ROOT, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run `shoal ARGV...` to the end (raises subprocess.TimeoutExpired after `timeout` s, the
    command stopped with SIGTERM first: kits.procs.run_to_end); keywords such as env go to
    subprocess.Popen."""
    return run_to_end([sys.executable, "-m", "shoal.cli", *argv], cwd=cwd, timeout=timeout, **kw)


def one_line(text: str) -> str:
    """The one line a failed command printed (WARNING lines aside); asserts there is no traceback."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, text
    return lines[0]


def one_line_error(out: subprocess.CompletedProcess | str) -> str:
    """`one_line` of a failed command's stderr (or of `out` itself), with no repeated prefix such as
    "peer: peer:"."""
    line = one_line(out if isinstance(out, str) else out.stderr)
    for cmd in ("coordinator", "peer", "swarm", "status"):
        assert f"{cmd}: {cmd}:" not in line, line
    return line


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: per line, what the last carriage return left (the tail of
    a bar that a write cleared is overwritten by the spaces it wrote, then by the text)."""
    return [line.split("\r")[-1].rstrip() for line in text.split("\n")]
