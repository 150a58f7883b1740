"""Relays end to end (docs/nat.md, "Relays"), with a real `shoal relay` process: a registered
peer is reached through its relayed address (the splice round trip), a registration under
another peer's key is refused; a relay that flips a bit of a chunk (in its values, or in its gRPC length
prefix: a message the receiver never gets, with no error at either end) makes the round abort with the
relay blamed and no peer excluded (then the retry commits); with TLS on, what the relay forwards
holds no plaintext tensor bytes (the same search finds them without TLS)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.bench.collective_job import make_input
from shoal.common.identity import public_bytes
from shoal.relay.protocol import register_line
from shoal.peer.lanes.relay import RelayLink
from kits.procs import read_json, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _relay(procs, name: str = "relay", *flags: str) -> str:
    ready = procs.workdir / f"{name}.addr"
    p = procs.start(name, [sys.executable, "-m", "shoal.cli", "relay", "--listen", "127.0.0.1:0", "--ready-file",
                           str(ready), "--stats", str(procs.workdir / f"{name}.json"), *flags])
    return procs.wait_file(ready, 30, p)


def _line(relay: str, line: bytes) -> str:
    host, port = relay.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(line)
        return s.makefile("rb").readline().decode()


def test_relay_splices_a_registered_peer_and_refuses_a_forged_registration(procs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    relay = _relay(procs, "relay", "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
                   "--capacity-mbit", "80")
    payload = os.urandom(300_000)

    async def main() -> tuple[bytes, str]:
        async def echo(r, w):
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
            w.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        local = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        link = RelayLink(relay, Ed25519PrivateKey.generate(), local)
        address = await link.start(30)
        try:
            host, port = address.rsplit(":", 1)
            r, w = await asyncio.open_connection(host, int(port))
            w.write(payload)
            await w.drain()
            got = await asyncio.wait_for(r.readexactly(len(payload)), 60)
            w.close()
            assert link.capacity == 10e6  # the declared 80 Mbit/s, told at registration (bytes/s)
            return got, address
        finally:
            await link.close()
            server.close()

    got, address = asyncio.run(main())
    assert got == payload and address != relay  # a port of its own on the relay
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    words = register_line(key, relay).decode().split()
    words[3] = public_bytes(other).hex()  # the other peer's id, signed with this key
    assert _line(relay, (" ".join(words) + "\n").encode()).startswith("ERR")
    line = register_line(key, relay)
    assert _line(relay, line).startswith("OK")
    assert _line(relay, line).startswith("ERR")  # the same line again: a replay
    deadline = 30.0
    while deadline > 0:  # the stats file is rewritten every second
        stats = read_json(procs.workdir / "relay.json")
        if stats["relayed_bytes"] >= 2 * len(payload):
            break
        asyncio.run(asyncio.sleep(0.5))
        deadline -= 0.5
    assert stats["relayed_bytes"] >= 2 * len(payload) and stats["registrations_refused"] == 2
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counted = next(float(line.split()[1]) for line in scraped.splitlines()
                   if line.startswith("shoal_relay_relayed_bytes_total "))
    assert counted >= 2 * len(payload)


# a chunk's values; its gRPC length prefix (a soak: default-run budget, 7 s; the blame rule for a
# relay is the same for both, tests/unit/test_blame.py)
@pytest.mark.parametrize("fault", ["flip@2", pytest.param("prefix@2", marks=pytest.mark.soak)])
def test_a_relay_that_alters_a_chunk_is_blamed_and_no_peer_is_excluded(tmp_path, fault):
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    env = {**os.environ, "SHOAL_FAULT_RELAY": fault}  # only the relay reads it
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--relay", "--peers", "3", "--rounds", "6", "--summary",
         str(summary), "--no-progress", "--workdir", str(wd), "--timeout", "400"],
        capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 6 and s["digest_mismatches"] == 0
    assert "fault injection" in (wd / "relay.log").read_text()
    aborts = [json.loads(line) for i in range(3) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()
              if '"abort"' in line]
    assert aborts, "the altered chunk did not abort its round"
    for a in aborts:
        assert "relay" in a["reason"] and a["excluded"] == [], a


@pytest.mark.parametrize("security", ["plaintext", "tls"])
def test_with_tls_the_relay_forwards_no_plaintext_tensor_bytes(procs, monkeypatch, security):
    wd, size = procs.workdir, 60_000
    common = ["--insecure"]
    coord_flags = ["--insecure"]
    if security == "tls":
        subprocess.run([sys.executable, "-m", "shoal.cli", "certs", "init", "--out", str(wd / "tls")], check=True,
                       capture_output=True, timeout=60)
        (wd / "tls-peer").mkdir()
        (wd / "tls-peer" / "ca.pem").write_bytes((wd / "tls" / "ca.pem").read_bytes())
        token = subprocess.run([sys.executable, "-m", "shoal.cli", "token", "create", "--secret", str(wd / "secret")],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[-1]
        common = ["--tls-dir", str(wd / "tls-peer"), "--join-token", token]
        coord_flags = ["--tls-dir", str(wd / "tls"), "--join-token-secret", str(wd / "secret")]
    _, addr = procs.coordinator("--rounds", "2", "--min-peers", "2", "--initial-peers", "2", *coord_flags)
    monkeypatch.setenv("SHOAL_FAULT_RELAY_RECORD", str(wd / "forwarded.bin"))
    relay = _relay(procs)
    monkeypatch.delenv("SHOAL_FAULT_RELAY_RECORD")
    jobs = [procs.start(f"job-{r}", [
        sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r), "--size", str(size),
        "--key", str(wd / f"job-{r}.key"), "--out", str(wd / f"job-{r}.json"), "--timeout", "120", "--relay", relay,
        "--no-save", "--no-shared-memory", *common]) for r in range(2)]
    for job in jobs:
        assert job.wait(timeout=180) == 0, procs.log(job.name)
    assert all(read_json(wd / f"job-{r}.json")["committed"] == 2 for r in range(2))
    forwarded = (wd / "forwarded.bin").read_bytes()
    assert len(forwarded) > 2 * 4 * size // 2  # each job's half of its input went through the relay
    # 32-byte windows of what each job contributed: its input, as float32 on the wire.
    windows = [make_input(0, r, k, size, "float32")[i:i + 8].tobytes()
               for r in range(2) for k in range(2) for i in range(0, size - 8, 499)]
    found = sum(1 for w in windows if w in forwarded)
    if security == "plaintext":
        assert found > len(windows) // 4  # the search works: half of each input crossed the relay in clear
    else:
        assert found == 0


def test_a_peer_whose_relay_cannot_be_reached_exits_unavailable(procs):
    """The peer joins (outbound-only, for its relay ticket), then cannot register: exit 3, the
    relay named at once and in the last line."""
    tmp_path = procs.workdir
    _, coordinator = procs.coordinator()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", coordinator, "--relay",
         f"127.0.0.1:{port}", "--connect-timeout", "2", "--key", str(tmp_path / "peer.key")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    # Said at once (not only when it gives up), and the last line names the relay.
    assert f"relay 127.0.0.1:{port}: cannot register" in proc.stderr
    assert f"peer: relay 127.0.0.1:{port} unreachable" in proc.stderr.strip().splitlines()[-1]


def test_a_peer_waiting_for_its_relay_leaves_on_sigterm(procs):
    """SIGTERM while the relay (or the coordinator) does not answer yet ends the peer at once,
    exit 0, instead of after --connect-timeout (it needed kill -9)."""
    tmp_path = procs.workdir
    _, coordinator = procs.coordinator()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", coordinator, "--relay",
         f"127.0.0.1:{port}", "--connect-timeout", "300", "--key", str(tmp_path / "peer.key")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:  # wait until it is in its registration retries
            line = proc.stdout.readline()
            lines.append(line)
            if "cannot register" in line:
                break
        assert "cannot register" in lines[-1], lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "stopped before it joined the swarm" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
