"""peer.lanes.pool: the one-connection bound and the pool size rule (pure), and TCP_INFO read
from a real loopback connection."""

from __future__ import annotations

import contextlib
import math
import socket

import pytest

from shoal.peer.lanes import pool
from shoal.peer.lanes.pool import TcpPath, connection_bound, initial_pool_size, next_pool_size


class Conn:
    """What BulkClient reads of a bulk connection: its socket, and whether it broke."""

    broken = False

    def __init__(self, sock):
        self.sock = sock


@contextlib.contextmanager
def loopback_pair():
    """A connected pair of real TCP sockets on loopback: (client, server side)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        with a, b:
            yield a, b

MB = 1e6 / 8  # bytes/s per Mbit/s
WINDOW = 3 << 20


def test_the_bound_is_the_window_or_the_mathis_rate_whichever_is_lower():
    lossy = TcpPath(rtt_seconds=0.1, loss=0.001, mss_bytes=1448)
    assert connection_bound(lossy, WINDOW) == pytest.approx(1.2247 * 1448 / (0.1 * math.sqrt(0.001)), rel=1e-3)
    assert connection_bound(lossy, WINDOW) / MB == pytest.approx(4.49, abs=0.01)  # the 4.5 Mbit/s
    clean = TcpPath(0.1, 0.0, 1448)
    assert connection_bound(clean, WINDOW) == pytest.approx(WINDOW / 0.1)
    assert connection_bound(TcpPath(0.0, 0.01, 1448), WINDOW) == math.inf
    bbr = TcpPath(0.1, 0.001, 1448, congestion="bbr")  # not loss-bound: the window only
    assert connection_bound(bbr, WINDOW) == pytest.approx(WINDOW / 0.1)


def test_a_pool_held_back_by_its_connections_grows_and_a_lan_keeps_one():
    lossy = TcpPath(0.1, 0.001, 1448)  # ~4.5 Mbit/s per connection
    assert next_pool_size(1, 20 * MB, lossy, WINDOW, 16) == 2
    assert next_pool_size(4, 60 * MB, lossy, WINDOW, 16) == 8
    assert next_pool_size(16, 300 * MB, lossy, WINDOW, 16) == 16  # capped by the setting
    assert next_pool_size(4, 60 * MB, lossy, WINDOW, 1) == 1
    lan = TcpPath(0.0002, 0.0, 1448)
    assert next_pool_size(1, 900 * MB, lan, WINDOW, 16) == 1


def test_a_pool_the_path_holds_back_shrinks_to_what_reaches_the_same_goodput():
    clean = TcpPath(0.1, 0.0, 1448)  # ~250 Mbit/s per connection (3 MiB window)
    assert next_pool_size(16, 100 * MB, clean, WINDOW, 16) == 1
    lossy = TcpPath(0.1, 0.001, 1448)
    assert next_pool_size(16, 10 * MB, lossy, WINDOW, 16) == 5
    assert next_pool_size(8, 12 * MB, lossy, WINDOW, 16) == 8  # in between: unchanged
    assert next_pool_size(3, 0.0, lossy, WINDOW, 16) == 3 and next_pool_size(3, 5 * MB, None, WINDOW, 16) == 3


def test_the_first_pool_covers_the_link_from_the_handshakes_rtt_and_a_lan_keeps_one():
    clean = TcpPath(0.1, 0.0, 1448)  # one connection: 3 MiB per 100 ms, ~252 Mbit/s
    assert initial_pool_size(clean, WINDOW, 1000 * MB, 16) == 4  # the 4 connections for 1 Gbit/s
    assert initial_pool_size(clean, WINDOW) == 4  # uplink not known: POOL_TARGET_BYTES_PER_S, 1 Gbit/s
    assert pool.POOL_TARGET_BYTES_PER_S == 1000 * MB
    assert initial_pool_size(clean, WINDOW, 100 * MB) == 1  # one connection covers it
    assert initial_pool_size(clean, WINDOW, 10_000 * MB, 16) == 16  # capped by the setting
    assert initial_pool_size(clean, WINDOW, 1000 * MB, 2) == 2 and initial_pool_size(clean, WINDOW, 1000 * MB, 0) == 1
    one = connection_bound(clean, WINDOW)
    assert initial_pool_size(clean, WINDOW, 3 * one) == 3 and initial_pool_size(clean, WINDOW, 3.01 * one) == 4
    assert initial_pool_size(TcpPath(0.02, 0.0, 1448), WINDOW, 1000 * MB) == 1  # 20 ms: ~1.26 Gbit/s each
    # A loss, when the path has one, counts as in `connection_bound` (Mathis; BBR: the window only).
    assert initial_pool_size(TcpPath(0.1, 0.001, 1448), WINDOW, 1000 * MB, 16) == 16
    assert initial_pool_size(TcpPath(0.1, 0.001, 1448, congestion="bbr"), WINDOW, 1000 * MB, 16) == 4
    # A LAN keeps one connection whatever the link; nothing measured: one.
    lan = TcpPath(0.0002, 0.0, 1448)
    assert initial_pool_size(lan, WINDOW, 1000 * MB) == initial_pool_size(lan, WINDOW, 10_000 * MB) == 1
    assert initial_pool_size(TcpPath(30e-6, 0.0, 65483), WINDOW) == 1  # loopback's handshake
    assert initial_pool_size(None, WINDOW, 1000 * MB) == initial_pool_size(TcpPath(0.0, 0.0, 1448), WINDOW) == 1


def test_a_pool_is_sized_at_its_first_handshake_and_a_stream_decides_after():
    """BulkClient._size_from_handshake on a connection just opened (no data sent yet): the kernel
    already holds the handshake's RTT; loopback is a LAN (one connection), and an uplink far past
    one loopback connection's bound takes the most the setting allows. Sized once per address;
    the size chosen for another peer lifts it, a stream's own outcome replaces it, `forget`
    drops it."""
    from shoal.peer.lanes.bulk import BulkClient

    with loopback_pair() as (a, b):
        path = pool.tcp_path([a])
        assert path is not None and 0 < path.rtt_seconds < 0.05 and path.loss == 0.0  # the SYN / SYN-ACK
        lan = BulkClient(probe=None, max_connections=16)
        assert lan._size_from_handshake("p:1", Conn(a)) == 1 and lan.pool_size("p:1") == 1
        far = BulkClient(probe=None, max_connections=6, link_bytes_per_s=1e15)
        assert far._size_from_handshake("p:1", Conn(a)) == 6 and far.pool_size("p:1") == 6
        assert far._size_from_handshake("p:1", Conn(a)) == 0  # sized once
        assert far.pool_size("p:2") == 1  # not connected yet: the size last chosen (none yet)
        lan._first = 3  # a stream to another peer chose 3
        assert lan.pool_size("p:1") == 3
        far.observe_stream("p:1", [Conn(a)] * 6, 1000.0)  # far below the bound: the path holds it,
        assert far.pool_size("p:1") == 6  # but a pool never shrinks below its handshake's size
        far._sized["p:1"] = 2
        far.observe_stream("p:1", [Conn(a)] * 6, 1000.0)
        assert far.pool_size("p:1") == 2
        assert far._size_from_handshake("p:1", Conn(a)) == 0  # streamed to: the stream decides
        assert far._size_from_handshake("p:3", Conn(a)) == 6 and far.pool_size("p:3") == 6
        far.forget("p:3")
        assert far.pool_size("p:3") == 2 and "p:3" not in far._sized  # the size last chosen for p:1


def test_the_send_buffer_goes_past_autotuning_only_where_that_gives_more():
    core = int(open("/proc/sys/net/core/wmem_max").read())
    auto = int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2])
    assert pool.send_buffer_bytes() == (core if 2 * core > auto else 0)
    assert pool.window_bytes() == max(64 << 10, min(int(open("/proc/sys/net/ipv4/tcp_rmem").read().split()[2]) // 2,
                                                   int(0.7 * max(auto, 2 * pool.send_buffer_bytes()))))


def test_tcp_path_reads_the_kernels_measurement_of_a_real_connection():
    with loopback_pair() as (a, b):
        a.sendall(b"x" * 200_000)
        got = 0
        while got < 200_000:
            got += len(b.recv(1 << 16))
        path = pool.tcp_path([a])
    assert path is not None
    assert 0 < path.rtt_seconds < 0.05 and path.loss == 0.0 and path.mss_bytes > 500
    assert 0 < path.min_rtt_seconds <= path.rtt_seconds and path.congestion
    assert pool.tcp_path([]) is None
    assert pool.window_bytes() >= 64 << 10


def test_the_bulk_lanes_path_measurement_feeds_the_link_meters_rtt_and_loss():
    from shoal.peer.links import LinkMeter

    meter = LinkMeter(alpha=0.5, clock=lambda: 0.0)
    meter.observe_path("b" * 32, rtt=0.1, loss=0.002)
    meter.observe_path("b" * 32, rtt=0.2, loss=0.0)
    [view] = meter.links()
    assert view.rtt_seconds == pytest.approx(0.15)
    assert meter.loss("b" * 32) == pytest.approx(0.001)
    assert meter.loss("c" * 32) == 0.0
    assert meter.report("a" * 32).links[0].rtt_seconds == pytest.approx(0.15)  # what the planner's α gets


def test_a_peer_not_streamed_to_yet_starts_at_the_size_last_chosen_for_another():
    """BulkClient.observe_stream on a real socket: a stream that filled its connection's window
    doubles the pool to that peer, and a peer first seen after it starts there too (a ring's
    successor changes from round to round); a LAN stream brings it back to 1."""
    from shoal.peer.lanes.bulk import BulkClient

    with loopback_pair() as (a, b):
        a.sendall(b"x" * 10_000)
        b.recv(1 << 16)
        client = BulkClient(probe=None, max_connections=16)
        path = pool.tcp_path([a])
        fills = pool.connection_bound(path, client.window)  # bytes/s: one connection's bound
        assert client.pool_size("p:1") == client.pool_size("p:2") == 1
        client.observe_stream("p:1", [Conn(a)], fills)
        assert client.pool_size("p:1") == 2 and client.pool_size("p:2") == 2
        client.observe_stream("p:2", [Conn(a), Conn(a)], 1000.0)  # far below the bound: the path holds it
        assert client.pool_size("p:2") == 1 and client.pool_size("p:3") == 1
        assert client.pool_size("p:1") == 2


def test_a_striped_connection_holds_its_unsent_bytes_below_the_low_water_mark():
    """BulkConnection.notsent_lowat sets TCP_NOTSENT_LOWAT on the real socket (0: the default)."""
    from shoal.peer.lanes.bulk import BulkConnection

    with loopback_pair() as (a, b):
        conn = BulkConnection.__new__(BulkConnection)
        conn.sock = a
        conn.notsent_lowat(pool.STRIPE_NOTSENT_LOWAT)
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == pool.STRIPE_NOTSENT_LOWAT
        conn.notsent_lowat(0)
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == 0


def test_a_stream_that_waited_for_its_producer_does_not_resize_the_pool():
    """A ring step's stream waits for its predecessor's chunks: its goodput is the collective's
    pace, and a pool sized from it would shrink to one connection on a long path."""
    assert pool.stream_goodput(100, 2.0, 0.0) == 50.0
    assert pool.stream_goodput(100, 2.0, 0.49) == 50.0  # under a quarter of it waiting: the connections
    assert pool.stream_goodput(100, 2.0, 0.5) is None
    assert pool.stream_goodput(100, 0.0, 0.0) is None


def test_observe_stream_without_a_goodput_keeps_the_size_and_records_the_path():
    from shoal.peer.lanes.bulk import BulkClient

    with loopback_pair() as (a, _):
        client = BulkClient(probe=None, max_connections=8)
        client._pool["p:1"] = 3
        path = client.observe_stream("p:1", [Conn(a)], None)
        assert path is not None and client.paths["p:1"] == path
        assert client.pool_size("p:1") == 3
