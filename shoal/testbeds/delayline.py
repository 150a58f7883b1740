"""A packet-level delay line: a user-space forwarder on a TUN device (docs/concepts.md, "Test beds").

The network-namespace bed (shoal.testbeds.netbed) routes every packet between two hosts, and
between a host and the root namespace, through one "core" namespace whose policy routing hands
the packet to a TUN device. This module is the process on the other end of that device: it reads
each IPv4 packet, looks its direction (source address, destination address) up in the path table,
and writes it back to the device after the direction's one-way delay, or drops it. The kernels at
both ends run TCP end to end through it, with real windows, slow start and loss recovery (a
user-space proxy that terminates TCP would hide all of that); rate stays the job of the bed's
``tc tbf`` shapers.

Per direction (a `Path`): ``delay_ms`` (one-way), ``jitter_ms`` (each packet's delay is drawn
uniformly from ``delay_ms ± jitter_ms``; packets keep their order, as on one real path, unless
``reorder`` > 0), ``loss`` (probability that a packet, an MSS segment, is dropped, independently per segment, as
netem's ``loss random``) and ``reorder`` (probability that a packet is held back by an extra
``max(jitter_ms, 1 ms)`` outside the order, so that the ones behind it overtake it). Every
direction draws from its own ``random.Random`` seeded from (seed, source, destination): the same
seed gives the same drops and delays for the same packet sequence.

Protocol (the bed drives it; JSON lines): the process reads one JSON object per line on stdin:
``{"paths": [[src, dst, delay_ms, jitter_ms, loss, reorder], ...], "seed": N}`` replaces the
path table at once (a packet already held keeps its release time), ``{"stats": true}`` makes it
print its counters as one JSON line on stdout; it writes ``{"ready": true}`` once the device is
open, and its counters when stdin closes or SIGTERM arrives, then exits. Directions missing from
the table pass without delay.

Offloads: the device is opened with a virtio-net header and TCP segmentation offload
(`open_tun`), so the kernel hands over whole GSO super-packets of up to 64 KiB and one read and one
write system call move up to 44 MTU-sized segments. Loss still applies per MSS segment, as on the
wire: a super-packet that loses some of its segments goes on as the runs of the others
(`split_tcp_gso`). ``--no-offload`` gives the plain device, one MTU per frame.

Limits: one thread on one core. It runs at nice -10: on a machine whose cores the workload keeps
busy, a forwarder scheduled like any process holds packets for longer than its path says (they
wait in the device's queue) and caps the rate. docs/performance.md, "The delay line's own limits",
gives its frames and segments per second, the rate it holds at a 1,500-byte MTU and its CPU, with
the command that measures them (`python -m shoal.bench.paths`).

Run as ``python -m shoal.testbeds.delayline --tun NAME`` inside the namespace that holds the
device (Linux only; needs access to /dev/net/tun).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import heapq
import json
import math
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Path", "DelayLine", "open_tun", "main"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUNSETOFFLOAD = 0x400454D0
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO_ECN = 0x01, 0x02, 0x08
VNET_HDR = struct.Struct("<BBHHHH")  # virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
_VNET_LEN = VNET_HDR.size  # 10 bytes
_F_NEEDS_CSUM = 0x01
_GSO_TCPV4, _GSO_ECN = 0x01, 0x80
_READ_SIZE = _VNET_LEN + 65536  # the largest frame the device hands out (IPv4 GSO ≤ 64 KiB)
_READ_BATCH = 256  # packets read per wake-up before the due ones are written
_NICE = -10  # the forwarder's scheduling priority (it models the network, not a process of the workload)
_MAX_HELD = 200_000  # packets held at once; beyond this new packets are dropped (counted: "overflow")


@dataclass(frozen=True)
class Path:
    """One direction's behaviour. delay_ms / jitter_ms in milliseconds (≥ 0; jitter ≤ delay),
    loss and reorder probabilities in [0, 1). Raises ValueError for values outside."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    reorder: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms"):
            v = getattr(self, name)
            if not (v >= 0 and v < 60_000):
                raise ValueError(f"{name}: must be in [0, 60000) ms, got {v!r}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms: {self.jitter_ms} is larger than delay_ms {self.delay_ms}")
        for name in ("loss", "reorder"):
            v = getattr(self, name)
            if not (0 <= v < 1):
                raise ValueError(f"{name}: must be a probability in [0, 1), got {v!r}")

    @property
    def idle(self) -> bool:
        return self.delay_ms == 0 and self.loss == 0 and self.reorder == 0


def open_tun(name: str, offload: bool = True) -> tuple[int, bool]:
    """Open the existing (or a new) TUN device `name` in this namespace, without packet
    information headers, non-blocking. With `offload`, ask for a virtio-net header on every frame
    and TCP segmentation offload (``TUNSETOFFLOAD``: checksum, TSO for IPv4, ECN), so that the
    kernel hands the forwarder whole GSO super-packets of up to 64 KiB instead of one MTU each;
    a kernel that refuses gets the plain device. Returns (file descriptor, whether frames carry
    the header). Raises OSError."""
    flags = _IFF_TUN | _IFF_NO_PI
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        if offload:
            try:
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), flags | _IFF_VNET_HDR))
                fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO_ECN)
            except OSError:
                os.close(fd)
                fd = os.open("/dev/net/tun", os.O_RDWR)
            else:
                os.set_blocking(fd, False)
                return fd, True
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd, False


def _direction_seed(seed: int, src: bytes, dst: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + src + dst,
                                          digest_size=8).digest(), "little")


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _words(b: bytes) -> int:
    return sum(struct.unpack(f"!{len(b) // 2}H", b))


def tcp_segments(pkt: bytes, gso_size: int, off: int = 0) -> int:
    """How many MSS segments the IPv4/TCP GSO super-packet at `pkt[off:]` stands for (≥ 1)."""
    ihl = (pkt[off] & 0x0F) * 4
    payload = len(pkt) - off - ihl - (pkt[off + ihl + 12] >> 4) * 4
    return max(1, -(-payload // gso_size))


def split_tcp_gso(pkt: bytes, gso_size: int, ecn: bool, runs: list[tuple[int, int]]) -> list[bytes]:
    """Cut the IPv4/TCP GSO super-packet `pkt` (segments of `gso_size` payload bytes) into one
    frame (virtio-net header + packet) per run [a, b) of its segments, as the kernel's own
    segmentation would have numbered them (tcp_gso_segment): sequence number advanced by the bytes
    before, IP id by the segments before, FIN/PSH kept on the last segment only and CWR on the
    first, IP header checksum recomputed, the TCP checksum left partial (the pseudo-header sum;
    VIRTIO_NET_HDR_F_NEEDS_CSUM asks the kernel to finish it). A run of two or more segments stays
    a GSO frame. Used to drop single segments out of a super-packet."""
    ihl = (pkt[0] & 0x0F) * 4
    doff = (pkt[ihl + 12] >> 4) * 4
    hl = ihl + doff
    ip, tcp, payload = bytearray(pkt[:ihl]), bytearray(pkt[ihl:hl]), memoryview(pkt)[hl:]
    ident = struct.unpack_from("!H", ip, 4)[0]
    seq = struct.unpack_from("!I", tcp, 4)[0]
    flags = tcp[13]
    n = tcp_segments(pkt, gso_size)
    addr = _words(bytes(ip[12:20])) + 6
    out = []
    for a, b in runs:
        body = payload[a * gso_size:min(b * gso_size, len(payload))]
        struct.pack_into("!HH", ip, 2, hl + len(body), (ident + a) & 0xFFFF)
        struct.pack_into("!H", ip, 10, 0)
        struct.pack_into("!H", ip, 10, 0xFFFF - _fold(_words(bytes(ip))))
        struct.pack_into("!I", tcp, 4, (seq + a * gso_size) & 0xFFFFFFFF)
        f = flags
        if b < n:
            f &= ~0x09  # FIN, PSH: the last segment's
        if a > 0:
            f &= ~0x80  # CWR: the first segment's
        tcp[13] = f
        struct.pack_into("!H", tcp, 16, _fold(addr + doff + len(body)))
        gso = b - a > 1
        hdr = VNET_HDR.pack(_F_NEEDS_CSUM, (_GSO_TCPV4 | (_GSO_ECN if ecn else 0)) if gso else 0,
                            hl if gso else 0, gso_size if gso else 0, ihl, 16)
        out.append(hdr + bytes(ip) + bytes(tcp) + bytes(body))
    return out


class DelayLine:
    """The forwarding engine, without the device: `take(frame, now)` decides a frame's fate and
    `due(now)` returns the frames to write. Times in seconds (time.monotonic). Pure and
    deterministic given the seed and the sequence of calls (the unit tests drive it directly).

    With `vnet` each frame starts with a virtio-net header (the device's offloads, `open_tun`): a
    TCP super-packet of n segments meets the path's loss once per segment, as n packets on the wire
    would, and one that loses some of them goes on as the runs of the others (`split_tcp_gso`).
    Loss draws the gap to the next lost segment (geometric, `loss` per segment), so a super-packet
    costs one comparison whatever its size."""

    def __init__(self, paths: dict[tuple[str, str], Path] | None = None, seed: int = 0, vnet: bool = False) -> None:
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._vnet = vnet
        self._last: dict[tuple[bytes, bytes], float] = {}
        self.stats = {"in": 0, "segments_in": 0, "bytes_in": 0, "out": 0, "lost": 0, "split": 0, "reordered": 0,
                      "overflow": 0, "not_ipv4": 0, "max_held": 0}
        self.set_paths(paths or {}, seed)

    def set_paths(self, paths: dict[tuple[str, str], Path], seed: int = 0) -> None:
        """Replace the table: {(source IPv4, destination IPv4): Path}. Held packets keep their
        release times. Raises OSError for an address that is not IPv4 dotted-quad."""
        self._paths: dict[tuple[bytes, bytes], list[Any]] = {}
        for (src, dst), path in paths.items():
            s, d = socket.inet_aton(src), socket.inet_aton(dst)
            if not path.idle or path.jitter_ms:
                rng = random.Random(_direction_seed(seed, s, d))
                self._paths[(s, d)] = [path, rng, self._gap(path, rng)]

    @staticmethod
    def _gap(path: Path, rng: random.Random) -> float:
        """Segments that pass before the next lost one: geometric with success probability `loss`."""
        if not path.loss:
            return math.inf
        return math.floor(math.log(1.0 - rng.random()) / math.log1p(-path.loss))

    @property
    def held(self) -> int:
        return len(self._heap)

    def next_release(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def take(self, frame: bytes, now: float) -> bytes | None:
        """Accept one frame read at `now`. Returns it when it is to be written at once (no path
        for its direction), None when it is held or dropped (whole, or in part: the rest is held)."""
        st = self.stats
        st["in"] += 1
        st["bytes_in"] += len(frame)
        off = _VNET_LEN if self._vnet else 0
        if len(frame) < off + 20 or frame[off] >> 4 != 4:
            st["not_ipv4"] += 1
            st["segments_in"] += 1
            return frame
        gso_size = gso_type = 0
        n = 1
        if off:
            _, gso_type, _, gso_size, _, _ = VNET_HDR.unpack_from(frame)
            if gso_type & 0x7F == _GSO_TCPV4 and gso_size:
                n = tcp_segments(frame, gso_size, off)  # (no copy of the frame: the hot path)
        st["segments_in"] += n
        key = (frame[off + 12:off + 16], frame[off + 16:off + 20])
        entry = self._paths.get(key)
        if entry is None:
            return frame
        path, rng, gap = entry
        pieces = [frame]
        if gap < n:
            lost, k = [], gap
            while k < n:
                lost.append(int(k))
                k += 1 + self._gap(path, rng)
            entry[2] = k - n
            st["lost"] += len(lost)
            if len(lost) == n:
                return None
            if n > 1:
                st["split"] += 1
                runs, a = [], 0
                for j in (*lost, n):
                    if j > a:
                        runs.append((a, j))
                    a = j + 1
                pieces = split_tcp_gso(frame[off:], gso_size, bool(gso_type & _GSO_ECN), runs)
        else:
            entry[2] = gap - n
        if len(self._heap) >= _MAX_HELD:
            st["overflow"] += 1
            return None
        delay = path.delay_ms
        if path.jitter_ms:
            delay += (2 * rng.random() - 1) * path.jitter_ms
        release = now + delay / 1000.0
        if path.reorder and rng.random() < path.reorder:
            st["reordered"] += 1
            release += max(path.jitter_ms, 1.0) / 1000.0
        else:
            last = self._last.get(key, 0.0)
            if release < last:
                release = last  # keep order within the direction
            self._last[key] = release
        for piece in pieces:
            self._seq += 1
            heapq.heappush(self._heap, (release, self._seq, piece))
        if len(self._heap) > st["max_held"]:
            st["max_held"] = len(self._heap)
        return None

    def due(self, now: float) -> list[bytes]:
        """Pop every held packet whose release time is ≤ now, in release order."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        return out


def parse_paths(rows: Any) -> dict[tuple[str, str], Path]:
    """The ``paths`` of a control line: [[src, dst, delay_ms, jitter_ms, loss, reorder], ...].
    Raises ValueError naming the bad row."""
    if not isinstance(rows, list):
        raise ValueError(f"paths: must be a list, got {type(rows).__name__}")
    out = {}
    for k, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 6:
            raise ValueError(f"paths[{k}]: must be [src, dst, delay_ms, jitter_ms, loss, reorder], got {row!r}")
        try:
            socket.inet_aton(row[0])
            socket.inet_aton(row[1])
            out[(row[0], row[1])] = Path(*(float(v) for v in row[2:]))
        except (OSError, TypeError, ValueError) as exc:
            raise ValueError(f"paths[{k}]: {exc}") from None
    return out


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _control(line: str, line_obj: DelayLine, started: float, cpu0: float) -> str | None:
    """Apply one control line; return the line to print (stats), if any."""
    msg = json.loads(line)
    if "paths" in msg:
        line_obj.set_paths(parse_paths(msg["paths"]), int(msg.get("seed", 0)))
    if msg.get("stats"):
        return json.dumps(_report(line_obj, started, cpu0))
    return None


def _report(line_obj: DelayLine, started: float, cpu0: float) -> dict:
    wall = time.monotonic() - started
    return {**line_obj.stats, "held": line_obj.held, "wall_s": round(wall, 3),
            "cpu_s": round(_cpu_seconds() - cpu0, 3)}


def serve(tun: str, offload: bool = True) -> int:
    """Forward packets on TUN device `tun` until stdin closes or SIGTERM (the module docstring's
    protocol); with `offload`, whole GSO super-packets (`open_tun`). Returns the exit status."""
    fd, vnet = open_tun(tun, offload)
    with contextlib.suppress(OSError):  # the line stands for the wire: it runs ahead of the workload
        os.setpriority(os.PRIO_PROCESS, 0, _NICE)
    engine = DelayLine(vnet=vnet)
    stop = False

    def _term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    buf = b""
    started, cpu0 = time.monotonic(), _cpu_seconds()
    print(json.dumps({"ready": True, "offload": vnet}), flush=True)
    read, write, mono = os.read, os.write, time.monotonic
    while not stop:
        nxt = engine.next_release()
        timeout = 0.5 if nxt is None else max(0.0, nxt - mono())
        try:
            ready, _, _ = select.select([fd, ctl], [], [], timeout)
        except InterruptedError:
            continue
        if ctl in ready:
            try:
                chunk = os.read(ctl, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                break
            buf += chunk or b""
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    try:
                        reply = _control(line.decode(), engine, started, cpu0)
                    except (ValueError, KeyError) as exc:
                        reply = json.dumps({"error": str(exc)})
                    if reply:
                        print(reply, flush=True)
        if fd in ready:
            now = mono()
            for _ in range(_READ_BATCH):
                try:
                    pkt = read(fd, _READ_SIZE)
                except BlockingIOError:
                    break
                now = mono()
                passed = engine.take(pkt, now)
                if passed is not None:
                    _write(write, fd, passed, engine)
        for pkt in engine.due(mono()):
            _write(write, fd, pkt, engine)
    print(json.dumps(_report(engine, started, cpu0)), flush=True)
    os.close(fd)
    return 0


def _write(write: Any, fd: int, pkt: bytes, engine: DelayLine) -> None:
    try:
        write(fd, pkt)
        engine.stats["out"] += 1
    except OSError:  # the kernel refused it (no route, device down): a loss the stats show
        engine.stats["write_errors"] = engine.stats.get("write_errors", 0) + 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.testbeds.delayline", description=__doc__.split("\n")[0])
    ap.add_argument("--tun", required=True, help="the TUN device to serve (in this network namespace)")
    ap.add_argument("--no-offload", action="store_true",
                    help="one MTU per frame (no virtio-net header, no segmentation offload)")
    args = ap.parse_args(argv)
    return serve(args.tun, offload=not args.no_offload)


if __name__ == "__main__":
    sys.exit(main())
