"""A newcomer's first hour (issue 15), the CLI side: what each trap did, tried the way a new user
would, now ends with one line, the documented exit code, and no traceback.

1  a coordinator or peer whose --listen or --metrics-port is taken by another process
2  `shoal status | head -3` (the reader closes the pipe)
3  SIGTERM of a coordinator (the peer's graceful leave needs the peer round protocol: not here)
6  `shoal bench allreduce --baseline gloo` without PyTorch
7  `shoal --version`, the exit-code footer on every help page, defaults shown, bad bench sizes
   refused, "did you mean" for a misspelt setting
8  `shoal swarm`: says what it does after the bar, that /metrics URLs stop with it, and log lines
   go above the bar instead of onto it
9  the README's join token: `SHOAL_JOIN_TOKEN=$(shoal token create ...)`, then the peer joins
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

from shoal import bench, cli, config, swarm
from shoal.status import fetch_status

ROOT = pathlib.Path(__file__).resolve().parents[1]


def shoal(*argv: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kw)


def one_line(text: str) -> str:
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, text
    return lines[0]


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: per line, what the last carriage return left (the tail of
    a bar that a write cleared is overwritten by the spaces it wrote, then by the text)."""
    return [line.split("\r")[-1].rstrip() for line in text.split("\n")]


# ------------------------------------------------------------------------------ 1: ports in use


@pytest.fixture
def taken_port():
    """A port another process listens on (here: this test, with a plain socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize("command, flags, flag", [
    ("coordinator", ["--listen", "127.0.0.1:{port}"], "--listen 127.0.0.1:{port}"),
    ("coordinator", ["--listen", "127.0.0.1:0", "--metrics-port", "{port}", "--metrics-host", "127.0.0.1"],
     "--metrics-port 127.0.0.1:{port}"),
    ("peer", ["--listen", "127.0.0.1:{port}"], "--listen 127.0.0.1:{port}"),
    ("peer", ["--listen", "127.0.0.1:0", "--metrics-port", "{port}"], "--metrics-port 0.0.0.0:{port}"),
])
def test_a_port_in_use_is_one_line_naming_it_and_exit_3(command, flags, flag, taken_port, tmp_path):
    flags = [f.format(port=taken_port) for f in flags]
    files = (["--state", str(tmp_path / "c.db"), "--ready-file", str(tmp_path / "addr")] if command == "coordinator"
             else ["--key", str(tmp_path / "p.key"), "--ready-file", str(tmp_path / "addr"), "--connect-timeout", "5"])
    out = shoal(command, "--insecure", *files, *flags, timeout=60)
    assert out.returncode == cli.EXIT_UNAVAILABLE, out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr
    line = one_line(out.stderr)
    assert line.startswith(f"shoal {command}: {flag.format(port=taken_port)}: address already in use"), line
    assert not (tmp_path / "addr").exists()  # it never served


def test_the_servers_own_bind_error_is_named_too():
    """The race the probe cannot close (another process binds between probe and server): grpc's
    RuntimeError becomes the same kind of line."""
    exc = RuntimeError("Failed to bind to address 127.0.0.1:7070; set GRPC_VERBOSITY=debug environment variable")
    failure = cli._bind_failure(exc, "--listen", "127.0.0.1:7070")
    assert isinstance(failure, cli.AddressUnavailable) and str(failure).startswith("--listen 127.0.0.1:7070: ")
    assert cli._bind_failure(RuntimeError("something else"), "--listen", "x:1") is None


# ------------------------------------------------------------------------------ 2: broken pipe


@pytest.mark.integration
def test_status_into_a_closed_pipe_exits_0_without_a_traceback(procs):
    _, addr = procs.coordinator()
    for extra in ((), ("--json",)):
        read, write = os.pipe()
        os.close(read)  # `head` has read its lines and gone
        try:
            out = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--insecure", "--coordinator", addr,
                                  "--recent", "50", *extra], cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                                 text=True, timeout=60)
        finally:
            os.close(write)
        assert out.returncode == cli.EXIT_OK, out.stderr
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
        assert "Exception ignored" not in out.stderr, out.stderr


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
    stdout = os.dup(1)  # main() points fd 1 at /dev/null; give the test its stdout back
    try:
        assert cli.main(["token", "create", "--secret", str(tmp_path / "s")]) == cli.EXIT_OK
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)


# ------------------------------------------------------------------------------ 3: SIGTERM (coordinator)


@pytest.mark.integration
def test_coordinator_sigterm_persists_and_exits_0(procs):
    """SIGTERM (docker stop, kubectl delete) of a coordinator that committed rounds: exit 0, and
    a coordinator restarted on the same state file reports the same commits."""
    coord, addr = procs.coordinator("--rounds", "3", "--min-peers", "2", "--initial-peers", "2")
    jobs = [procs.start(f"job-{r}", [sys.executable, "-m", "shoal.collective_job", "--coordinator", addr,
                                     "--rank", str(r), "--size", "1000", "--key", str(procs.workdir / f"k{r}"),
                                     "--out", str(procs.workdir / f"job-{r}.json"), "--timeout", "120"])
            for r in range(2)]
    for j in jobs:
        assert procs.wait_exit(j, 120) == 0, procs.log(j.name)
    before = fetch_status(addr)
    assert before["rounds_committed"] == 3
    coord.send_signal(signal.SIGTERM)
    assert procs.wait_exit(coord, 60) == 0, procs.log("coordinator")
    assert "Traceback" not in procs.log("coordinator")
    _, addr2 = procs.coordinator("--rounds", "3", name="coordinator-2", listen=addr)
    after = fetch_status(addr2)
    assert after["rounds_committed"] == 3
    assert [r["state_digest"] for r in after["rounds"] if r["status"] == "committed"] == \
        [r["state_digest"] for r in before["rounds"] if r["status"] == "committed"]


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


def test_version(capsys):
    """--version says the code's version (the one a peer sends at Join), which is pyproject's."""
    import pathlib
    import tomllib

    import shoal

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"shoal {shoal.__version__}"
    pyproject = tomllib.loads((pathlib.Path(shoal.__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == shoal.__version__


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
        logging.getLogger("shoal.swarm").info("chaos: kill -9 peer-1 and restart it with the same identity")
    assert handler.stream is out  # given back
    shown = screen(out.getvalue())
    assert "INFO shoal.swarm: chaos: kill -9 peer-1 and restart it with the same identity" in shown, shown
    assert shown[-1].startswith("rounds:"), shown  # the bar redrawn below it


@pytest.mark.integration
def test_swarm_says_what_it_does_after_the_bar_and_that_metrics_stop(tmp_path):
    out = shoal("swarm", "--peers", "2", "--rounds", "3", "--metrics", "--workdir", str(tmp_path / "w"),
                timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    shown = screen(out.stderr)
    says = [line for line in shown if not line.startswith("rounds:")]
    assert any(line.endswith("all 3 rounds committed; the peers evaluate the final model and leave")
               for line in says), shown
    assert any(line.startswith("baseline: training one process for the same 300 optimizer steps")
               for line in says), shown
    assert any("/metrics URLs answer while the swarm runs; they stop with it" in line for line in says), shown
    # Every log line shows on a line of its own, none glued onto the bar.
    logged = [line for line in shown if " INFO " in line or " WARNING " in line]
    assert logged and all(re.match(r"^\d\d:\d\d:\d\d (INFO|WARNING) ", line) for line in logged), logged


# ------------------------------------------------------------------------------ 9: the README's join token


def readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"## {title}"):]
    return section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]


def test_readme_defines_every_variable_it_uses():
    block = readme_block("Running it for real")
    commands = "\n".join(line.split("#")[0] for line in block.splitlines())
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", commands))
    defined = set(re.findall(r"(?:export\s+)?([A-Z_][A-Z0-9_]*)=", commands))
    assert used <= defined, used - defined
    assert "SHOAL_JOIN_TOKEN=$(" in block and "shoal token create" in block
    assert "--join-token " not in block  # the token stays off the command line


@pytest.mark.integration
def test_the_readme_token_flow_admits_the_peer(procs, tmp_path):
    """`export SHOAL_JOIN_TOKEN=$(shoal token create --secret join.secret ...)`, a coordinator on
    that secret, and a peer with no token flag joins."""
    secret = tmp_path / "join.secret"
    made = shoal("token", "create", "--secret", str(secret), "--ttl", "600", "--label", "alice")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token and "\n" not in token  # usable as $(...)
    _, addr = procs.coordinator("--join-token-secret", str(secret))
    env = {**os.environ, "SHOAL_JOIN_TOKEN": token}
    ready = tmp_path / "peer.addr"
    with open(tmp_path / "peer.log", "wb") as log:  # procs.log("peer") reads it on failure
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                 "--key", str(tmp_path / "p.key"), "--ready-file", str(ready),
                                 "--connect-timeout", "30"],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.name = "peer"  # type: ignore[attr-defined]
    procs.procs.append(proc)  # killed at teardown like the others
    procs.wait_file(ready, 60, proc)  # written once joined: the coordinator admitted the token
