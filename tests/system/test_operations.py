"""A running swarm as an operator sees it: /metrics scrapes, `shoal status`, gRPC health and
reflection. One swarm (coordinator + 3 peer processes, metrics on) serves every test of this
module; every process is killed at the end, also on failure, and every wait is bounded."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shoal.common.metrics import COORDINATOR_METRICS, PEER_METRICS
from shoal.testbeds.swarm import Swarm, SwarmOptions

# Starts a swarm of processes (module fixture) and `shoal status`: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS = 3


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def sample(text: str, name: str) -> float:
    """Sum of the samples of `name` (all label sets) in a /metrics page."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} not exported"
    return total


def wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError, AssertionError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    wd = tmp_path_factory.mktemp("ops-swarm")
    opts = SwarmOptions(peers=PEERS, rounds=0, inner_steps=5, metrics=True, progress=False, min_peers=2)
    s = Swarm(opts, wd)
    try:
        s.start_coordinator()
        for i in range(PEERS):
            s.start_peer(i)
        wait_for(lambda: sum(1 for e in s.all_events() if e["event"] == "commit") >= 2 * PEERS, 60,
                 "two committed rounds")
        yield s
    finally:
        s.stop_all()


def test_metrics_of_coordinator_and_peer(swarm):
    urls = swarm.metrics_urls()
    assert set(urls) == {"coordinator", *(f"peer-{i}" for i in range(PEERS))}

    def coordinator_ready():
        text = scrape(urls["coordinator"])
        # Gauges refresh every second; link estimates are set when reported (maybe before the refresh
        # that counts the peers as members).
        return text if 'shoal_coordinator_members{state="member"} 3.0' in text and \
            sample(text, "shoal_coordinator_link_up_bytes_per_second") > 0 else None

    text = wait_for(coordinator_ready, 20, "coordinator gauges")
    for spec in COORDINATOR_METRICS:
        assert spec.name in text, spec.name
    assert sample(text, "shoal_coordinator_rounds_committed_total") >= 1
    assert sample(text, "shoal_coordinator_round_duration_seconds_count") >= 1
    assert 'shoal_coordinator_members{state="member"} 3.0' in text
    # Why the next round is not open: exactly one reason at 1 (the swarm runs rounds back to back).
    waiting = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("shoal_coordinator_round_waiting{")}
    assert sum(waiting.values()) == 1.0 and {"running", "quorum", "stragglers", "finished"} <= set(waiting)

    text = scrape(urls["peer-0"])
    for spec in PEER_METRICS:
        assert spec.name in text, spec.name
    assert sample(text, "shoal_peer_rounds_committed_total") >= 1
    assert sample(text, "shoal_peer_bytes_sent_total") > 0
    assert sample(text, "shoal_peer_bytes_received_total") > 0
    assert sample(text, "shoal_peer_link_up_bytes_per_second") > 0
    assert 0.0 < sample(text, "shoal_peer_test_accuracy") <= 1.0


def test_status_json_lists_the_members(swarm):
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--insecure", "--coordinator", swarm.address, "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert len(st["members"]) == PEERS
    assert {m["state"] for m in st["members"]} == {"member"}
    assert all(":" in m["address"] and "up_bytes_per_s" in m["links"] for m in st["members"])
    assert st["rounds_committed"] >= 1 and any(r["status"] == "committed" for r in st["rounds"])
    assert st["run_config"]["algorithm"] == "diloco"
    assert st["compression"] == {"name": "none", "bytes_per_element": 4.0, "float32_over_these": 1.0}
    assert not any(m["untrusted"] for m in st["members"])
    # The swarm's peers share this host: each reports the others as shared-memory peers (after a round).
    assert all(m["shm_peers"] == PEERS - 1 for m in st["members"]), st["members"]
    assert st["waiting"]["reason"] in {"running", "quorum", "stragglers", "syncing", "backoff", "opening"}
    assert st["waiting"]["message"]

    out = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--insecure", "--coordinator", swarm.address],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "members (3)" in out.stdout and "recent rounds" in out.stdout and "shm peers" in out.stdout
    assert "next round: " in out.stdout
    assert st["members"][0]["peer_id"][:12] in out.stdout


def test_health_and_reflection(swarm):
    import asyncio

    from shoal.cli.status import fetch_status

    peer_address = fetch_status(swarm.address)["members"][0]["address"]

    async def check(address: str, service: str) -> tuple[int, int, set[str]]:
        async with grpc.aio.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            named = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            names: set[str] = set()
            async for resp in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                        timeout=5):
                names |= {s.name for s in resp.list_services_response.service}
            return overall.status, named.status, names

    serving = health_pb2.HealthCheckResponse.SERVING
    for address, service in ((swarm.address, "shoal.v1.Coordinator"), (peer_address, "shoal.v1.Peer")):
        overall, named, names = asyncio.run(check(address, service))
        assert overall == serving and named == serving
        assert {service, "grpc.health.v1.Health"} <= names
