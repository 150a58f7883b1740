"""The bed's delay line with real TCP: connections between namespaces see the path's RTT, the
root namespace's too, a path changed while the bed runs, and TCP retransmits what the line drops."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from shoal.testbeds.netbed import ROOT, Latency, NetBed

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("netbed_available"),
]

PREFIX = "shld"

# Accepts connections; for each, reads until EOF and answers with the byte count.
SERVER = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64); print("ready", flush=True)
def serve(c):
    n = 0
    while True:
        d = c.recv(1 << 16)
        if not d:
            break
        n += len(d)
    c.sendall(str(n).encode()); c.close()
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

# Times `count` TCP connects (SYN to SYN-ACK: one round trip), then sends `nbytes` over one
# connection; prints the connect times in ms and the byte count the server read.
CLIENT = r"""
import json, socket, sys, time
host, port, count, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ms = []
for _ in range(count):
    t = time.monotonic(); c = socket.create_connection((host, port), timeout=10)
    ms.append((time.monotonic() - t) * 1000); c.shutdown(socket.SHUT_WR); c.recv(16); c.close()
got = 0
if nbytes:
    c = socket.create_connection((host, port), timeout=20); c.sendall(b"x" * nbytes)
    c.shutdown(socket.SHUT_WR); got = int(c.recv(32)); c.close()
print(json.dumps({"ms": ms, "got": got}))
"""


def _retrans(bed: NetBed, i: int) -> int:
    """TCP segments host i retransmitted so far (its namespace's /proc/net/snmp RetransSegs)."""
    out = bed.run(i, ["cat", "/proc/net/snmp"], capture_output=True, text=True).stdout
    head, vals = [l.split() for l in out.splitlines() if l.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


def _client(bed: NetBed, src: int, dst_ip: str, count: int = 5, nbytes: int = 0) -> dict:
    argv = [sys.executable, "-c", CLIENT, dst_ip, "7100", str(count), str(nbytes)]
    if src == ROOT:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=40)
    else:
        proc = bed.run(src, argv, capture_output=True, text=True, timeout=40)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_tcp_across_the_delay_line_sees_the_rtt_and_the_loss():
    lat = [Latency(rtt_ms=60), Latency(rtt_ms=60), None]
    with NetBed(3, prefix=PREFIX, latency=lat, pair_latency={(1, 2): Latency(rtt_ms=20, loss=0.05)},
                delay_seed=5) as bed:
        for i in range(3):
            srv = bed.popen(i, [sys.executable, "-c", SERVER, bed.host_ip(i), "7100"],
                            stdout=subprocess.PIPE, text=True)
            assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"

        # Host 0 ↔ 1: both hosts' 60 ms. Host 0 ↔ root: host 0's own 60 ms.
        for src, dst in ((0, 1), (ROOT, 0)):
            ms = statistics.median(_client(bed, src, bed.host_ip(dst))["ms"])
            assert 60 <= ms < 80, (src, dst, ms)

        # A path changed while the bed runs.
        bed.set_pair_latency(0, 1, Latency(rtt_ms=150))
        ms = statistics.median(_client(bed, 0, bed.host_ip(1))["ms"])
        assert 150 <= ms < 175, ms

        # 5 % loss each way on 1 ↔ 2: TCP retransmits and still delivers every byte; the lossless
        # 0 → 1 path needs no retransmission for the same transfer.
        # Tail-loss probes resend a segment when an ACK is late (a forwarder starved on a busy
        # host), which would count on the lossless path too; only losses should.
        bed.run(0, ["sysctl", "-qw", "net.ipv4.tcp_early_retrans=0"], check=True)
        before = bed.delay_stats()
        r1, r0 = _retrans(bed, 1), _retrans(bed, 0)
        assert _client(bed, 1, bed.host_ip(2), count=1, nbytes=1_000_000)["got"] == 1_000_000
        assert _client(bed, 0, bed.host_ip(1), count=1, nbytes=1_000_000)["got"] == 1_000_000
        after = bed.delay_stats()
        lost = after["lost"] - before["lost"]
        assert lost > 0
        assert _retrans(bed, 1) - r1 >= lost // 2  # the data direction's drops are all resent
        assert _retrans(bed, 0) - r0 == 0


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_on_a_long_lossy_path_a_pool_of_connections_carries_more_than_one():
    """100 ms RTT and 0.1 % loss with cubic: one connection is loss-bound near the Mathis rate
    (≈ 4.5 Mbit/s); 16 at once carry several times that (docs/performance.md, "Long, lossy paths")."""
    from shoal.bench.paths import measure_streams

    ok, _ = NetBed.congestion_available("cubic")
    if not ok:
        pytest.skip("the kernel has no cubic")
    lat = Latency(rtt_ms=100, loss=0.001)
    with NetBed(2, [1000] * 2, [1000] * 2, prefix=PREFIX, latency=[lat, lat], delay_seed=1,
                tcp_congestion="cubic") as bed:
        one = measure_streams(bed, 1, seconds=10, warmup=3)
        pool = measure_streams(bed, 16, seconds=10, warmup=3)
    assert one["retransmitted_segments"] > 0 and one["mbit"] < 20
    assert pool["mbit"] > 3 * one["mbit"], (one, pool)
