"""Memberships with real processes: a member whose token expired comes back after a
crash; a revoked member is refused with one line; one process per identity (a second one exits 2
naming the id, the rounds go on); two peers from one directory without --key are two identities;
each connection failure has its own line. Durations are printed for the reader, never asserted:
the machine is shared."""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import sys
import time

import pytest

from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.coordinator.admission import create_secret, create_token
from shoal.cli.status import fetch_status

from kits.etcdserver import etcd_server  # noqa: F401 - the fixture
from kits.cli import shoal

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]


def wait_for(what: str, check, timeout: float, procs):
    return procs.wait_for(what, check, timeout, every=0.1, tail=2000)


def peer(procs, name: str, addr: str, *flags: str):
    wd = procs.workdir
    return procs.start(name, [sys.executable, "-m", "shoal.cli", "peer", "--coordinator", addr,
                              "--events", str(wd / f"{name}.jsonl"), *flags])


def commits(procs, name: str) -> list[dict]:
    path = procs.workdir / f"{name}.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "commit"]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " ERROR " in line]


def id_of(path: pathlib.Path) -> str:
    return peer_id_of(public_bytes(load_or_create_key(path)))


@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run that waits out a token; tests/unit/test_membership.py keeps the rules
def test_a_member_whose_token_expired_rejoins_after_a_crash_and_a_new_key_is_refused(procs):
    wd = procs.workdir
    secret = create_secret(wd / "join.secret")
    ttl = 25.0  # long enough for both to join (peers join in 2-5 s; 60 s made this test the longest); then it waits it out
    token = create_token(secret, ttl, "volunteers")
    made = time.time()
    _, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "10",
                                "--join-token-secret", str(wd / "join.secret"))
    base = ("--insecure", "--join-token", token, "--connect-timeout", "60")
    peer(procs, "p0", addr, *base, "--key", str(wd / "p0.key"), "--data-shard", "0")
    p1 = peer(procs, "p1", addr, *base, "--key", str(wd / "p1.key"), "--data-shard", "1")
    wait_for("2 members", lambda: len(fetch_status(addr)["members"]) == 2, ttl, procs)
    time.sleep(max(0.0, made + ttl + 1.0 - time.time()))  # the token has expired
    wait_for("a committed round", lambda: fetch_status(addr)["rounds_committed"] >= 1, 180, procs)

    procs.kill(p1)  # a crash: SIGKILL, no Leave
    procs.wait_exit(p1, 30)
    started = time.monotonic()
    again = peer(procs, "p1-again", addr, *base, "--key", str(wd / "p1.key"), "--data-shard", "1")
    wait_for("the restarted member joined", lambda: "joined as" in procs.log("p1-again"), 180, procs)
    joined = time.monotonic()
    wait_for("a commit of the restarted member", lambda: commits(procs, "p1-again"), 180, procs)
    print(f"\nrestarted member with an expired token: joined {joined - started:.1f} s after the process started "
          f"(imports included), first commit {time.monotonic() - joined:.1f} s after joining")
    assert again.poll() is None
    assert f"peer {id_of(wd / 'p1.key')[:8]} joined from" in procs.log("coordinator")
    assert "member since" in procs.log("coordinator")

    # The same expired token does not admit a key that was never a member: one line, exit 2.
    stranger = peer(procs, "stranger", addr, *base, "--key", str(wd / "p2.key"), "--data-shard", "2")
    assert procs.wait_exit(stranger, 60) == 2
    lines = error_lines(procs.log("stranger"))
    assert len(lines) == 1 and "refused this peer: join_token: expired" in lines[0], procs.log("stranger")
    assert "fix: ask the operator for a new join token" in lines[0]


@pytest.mark.soak  # default-run budget (10 min): a 22-33 s process run; tests/unit/test_membership.py keeps the revocation rules
def test_a_revoked_member_is_refused_at_its_next_call_and_on_every_join(procs):
    wd = procs.workdir
    _, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "3", "--inner-steps", "10")
    ps = [peer(procs, f"p{i}", addr, "--insecure", "--key", str(wd / f"p{i}.key"), "--data-shard", str(i),
               "--connect-timeout", "60") for i in range(3)]
    wait_for("2 committed rounds of 3", lambda: fetch_status(addr)["rounds_committed"] >= 2, 180, procs)
    victim = id_of(wd / "p2.key")
    admin = ("--coordinator", addr, "--insecure", "--admin-key", str(wd / "coordinator.key"))

    listed = shoal("member", "list", *admin, "--json")
    assert listed.returncode == 0, listed.stderr
    assert {m["member"]: m["status"] for m in json.loads(listed.stdout)["members"]} == {
        id_of(wd / f"p{i}.key"): "admitted" for i in range(3)}
    # Only the coordinator's key is the operator's credential.
    wrong = shoal("member", "list", "--coordinator", addr, "--insecure", "--admin-key", str(wd / "p0.key"))
    assert wrong.returncode == 2 and "coordinator's key" in wrong.stderr, wrong

    out = shoal("member", "revoke", victim[:10], *admin)
    assert out.returncode == 0 and f"revoked {victim}" in out.stdout, out
    revoked_at = time.monotonic()
    assert procs.wait_exit(ps[2], 60) == 2
    print(f"\nrevoked member exited {time.monotonic() - revoked_at:.1f} s after the revocation")
    lines = error_lines(procs.log("p2"))
    assert len(lines) == 1 and "revoked" in lines[0] and victim in lines[0], procs.log("p2")[-3000:]

    again = peer(procs, "p2-again", addr, "--insecure", "--key", str(wd / "p2.key"), "--data-shard", "2",
                 "--connect-timeout", "60")
    assert procs.wait_exit(again, 60) == 2
    lines = error_lines(procs.log("p2-again"))
    assert len(lines) == 1 and "membership revoked by the operator" in lines[0], procs.log("p2-again")
    table = shoal("member", "list", *admin)
    assert table.returncode == 0 and any(line.startswith(victim) and "revoked" in line
                                         for line in table.stdout.splitlines()), table.stdout
    c = fetch_status(addr)["rounds_committed"]
    wait_for("the others keep committing", lambda: fetch_status(addr)["rounds_committed"] >= c + 2, 120, procs)
    assert all(p.poll() is None for p in ps[:2])


def test_a_second_process_with_a_live_key_exits_2_naming_the_id_and_the_rounds_go_on(procs):
    wd = procs.workdir
    _, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "10")
    ps = [peer(procs, f"p{i}", addr, "--insecure", "--key", str(wd / f"p{i}.key"), "--data-shard", str(i),
               "--connect-timeout", "60") for i in range(2)]
    wait_for("3 committed rounds", lambda: fetch_status(addr)["rounds_committed"] >= 3, 180, procs)
    pid = id_of(wd / "p0.key")
    before = fetch_status(addr, recent=1000)

    # The same key on "another machine" (a copy of the file): the coordinator refuses the second.
    shutil.copy(wd / "p0.key", wd / "copy.key")
    started = time.monotonic()
    dup = peer(procs, "dup", addr, "--insecure", "--key", str(wd / "copy.key"), "--data-shard", "2",
               "--connect-timeout", "60")
    assert procs.wait_exit(dup, 60) == 2
    print(f"\nsecond process with a live key (another machine): exit 2 after {time.monotonic() - started:.1f} s")
    lines = error_lines(procs.log("dup"))
    assert len(lines) == 1 and f"peer {pid} is already running" in lines[0], procs.log("dup")
    # The same key file on this machine: refused at start by the file lock, before any call.
    started = time.monotonic()
    local = peer(procs, "dup-local", addr, "--insecure", "--key", str(wd / "p0.key"), "--connect-timeout", "60")
    assert procs.wait_exit(local, 60) == 2
    print(f"second process with a live key (same file): exit 2 after {time.monotonic() - started:.1f} s")
    out = procs.log("dup-local")
    assert f"(peer {pid}) is in use by another process" in out and "Traceback" not in out, out

    c = fetch_status(addr)["rounds_committed"]
    wait_for("3 more committed rounds", lambda: fetch_status(addr)["rounds_committed"] >= c + 3, 120, procs)
    after = fetch_status(addr, recent=1000)
    new_aborts = [r for r in after["rounds"] if r["status"] == "aborted" and r not in before["rounds"]]
    assert not [r for r in new_aborts if pid[:8] in r.get("reason", "")], new_aborts
    print(f"aborts while the second processes came and went: {after['rounds_aborted'] - before['rounds_aborted']}")
    assert all(p.poll() is None for p in ps)
    assert "fenced" not in procs.log("p0") and "took over" not in procs.log("coordinator")


@pytest.mark.soak  # default-run budget (CI 577-602 s of 600): 9 s; tests/unit/test_membership.py keeps the take-over
# and fencing rules, the second-process test a real refusal
def test_a_holder_that_stopped_renewing_is_taken_over_and_then_fenced(procs):
    wd = procs.workdir
    _, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "10",
                                "--lease-seconds", "6")
    ps = [peer(procs, f"p{i}", addr, "--insecure", "--key", str(wd / f"p{i}.key"), "--data-shard", str(i),
               "--connect-timeout", "60") for i in range(2)]
    wait_for("2 committed rounds", lambda: fetch_status(addr)["rounds_committed"] >= 2, 180, procs)
    pid = id_of(wd / "p0.key")
    procs.kill(ps[0], signal.SIGSTOP)  # frozen: its stream stays open, its heartbeats stop
    time.sleep(4.0)  # more than half a lease without renewal: no longer live
    shutil.copy(wd / "p0.key", wd / "copy.key")
    new = peer(procs, "p0-new", addr, "--insecure", "--key", str(wd / "copy.key"), "--data-shard", "0",
               "--connect-timeout", "60")
    wait_for("the new process took over", lambda: "took over" in procs.log("coordinator"), 120, procs)
    wait_for("a commit of the new process", lambda: commits(procs, "p0-new"), 180, procs)
    procs.kill(ps[0], signal.SIGCONT)
    assert procs.wait_exit(ps[0], 60) == 2
    lines = error_lines(procs.log("p0"))
    assert len(lines) == 1 and f"peer {pid}: another process with this key took over" in lines[0], \
        procs.log("p0")[-3000:]
    c = fetch_status(addr)["rounds_committed"]
    wait_for("the new process keeps committing", lambda: fetch_status(addr)["rounds_committed"] >= c + 2, 120, procs)
    assert new.poll() is None and ps[1].poll() is None


def test_two_peers_from_one_directory_without_key_are_two_identities(procs, monkeypatch):
    wd = procs.workdir
    monkeypatch.setenv("XDG_DATA_HOME", str(wd / "data"))
    _, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "10")
    for i in range(2):
        peer(procs, f"p{i}", addr, "--insecure", "--data-shard", str(i), "--connect-timeout", "60")
    wait_for("a committed round of two members",
             lambda: (s := fetch_status(addr))["rounds_committed"] >= 1 and len(s["members"]) == 2, 180, procs)
    keys = sorted((wd / "data" / "shoal").glob("peer-*.key"))
    assert [k.name for k in keys] == ["peer-1.key", "peer-2.key"]
    assert {m["peer_id"] for m in fetch_status(addr)["members"]} == {id_of(k) for k in keys}
    assert {f"key file {k}" in procs.log("p0") + procs.log("p1") for k in keys} == {True}


def test_each_connection_failure_says_what_is_wrong(procs):
    from shoal.testbeds.swarm import free_port

    wd = procs.workdir
    for d, host in (("tls-a", "coord.example.org"), ("tls-b", "127.0.0.1")):
        assert shoal("certs", "init", "--out", str(wd / d), "--host", host).returncode == 0
    _, tls_addr = procs.coordinator("--tls-dir", str(wd / "tls-a"), name="tls-coordinator", state="tls.db")
    cases = {
        "closed": (f"127.0.0.1:{free_port()}", ("--insecure",), "connection refused"),
        "dns": ("nosuch.invalid:7070", ("--insecure",), "DNS lookup of 'nosuch.invalid' failed"),
        "wrong-ca": (tls_addr, ("--tls-dir", str(wd / "tls-b")), "certificate signed by an unknown CA"),
        "mismatch": (tls_addr, ("--tls-dir", str(wd / "tls-a")),
                     "the certificate is not valid for '127.0.0.1' (it holds coord.example.org)"),
    }
    started = time.monotonic()
    running = {name: peer(procs, name, addr, *flags, "--key", str(wd / f"{name}.key"), "--connect-timeout", "6")
               for name, (addr, flags, _) in cases.items()}
    first: dict[str, str] = {}

    def first_lines() -> bool:
        for name in set(cases) - set(first):
            got = [line for line in procs.log(name).splitlines() if "cannot reach coordinator" in line]
            if got:
                first[name] = got[0]
                print(f"\n{name}: first line {time.monotonic() - started:.1f} s after the start (4 processes "
                      f"starting at once, imports included): {got[0]}")
        return len(first) == len(cases)

    wait_for("the first line of each", first_lines, 60, procs)
    for name, (addr, _, says) in cases.items():
        assert says in first[name], first[name]
        assert procs.wait_exit(running[name], 60) == 3
        final = error_lines(procs.log(name))
        assert len(final) == 1 and "gave up after --connect-timeout 6s" in final[0] and says in final[0], final
        assert "fix: " in final[0]


@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run that waits out a token; test_leadership keeps etcd failover
def test_memberships_on_etcd_outlive_the_coordinator_and_a_revocation_holds_for_the_next(procs, etcd_server):
    """Standby coordinators share memberships through etcd: a member admitted with a token (now
    expired) rejoins through the next coordinator without one; a revocation made on the first
    holds on the next."""
    wd = procs.workdir
    url = etcd_server.url()
    secret = create_secret(wd / "join.secret")
    ttl = 20.0  # long enough for both to join; then the test waits it out
    token = create_token(secret, ttl, "etcd")
    made = time.time()

    def coordinator(name: str):
        ready = wd / f"{name}.addr"
        p = procs.start(name, [sys.executable, "-m", "shoal.cli", "coordinator", "--insecure", "--listen",
                               "127.0.0.1:0", "--state", url, "--key", str(wd / "coord.key"), "--ready-file",
                               str(ready), "--join-token-secret", str(wd / "join.secret"), "--rounds", "0",
                               "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "10"])
        return p, procs.wait_file(ready, 60, p)

    first, addr = coordinator("c1")
    ps = [peer(procs, f"p{i}", addr, "--insecure", "--join-token", token, "--key", str(wd / f"p{i}.key"),
               "--data-shard", str(i), "--connect-timeout", "60") for i in range(2)]
    wait_for("2 members", lambda: len(fetch_status(addr)["members"]) == 2, ttl, procs)
    admin = ("--coordinator", addr, "--insecure", "--admin-key", str(wd / "coord.key"))
    out = shoal("member", "revoke", id_of(wd / "p1.key"), *admin)
    assert out.returncode == 0, out
    assert procs.wait_exit(ps[1], 60) == 2
    procs.kill(ps[0])
    procs.kill(first)
    procs.wait_exit(first, 30)
    time.sleep(max(0.0, made + ttl + 1.0 - time.time()))  # the token has expired

    _, addr2 = coordinator("c2")
    back = peer(procs, "p0-back", addr2, "--insecure", "--join-token", token, "--key", str(wd / "p0.key"),
                "--data-shard", "0", "--connect-timeout", "60")
    wait_for("the member rejoined the next coordinator",
             lambda: id_of(wd / "p0.key") in {m["peer_id"] for m in fetch_status(addr2)["members"]}, 120, procs)
    revoked = peer(procs, "p1-back", addr2, "--insecure", "--join-token", token, "--key", str(wd / "p1.key"),
                   "--data-shard", "1", "--connect-timeout", "60")
    assert procs.wait_exit(revoked, 60) == 2 and "membership revoked" in procs.log("p1-back")
    listed = json.loads(shoal("member", "list", "--coordinator", addr2, "--insecure", "--admin-key",
                              str(wd / "coord.key"), "--json").stdout)
    assert {m["member"]: m["status"] for m in listed["members"]} == {
        id_of(wd / "p0.key"): "admitted", id_of(wd / "p1.key"): "revoked"}
    assert back.poll() is None
