"""Blame, reachability and coordinator stalls end to end: `shoal swarm --scenario` with real
processes on 127.0.0.1 (cases: a peer SIGSTOPped mid reduce-scatter / all-gather, a peer
advertising an address that drops packets, the coordinator SIGSTOPped longer than the lease).

Wrongful exclusions are computed here from the coordinator's state file: an excluded peer is
wrongfully excluded when no scenario fault or event touched it.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _peer_ids(wd, n: int) -> list[str]:
    """Peer ids by index, from each peer's events file (its first record names it)."""
    out = []
    for i in range(n):
        first = (wd / f"peer-{i}.jsonl").read_text().splitlines()[0]
        out.append(json.loads(first)["peer"])
    return out


def _aborts(wd) -> list[tuple[int, int, str, list[str]]]:
    con = sqlite3.connect(wd / "coordinator.db")
    try:
        rows = con.execute("SELECT round, attempt, reason, excluded FROM aborts ORDER BY id").fetchall()
    finally:
        con.close()
    return [(r, a, why, json.loads(ex)) for r, a, why, ex in rows]


def _swarm(tmp_path, scenario: str, *args: str, timeout: float = 600, swarm_timeout: float | None = None,
           ) -> tuple[dict, object, str]:
    """Run the swarm; with `swarm_timeout` it is expected to end by that timeout (a peer left
    stopped never finishes), else to succeed."""
    path, summary, wd = tmp_path / "scenario.toml", tmp_path / "s.json", tmp_path / "wd"
    path.write_text(scenario)
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--scenario", str(path), "--summary", str(summary),
         "--no-progress", "--workdir", str(wd), "--timeout", str(int(swarm_timeout or timeout - 60)), *args],
        capture_output=True, text=True, timeout=timeout)
    if swarm_timeout is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(summary.read_text()), wd, proc.stderr


def _commits(wd) -> int:
    con = sqlite3.connect(wd / "coordinator.db")
    try:
        return con.execute("SELECT COUNT(*) FROM commits").fetchone()[0]
    finally:
        con.close()


def _check_stall(tmp_path, point: str, seed: int) -> None:
    # Peer 2 stops itself in round 4 (SIGSTOP on its first chunk of that phase) and stays
    # stopped: the swarm ends at its timeout (a scenario `cont` at a fixed time can come before
    # the stall on a loaded machine); the others must have committed every round by then.
    # resume_after = 0: not resumed by the scenario before the last round committed (a resume
    # within the chunk deadline is no fault at all, and deadlines follow the measured links).
    scenario = f'[[peer]]\n[[peer]]\n[[peer]]\nfault = "{point}:stop@4"\nresume_after = 0.0\n[[peer]]\n'
    s, wd, _ = _swarm(tmp_path, scenario, "--peers", "4", "--rounds", "8", "--seed", str(seed),
                      swarm_timeout=150, timeout=400)
    ids = _peer_ids(wd, 4)
    aborts = _aborts(wd)
    wrongful = [(r, a, p) for r, a, _, ex in aborts for p in ex if p != ids[2]]
    assert wrongful == [], aborts
    stalled = [(r, a) for r, a, _, ex in aborts if ids[2] in ex]
    assert stalled and stalled[0][0] == 4, aborts  # the first retry of round 4 left peer 2 out
    assert _commits(wd) == 8 and s["digest_mismatches"] == 0


# The all-gather case runs with the soaks (every seed, below); the default run keeps the reduce-scatter one.
@pytest.mark.parametrize("point", ["rs", pytest.param("ag", marks=pytest.mark.soak)])
def test_the_stalled_peer_is_the_one_excluded(tmp_path, point):
    _check_stall(tmp_path, point, seed=0)


@pytest.mark.soak
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("point", ["rs", "ag"])
def test_the_stalled_peer_is_the_one_excluded_every_seed(tmp_path, point, seed):
    _check_stall(tmp_path, point, seed)


class Blackhole:
    """A loopback address that drops packets: a listener whose accept queue is full and never
    drained, so the kernel drops every further SYN (no root, no netem needed)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.fill = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(self.listener.getsockname())
            except BlockingIOError:
                pass
            self.fill.append(s)
        time.sleep(0.2)

    def close(self) -> None:
        for s in self.fill:
            s.close()
        self.listener.close()


def test_blackhole_drops_connections():
    hole = Blackhole()
    try:
        host, port = hole.address.split(":")
        with pytest.raises(TimeoutError):
            socket.create_connection((host, int(port)), timeout=1.0)
    finally:
        hole.close()


@pytest.mark.soak  # default-run budget (10 min): a 15-17 s swarm; tests/system/test_outbound_only_swarm.py keeps outbound-only peers in committed rounds, tests/unit/test_blame.py the rules
def test_an_unreachable_peer_is_told_and_takes_part_outbound_only(tmp_path):
    hole = Blackhole()
    try:
        s, wd, _ = _swarm(tmp_path, f'[[peer]]\n[[peer]]\n[[peer]]\n[[peer]]\nadvertise = "{hole.address}"\n',
                          "--peers", "4", "--rounds", "15")
    finally:
        hole.close()
    ids = _peer_ids(wd, 4)
    aborts = _aborts(wd)
    wrongful = [p for _, _, _, ex in aborts for p in ex if p != ids[3]]
    assert wrongful == [] and len(aborts) <= 2, aborts
    assert s["rounds_committed"] == 15 and s["digest_mismatches"] == 0
    lines = [line for line in (wd / "peer-3.log").read_text().splitlines()
             if "cannot reach this peer's data address" in line]
    assert len(lines) == 1, lines
    assert hole.address in lines[0] and "outbound-only" in lines[0]
    # Nobody dials the address it advertises, yet it takes part (docs/nat.md): it never owns a shard.
    commits = [json.loads(line) for line in (wd / "peer-3.jsonl").read_text().splitlines()]
    assert len({e["round"] for e in commits if e["event"] == "commit"}) >= 13
    plans = [e for e in commits if e["event"] == "plan"]
    assert plans and all(e["outbound_only"] == [ids[3]] and e["collective"] == "butterfly" for e in plans)
    assert all(ids[3] in e["demoted"] for e in plans)
    # Nor does anyone probe it (a probe of a black hole waited out its timeout before the Ready).
    for i in range(3):
        log = (wd / f"peer-{i}.log").read_text()
        assert f"bulk lane to {hole.address}" not in log and "probe failed" not in log, log[-2000:]


@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run; tests/unit/test_pauses.py keeps the pause-aware leases
def test_a_coordinator_stall_longer_than_the_lease_evicts_nobody(tmp_path):
    """SIGSTOP the coordinator at 10 s, SIGCONT at 20 s (lease 5 s: the stall is two leases;
    the 20 s / 40 s / 10 s run is examples/scenarios/coordinator-stall.toml): nobody is
    dropped, every peer takes part in a commit within 10 s of the resume, no digest disagrees."""
    scenario = ('[[event]]\nat = 10.0\naction = "coordinator-stop"\n\n'
                '[[event]]\nat = 20.0\naction = "coordinator-cont"\n')
    s, wd, _ = _swarm(tmp_path, scenario, "--peers", "3", "--rounds", "150", "--lease-seconds", "5",
                      "--inner-steps", "5", timeout=900)
    log = (wd / "coordinator.log").read_text()
    assert "did not run for" in log
    assert "dropped (lease expired or left)" not in log.split("run finished")[0], log[-3000:]
    assert s["digest_mismatches"] == 0 and s["rounds_committed"] == 150
    stop, cont = s["events"]
    assert cont["action"] == "coordinator-cont" and cont["done_after_start_seconds"] is not None
    t0 = (wd / "coordinator.addr").stat().st_mtime  # the driver's clock starts as the coordinator serves
    resumed = t0 + cont["done_after_start_seconds"]
    for i in range(3):
        events = [json.loads(line) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()]
        after = [e["t"] for e in events if e["event"] == "commit" and e["t"] >= resumed]
        assert after, f"peer-{i} took part in no commit after the resume"
        assert min(after) - resumed <= 10.0, (i, min(after) - resumed)
