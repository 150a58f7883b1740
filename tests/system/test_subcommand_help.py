"""Configuration: defaults < TOML file < SHOAL_* environment < flags, errors, generated docs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from shoal import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_subcommand_has_help_and_logging_flags(capsys):
    # In this process (one interpreter start instead of one per command); `shoal` as a process
    # is the next test's.
    for cmd in cli.COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            cli.main([cmd, "--help"])
        out = capsys.readouterr()
        assert exit_.value.code in (0, None), (cmd, out.err)
        for flag in ("--config", "--log-level", "--log-format", "exit codes"):
            assert flag in out.out, (cmd, flag)


@pytest.mark.integration
def test_help_as_a_process():
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "peer", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--log-level" in out.stdout and "exit codes" in out.stdout, out.stderr
