"""The bulk lane's frames (peer/lanes/bulk.py), without sockets: the chunk frame codec, hello and
header checks, posted receive places, result-buffer reuse, and a cancelled wait. Over real
sockets: tests/component/test_tcp_lane.py.
"""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.peer.lanes import bulk as bulk_lane
from shoal.peer.dataplane import Inbox, Session, Transport
from shoal.v1 import shoal_pb2 as pb
from kits.chunks import ALICE, chunk_header



# ------------------------------------------------------------------------------- codec (pure)


def test_chunk_frame_round_trips_header_and_payload():
    values = np.arange(5, dtype=np.float32)
    header = chunk_header(count=5, step=2, ticket=b"t" * 40)
    frame = bulk_lane.chunk_frame(header, values)
    kind, meta_len, payload_len = bulk_lane.decode_header(frame[:bulk_lane.HEADER.size])
    assert (kind, payload_len) == (bulk_lane.CHUNK, 20) and len(frame) == bulk_lane.HEADER.size + meta_len + 20
    c, body = bulk_lane.split_chunk_frame(frame)
    assert c == header and np.array_equal(np.frombuffer(body, np.float32), values)
    values[0] = 99  # the frame holds a copy: later writes to the source never reach the wire
    assert np.frombuffer(bulk_lane.split_chunk_frame(frame)[1], np.float32)[0] == 0


def test_a_chunk_frame_is_the_same_bytes_without_copying_the_payload():
    values = np.arange(5, dtype=np.float32)
    header = chunk_header(count=5, step=1)
    frame = bulk_lane.ChunkFrame(header, values)
    assert bytes(frame.joined()) == bytes(bulk_lane.chunk_frame(header, values)) and len(frame) == len(frame.joined())
    values[0] = 99  # a view: the caller must not write before the frame left (peer.collectives)
    assert np.frombuffer(frame.payload, np.float32)[0] == 99


def test_a_posted_place_is_handed_out_once_and_only_for_its_size_and_attempt():
    inbox = Inbox()
    inbox.start(Session(0, 1, frozenset({ALICE}), pb.FLOAT32))
    dest = np.zeros(4, np.float32)
    key = (0, 1, pb.ALL_GATHER, 0, 0, 0, ALICE)
    inbox.post(key, dest)
    inbox.post((0, 0, pb.ALL_GATHER, 0, 0, 0, ALICE), np.zeros(4, np.float32))  # an older attempt: ignored
    assert inbox.claim((0, 0, pb.ALL_GATHER, 0, 0, 0, ALICE), 16) is None
    assert inbox.claim(key, 12) is None and inbox.claim(key, 16) is None  # a wrong size uses it up
    inbox.post(key, dest)
    view = inbox.claim(key, 16)
    assert view is not None and view.nbytes == 16 and inbox.claim(key, 16) is None  # once
    view[:4] = b"\x00\x00\x80\x3f"
    assert dest[0] == 1.0
    inbox.post(key, dest)
    inbox.finish(0, 1)
    assert inbox.claim(key, 16) is None


def test_frame_headers_refuse_unknown_kinds_and_oversized_meta():
    with pytest.raises(InvalidArgument, match="kind 9"):
        bulk_lane.decode_header(struct.pack("<B3xIQ", 9, 0, 0))
    with pytest.raises(InvalidArgument, match="header"):
        bulk_lane.decode_header(struct.pack("<B3xIQ", bulk_lane.CHUNK, bulk_lane.MAX_META_BYTES + 1, 0))
    with pytest.raises(InvalidArgument, match="whole CHUNK"):
        bulk_lane.split_chunk_frame(bulk_lane.chunk_frame(chunk_header(), np.zeros(4, np.float32))[:-1])


def test_hello_carries_the_signature_pairs_and_garbage_is_refused():
    md = (("x-shoal-pubkey", "ab"), ("x-shoal-ts", "1"))
    frame = bulk_lane.hello_frame(md)
    kind, meta_len, payload_len = bulk_lane.decode_header(frame[:bulk_lane.HEADER.size])
    assert (kind, payload_len) == (bulk_lane.HELLO, 0)
    assert bulk_lane.parse_hello(frame[bulk_lane.HEADER.size:]) == md
    for bad in (b"{", b"[1]", b"7"):
        with pytest.raises(InvalidArgument, match="HELLO"):
            bulk_lane.parse_hello(bad)


def test_a_chunk_header_must_not_carry_its_bytes():
    with pytest.raises(InvalidArgument, match="follow"):
        bulk_lane.parse_chunk_header(chunk_header(data=b"\0" * 16).SerializeToString())
    with pytest.raises(InvalidArgument, match="decode"):
        bulk_lane.parse_chunk_header(b"\xff\xff\xff")


def test_check_chunk_holds_a_bulk_payload_to_the_plans_checks():
    s = Session(0, 0, frozenset({ALICE}), pb.FLOAT32, None, (0, 16), 16)
    body = memoryview(np.arange(4, dtype=np.float32)).cast("B")
    assert np.array_equal(s.check_chunk(chunk_header(), None, body), np.arange(4, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="data"):
        s.check_chunk(chunk_header(count=5), None, body)  # 16 bytes for 5 elements
    with pytest.raises(InvalidArgument, match="dtype"):
        s.check_chunk(chunk_header(dtype=pb.FLOAT16, count=8), None, body)
    with pytest.raises(InvalidArgument, match="shape"):
        s.check_chunk(chunk_header(offset=14), None, body)  # past the shard's 16 elements
    with pytest.raises(InvalidArgument, match="data"):
        s.check_chunk(chunk_header(data=bytes(16)), None, body)  # bytes inline and behind the header
    assert bulk_lane.max_payload(s) == 16 * 8


# ------------------------------------------------------------------------------- real processes


def test_a_result_buffer_is_reused_only_once_no_view_of_it_is_alive():
    t = Transport()
    a = t.take_buffer(1000, np.float32)
    first = a.__array_interface__["data"][0]
    view = memoryview(a[10:20]).cast("B")  # e.g. a place the inbox handed to a lane
    del a
    b = t.take_buffer(1000, np.float32)  # the first is still referred to: a new one
    assert b.__array_interface__["data"][0] != first
    del view
    assert t.take_buffer(1000, np.float32).__array_interface__["data"][0] == first  # free now: reused
    assert t.take_buffer(1000, np.float16).dtype == np.float16  # another size: its own buffer


async def test_a_cancelled_stream_cancels_its_wait_for_the_next_frame():
    # An aborted attempt cancels its streams while one waits for its next frame: that wait (a task
    # of its own) was left pending and logged "Task was destroyed but it is pending!" at ERROR.
    started = asyncio.Event()

    async def frames():
        started.set()
        await asyncio.Event().wait()  # no next frame (the collective waits on a peer)

    reply = asyncio.get_running_loop().create_future()  # the receiver has not answered
    waiting = asyncio.ensure_future(bulk_lane.BulkConnection._next(frames, reply))
    await asyncio.wait_for(started.wait(), 5)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
