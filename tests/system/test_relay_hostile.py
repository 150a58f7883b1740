"""A hostile client at the relay (docs/nat.md, "Relays"; docs/security.md): `shoal swarm --relay`
on loopback (every peer through one relay, which admits the coordinator's members only), and,
while it trains, one client (127.0.0.2) tries 5,000 registrations under fresh keys without a
relay ticket and opens 7,000 connections to a member's relayed port and holds them; a member is
killed and restarted meanwhile. Every registration is refused, the relay keeps its 3 peers, the
flood is cut at the per-dialler limit, and the run commits every round with no digest mismatch
and no wrongful exclusion; the restarted member takes part again."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.relay.protocol import register_line
from kits.procs import finish

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(600)]

SCENARIO = """
[[event]]
at = 90.0
action = "restart"
peer = 2
"""
FLOOD_CONNECTIONS = 7000
STRANGERS = 5000
ROUNDS = 300  # about 2 s per round here: the run goes on well past the restart at 90 s


def _commits(path) -> list[float]:
    """The times (unix s) of the commits in a peer's events file."""
    try:
        return [e["t"] for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "commit"]
    except (OSError, ValueError):
        return []


def _stats(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


async def _register_strangers(relay: str, n: int) -> dict[str, int]:
    """`n` registrations under fresh keys, no ticket, 100 at a time; how they were answered."""
    host, port = relay.rsplit(":", 1)
    answers: dict[str, int] = {}
    gate = asyncio.Semaphore(100)

    async def one() -> None:
        async with gate:
            try:
                r, w = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
                w.write(register_line(Ed25519PrivateKey.generate(), relay))
                await w.drain()
                word = (await asyncio.wait_for(r.readline(), 10)).decode().split()[:1]
                w.close()
            except (OSError, TimeoutError):
                word = ["closed"]
            key = (word or ["closed"])[0]
            answers[key] = answers.get(key, 0) + 1

    await asyncio.gather(*(one() for _ in range(n)))
    return answers


def _flood(address: str, n: int) -> list[socket.socket]:
    """`n` connections from 127.0.0.2 to `address`, held open (those refused at once are closed)."""
    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.settimeout(2)
        try:
            s.connect((host, int(port)))
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


def test_strangers_and_a_connection_flood_at_the_relay_leave_the_rounds_and_a_restart_alone(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD_CONNECTIONS + 1000:
        pytest.skip(f"the open-file limit ({hard}) is below the flood's {FLOOD_CONNECTIONS} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    scenario, summary, wd = tmp_path / "sc.toml", tmp_path / "s.json", tmp_path / "wd"
    scenario.write_text(SCENARIO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "swarm", "--relay", "--peers", "3", "--rounds", str(ROUNDS), "--scenario",
         str(scenario), "--summary", str(summary), "--workdir", str(wd), "--no-progress", "--timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held: list[socket.socket] = []
    try:
        end = time.monotonic() + 180
        while len(_stats(wd / "relay.json").get("peers", {})) < 3 or not _commits(wd / "peer-0.jsonl"):
            assert proc.poll() is None and time.monotonic() < end, "no round committed through the relay"
            time.sleep(0.5)
        stats = _stats(wd / "relay.json")
        relay = stats["address"]
        member = next(iter(stats["peers"].values()))["address"]
        t0 = time.time()
        answers = asyncio.run(_register_strangers(relay, STRANGERS))
        held = _flood(member, FLOOD_CONNECTIONS)
        t1 = time.time()
        out = finish(proc, 500)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    s = json.loads(summary.read_text())
    final = _stats(wd / "relay.json")
    assert answers.get("OK", 0) == 0 and sum(answers.values()) == STRANGERS, answers
    assert len(final["peers"]) == 3  # the members, nobody else
    assert final["dials_refused"] >= FLOOD_CONNECTIONS - 32 - 10, final  # cut at the per-dialler limit
    commits = _commits(wd / "peer-0.jsonl")
    during = sum(t0 <= t <= t1 for t in commits) / (t1 - t0)
    print(f"attack {t1 - t0:.1f}s: {during:.2f} commits/s during it, "
          f"{len(commits) / (commits[-1] - commits[0]):.2f} over the run; relay {final}")
    assert during > 0, "no round committed during the attack"
    assert s["rounds_committed"] == ROUNDS and s["digest_mismatches"] == 0 and s["wrongful_exclusions"] == 0, s
    restart = next(e for e in s["events"] if e["action"] == "restart")
    assert restart["done_after_start_seconds"] is not None and restart["peer_next_commit_seconds"] is not None, restart
    assert restart["max_commit_gap_seconds_30s"] is not None and restart["max_commit_gap_seconds_30s"] < 30.0, restart
