"""What the `shoal` command says, in this process: a server's own bind error named, a broken pipe
is a quiet exit 0, bench extras refused up front, help pages (exit codes, defaults), "did you
mean" for a misspelt setting, log lines above the progress bar."""

from __future__ import annotations

import argparse
import io
import logging
import os
import pathlib
import re
import sys

import pytest

from shoal import cli, config
from shoal.bench import allreduce as bench
from shoal.testbeds import swarm

from kits.cli import one_line, screen

ROOT = pathlib.Path(__file__).resolve().parents[2]




# ------------------------------------------------------------------------------ 1: ports in use


def test_the_servers_own_bind_error_is_named_too():
    """The race the probe cannot close (another process binds between probe and server): grpc's
    RuntimeError becomes the same kind of line."""
    exc = RuntimeError("Failed to bind to address 127.0.0.1:7070; set GRPC_VERBOSITY=debug environment variable")
    failure = cli._bind_failure(exc, "--listen", "127.0.0.1:7070")
    assert isinstance(failure, cli.AddressUnavailable) and str(failure).startswith("--listen 127.0.0.1:7070: ")
    assert cli._bind_failure(RuntimeError("something else"), "--listen", "x:1") is None


# ------------------------------------------------------------------------------ 2: broken pipe


def test_a_broken_pipe_in_any_command_is_a_quiet_exit_0(monkeypatch, tmp_path):
    """The handler sits in main(), around every command (here a tool whose print fails)."""
    def tool(a):
        raise BrokenPipeError(32, "Broken pipe")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    create = parser.parse_args(["token", "create", "--secret", "x"])  # the parser that sets `tool`
    assert create.tool is cli.cmd_token_create
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            token = action.choices["token"]
    for action in token._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices["create"].set_defaults(tool=tool)
    # main() points stdout's descriptor at /dev/null; under pytest's capture that descriptor is the
    # capture's own file, not fd 1, so it is the one to save and give back.
    fd = sys.stdout.fileno()
    saved = os.dup(fd)
    try:
        assert cli.main(["token", "create", "--secret", str(tmp_path / "s")]) == cli.EXIT_OK
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# ------------------------------------------------------------------------------ 6: extras up front


def test_bench_gloo_without_torch_refuses_before_running_anything(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import fails
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    monkeypatch.setattr(bench, "run_bench", lambda opts: pytest.fail("the bench ran"))
    assert cli.main(["bench", "allreduce", "--baseline", "gloo"]) == cli.EXIT_USAGE
    line = one_line(capsys.readouterr().err)
    assert line == 'shoal bench: --baseline gloo needs PyTorch: pip install -e ".[torch]"', line


def test_bench_without_a_baseline_needs_no_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(bench, "run_bench", lambda opts: {"ran": opts.size_mb})
    assert cli.main(["bench", "allreduce", "--size-mb", "1"]) == cli.EXIT_OK
    assert '"ran": 1.0' in capsys.readouterr().out


# ------------------------------------------------------------------------------ 7: help, version, ranges


def test_every_help_page_ends_with_the_exit_codes():
    parser = cli.build_parser()
    pages = {p.prog: p.format_help() for p in [parser, *cli._subparsers(parser)]}
    for prog in ("shoal bench", "shoal bench allreduce", "shoal certs", "shoal certs init", "shoal token",
                 "shoal token create", "shoal swarm", "shoal status"):
        assert prog in pages, sorted(pages)
    for prog, text in pages.items():
        assert "exit codes: 0 success; 1 the job failed; 2 bad usage or configuration" in text, prog


def test_bench_help_shows_the_defaults():
    parser = cli.build_parser()
    page = next(p for p in cli._subparsers(parser) if p.prog == "shoal bench allreduce").format_help()
    text = " ".join(page.split())
    for flag, default in (("--peers PEERS", "4"), ("--size-mb SIZE_MB", "64"), ("--repeat REPEAT", "3"),
                          ("--timeout TIMEOUT", "900")):
        assert re.search(re.escape(flag) + r" (?:(?! --).)*\(default " + default, text), (flag, text)


@pytest.mark.parametrize("argv, says", [
    (["--size-mb", "0"], "--size-mb must be > 0, got 0"),
    (["--size-mb", "-3"], "--size-mb must be > 0, got -3"),
    (["--size-mb", "nan"], "--size-mb must be > 0, got nan"),
    (["--peers", "1"], "--peers must be >= 2, got 1"),
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["--chunk-bytes", "10"], "--chunk-bytes must be >= 1024, got 10"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
    (["--link-mbit", "0"], "link rates must be > 0 Mbit/s"),
    (["--compression", "topk", "--sparse-k", "5000"], "--sparse-k: must be in 1..sparse_chunk (4096), got 5000"),
    (["--compression", "topk", "--sparse-bits", "9"], "--sparse-bits: must be in 2..8, got 9"),
    (["--compression", "topk", "--sparse-chunk", "0"], "--sparse-chunk: must be in 2..65536, got 0"),
    (["--compression", "dct", "--sparse-beta", "1.5"], "--sparse-beta: must be in [0, 1], got 1.5"),
    (["--compression", "topk,,int8"], "--compression must be distinct entries of none, fp16, bf16, int8, fp4, topk, "
                                      "dct, got 'topk,,int8'"),
])
def test_bench_refuses_sizes_that_mean_nothing(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", lambda opts: pytest.fail("the bench ran"))
    assert cli.main(["bench", "allreduce", *argv]) == cli.EXIT_USAGE
    assert one_line(capsys.readouterr().err) == f"shoal bench: {says}"


@pytest.mark.parametrize("text, says", [
    ("[run]\ninner_step = 3\n", "unknown key run.inner_step (did you mean run.inner_steps?)"),
    ("[peer]\nrounds = 3\n", "unknown key peer.rounds (did you mean rounds.rounds?)"),
    ("[rounds]\nstraggler_timout = 3.0\n", "unknown key rounds.straggler_timout (did you mean rounds.ready_timeout?)"),
    ("[runs]\nseed = 1\n", "unknown table [runs] (did you mean [run]?)"),
    ("[run]\nqwertyuiop = 1\n", "unknown key run.qwertyuiop"),
])
def test_a_misspelt_key_gets_a_did_you_mean(text, says, tmp_path, capsys):
    path = tmp_path / "shoal.toml"
    path.write_text(text)
    assert cli.main(["swarm", "--config", str(path)]) == cli.EXIT_USAGE
    line = one_line(capsys.readouterr().err)
    assert line.endswith(says), line
    if "did you mean" not in says:
        assert "did you mean" not in line


def test_a_misspelt_environment_variable_gets_a_did_you_mean():
    with pytest.raises(config.ConfigError, match=r"^env SHOAL_RUN_INNER_STEP: unknown setting "
                                                 r"\(did you mean SHOAL_RUN_INNER_STEPS\?\)$"):
        config.load(None, {"SHOAL_RUN_INNER_STEP": "3"}, command="swarm")


# ------------------------------------------------------------------------------ 8: the swarm's output


class _Bar:
    """The part of tqdm the swarm's stream uses, drawing into `out` like tqdm does."""

    def __init__(self, out: io.StringIO):
        self.out = out
        self.out.write("rounds:  40%|####      | 2/5")

    def write(self, text: str, file=None) -> None:
        self.out.write("\r" + " " * 30 + "\r" + text + "\n" + "rounds:  40%|####      | 2/5")


def test_log_lines_go_above_the_bar_not_onto_it(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.INFO)
    bar = _Bar(out)
    with swarm._logs_through(bar):
        logging.getLogger("shoal.testbeds.swarm").info("chaos: kill -9 peer-1 and restart it with the same identity")
    assert handler.stream is out  # given back
    shown = screen(out.getvalue())
    assert "INFO shoal.testbeds.swarm: chaos: kill -9 peer-1 and restart it with the same identity" in shown, shown
    assert shown[-1].startswith("rounds:"), shown  # the bar redrawn below it
