"""The bulk lane (peer/bulk_lane.py): its frame codec, its admission (the same checks as
PushChunks), all-reduces over it, and broken connections.

The codec tests are pure. The others use real TCP sockets and real gRPC on loopback in this
event loop (tests/swarmlet.py: real Ed25519 identities, coordinator-signed tickets), and real
processes (collective jobs, `shoal peer`) for the end-to-end and kill -9 cases.
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from kits.procs import read_json
from shoal.bench.collective_job import make_input
from shoal.common.certs import init_certs


# ------------------------------------------------------------------------------- real processes


def _jobs(procs, p: int, size: int, *flags: str, tag: str, coordinator_flags: tuple[str, ...] = ()) -> list[dict]:
    """One run of p collective jobs on loopback without shared memory. The same key files every
    run: the same peer ids, so the same participant order, so the same order of every sum."""
    coord, addr = procs.coordinator("--rounds", "2", "--min-peers", str(p), "--initial-peers", str(p),
                                    "--collective", "butterfly", *coordinator_flags, name=f"coordinator-{tag}",
                                    state=f"coordinator-{tag}.db")
    jobs = []
    for r in range(p):
        out = procs.workdir / f"{tag}-{r}.json"
        jobs.append((procs.start(f"{tag}-{r}", [
            sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r), "--size", str(size),
            "--key", str(procs.workdir / f"job-{r}.key"), "--out", str(out), "--timeout", "90",
            "--no-shared-memory", *flags]), out))
    reports = []
    for proc, out in jobs:
        assert procs.wait_exit(proc, 120) == 0, procs.log(proc.name)
        rep = read_json(out)
        rep["result"] = np.load(str(out) + ".npy")
        reports.append(rep)
    procs.kill(coord)
    return reports


@pytest.mark.integration
def test_processes_over_the_bulk_lane_commit_the_same_bytes_as_over_grpc(procs):
    p, size = 3, 700_001
    bulk = _jobs(procs, p, size, tag="tcp")
    grpc_lane = _jobs(procs, p, size, "--no-tcp-lane", tag="grpc")
    assert all(rd["lanes"] == ["tcp"] for rep in bulk for rd in rep["rounds"]), [rep["rounds"] for rep in bulk]
    assert all(rd["lanes"] == ["socket"] for rep in grpc_lane for rd in rep["rounds"])
    assert len({rep["result"].tobytes() for rep in bulk + grpc_lane}) == 1
    expected = sum(make_input(0, r, 1, size, "float32").astype(np.float64) for r in range(p))
    np.testing.assert_allclose(bulk[0]["result"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
def test_tls_processes_take_the_bulk_lane_over_tls_and_commit_the_same_bytes_as_tls_grpc(procs):
    # Real processes, real TLS: certificates issued at join, as `shoal bench --tls` runs them.
    p, size = 3, 700_001
    tls = init_certs(procs.workdir / "tls").dir
    peer_dir = procs.workdir / "tls-peer"
    peer_dir.mkdir()
    (peer_dir / "ca.pem").write_bytes((tls / "ca.pem").read_bytes())
    coordinator_flags = ("--tls-dir", str(tls))
    bulk = _jobs(procs, p, size, "--tls-dir", str(peer_dir), tag="tls-tcp", coordinator_flags=coordinator_flags)
    grpc_lane = _jobs(procs, p, size, "--tls-dir", str(peer_dir), "--no-tcp-lane", tag="tls-grpc",
                      coordinator_flags=coordinator_flags)
    assert all(rd["lanes"] == ["tcp-tls"] for rep in bulk for rd in rep["rounds"]), [rep["rounds"] for rep in bulk]
    assert all(rd["lanes"] == ["socket"] for rep in grpc_lane for rd in rep["rounds"])
    assert len({rep["result"].tobytes() for rep in bulk + grpc_lane}) == 1
    expected = sum(make_input(0, r, 1, size, "float32").astype(np.float64) for r in range(p))
    np.testing.assert_allclose(bulk[0]["result"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
def test_a_peer_killed_mid_collective_on_the_bulk_lane_is_retried_without_it(procs):
    from test_chaos import assert_survivors_consistent, events, start_peer, start_swarm

    addr = start_swarm(procs, 4)
    extra = ("--no-shared-memory",)  # loopback processes then talk over the bulk lane
    peers = [start_peer(procs, addr, i, fault="rs:kill@3" if i == 2 else "", extra=extra) for i in range(4)]
    assert procs.wait_exit(peers[2], 60) == -signal.SIGKILL, "the fault did not fire"
    assert_survivors_consistent(procs, [p for i, p in enumerate(peers) if i != 2])
    aborted = [e for e in events(procs, "peer-0") if e["event"] == "abort"]
    assert any(e["round"] == 3 and e["will_retry"] for e in aborted), "round 3 should have been aborted and retried"
    r3 = [e for e in events(procs, "peer-0") if e["event"] == "commit" and e["round"] == 3][0]
    assert r3["participants"] == 3 and r3["attempt"] >= 1
