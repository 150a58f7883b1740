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
``reorder`` > 0), ``loss`` (probability that a packet is dropped, independently per packet, as
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

Limits: one thread on one core, one read and one write system call per packet (the device has
no offloads, so every packet is at most one MTU). It runs at nice -10: on a machine whose cores
the workload keeps busy, a forwarder scheduled like any process holds packets for longer than
its path says (they wait in the device's queue) and caps the rate. docs/performance.md, "The delay line's own
limits", gives its packets per second and the rate it holds at a 1,500-byte MTU, with the
command that measures them (`python -m shoal.bench.paths`).

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


def open_tun(name: str) -> int:
    """Open the existing (or a new) TUN device `name` in this namespace, without packet
    information headers, non-blocking. Returns the file descriptor. Raises OSError."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


def _direction_seed(seed: int, src: bytes, dst: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + src + dst,
                                          digest_size=8).digest(), "little")


class DelayLine:
    """The forwarding engine, without the device: `take(packet, now)` decides a packet's fate and
    `due(now)` returns the packets to write. Times in seconds (time.monotonic). Pure and
    deterministic given the seed and the sequence of calls (the unit tests drive it directly)."""

    def __init__(self, paths: dict[tuple[str, str], Path] | None = None, seed: int = 0) -> None:
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._last: dict[tuple[bytes, bytes], float] = {}
        self.stats = {"in": 0, "bytes_in": 0, "out": 0, "lost": 0, "reordered": 0, "overflow": 0, "not_ipv4": 0,
                      "max_held": 0}
        self.set_paths(paths or {}, seed)

    def set_paths(self, paths: dict[tuple[str, str], Path], seed: int = 0) -> None:
        """Replace the table: {(source IPv4, destination IPv4): Path}. Held packets keep their
        release times. Raises OSError for an address that is not IPv4 dotted-quad."""
        self._paths: dict[tuple[bytes, bytes], tuple[Path, random.Random]] = {}
        for (src, dst), path in paths.items():
            s, d = socket.inet_aton(src), socket.inet_aton(dst)
            if not path.idle or path.jitter_ms:
                self._paths[(s, d)] = (path, random.Random(_direction_seed(seed, s, d)))

    @property
    def held(self) -> int:
        return len(self._heap)

    def next_release(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def take(self, pkt: bytes, now: float) -> bytes | None:
        """Accept one packet read at `now`. Returns it when it is to be written at once (no path
        for its direction), None when it is held or dropped."""
        st = self.stats
        st["in"] += 1
        st["bytes_in"] += len(pkt)
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            st["not_ipv4"] += 1
            return pkt
        key = (pkt[12:16], pkt[16:20])
        entry = self._paths.get(key)
        if entry is None:
            return pkt
        path, rng = entry
        if path.loss and rng.random() < path.loss:
            st["lost"] += 1
            return None
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
        self._seq += 1
        heapq.heappush(self._heap, (release, self._seq, pkt))
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


def serve(tun: str) -> int:
    """Forward packets on TUN device `tun` until stdin closes or SIGTERM (the module docstring's
    protocol). Returns the exit status."""
    fd = open_tun(tun)
    with contextlib.suppress(OSError):  # the line stands for the wire: it runs ahead of the workload
        os.setpriority(os.PRIO_PROCESS, 0, _NICE)
    engine = DelayLine()
    stop = False

    def _term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    buf = b""
    started, cpu0 = time.monotonic(), _cpu_seconds()
    print(json.dumps({"ready": True}), flush=True)
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
                    pkt = read(fd, 65536)
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
    args = ap.parse_args(argv)
    return serve(args.tun)


if __name__ == "__main__":
    sys.exit(main())
