"""The bulk lane (peer/lanes/bulk.py) over real TCP sockets and real gRPC on loopback in this
event loop (tests/kits/swarmlet.py: real Ed25519 identities, coordinator-signed tickets): reads and
writes on full sockets, all-reduces over it, its admission (the same checks as PushChunks), its TLS
binding, and broken or restarted connections. The frame codec's pure tests are
tests/unit/test_bulk_lane_frames.py.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.certs import PeerTLS, init_certs
from shoal.coordinator.ca import CertificateAuthority
from shoal.common.identity import peer_id_of, public_bytes, sign_metadata
from shoal.peer.lanes import pool
from shoal.common.security import Security
from shoal.common.tensors import result_digest
from shoal.common.tickets import issue_ticket, verify_ticket
from shoal.peer.lanes import bulk as bulk_lane
from shoal.peer.collectives import CollectiveError
from shoal.peer.dataplane import Inbox, PeerService, SenderGone, Session, Transport, serve_data_plane
from shoal.v1 import shoal_pb2 as pb
from kits.chunks import chunk_header
from kits.swarmlet import Swarmlet



# ------------------------------------------------------------------------------- sockets


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setblocking(False)
    return a, b


async def test_send_frame_writes_every_byte_when_the_socket_fills():
    loop = asyncio.get_running_loop()
    a, b = _tcp_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # sendmsg writes part, sock_sendall the rest
    values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    frames = [bulk_lane.ChunkFrame(chunk_header(count=values.size, offset=i), values) for i in range(3)]
    try:
        async with asyncio.timeout(30):
            async def send():
                for f in frames:
                    await bulk_lane.send_frame(loop, a, f)

            sender = asyncio.ensure_future(send())
            for i in range(3):
                kind, meta, n = await bulk_lane.read_frame_head(loop, b)
                body = await bulk_lane.recv_payload(loop, b, n)
                assert kind == bulk_lane.CHUNK and pb.Chunk.FromString(meta).offset == i
                assert bytes(body) == values.tobytes()
            await sender
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("nbytes", [1 << 20, 300_000, 70_000])
async def test_a_long_read_wakes_per_low_water_mark_and_leaves_the_socket_as_it_was(nbytes):
    loop = asyncio.get_running_loop()
    a, b = _tcp_pair()
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    buf = memoryview(bytearray(nbytes))
    try:
        async with asyncio.timeout(30):
            async def send():  # in pieces with pauses: the tail is shorter than the mark
                for i in range(0, nbytes, 50_000):
                    await loop.sock_sendall(a, data[i:i + 50_000])
                    await asyncio.sleep(0.002)

            sender = asyncio.ensure_future(send())
            await bulk_lane.recv_into(loop, b, buf)
            await sender
        assert bytes(buf) == data
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # header reads wake at the first byte
        rcvbuf = b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        bulk_lane._set_lowat(b, 10 * rcvbuf)  # never past a quarter of the receive buffer (no window clamp)
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) <= rcvbuf // 4
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("reply", [
    bulk_lane.encode_frame(bulk_lane.ACK, b'{"chunks": 3}'),  # acknowledged before the END
    bulk_lane.encode_frame(bulk_lane.ACK, b"[1]"),  # not the reply's shape
    bulk_lane.encode_frame(bulk_lane.CHUNK, b""),  # not a reply
    b"\x09" + bytes(15),  # not a frame
])
async def test_a_receiver_out_of_step_breaks_the_stream(reply):
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    try:
        theirs.sendall(reply)
        conn = bulk_lane.BulkConnection(mine)
        items = iter([(chunk_header(), bulk_lane.chunk_frame(chunk_header(), np.zeros(4, np.float32)))] * 3)

        async def frames():
            return next(items, None)

        with pytest.raises(ConnectionError):
            await conn.send_stream(frames, lambda h: (("k", "v"),))
        assert conn.broken
    finally:
        mine.close()
        theirs.close()


# ------------------------------------------------------------------------------- all-reduce (sockets)


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
async def test_all_reduce_over_the_bulk_lane_is_bit_identical_to_push_chunks(algorithm):
    p, n = 4, 1_000_003  # several chunks per shard, n not divisible by p
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        claimed = [0] * p  # all-gather chunks read straight into the result (`Inbox.post`)
        for i, inbox in enumerate(peers.inboxes):
            def counting(key, n, claim=inbox.claim, i=i):
                got = claim(key, n)
                claimed[i] += got is not None and key[2] == pb.ALL_GATHER
                return got
            inbox.claim = counting
        bulk = []
        for attempt in range(2):  # the second attempt reuses the connections of the first
            bulk = await peers.run(xs, attempt=attempt, algorithm=algorithm, chunk_bytes=128 << 10)
            assert all(set(t.lanes().values()) == {"tcp"} for t in peers.transports)
        pairs = list(zip(peers.ids, peers.addresses))  # what each peer's link report names: those it sent to
        assert all(t.bulk_peers(pairs) == [q for q, a in pairs if a in t.lanes()] and not t.shm_peers(pairs)
                   for t in peers.transports)
        # Every all-gather chunk of both attempts (posted before its sender could have it).
        per_attempt = [sum(-(-(n * (k + 1) // p - n * k // p) * 4 // (128 << 10)) for k in range(p) if k != i)
                       for i in range(p)]
        assert claimed == [2 * c for c in per_attempt]
        assert all(len(t.bulk._idle.get(a, ())) == 1 for t in peers.transports for a in t.lanes())
    async with Swarmlet(p, [False] * p) as peers:
        grpc_lane = await peers.run(xs, attempt=0, algorithm=algorithm, chunk_bytes=128 << 10)
        assert all(set(t.lanes().values()) == {"socket"} for t in peers.transports)
        assert not any(t.bulk_peers(zip(peers.ids, peers.addresses)) for t in peers.transports)
    assert len({r.values.tobytes() for r in bulk + grpc_lane}) == 1
    assert all(r.digest == result_digest(r.values) for r in bulk)


async def test_the_sparse_reduce_scatter_over_sockets_gives_the_sparse_all_gather_bits():
    """"sparse_rs" over the bulk lane and over gRPC streams, "allgather" over the bulk lane, the
    same inputs and accumulators: every peer of every run holds the same bytes (the owners' sparse
    streams by shard, then the merged ranges as float32, through the data plane's real checks)."""
    from shoal.common.plan import sparse_shard_bounds
    from shoal.peer.collectives import SparseRound
    from shoal.peer.sparse import ErrorAccumulator, SparseCodec

    p, n, codec = 4, 300_001, SparseCodec("topk", 1024, 16, 2)
    xs = [np.random.default_rng(30 + i).standard_normal(n).astype(np.float32) for i in range(p)]

    def rounds():
        return [SparseRound(ErrorAccumulator(n, codec, 0.9)) for _ in range(p)]

    rs_bounds = sparse_shard_bounds(n, 1024, p)
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        rs_bulk = await peers.run(xs, attempt=0, algorithm="sparse_rs", chunk_bytes=16 << 10, sparse=rounds(),
                                  shard_bounds=rs_bounds)
        assert all(set(t.lanes().values()) == {"tcp"} for t in peers.transports)
        ag_bulk = await peers.run(xs, attempt=1, algorithm="allgather", chunk_bytes=16 << 10, sparse=rounds(),
                                  shard_bounds=(0, n), shard_owner=(0,))
    async with Swarmlet(p, [False] * p) as peers:
        rs_grpc = await peers.run(xs, attempt=0, algorithm="sparse_rs", chunk_bytes=16 << 10, sparse=rounds(),
                                  shard_bounds=rs_bounds)
        assert all(set(t.lanes().values()) == {"socket"} for t in peers.transports)
    assert len({r.values.tobytes() for r in rs_bulk + ag_bulk + rs_grpc}) == 1
    assert len({r.digest for r in rs_bulk + ag_bulk + rs_grpc}) == 1


async def test_a_pool_of_connections_per_peer_gives_the_same_bits(algorithm="butterfly"):
    """Every stream striped over 4 connections per peer pair (peer.lanes.pool): chunks arrive in
    any order across them, the inboxes place them by key, the result is bit-identical to one
    connection's, and every connection comes back for the next attempt."""
    p, n = 4, 300_001
    xs = [np.random.default_rng(20 + i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        one = await peers.run(xs, attempt=0, algorithm=algorithm, chunk_bytes=16 << 10)
        for t in peers.transports:
            for a in t.lanes():
                t.bulk._pool[a] = 4  # as a long lossy path would make `next_pool_size` choose
        sent = []
        for t in peers.transports:  # count the streams each transport opens
            orig = t.bulk_pool

            async def counting(address, peer_id="", orig=orig):
                conns = await orig(address, peer_id)
                sent.append(len(conns))
                return conns
            t.bulk_pool = counting
        pooled = await peers.run(xs, attempt=1, algorithm=algorithm, chunk_bytes=16 << 10)
        assert sent and set(sent) == {4}
        assert all(len(t.bulk._idle.get(a, ())) == 4 for t in peers.transports for a in t.lanes())
        assert all(t.bulk.paths[a].rtt_seconds < 0.05 for t in peers.transports for a in t.lanes())
        if want := pool.send_buffer_bytes():  # every sender's buffer set past autotuning's maximum
            bufs = {c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                    for t in peers.transports for a in t.lanes() for c in t.bulk._idle[a]}
            assert bufs == {2 * want}
    assert len({r.values.tobytes() for r in one + pooled}) == 1


async def test_a_pool_sized_at_the_handshake_is_open_before_the_first_stream():
    """A sender told an uplink far past what one loopback connection carries sizes each peer's
    pool at its first handshake (peer.lanes.pool.initial_pool_size) and opens all of it in the
    warm-up before a round (`Transport.probe_lanes`): its first streams go out on the whole pool,
    on connections opened before them, and the result is the same bits. A sender not told one
    keeps one connection on loopback (a LAN)."""
    p, n = 3, 300_001
    xs = [np.random.default_rng(40 + i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        pairs = list(zip(peers.ids, peers.addresses))
        t, lan = peers.transports[0], peers.transports[1]
        t.bulk.link_bytes_per_s, t.bulk.max_connections = 1e15, 4
        await t.probe_lanes(pairs[1:])
        await lan.probe_lanes([pairs[0], pairs[2]])
        warmed = {a: set(map(id, t.bulk._idle[a])) for a in peers.addresses[1:]}
        assert all(len(ids) == 4 and t.bulk.pool_size(a) == 4 for a, ids in warmed.items())
        assert all(len(lan.bulk._idle[a]) == 1 and lan.bulk.pool_size(a) == 1 for a in (pairs[0][1], pairs[2][1]))
        assert t.lanes() == {a: "tcp" for a in peers.addresses[1:]}
        streams = []
        orig = t.bulk_pool

        async def counting(address, peer_id=""):
            conns = await orig(address, peer_id)
            streams.append((address, {id(c) for c in conns}))
            return conns
        t.bulk_pool = counting
        pooled = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10)
        assert sorted(a for a, _ in streams) == sorted(peers.addresses[1:])
        assert all(ids == warmed[a] for a, ids in streams)  # the warmed pool, nothing opened in the round
        assert all(len(t.bulk._idle[a]) == 4 for a in peers.addresses[1:])  # back for the next round
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        one = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10)
    assert len({r.values.tobytes() for r in pooled + one}) == 1


async def test_idle_connections_are_reused_only_while_open_and_warmed_before_rounds():
    p, n = 3, 100_003
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        t, to_1 = peers.transports[0], peers.addresses[1]
        await t.probe_lanes(list(zip(peers.ids, peers.addresses))[1:])  # what the agent does before Ready
        # Connected, and the lane chosen for the next stream: reported as a bulk peer already.
        assert t.bulk.has_idle(to_1) and t.lanes() == {a: "tcp" for a in peers.addresses[1:]}
        assert t.bulk_peers(zip(peers.ids, peers.addresses)) == peers.ids[1:]
        first = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10)
        idle = t.bulk._idle[to_1][0]
        assert idle.alive()
        for task in list(peers.services[1].bulk._tasks):  # the receiver drops its idle connections
            if task.get_coro().__qualname__.endswith("_serve"):
                task.cancel()
        await asyncio.sleep(0.1)
        assert not idle.alive()
        again = await peers.run(xs, attempt=1, algorithm="butterfly", chunk_bytes=16 << 10)
        assert t.lanes()[to_1] == "tcp" and t.bulk._idle[to_1][0] is not idle
    assert first[0].values.tobytes() == again[0].values.tobytes()


async def test_a_peer_without_a_bulk_listener_is_pushed_to_and_the_result_is_the_same():
    p, n = 3, 200_003
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True, True, False]) as peers:
        mixed = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
        lanes = [t.lanes() for t in peers.transports]
    assert lanes[0][peers.addresses[2]] == lanes[1][peers.addresses[2]] == "socket"  # it advertises no port
    assert lanes[0][peers.addresses[1]] == "tcp" and set(lanes[2].values()) == {"socket"}
    async with Swarmlet(p, [False] * p) as peers:
        plain = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
    assert mixed[0].values.tobytes() == plain[0].values.tobytes()


async def test_a_refused_bulk_stream_fails_the_attempt_cleanly():
    # Tickets signed by a key the receivers do not trust: every stream is refused at its HELLO
    # (PERMISSION_DENIED), every peer raises CollectiveError, no value reaches an inbox.
    p, n = 3, 50_000
    xs = [np.ones(n, np.float32)] * p
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        peers.coordinator_key = Ed25519PrivateKey.generate()
        out = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10,
                              return_exceptions=True, chunk_timeout=10.0)
        assert all(isinstance(e, CollectiveError) for e in out), out
        assert any("PERMISSION_DENIED" in str(e) for e in out), out
        lanes = [set(t.lanes().values()) for t in peers.transports]
        assert all(lane <= {"tcp"} for lane in lanes) and any(lanes), lanes  # refused, not fallen back
        assert all(inbox._bytes == 0 for inbox in peers.inboxes)


# ------------------------------------------------------------------------------- admission (sockets)


def _session(peers: Swarmlet, chunk_elems: int = 16) -> Session:
    pub_key = peers.coordinator_key

    def check(ticket: bytes, sender: str) -> None:
        from shoal.common.identity import public_bytes

        verify_ticket(public_bytes(pub_key), ticket, round=0, attempt=0, sender=sender)

    return Session(0, 0, frozenset(peers.ids), pb.FLOAT32, check, (0, 16, 32), chunk_elems, 30.0)


async def _send(port: int, key, chunks, *, sign=None, method: str = bulk_lane.BULK_METHOD) -> int:
    """One bulk stream of (header, payload) pairs signed by `key` (or the given metadata)."""
    conn = await bulk_lane.BulkConnection.open("127.0.0.1", port)
    items = iter(chunks)

    async def frames():
        item = next(items, None)
        return None if item is None else (item[0], bulk_lane.chunk_frame(*item))

    try:
        return await conn.send_stream(frames, sign or (lambda h: sign_metadata(key, method, h)))
    finally:
        conn.close()


def _ticket(peers: Swarmlet, key=None) -> bytes:
    return issue_ticket(key or peers.coordinator_key, 0, 0, peers.ids, bytes(32), 60.0)


async def test_the_bulk_lane_admits_exactly_what_push_chunks_admits():
    async with Swarmlet(2, [False, False], tcp=[True, False]) as peers:
        inbox, port = peers.inboxes[0], peers.services[0].bulk.port
        inbox.start(_session(peers))
        me, key = peers.ids[1], peers.keys[1]
        vals = np.arange(4, dtype=np.float32)
        t = _ticket(peers)
        stranger = Ed25519PrivateKey.generate()
        refusals = {
            "UNAUTHENTICATED": [  # signed by another key; signed for PushChunks, not the bulk lane
                dict(chunks=[(chunk_header(me, ticket=t), vals)], key=stranger),
                dict(chunks=[(chunk_header(me, ticket=t), vals)], key=key, method="/shoal.v1.Peer/PushChunks")],
            "PERMISSION_DENIED": [  # no ticket; a ticket the sender signed itself
                dict(chunks=[(chunk_header(me), vals)], key=key),
                dict(chunks=[(chunk_header(me, ticket=_ticket(peers, stranger)), vals)], key=key)],
            "INVALID_ARGUMENT": [  # dtype, past the shard, 2-D, payload length, a bad second chunk
                dict(chunks=[(chunk_header(me, ticket=t, dtype=pb.FLOAT16, count=8), vals)], key=key),
                dict(chunks=[(chunk_header(me, ticket=t, offset=14), vals)], key=key),
                dict(chunks=[(pb.Chunk(round=0, sender=me, dtype=pb.FLOAT32, shape=[2, 2], ticket=t), vals)], key=key),
                dict(chunks=[(chunk_header(me, ticket=t, count=3), vals)], key=key),
                dict(chunks=[(chunk_header(me, ticket=t), vals), (chunk_header(me, offset=4, dtype=pb.FLOAT16, count=8), vals)],
                     key=key)],
        }
        for code, cases in refusals.items():
            for case in cases:
                with pytest.raises(bulk_lane.BulkRefused) as refused:
                    await _send(port, case.pop("key"), case.pop("chunks"), **case)
                assert refused.value.code == code, refused.value
        # Only the valid first chunk of the last stream got in; nothing of a refused chunk did.
        assert inbox._bytes == 16
        assert np.array_equal(await inbox.get((0, 0, pb.REDUCE_SCATTER, 0, 0, 0, me), 1.0), vals)
        assert inbox._bytes == 0
        # A valid stream is acknowledged; the same signed HELLO replayed is refused.
        md = sign_metadata(key, bulk_lane.BULK_METHOD, chunk_header(me, ticket=t, offset=8))
        assert await _send(port, key, [(chunk_header(me, ticket=t, offset=8), vals)], sign=lambda h: md) == 1
        with pytest.raises(bulk_lane.BulkRefused, match="replayed"):
            await _send(port, key, [(chunk_header(me, ticket=t, offset=8), vals)], sign=lambda h: md)
        # A payload larger than the plan's chunks is refused before it is read.
        big = np.zeros(17 * 2, np.float32)
        with pytest.raises(bulk_lane.BulkRefused, match="at most"):
            await _send(port, key, [(chunk_header(me, ticket=t, offset=12), vals), (chunk_header(me, count=34), big)])


async def test_a_connection_killed_mid_stream_fails_the_waits_on_its_sender_at_once():
    async with Swarmlet(2, [False, False], tcp=[True, False]) as peers:
        inbox, port = peers.inboxes[0], peers.services[0].bulk.port
        inbox.start(_session(peers))
        me, key = peers.ids[1], peers.keys[1]
        first = chunk_header(me, ticket=_ticket(peers))
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        await loop.sock_sendall(sock, bulk_lane.hello_frame(sign_metadata(key, bulk_lane.BULK_METHOD, first)))
        await loop.sock_sendall(sock, bulk_lane.chunk_frame(first, np.ones(4, np.float32)))
        second = bulk_lane.chunk_frame(chunk_header(me, offset=4), np.ones(4, np.float32))
        await loop.sock_sendall(sock, second[:-5])  # the connection dies inside the second payload
        assert np.array_equal(await inbox.get((0, 0, pb.REDUCE_SCATTER, 0, 0, 0, me), 10.0), np.ones(4))
        sock.close()
        with pytest.raises(SenderGone, match="broke"):  # not the 20 s chunk timeout: the break itself
            await inbox.get((0, 0, pb.REDUCE_SCATTER, 0, 0, 4, me), 20.0)
        assert inbox._bytes == 0


async def test_a_receiver_that_goes_away_mid_stream_fails_the_senders_attempt():
    # Peer 2's data plane takes the first chunk of both bulk streams and then stalls; its bulk
    # listener then closes every connection: the senders' streams break mid-transfer and their
    # attempts fail blaming peer 2 (as when a PushChunks stream is killed), not at a timeout.
    p, n = 3, 2_000_000
    xs = [np.ones(n, np.float32)] * p
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        entered: list[str] = []

        async def stall(first, *args, **kw):
            entered.append(first.sender)
            await asyncio.Event().wait()

        peers.services[2]._receive = stall

        async def kill_when_entered():
            while len(entered) < 2:  # both senders' streams are open and stalled
                await asyncio.sleep(0.01)
            peers.services[2].bulk.close()

        killer = asyncio.ensure_future(kill_when_entered())
        out = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10,
                              return_exceptions=True, silent=(2,), chunk_timeout=60.0)
        await killer
        assert all(isinstance(r, CollectiveError) and "deadline" not in str(r) for r in out[:2]), out
        # Each sender's stream to peer 2 broke; one that failed first may make the other fail
        # on its broken stream from that one (as with PushChunks).
        assert any(peers.ids[2] in r.suspects and "bulk lane broke" in str(r) for r in out[:2]), out


async def test_an_advertised_port_that_refuses_falls_back_to_push_chunks():
    p, n = 3, 100_003
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        bulk = peers.services[2].bulk
        listener_port = bulk.port
        bulk.close()  # Probe still advertises the port; connecting to it is refused
        assert peers.services[2].bulk.port == listener_port
        out = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10)
        assert peers.transports[0].lanes()[peers.addresses[2]] == "socket"
        assert peers.transports[0].lanes()[peers.addresses[1]] == "tcp"
    assert len({r.values.tobytes() for r in out}) == 1


async def test_a_receiver_restarted_on_a_new_bulk_port_is_sent_to_there_not_over_push_chunks():
    # The sender caches each address's bulk port. A peer that restarts at the same address
    # listens on a new ephemeral port: the cached port is refused, and the sender must ask the
    # new one at once rather than fall back to PushChunks for DOWN_SECONDS (300 s).
    p, n = 3, 100_003
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    async with Swarmlet(p, [False] * p, tcp=[True] * p) as peers:
        first = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=16 << 10)
        t, to_2 = peers.transports[0], peers.addresses[2]
        assert t.lanes()[to_2] == "tcp"
        service = peers.services[2]
        old_port = service.bulk.port
        service.bulk.close()  # the restart: the old port refuses, a new listener takes another one
        service.bulk = bulk_lane.BulkServer(service)
        await service.bulk.start("127.0.0.1")
        assert service.bulk.port != old_port
        await asyncio.sleep(0.1)  # the receiver's end of the idle connections is closed
        again = await peers.run(xs, attempt=1, algorithm="butterfly", chunk_bytes=16 << 10)
        assert t.lanes()[to_2] == "tcp" and peers.transports[1].lanes()[to_2] == "tcp"
        assert not t.bulk._down  # nothing was marked down: the new port answered
    assert first[0].values.tobytes() == again[0].values.tobytes()
    assert len({r.values.tobytes() for r in again}) == 1


# ------------------------------------------------------------------------------- TLS (sockets)


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority.from_dir(init_certs(tmp_path_factory.mktemp("tls")).dir, lifetime_s=3600)


def _issued(ca: CertificateAuthority, peer_id: str) -> PeerTLS:
    tls = PeerTLS(peer_id)
    issued = ca.issue(peer_id, tls.csr())
    tls.install(issued.certificate, issued.ca)
    return tls


async def _tls_receiver(peers: Swarmlet, tls: PeerTLS) -> tuple[Inbox, bulk_lane.BulkServer]:
    """Peer 0's bulk listener over mutual TLS with `tls`, its service checking client
    certificates against signers (as `serve_data_plane` sets it up with an issued certificate)."""
    inbox = Inbox()
    service = PeerService(inbox, coordinator_public_key=public_bytes(peers.coordinator_key), shared_memory=False,
                          key=peers.keys[0])
    service.tls_identity = True
    bulk = bulk_lane.BulkServer(service, tls)
    await bulk.start("127.0.0.1")
    inbox.start(_session(peers))
    return inbox, bulk


async def _send_tls(port: int, tls: PeerTLS | None, to: str, key, chunks) -> int:
    conn = await bulk_lane.BulkConnection.open("127.0.0.1", port, tls, to)
    items = iter(chunks)

    async def frames():
        item = next(items, None)
        return None if item is None else (item[0], bulk_lane.chunk_frame(*item))

    try:
        return await conn.send_stream(frames, lambda h: sign_metadata(key, bulk_lane.BULK_METHOD, h))
    finally:
        conn.close()


async def test_the_tls_bulk_lane_binds_the_certificate_to_the_signer_of_the_stream(ca, tmp_path, caplog):
    # Peers 0 (receiver) and 1 are participants; 2 is a member with a valid certificate from the
    # same CA but no part in the round. Every connection below is a real TLS 1.3 handshake.
    async with Swarmlet(3, [False] * 3) as peers:
        tls = [_issued(ca, pid) for pid in peers.ids]
        receiver, third, third_key = peers.ids[0], peers.ids[2], peers.keys[2]
        peers.ids = peers.ids[:2]  # the round's participants: the ticket and the session name 0 and 1
        inbox, bulk = await _tls_receiver(peers, tls[0])
        me, key, t = peers.ids[1], peers.keys[1], _ticket(peers)
        vals = np.arange(4, dtype=np.float32)
        try:
            assert await _send_tls(bulk.port, tls[1], receiver, key, [(chunk_header(me, ticket=t), vals)]) == 1
            assert np.array_equal(await inbox.get((0, 0, pb.REDUCE_SCATTER, 0, 0, 0, me), 1.0), vals)
            # Peer 2's own certificate carrying peer 1's signed stream and ticket (a stolen
            # identity key, or a HELLO copied off another connection): refused by the certificate.
            with pytest.raises(bulk_lane.BulkRefused, match="certificate is for peer") as refused:
                await _send_tls(bulk.port, tls[2], receiver, key, [(chunk_header(me, ticket=t, offset=4), vals)])
            assert refused.value.code == "UNAUTHENTICATED"
            # Peer 2 signing as itself with the round's ticket: not a participant.
            with pytest.raises(bulk_lane.BulkRefused) as refused:
                await _send_tls(bulk.port, tls[2], receiver, third_key, [(chunk_header(third, ticket=t, offset=4), vals)])
            assert refused.value.code == "PERMISSION_DENIED"
            # A certificate for peer 1 from another CA (its holder trusts both CAs, so it takes the
            # receiver's): the receiver refuses the handshake and says why; the sender's first
            # read fails (TLS 1.3: the client's certificate is judged after its handshake ended).
            other = PeerTLS(me)
            issued = CertificateAuthority.from_dir(init_certs(tmp_path / "other").dir, lifetime_s=3600).issue(me, other.csr())
            other.install(issued.certificate, issued.ca + ca.issue(me, other.csr()).ca)
            caplog.clear()
            with pytest.raises(ssl.SSLError, match="(?i)alert|EOF"):
                await _send_tls(bulk.port, other, receiver, key, [(chunk_header(me, ticket=t, offset=4), vals)])
            assert any("TLS handshake refused" in r.getMessage() and "certificate verify failed" in r.getMessage()
                       for r in caplog.records), caplog.text
            # A plaintext sender on a TLS listener: never read as a stream.
            with pytest.raises((ConnectionError, OSError)):
                await _send_tls(bulk.port, None, receiver, key, [(chunk_header(me, ticket=t, offset=4), vals)])
            # The receiver is verified by the peer id the plan names: dialled as peer 2, refused.
            with pytest.raises(ssl.SSLCertVerificationError, match="(?i)hostname"):
                await bulk_lane.BulkConnection.open("127.0.0.1", bulk.port, tls[1], third)
            assert inbox._bytes == 0
        finally:
            bulk.close()


async def test_a_tls_data_plane_serves_and_takes_the_bulk_lane_only_over_tls(ca, tmp_path):
    volunteer = tmp_path / "volunteer"  # a peer's TLS directory: ca.pem only
    volunteer.mkdir()
    (volunteer / "ca.pem").write_bytes(ca.ca_pem)
    security = Security(tls_dir=str(volunteer))
    key_a, key_b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    a_id, b_id = peer_id_of(public_bytes(key_a)), peer_id_of(public_bytes(key_b))
    tls_a, tls_b = _issued(ca, a_id), _issued(ca, b_id)
    service = PeerService(Inbox(), key=key_a)
    server, bound = await serve_data_plane(service, "127.0.0.1:0", security, peer_tls=tls_a, tcp_lane=True)
    t = Transport(security, key_b, shared_memory=False, peer_tls=tls_b, tcp_lane=True)
    legacy = Transport(security, key_b, shared_memory=False, peer_tls=None, tcp_lane=True)
    try:
        assert service.bulk is not None and service.bulk.tls is tls_a and service.tls_identity
        conn = await t.bulk_lane(bound, a_id)
        assert conn is not None and conn.tls and t.lanes() == {bound: "tcp-tls"}
        t.give_back_bulk(bound, conn)
        await asyncio.sleep(0.05)
        assert conn.alive()  # idle TLS connection: nothing arrives unasked (no session tickets)
        # A renewal: the idle connection (older certificate) is not reused, as gRPC channels are not.
        again = ca.issue(b_id, tls_b.csr())
        tls_b.install(again.certificate, again.ca)
        conn2 = await t.bulk_lane(bound, a_id)
        assert conn2 is not None and conn2 is not conn and conn2.generation == tls_b.generation
        conn2.close()
        # TLS without an issued certificate (a legacy shared peer.key): no bulk lane, never plaintext.
        assert legacy.bulk is None and await legacy.bulk_lane(bound, a_id) is None
        assert legacy.lanes() == {bound: "socket"}
    finally:
        await t.close()
        await legacy.close()
        await server.stop(grace=None)
        service.close()


# ------------------------------------------------------------------------------- real processes


async def test_large_payloads_are_read_into_pooled_buffers_reused_once_consumed():
    """Bulk-lane payloads of POOLED_PAYLOAD_BYTES and more are read into pooled buffers (no page
    faults per chunk): the same bytes arrive, a buffer a consumer still refers to is never reused,
    a consumed one is; small payloads take fresh buffers (not pooled)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    n = bulk_lane.POOLED_PAYLOAD_BYTES + 4096
    sent = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i in range(3)]
    try:
        async def send_all():
            for x in sent:
                await loop.sock_sendall(a, x.tobytes())
            await loop.sock_sendall(a, b"\x07" * 100)

        sender = asyncio.ensure_future(send_all())
        first = await asyncio.wait_for(bulk_lane.recv_payload(loop, b, n), 10)
        where = np.frombuffer(first, np.uint8).__array_interface__["data"][0]
        held = np.frombuffer(first, np.uint8)[5:9]  # a consumer's view keeps the buffer
        del first
        second = await asyncio.wait_for(bulk_lane.recv_payload(loop, b, n), 10)
        other = np.frombuffer(second, np.uint8).__array_interface__["data"][0]
        assert other != where
        assert bytes(second) == sent[1].tobytes() and bytes(held) == sent[0].tobytes()[5:9]
        del held, second
        third = await asyncio.wait_for(bulk_lane.recv_payload(loop, b, n), 10)
        assert np.frombuffer(third, np.uint8).__array_interface__["data"][0] in (where, other)  # reused
        assert bytes(third) == sent[2].tobytes()
        assert sum(len(e.mm) == n for e in bulk_lane._payloads) == 2  # two made, the third on one of them
        small = await asyncio.wait_for(bulk_lane.recv_payload(loop, b, 100), 10)
        assert bytes(small) == b"\x07" * 100
        assert not any(len(e.mm) == 100 for e in bulk_lane._payloads)  # the small one is not pooled
        await asyncio.wait_for(sender, 10)
    finally:
        a.close()
        b.close()
