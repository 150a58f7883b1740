"""User errors of the `shoal` command: one line naming what is wrong, the documented exit code,
no traceback, nothing started. Real processes where the network is involved."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from shoal import cli, config
from shoal.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def shoal(*argv: str, cwd: pathlib.Path = ROOT, timeout: float = 60, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "shoal.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line_error(out: subprocess.CompletedProcess | str) -> str:
    """The error line of a failed command; asserts there is no traceback and no repeated prefix."""
    text = out if isinstance(out, str) else out.stderr
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, text
    line = lines[0]
    for cmd in ("coordinator", "peer", "swarm", "status"):
        assert f"{cmd}: {cmd}:" not in line, line
    return line


# ------------------------------------------------------------------------------ validation (A)


@pytest.mark.parametrize("argv, names", [
    (["swarm", "--peers", "0"], "--peers"),
    (["swarm", "--peers", "-1"], "--peers"),
    (["swarm", "--rounds", "-5"], "--rounds"),
    (["swarm", "--timeout", "-1"], "--timeout"),
    (["swarm", "--lease-seconds", "0"], "--lease-seconds"),
    (["swarm", "--lr", "-1"], "--lr"),
    (["swarm", "--lr", "nan"], "--lr"),
    (["swarm", "--chunk-bytes", "0"], "--chunk-bytes"),
    (["swarm", "--chunk-bytes", "1023"], "--chunk-bytes"),
    (["swarm", "--aggregator", "krum", "--krum-f", "-1"], "--krum-f"),
    (["swarm", "--hidden", "0"], "--hidden"),
    (["swarm", "--seed", "-1"], "--seed"),
    (["swarm", "--batch-size", "0"], "--batch-size"),
    (["swarm", "--byzantine", "1"], "--attack"),
    (["peer", "--insecure", "--data-shard", "-1"], "--data-shard"),
    (["peer", "--insecure", "--advertise", "10.0.0.1:0"], "--advertise"),
    (["peer", "--insecure", "--listen", "127.0.0.1:99999"], "--listen"),
    (["peer", "--insecure", "--listen", "garbage"], "--listen"),
    (["peer", "--insecure", "--coordinator", "nohost"], "--coordinator"),
    (["coordinator", "--insecure", "--listen", ":7070"], "--listen"),
    (["status", "--insecure", "--recent", "0"], "--recent"),
])
def test_out_of_range_settings_are_one_line_and_exit_2(argv, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be created: checked below
    assert cli.main(argv) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"shoal {argv[0]}: ") and names in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_error_names_the_layer_that_set_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"^env SHOAL_SWARM_PEERS: must be >= 1, got 0$"):
        config.load(None, {"SHOAL_SWARM_PEERS": "0"}, command="swarm")
    p = tmp_path / "s.toml"
    p.write_text("[rounds]\nchunk_bytes = 10\n")
    with pytest.raises(ConfigError, match=r"s\.toml: rounds\.chunk_bytes: must be >= 1024, got 10"):
        config.load(str(p), {}, command="coordinator")
    # A command checks only the sections it reads: a shared file may hold other commands' tables.
    p.write_text("[swarm]\npeers = 0\n")
    config.load(str(p), {}, command="peer")


def test_every_default_is_valid():
    config.ShoalConfig().validate()


def test_min_peers_above_peers_is_an_error_not_a_silent_cap(capsys):
    assert cli.main(["swarm", "--peers", "2", "--min-peers", "3"]) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "--min-peers 3" in line and "--peers 2" in line


def test_run_config_checks_its_own_ranges():
    from shoal.common.errors import InvalidArgument
    from shoal.peer.training import RunConfig

    for bad in ({"batch_size": 0}, {"hidden": 0}, {"lr": 0.0}, {"lr": float("nan")}, {"seed": -1}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            RunConfig(**bad)


# ------------------------------------------------------------------------------ files (B)


def test_swarm_paths_are_checked_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["swarm", "--workdir", "/proc/nope"]) == cli.EXIT_USAGE
    assert "--workdir /proc/nope" in one_line_error(capsys.readouterr().err)
    assert cli.main(["swarm", "--summary", str(tmp_path / "no" / "dir" / "s.json")]) == cli.EXIT_USAGE
    assert "--summary" in one_line_error(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["swarm", "--plot", str(tmp_path / "c.png")]) == cli.EXIT_USAGE
    assert 'pip install -e ".[plot]"' in one_line_error(capsys.readouterr().err)


@pytest.mark.integration
def test_certs_init_errors(tmp_path):
    out = shoal("certs", "init", "--out", "/proc/x")
    assert out.returncode == 2 and "--out /proc/x" in one_line_error(out)
    assert shoal("certs", "init", "--out", str(tmp_path / "tls")).returncode == 0
    out = shoal("certs", "init", "--out", str(tmp_path / "tls"))
    assert out.returncode == 2 and "--force" in one_line_error(out) and "overwrite=True" not in out.stderr
    assert shoal("certs", "init", "--out", str(tmp_path / "tls"), "--force").returncode == 0


@pytest.mark.integration
def test_token_create_never_makes_directories(tmp_path):
    secret = tmp_path / "no" / "dir" / "s"
    out = shoal("token", "create", "--secret", str(secret))
    assert out.returncode == 2 and "does not exist" in one_line_error(out)
    assert not (tmp_path / "no").exists()


@pytest.mark.integration
@pytest.mark.parametrize("flags, says", [
    (["--tls-dir", "/nonexistent"], "shoal certs init"),
    (["--insecure", "--join-token-secret", "/nonexistent/s"], "shoal token create"),
    (["--insecure", "--allow-list", "/nonexistent/a"], "--allow-list"),
    (["--insecure", "--state", "/nonexistent/dir/x.db"], "--state"),
    ([], "--insecure"),
])
def test_coordinator_refuses_bad_files_before_serving(flags, says, tmp_path):
    if "--state" not in flags:
        flags = [*flags, "--state", str(tmp_path / "c.db")]
    out = shoal("coordinator", "--listen", "127.0.0.1:0", "--ready-file", str(tmp_path / "addr"), *flags)
    assert out.returncode == 2, out.stderr
    assert says in one_line_error(out)
    assert not (tmp_path / "addr").exists() and not (tmp_path / "c.db").exists()
    assert not pathlib.Path("/nonexistent").exists()


@pytest.mark.integration
def test_peer_refuses_a_bad_key(tmp_path):
    (tmp_path / "bad.key").write_text("not a key\n")
    for key, says in ((str(tmp_path / "bad.key"), "not a PEM Ed25519"), ("/proc/nope/p.key", "/proc/nope")):
        out = shoal("peer", "--insecure", "--key", key, "--connect-timeout", "1")
        assert out.returncode == 2 and says in one_line_error(out)


# ------------------------------------------------------------------------------ join failures (C)


@pytest.mark.integration
def test_peer_gives_up_on_an_unreachable_coordinator_after_connect_timeout(tmp_path):
    from shoal.swarm import free_port

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = shoal("peer", "--insecure", "--coordinator", address, "--key", str(tmp_path / "p.key"),
                "--connect-timeout", "3", timeout=60)  # the timeout only guards against a hang
    exited = time.monotonic()
    assert out.returncode == cli.EXIT_UNAVAILABLE, out.stderr
    assert f"peer: coordinator {address} unreachable (gave up after --connect-timeout 3s)" in one_line_error(out)
    # Order, not speed: the 3 s ran out before it exited (it kept retrying, it did not give up at
    # once). No upper bound: how long after that it exits depends only on the machine's load.
    assert exited - started >= 3.0


@pytest.mark.integration
def test_peer_refused_by_the_coordinator_exits_2_with_the_reason(procs, tmp_path):
    from shoal.coordinator.admission import create_secret, create_token

    secret = create_secret(tmp_path / "join.secret")
    _, addr = procs.coordinator("--join-token-secret", str(tmp_path / "join.secret"))
    for token, reason in (("", "join_token: missing"), (create_token(b"x" * 32, 60.0), "bad signature")):
        out = shoal("peer", "--insecure", "--coordinator", addr, "--key", str(tmp_path / "p.key"),
                    "--join-token", token, "--connect-timeout", "10", timeout=60)
        assert out.returncode == cli.EXIT_USAGE, out.stderr
        line = one_line_error(out)
        assert f"coordinator {addr} refused" in line and reason in line, line
    assert secret  # the right token is admitted (covered by test_security_processes)


# ------------------------------------------------------------------------------ status over TLS (D)


@pytest.mark.integration
def test_status_over_mutual_tls(procs, tmp_path):
    tls = tmp_path / "tls"
    assert shoal("certs", "init", "--out", str(tls)).returncode == 0
    _, addr = procs.coordinator("--tls-dir", str(tls), "--mtls")
    out = shoal("status", "--coordinator", addr, "--tls-dir", str(tls), "--mtls", "--json")
    assert out.returncode == 0, out.stderr
    assert '"rounds_committed": 0' in out.stdout
    # Plaintext against TLS fails as unreachable; no choice at all is a usage error.
    out = shoal("status", "--coordinator", addr, "--insecure", "--timeout", "2")
    assert out.returncode == cli.EXIT_UNAVAILABLE and "unreachable" in one_line_error(out)
    out = shoal("status", "--coordinator", addr)
    assert out.returncode == cli.EXIT_USAGE and "--tls-dir" in one_line_error(out)
    out = shoal("status", "--coordinator", addr, "--tls-dir", str(tmp_path / "none"))
    assert out.returncode == cli.EXIT_USAGE and "shoal certs init" in one_line_error(out)
    # Nothing listening (e.g. a finished run's coordinator, gone after --finish-linger): why, and the fix.
    from shoal.swarm import free_port

    out = shoal("status", "--coordinator", f"127.0.0.1:{free_port()}", "--insecure", "--timeout", "2")
    line = one_line_error(out)
    assert out.returncode == cli.EXIT_UNAVAILABLE and "connection refused" in line and "fix: " in line, line


def test_status_shows_a_zero_loss():
    from shoal.status import render_table

    s = {"coordinator": "x:1", "epoch": 1, "round": 1, "rounds_committed": 1, "rounds_aborted": 1,
         "run_config": {}, "members": [],
         "rounds": [{"round": 0, "attempt": 0, "status": "committed", "participants": 2, "seconds": 0.5,
                     "train_loss": 0.0, "reason": "", "state_digest": ""},
                    {"round": 1, "attempt": 0, "status": "aborted", "participants": 0, "seconds": 0.0,
                     "train_loss": 0.0, "reason": "timeout", "state_digest": ""}]}
    rows = render_table(s).splitlines()[-2:]
    assert "0.0000" in rows[0] and "0.0000" not in rows[1]


# ------------------------------------------------------------------------------ help (F)


@pytest.mark.integration
def test_help_says_what_each_flag_does_once():
    out = shoal("swarm", "--help")
    text = " ".join(out.stdout.split())
    assert "--no-progress do not show" in text
    for chunk in text.split(" --")[1:]:
        assert chunk.count("(default") <= 1, chunk
    out = shoal("certs", "init", "--help")
    assert "--days DAYS days the certificates are valid" in " ".join(out.stdout.split())


# ------------------------------------------------------------------------------ coordinator (H)


def test_run_finished_is_logged_once(caplog):
    from shoal.coordinator.rounds import SendFinished
    from shoal.coordinator.server import CoordinatorService

    service = CoordinatorService(None, None, "{}", None)  # apply(SendFinished) touches neither
    with caplog.at_level("INFO", logger="shoal.coordinator"):
        for _ in range(3):  # the engine answers every late Ready with SendFinished
            service.apply([SendFinished(5, "run complete")])
    assert [r.getMessage() for r in caplog.records].count("run finished after 5 committed rounds") == 1


def test_round_gauge_moves_on_commit():
    from shoal.common.metrics import CoordinatorMetrics

    m = CoordinatorMetrics()
    m.on_commit(0.1, rounds_committed=3)
    assert m.registry.get_sample_value("shoal_coordinator_round") == 3


@pytest.mark.parametrize("argv, names", [
    (["swarm", "--local-work", "sometimes"], ["--local-work", "invalid choice: 'sometimes'"]),
    (["swarm", "--workload", "text"], ["--workload", "invalid choice: 'text'"]),
    (["swarm", "--overlap=1"], ["--overlap", "ignored explicit argument '1'"]),
    (["swarm", "--overlap", "yes"], ["shoal swarm: ", "--overlap", "takes no value (got 'yes')"]),
    (["swarm", "--peers", "3", "--overlap", "yes", "--rounds", "2"], ["--overlap", "'yes'"]),
    (["swarm", "--peers", "four"], ["--peers", "'four'"]),
    (["certs", "nothing"], ["invalid choice: 'nothing'"]),
])
def test_a_flag_parsing_error_is_one_line_naming_the_flag(argv, names, capsys):
    """argparse's own errors (a bad choice, a value that is not a number): one line, exit 2, not
    the whole usage first (a new user's report: 38 lines for `shoal swarm --local-work sometimes`)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert all(n in line for n in names) and "--help" in line
