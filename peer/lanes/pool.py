"""How many TCP connections the bulk lane opens to one peer: a connection pool for long, lossy paths.

One TCP connection carries at most its window per round trip, ``W / RTT``, and, with random loss
``p``, about ``1.22 · MSS / (RTT · √p)`` bytes/s (Mathis, Semke, Mahdavi & Ott, "The macroscopic
behavior of the TCP congestion avoidance algorithm", CCR 1997): 100 ms and 0.1 % loss hold one
Reno-like flow near 4.5 Mbit/s whatever the link. PCCL (arXiv 2505.14065) spreads each transfer
over a pool of connections to the same peer for this reason. Shoal's bulk lane does the same
(`peer.lanes.bulk.carry`): a stream's chunks go out over ``k`` connections, each taking the next
queued chunk as soon as it wrote its last (a connection slowed by a loss takes fewer), and the
receiver's inbox places every chunk by its key (phase, step, shard, offset), so the collective
reads them in its own order whatever connection brought them.

``k`` is chosen per peer address from what the kernel measured on the lane's own connections
(`tcp_path`: ``TCP_INFO``'s smoothed RTT, retransmitted / sent data segments, the MSS) and the
goodput the last stream reached (`next_pool_size`): when each of the ``k`` connections carried
at least POOL_GROW_SHARE of the one-connection bound (`connection_bound`; with BBR, which does not back off per loss, only the window counts),
the connections, not the path, held the stream back, so the next stream gets POOL_GROWTH times as many (at most the
`[peer] bulk_connections` setting); when they carried less than POOL_SHRINK_SHARE of it, the path
holds the stream and fewer connections reach the same goodput. On a LAN (RTT of microseconds) the
bound is far above any link and the lane keeps one connection.
"""

from __future__ import annotations

import math
import pathlib
import socket
import struct
from dataclasses import dataclass

__all__ = ["TcpPath", "connection_bound", "next_pool_size", "tcp_path", "window_bytes", "POOL_MAX"]

POOL_MAX = 16  # default of `[peer] bulk_connections`
POOL_GROWTH = 4  # a pool held back by its connections grows by this factor per stream
POOL_GROW_SHARE = 0.7  # ... when each connection carried this share of `connection_bound`
POOL_SHRINK_SHARE = 0.25  # below this share the path, not the connections, holds the stream
MATHIS_C = math.sqrt(1.5)  # ≈ 1.22: periodic loss, delayed ACKs off (Mathis et al. 1997)
DEFAULT_WINDOW_BYTES = 3 << 20  # when /proc cannot be read: Linux's default tcp_rmem max (6 MiB) / 2
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


def window_bytes() -> int:
    """The largest window one connection of this host gets: half of ``net.ipv4.tcp_rmem``'s
    maximum (the kernel keeps the other half for overhead at ``tcp_adv_win_scale`` 1), at most
    ``tcp_wmem``'s maximum (the sender's buffer). DEFAULT_WINDOW_BYTES when unreadable."""
    try:
        rmem = int(pathlib.Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
        wmem = int(pathlib.Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return DEFAULT_WINDOW_BYTES
    return max(64 << 10, min(rmem // 2, wmem))


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
