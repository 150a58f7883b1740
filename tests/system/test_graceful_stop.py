"""SIGTERM of a peer is a graceful leave: the round in play may end, the
coordinator is told (Leave: the member goes long before its lease would expire), its
shared-memory slabs are gone, it exits 0, and the others keep committing."""

from __future__ import annotations

import json
import pathlib
import signal
import sys

import pytest

from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.peer.lanes import shm
from shoal.cli.status import fetch_status

pytestmark = pytest.mark.integration


def wait_for(what: str, check, timeout: float, procs):
    return procs.wait_for(what, check, timeout, every=0.2, tail=1500)


def test_sigterm_of_a_peer_leaves_cleanly_and_exits_0(procs):
    # A lease far longer than the test: only a Leave can make the member go this soon.
    coord, addr = procs.coordinator("--rounds", "0", "--min-peers", "2", "--initial-peers", "3",
                                    "--lease-seconds", "300", "--inner-steps", "10")
    wd = procs.workdir
    peers = [procs.start(f"peer-{i}", [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                       "--key", str(wd / f"p{i}.key"), "--data-shard", str(i),
                                       "--events", str(wd / f"peer-{i}.jsonl"), "--connect-timeout", "60"])
             for i in range(3)]
    wait_for("3 committed rounds of 3 peers",
             lambda: (s := fetch_status(addr))["rounds_committed"] >= 3 and len(s["members"]) == 3, 120, procs)
    leaving = peer_id_of(public_bytes(load_or_create_key(str(wd / "p2.key"))))

    peers[2].send_signal(signal.SIGTERM)
    assert procs.wait_exit(peers[2], 60) == 0, procs.log("peer-2")[-3000:]
    log = procs.log("peer-2")
    assert "Traceback" not in log and "left the swarm" in log, log[-3000:]
    events = [json.loads(line) for line in (wd / "peer-2.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "left", events[-1]
    # Told by Leave (the lease has 300 s to go), and no slab of it left in /dev/shm.
    wait_for("the leaving peer dropped from the members",
             lambda: leaving not in {m["peer_id"] for m in fetch_status(addr)["members"]}, 30, procs)
    if shm.available():
        assert not [n for n in pathlib.Path(shm.SHM_DIR).iterdir()
                    if n.name.startswith(f"shoal-{shm._prefix(leaving)}-")]
    # The other two go on.
    c = fetch_status(addr)["rounds_committed"]
    wait_for("2 more committed rounds without it", lambda: fetch_status(addr)["rounds_committed"] >= c + 2, 120, procs)
    assert all(p.poll() is None for p in (coord, *peers[:2]))


def test_a_finished_run_ends_the_coordinator_with_exit_0(procs):
    """`shoal coordinator --rounds 3`: once the peers were told and left, it exits 0 (after
    --finish-linger, here 8 s, in which a latecomer joins), saying the run finished once. A peer
    that joins the finished run is told so and exits 0."""
    coord, addr = procs.coordinator("--rounds", "3", "--min-peers", "2", "--initial-peers", "2",
                                    "--inner-steps", "10", "--finish-linger", "8")
    peers = [procs.start(f"peer-{i}", [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                       "--key", str(procs.workdir / f"p{i}.key"), "--data-shard", str(i),
                                       "--connect-timeout", "60"])
             for i in range(2)]
    # A latecomer, while the coordinator lingers: told the run is over, it exits 0.
    wait_for("the run finished", lambda: "run finished" in procs.log("coordinator"), 180, procs)
    late = procs.start("late", [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                "--key", str(procs.workdir / "late.key"), "--data-shard", "2", "--connect-timeout", "60"])
    for p in (*peers, late):
        assert procs.wait_exit(p, 180) == 0, procs.log(p.name)[-3000:]
    assert procs.wait_exit(coord, 120) == 0, procs.log("coordinator")[-3000:]
    log = procs.log("coordinator")
    assert log.count("run finished after 3 committed rounds") == 1, log[-3000:]
    assert "every member has left" in log and "Traceback" not in log
    assert "joined after the run finished" in log
    out = procs.log("late")
    assert "the run had already finished (3 rounds committed, run complete) when this peer joined" in out, out
