"""Link measurement (pure LinkMeter arithmetic, probes over real gRPC) and the zero-copy chunk wire path."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from peer.dataplane import Inbox, PeerService, Transport, add_peer_service, channel_options
from peer.errors import InvalidArgument
from peer.links import LinkMeter, probe_missing
from peer.tensors import ChunkOut, decode_chunk, parse_chunk, serialize_chunk
from shoal.v1 import shoal_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_probe_sets_capacity_and_passive_only_raises_it():
    clock = Clock()
    m = LinkMeter(alpha=0.5, probe_interval=60.0, clock=clock)
    assert m.needs_probe("b")
    m.observe_probe("b", rtt=0.01, up=100.0e6, down=50.0e6)
    assert not m.needs_probe("b")
    # A slow passive stream (shared upload, waiting for others) is a lower bound: no change.
    m.observe_send("b", 10_000_000, 1.0)
    (v,) = m.links()
    assert v.up_bytes_per_s == 100.0e6 and v.down_bytes_per_s == 50.0e6 and v.rtt_seconds == 0.01
    # A faster real transfer raises the estimate.
    m.observe_receive("b", 80_000_000, 1.0)
    assert m.links()[0].down_bytes_per_s == 80.0e6
    clock.t = 61.0
    assert m.needs_probe("b")  # probes are refreshed: only they can lower an estimate


def test_aggregate_is_the_fastest_path_and_tiny_samples_are_ignored():
    m = LinkMeter()
    m.observe_probe("b", rtt=0.02, up=10e6, down=30e6)
    m.observe_probe("c", rtt=0.04, up=20e6, down=5e6)
    m.observe_send("d", 100, 1.0)  # too few bytes to say anything
    m.observe_collective(sent=50_000_000, received=10_000_000, seconds=1.0)
    up, down, rtt = m.aggregate()
    assert up == 50e6 and down == 30e6 and rtt == pytest.approx(0.03)
    rep = m.report("me")
    assert rep.peer_id == "me" and rep.up_bytes_per_s == 50e6
    assert [l.peer_id for l in rep.links] == ["b", "c"]


def test_chunk_wire_format_roundtrip_without_protobuf_copies():
    x = np.arange(1001, dtype=np.float32)
    meta = pb.Chunk(round=3, attempt=1, sender="ab", phase=pb.ALL_GATHER, step=2, shard=1, offset=77, dtype=pb.FLOAT32,
                    shape=[1001], ticket=b"t")
    wire = serialize_chunk(ChunkOut(meta, x[::1]))
    ref = pb.Chunk()
    ref.CopyFrom(meta)
    ref.data = x.tobytes()
    assert pb.Chunk.FromString(wire) == ref  # same message as protobuf would build
    for raw in (wire, ref.SerializeToString()):
        view = parse_chunk(raw)
        assert view.round == 3 and view.offset == 77 and view.ticket == b"t" and list(view.shape) == [1001]
        np.testing.assert_array_equal(decode_chunk(view.data, view.dtype, 1001), x)
    assert serialize_chunk(ref) == ref.SerializeToString()
    with pytest.raises(InvalidArgument):
        parse_chunk(wire[:-10])  # truncated payload


async def test_probes_measure_a_real_peer_and_fill_the_report():
    server = grpc.aio.server(options=channel_options())
    add_peer_service(PeerService(Inbox()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    transport = Transport()
    try:
        m = LinkMeter()
        peers = [("me", "127.0.0.1:1"), ("other", f"127.0.0.1:{port}")]
        assert await probe_missing(m, transport, peers, "me", nbytes=256 * 1024) == 1
        (v,) = m.links()
        assert v.peer_id == "other" and v.up_bytes_per_s > 0 and v.down_bytes_per_s > 0 and v.rtt_seconds > 0
        assert await probe_missing(m, transport, peers, "me") == 0  # history now: no probe
    finally:
        await transport.close()
        await server.stop(None)
