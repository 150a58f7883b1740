"""User errors of the `shoal` command: one line naming what is wrong, the documented exit code,
no traceback, nothing started. Real processes where the network is involved."""

from __future__ import annotations

import pathlib
import time

import pytest

from shoal import cli

from kits.cli import one_line_error, shoal

ROOT = pathlib.Path(__file__).resolve().parents[2]



# ------------------------------------------------------------------------------ files (B)


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
    from shoal.testbeds.swarm import free_port

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
    from shoal.testbeds.swarm import free_port

    out = shoal("status", "--coordinator", f"127.0.0.1:{free_port()}", "--insecure", "--timeout", "2")
    line = one_line_error(out)
    assert out.returncode == cli.EXIT_UNAVAILABLE and "connection refused" in line and "fix: " in line, line


@pytest.mark.integration
def test_status_pointed_at_a_peers_data_port_says_it_is_not_a_coordinator(procs, tmp_path):
    """A peer's data plane is a gRPC server too: `shoal status` against it answers in one line,
    exit 3 (no coordinator there), not with a traceback of the UNIMPLEMENTED call."""
    import sys

    from shoal.cli.status import fetch_status

    _, addr = procs.coordinator("--min-peers", "2", "--initial-peers", "2")  # one job: it joins and waits
    procs.start("job-0", [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", "0",
                          "--size", "100", "--key", str(tmp_path / "j.key"), "--out", str(tmp_path / "j.json"),
                          "--timeout", "120", "--no-save"])
    data = procs.wait_for("the job's membership", lambda: [m["address"] for m in fetch_status(addr)["members"]], 60)[0]
    for extra in ((), ("--json",)):
        out = shoal("status", "--insecure", "--coordinator", data, "--timeout", "5", *extra)
        line = one_line_error(out)
        assert out.returncode == cli.EXIT_UNAVAILABLE, out.stderr
        assert line.startswith(f"shoal status: {data} is not a Shoal coordinator") and "UNIMPLEMENTED" in line, line


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
