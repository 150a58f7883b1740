"""`python -m shoal.bench.paths`: one long, lossy path in the bed, measured with plain TCP.

Builds a two-host `shoal.testbeds.netbed.NetBed` with ``--mbit`` shaping each way and the delay
line set to ``--rtt-ms`` / ``--jitter-ms`` / ``--loss``, then, for each count in ``--streams``
(e.g. ``1,4,16``), sends from host 0 to host 1 over that many TCP connections at once for
``--seconds`` and reports the goodput the receiver counted after ``--warmup`` seconds (slow start
excluded as in iperf's ``--omit``), the sender's retransmitted segments, and the delay line's own
load: frames (reads of the device: a GSO super-packet or one packet), MTU-sized segments and bytes
per second it forwarded, and its CPU share of one core. ``--udp`` instead
floods the line with UDP datagrams of ``--udp-size`` bytes for the forwarder's packet rate limit;
``--ring HOSTS`` builds that many hosts and has each send to the next at once (a ring step), over
each count of connections with the bulk lane's send buffer: the rate the whole bed holds.
Prints one JSON object.

Needs root (network namespaces). Every process is killed and the bed deleted on return.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from shoal.peer.lanes.pool import send_buffer_bytes
from shoal.testbeds.netbed import Latency, NetBed, machine_congestion

__all__ = ["measure_ring", "measure_streams", "main"]

_PORT = 5301

# Accepts `n` connections, counts bytes on all of them after `warmup` seconds from the first
# byte, until every sender closed; prints {"bytes", "seconds", "mbit"}.
_RECEIVER = r"""
import json, selectors, socket, sys, time
host, port, n, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(256); print("ready", flush=True)
sel = selectors.DefaultSelector(); conns = []
srv.settimeout(60)
for _ in range(n):
    c, _ = srv.accept(); c.setblocking(False); sel.register(c, selectors.EVENT_READ); conns.append(c)
open_ = n; start = time.monotonic(); t0 = None; got = 0; last = start
while open_:
    for key, _ in sel.select(timeout=60):
        d = key.fileobj.recv(1 << 20)
        if not d:
            sel.unregister(key.fileobj); key.fileobj.close(); open_ -= 1; continue
        now = time.monotonic(); last = now
        if now - start >= warmup:
            if t0 is None:
                t0 = now
            else:
                got += len(d)
secs = max(last - (t0 or last), 1e-9)
print(json.dumps({"bytes": got, "seconds": secs, "mbit": got * 8 / secs / 1e6}), flush=True)
"""

# Opens `n` connections to the receiver and sends on all of them (one thread each) for `seconds`;
# with a 5th argument > 0, sets SO_SNDBUF to it first (as the bulk lane does: peer.lanes.pool).
_SENDER = r"""
import socket, sys, threading, time
host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sndbuf = int(sys.argv[5]) if len(sys.argv) > 5 else 0
conns = []
for _ in range(n):
    c = socket.socket()
    if sndbuf:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    c.settimeout(30); c.connect((host, port)); conns.append(c)
end = time.monotonic() + seconds; buf = b"x" * 65536
def pump(c):
    while time.monotonic() < end:
        c.sendall(buf)
    c.close()
ts = [threading.Thread(target=pump, args=(c,)) for c in conns]
[t.start() for t in ts]; [t.join() for t in ts]
"""

_UDP_SENDER = r"""
import socket, sys, time
host, port, size, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); buf = b"u" * size; n = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(64):
        try:
            s.sendto(buf, (host, port)); n += 1
        except OSError:
            pass
print(n, flush=True)
"""

_UDP_RECEIVER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24); s.settimeout(2.0); print("ready", flush=True)
n = 0; first = last = None
while True:
    try:
        s.recv(65536)
    except socket.timeout:
        break
    last = time.monotonic(); first = first or last; n += 1
print(n, (last - first) if first else 0.0, flush=True)
"""


def _retrans(bed: NetBed, i: int) -> int:
    out = bed.run(i, ["cat", "/proc/net/snmp"], capture_output=True, text=True).stdout
    head, vals = [line.split() for line in out.splitlines() if line.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


def _line_load(before: dict, after: dict) -> dict:
    wall = max(after["wall_s"] - before["wall_s"], 1e-9)
    pk = after["in"] - before["in"]
    seg = after["segments_in"] - before["segments_in"]
    return {"frames_per_s": round(pk / wall), "segments_per_s": round(seg / wall), "mbit_through": round((after["bytes_in"] - before["bytes_in"]) * 8
                                                                     / wall / 1e6, 1),
            "cpu_share": round((after["cpu_s"] - before["cpu_s"]) / wall, 3),
            "lost": after["lost"] - before["lost"], "overflow": after["overflow"] - before["overflow"],
            "max_held": after["max_held"]}


def _receiver(bed: NetBed, i: int, n: int, warmup: float) -> subprocess.Popen:
    """A `_RECEIVER` on host i for `n` connections, listening once it returns."""
    recv = bed.popen(i, [sys.executable, "-c", _RECEIVER, bed.host_ip(i), str(_PORT), str(n), str(warmup)],
                     stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    if recv.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the receiver on host {i} did not start")
    return recv


def measure_streams(bed: NetBed, n: int, seconds: float, warmup: float) -> dict:
    """Goodput (Mbit/s) from host 0 to host 1 over `n` TCP connections at once, the sender's
    retransmissions and the delay line's load over the run."""
    recv = _receiver(bed, 1, n, warmup)
    r0, s0 = _retrans(bed, 0), bed.delay_stats()
    send = bed.popen(0, [sys.executable, "-c", _SENDER, bed.host_ip(1), str(_PORT), str(n), str(seconds)])
    out, _ = recv.communicate(timeout=seconds + 90)
    send.wait(timeout=30)
    got = json.loads(out)
    return {"streams": n, "mbit": round(got["mbit"], 2), "retransmitted_segments": _retrans(bed, 0) - r0,
            "delay_line": _line_load(s0, bed.delay_stats())}


def measure_ring(bed: NetBed, n: int, seconds: float, warmup: float, sndbuf: int) -> dict:
    """Every host sends to the next (host i to i+1 mod hosts, as a ring all-reduce's step does)
    over `n` TCP connections each at once, with SO_SNDBUF `sndbuf` (0: autotuned): each host's
    goodput (Mbit/s), their sum, and the delay line's load. What the bed holds in all."""
    hosts = bed.n_hosts
    recvs = [_receiver(bed, i, n, warmup) for i in range(hosts)]
    s0 = bed.delay_stats()
    sends = [bed.popen(i, [sys.executable, "-c", _SENDER, bed.host_ip((i + 1) % hosts), str(_PORT), str(n),
                           str(seconds), str(sndbuf)]) for i in range(hosts)]
    got = [json.loads(r.communicate(timeout=seconds + 90)[0])["mbit"] for r in recvs]
    for s in sends:
        s.wait(timeout=30)
    return {"streams_per_host": n, "sndbuf_bytes": sndbuf, "mbit_per_host": [round(g, 1) for g in got],
            "mbit_total": round(sum(got), 1), "delay_line": _line_load(s0, bed.delay_stats())}


def measure_udp(bed: NetBed, size: int, seconds: float) -> dict:
    """The delay line's packet rate under a UDP flood of `size`-byte datagrams from host 0 to 1."""
    recv = bed.popen(1, [sys.executable, "-c", _UDP_RECEIVER, bed.host_ip(1), str(_PORT)],
                     stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    recv.stdout.readline()
    s0 = bed.delay_stats()
    sent = bed.run(0, [sys.executable, "-c", _UDP_SENDER, bed.host_ip(1), str(_PORT), str(size), str(seconds)],
                   capture_output=True, text=True, timeout=seconds + 30)
    s1 = bed.delay_stats()
    out, _ = recv.communicate(timeout=30)
    n, secs = out.split()
    return {"datagram_bytes": size, "sent": int(sent.stdout), "delivered": int(n),
            "delivered_per_s": round(int(n) / max(float(secs), 1e-9)),
            "delivered_mbit": round(int(n) * (size + 28) * 8 / max(float(secs), 1e-9) / 1e6, 1),
            "delay_line": _line_load(s0, s1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.paths", description=__doc__.split("\n")[0])
    ap.add_argument("--mbit", type=float, default=None, help="tc shaping each way, Mbit/s (default: unshaped)")
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0, help="packet loss probability per direction")
    ap.add_argument("--streams", default="1", help="comma-separated connection counts, e.g. 1,4,16")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--udp", action="store_true", help="flood UDP instead (the forwarder's packet rate)")
    ap.add_argument("--ring", type=int, default=0, metavar="HOSTS",
                    help="HOSTS hosts, each sending to the next at once over --streams connections each, "
                         "with the bulk lane's send buffer: what the bed holds in all")
    ap.add_argument("--udp-size", type=int, default=1472)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tcp-congestion", default=None, help="the hosts' TCP congestion control (default: the machine's)")
    a = ap.parse_args(argv)
    lat = Latency(a.rtt_ms, a.jitter_ms, a.loss)
    out: dict = {"mbit_shaped": a.mbit, "rtt_ms": a.rtt_ms, "jitter_ms": a.jitter_ms, "loss": a.loss,
                 "tcp_congestion": a.tcp_congestion or machine_congestion()}
    hosts = max(2, a.ring)
    with NetBed(hosts, [a.mbit] * hosts, [a.mbit] * hosts, prefix="shlp", latency=[lat] * hosts, delay_line=True,
                delay_seed=a.seed, tcp_congestion=a.tcp_congestion) as bed:
        if a.ring:
            out["ring"] = [measure_ring(bed, int(n), a.seconds, a.warmup, send_buffer_bytes())
                           for n in a.streams.split(",")]
        elif a.udp:
            out["udp"] = measure_udp(bed, a.udp_size, a.seconds)
        else:
            out["runs"] = [measure_streams(bed, int(n), a.seconds, a.warmup) for n in a.streams.split(",")]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
