"""How many TCP connections the bulk lane opens to one peer: a connection pool for long, lossy paths.

One TCP connection carries at most its window per round trip, ``W / RTT``, and, with random loss
``p``, about ``1.22 · MSS / (RTT · √p)`` bytes/s (Mathis, Semke, Mahdavi & Ott, "The macroscopic
behavior of the TCP congestion avoidance algorithm", CCR 1997): 100 ms and 0.1 % loss hold one
Reno-like flow near 4.5 Mbit/s whatever the link. PCCL (arXiv 2505.14065) spreads each transfer
over a pool of connections to the same peer for this reason. Shoal's bulk lane does the same
(`peer.lanes.bulk.carry`): a stream's chunks go out over ``k`` connections, each taking the next
queued chunk as soon as it wrote its last (a connection slowed by a loss takes fewer), and the
receiver's inbox places every chunk by its key (phase, step, shard, offset), so the collective
reads them in its own order whatever connection brought them. A striped connection holds at
most STRIPE_NOTSENT_LOWAT unsent bytes in the kernel (``TCP_NOTSENT_LOWAT``): without it a
connection still in slow start, or slowed by a loss, would take chunks into its send buffer
faster than it sends them, and the chunks the receiver needs next would wait behind them.

Before the first stream to an address, ``k`` comes from the connection's handshake
(`initial_pool_size`): right after ``connect`` the kernel's smoothed RTT is the SYN / SYN-ACK
round trip, and no data has been lost yet, so one connection's bound is its window over that RTT;
the pool gets as many connections as it takes for ``k`` of them to cover the sender's uplink (when
the client is told it) or POOL_TARGET_BYTES_PER_S. At 100 ms and a 5.6 MiB window (0.7 of the
8 MiB send buffer the lane sets) that is 3 for 1 Gbit/s, from the first stream on (growth by POOL_GROWTH per stream takes streams to get there,
and a pool whose new connections are still in slow start when its stream is measured stays
small); on a LAN (RTT of microseconds) 1. The
lane opens them together with the first connection (`peer.lanes.bulk.BulkClient.connect`): where
the peer warms its connections before a round (`Transport.probe_lanes`, before every Ready after
the first plan) the round's streams find them open, and a ring's successor of the next round has
its pool too.

After a stream, ``k`` is chosen per peer address from what the kernel measured on the lane's own
connections (`tcp_path`: ``TCP_INFO``'s smoothed RTT, retransmitted / sent data segments, the
MSS) and the goodput the last stream reached (`next_pool_size`): when each of the ``k``
connections carried at least POOL_GROW_SHARE of the one-connection bound (`connection_bound`;
with BBR, which does not back off per loss, only the window counts), the connections, not the
path, held the stream back, so the next stream gets POOL_GROWTH times as many (at most the
`[peer] bulk_connections` setting); when they carried less than POOL_SHRINK_SHARE of it, the path
holds the stream and fewer connections reach the same goodput, but never fewer than the
handshake asked for; in between it keeps its size (a
pool that grew until each connection carries less than POOL_GROW_SHARE of its bound found the
path's rate). A stream whose connections all waited on an empty queue for more than
POOL_STARVED_SHARE of it keeps the pool as it is: it went at its producer's pace (a ring step
waits for its predecessor's chunks), so its goodput measures the collective, not the path; sized
from such streams, a ring's pools shrink to one connection. A peer not streamed to yet starts at the size last chosen for another, or at its
handshake's size when that is larger: the sender's buffers and uplink are the same on all its
paths, and a ring's successor changes from round to round. On a LAN (RTT of microseconds) the
bound is far above any link and the lane keeps one connection.

The window is the sender's buffer: Linux keeps a connection's unacknowledged data in its send
buffer, so one connection carries at most about SNDBUF_IN_FLIGHT of ``SO_SNDBUF`` per round trip
(measured here: 219 Mbit/s at 100 ms RTT with the default 4 MiB ``tcp_wmem`` maximum, 463 Mbit/s
with 8 MiB). ``SO_SNDBUF`` may set twice ``net.core.wmem_max``, more than autotuning's
``tcp_wmem`` maximum on a host with default settings (8 MiB against 4 MiB), so the bulk lane's
sender sets it (`send_buffer_bytes`) and each connection carries twice as much without any
sysctl.
"""

from __future__ import annotations

import math
import pathlib
import socket
import struct
from dataclasses import dataclass

__all__ = ["TcpPath", "connection_bound", "initial_pool_size", "next_pool_size", "send_buffer_bytes", "stream_goodput",
           "tcp_path", "window_bytes", "POOL_MAX", "POOL_TARGET_BYTES_PER_S"]

POOL_MAX = 16  # default of `[peer] bulk_connections`
POOL_GROWTH = 2  # a pool held back by its connections grows by this factor per stream
POOL_GROW_SHARE = 0.5  # ... when each connection carried this share of `connection_bound`
POOL_SHRINK_SHARE = 0.2  # below this share the path, not the connections, holds the stream
# Bytes/s a pool sized at the handshake aims at when the sender's uplink is unknown: 1 Gbit/s, a
# host's access link on the long paths the pool is for. On a slower link the extra connections
# only share it (they stripe one stream; the pool does not shrink below the handshake's size).
POOL_TARGET_BYTES_PER_S = 1e9 / 8
POOL_STARVED_SHARE = 0.25  # a stream whose connections all waited this share of it or more for frames: not resized
WARM_CONNECTIONS_MAX = 128  # idle connections of a whole client past which a handshake opens no more pool ones
STRIPE_NOTSENT_LOWAT = 256 << 10  # unsent bytes a striped connection holds (TCP_NOTSENT_LOWAT)
SNDBUF_IN_FLIGHT = 0.7  # the share of the send buffer a connection keeps in flight (measured, above)
MATHIS_C = math.sqrt(1.5)  # ≈ 1.22: periodic loss, delayed ACKs off (Mathis et al. 1997)
DEFAULT_WINDOW_BYTES = 3 << 20  # when /proc cannot be read: 0.7 of Linux's default tcp_wmem max (4 MiB)
_TCP_INFO_LEN = 232
# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields, then u32s.
_OFF_SND_MSS, _OFF_RTT, _OFF_TOTAL_RETRANS, _OFF_MIN_RTT, _OFF_DATA_SEGS_OUT = 16, 68, 100, 148, 156


@dataclass(frozen=True)
class TcpPath:
    """What the kernel measured on one or more connections to a peer: rtt_seconds (smoothed RTT,
    queueing included: what the window sees), loss (retransmitted / sent data segments, 0 when
    none were sent), mss_bytes (sender MSS), min_rtt_seconds (the smallest RTT seen: the path's
    propagation delay, the planner's α; 0 when unknown)."""

    rtt_seconds: float
    loss: float
    mss_bytes: int
    min_rtt_seconds: float = 0.0
    congestion: str = ""  # the connections' congestion control (TCP_CONGESTION), "" when unknown


def tcp_path(socks) -> TcpPath | None:
    """The path measured on TCP sockets `socks` (the lane's connections to one peer): the largest
    smoothed RTT, loss over all their data segments, the smallest MSS. None when TCP_INFO cannot
    be read (not Linux, not TCP, closed)."""
    rtts, mins, mss, retrans, sent, cc = [], [], [], 0, 0, ""
    for s in socks:
        try:
            raw = socket.socket.getsockopt(s, socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            cc = cc or socket.socket.getsockopt(s, socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16) \
                .split(b"\0", 1)[0].decode("ascii", "replace")
        except (OSError, AttributeError):
            continue
        if len(raw) < _OFF_DATA_SEGS_OUT + 4:
            continue
        (snd_mss,) = struct.unpack_from("<I", raw, _OFF_SND_MSS)
        (rtt_us,) = struct.unpack_from("<I", raw, _OFF_RTT)
        (total_retrans,) = struct.unpack_from("<I", raw, _OFF_TOTAL_RETRANS)
        (data_segs_out,) = struct.unpack_from("<I", raw, _OFF_DATA_SEGS_OUT)
        (min_rtt_us,) = struct.unpack_from("<I", raw, _OFF_MIN_RTT)
        rtts.append(rtt_us / 1e6)
        if 0 < min_rtt_us < 0xFFFFFFFF:
            mins.append(min_rtt_us / 1e6)
        mss.append(snd_mss)
        retrans += total_retrans
        sent += data_segs_out
    if not rtts:
        return None
    return TcpPath(max(rtts), min(1.0, retrans / sent) if sent else 0.0, max(1, min(mss)), min(mins, default=0.0),
                   cc)


def _sysctl(name: str, field: int = 0) -> int | None:
    try:
        return int(pathlib.Path("/proc/sys/net", name).read_text().split()[field])
    except (OSError, ValueError, IndexError):
        return None


def send_buffer_bytes() -> int:
    """The ``SO_SNDBUF`` value the bulk lane's sender sets on its connections: ``net.core.wmem_max``
    (the kernel doubles it) when that gives more than autotuning's ``tcp_wmem`` maximum, else 0
    (autotuning already goes further: a host tuned for long paths keeps it). 0 when /proc cannot
    be read."""
    core, auto = _sysctl("core/wmem_max"), _sysctl("ipv4/tcp_wmem", 2)
    if core is None or auto is None or 2 * core <= auto:
        return 0
    return core


def window_bytes() -> int:
    """The most data one bulk connection of this host keeps in flight, bytes: SNDBUF_IN_FLIGHT of
    its send buffer (``2 · send_buffer_bytes()`` when the lane sets it, else ``tcp_wmem``'s
    maximum), at most half of ``tcp_rmem``'s maximum (the receiver's window; the kernel keeps the
    other half for overhead at ``tcp_adv_win_scale`` 1). DEFAULT_WINDOW_BYTES when unreadable."""
    rmem, wmem = _sysctl("ipv4/tcp_rmem", 2), _sysctl("ipv4/tcp_wmem", 2)
    if rmem is None or wmem is None:
        return DEFAULT_WINDOW_BYTES
    sndbuf = max(wmem, 2 * send_buffer_bytes())
    return max(64 << 10, min(rmem // 2, int(SNDBUF_IN_FLIGHT * sndbuf)))


def connection_bound(path: TcpPath, window: int) -> float:
    """Bytes/s one TCP connection carries on `path` with a `window`-byte window: the smaller of
    ``window / RTT`` and, with loss, the Mathis bound ``1.22 · MSS / (RTT · √loss)``; inf for an
    RTT of 0. BBR (Cardwell et al., "BBR: congestion-based congestion control", ACM Queue 2016)
    paces to its model of the path's bandwidth and does not back off per loss: only its window
    bounds it."""
    if path.rtt_seconds <= 0:
        return math.inf
    bound = window / path.rtt_seconds
    if path.loss > 0 and not path.congestion.startswith("bbr"):
        bound = min(bound, MATHIS_C * path.mss_bytes / (path.rtt_seconds * math.sqrt(path.loss)))
    return bound


def next_pool_size(current: int, goodput: float, path: TcpPath | None, window: int, most: int) -> int:
    """The connections the next stream to this peer gets, after a stream on `current` of them
    reached `goodput` bytes/s on `path` (see the module docstring); within [1, most]. No path
    measured: `current` (clamped)."""
    current = max(1, min(current, most))
    if path is None or goodput <= 0:
        return current
    bound = connection_bound(path, window)
    per = goodput / current
    if per >= POOL_GROW_SHARE * bound:
        return min(most, current * POOL_GROWTH)
    if per < POOL_SHRINK_SHARE * bound and current > 1:
        return max(1, min(current - 1, math.ceil(goodput / (POOL_GROW_SHARE * bound))))
    return current


def stream_goodput(nbytes: int, seconds: float, starved_seconds: float) -> float | None:
    """What a finished stream says about its connections: its goodput (bytes/s, `nbytes` over
    `seconds`), or None when its connections all waited on an empty queue for POOL_STARVED_SHARE
    of it or more (`starved_seconds`: the least any connection that carried a frame waited), so that it went
    at its producer's pace and the pool keeps its size (`BulkClient.observe_stream`)."""
    if seconds <= 0 or starved_seconds >= POOL_STARVED_SHARE * seconds:
        return None
    return nbytes / seconds


def initial_pool_size(path: TcpPath | None, window: int, link_bytes_per_s: float = 0.0, most: int = POOL_MAX) -> int:
    """The connections the first stream to a peer gets, from `path` as the kernel measured it on
    a connection right after it opened (the handshake's RTT, seconds; a loss counts when `path`
    has one: `BulkClient` passes none, since a retransmitted handshake or TLS record is no loss
    rate) and the sender's `window` (bytes, `window_bytes`): the fewest ``k`` for which
    ``k · connection_bound(path, window)`` covers `link_bytes_per_s` (the sender's uplink, bytes/s;
    0 or less when unknown: POOL_TARGET_BYTES_PER_S). Within [1, most]; 1 when nothing was
    measured (`path` None, RTT 0) and on a LAN, where one connection's bound is far above any
    link. PCCL (arXiv 2505.14065) pools connections per peer for the same reason: one TCP flow
    over a long path carries at most its window per round trip."""
    most = max(1, most)
    if path is None or path.rtt_seconds <= 0:
        return 1
    bound = connection_bound(path, window)
    if math.isinf(bound):
        return 1
    if bound <= 0:  # no window at all: as many as allowed
        return most
    target = link_bytes_per_s if link_bytes_per_s > 0 else POOL_TARGET_BYTES_PER_S
    return max(1, min(most, math.ceil(target / bound - 1e-9)))  # (exactly k bounds need k, not k + 1)
