"""What the `shoal` command says as a real process: a --listen or --metrics-port taken by another
process is one line and exit 3, `shoal status | head` exits 0, a coordinator's SIGTERM persists
and exits 0, `--version`, and `shoal swarm` says what it does after the bar and that its /metrics
URLs stop with it."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

from shoal import cli
from shoal.cli.status import fetch_status

from kits.cli import one_line, screen, shoal

ROOT = pathlib.Path(__file__).resolve().parents[2]




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


# ------------------------------------------------------------------------------ 3: SIGTERM (coordinator)


@pytest.mark.integration
def test_coordinator_sigterm_persists_and_exits_0(procs):
    """SIGTERM (docker stop, kubectl delete) of a coordinator that committed rounds: exit 0, and
    a coordinator restarted on the same state file reports the same commits."""
    coord, addr = procs.coordinator("--rounds", "3", "--min-peers", "2", "--initial-peers", "2")
    jobs = [procs.start(f"job-{r}", [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr,
                                     "--rank", str(r), "--size", "1000", "--key", str(procs.workdir / f"k{r}.key"),
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


# ------------------------------------------------------------------------------ 8: the swarm's output


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
