"""The coordinator's side of link measurement, without sockets: `Coordinator.Probe` (a joiner's
first estimate, members only, bounded sizes) and the link estimates with their age in GetStatus
and `shoal status`."""

from __future__ import annotations

import grpc
import pytest

from shoal.common.identity import MD_PUBKEY, peer_id_of
from shoal.coordinator.server import PROBE_MAX_BYTES
from shoal.cli.status import render_table
from shoal.v1 import shoal_pb2 as pb

from kits.service import service


class Aborted(Exception):
    pass


class Context:
    """What the handlers read of a grpc.aio.ServicerContext: the caller's signed key, and abort."""

    def __init__(self, pub: bytes):
        self.pub = pub
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self):
        return ((MD_PUBKEY, self.pub.hex()),)

    async def abort(self, code, details):
        self.code = code
        raise Aborted(details)


async def test_probe_answers_members_only_within_bounds():
    svc = service(clock=[0.0])
    member, stranger = bytes([1]) * 32, bytes([2]) * 32
    svc.apply(svc.engine.join(peer_id_of(member), member, "10.0.0.1:1", 1, 0.0))
    resp = await svc.Probe(pb.ProbeRequest(reply_bytes=1000), Context(member))
    assert resp.payload == bytes(1000)
    assert (await svc.Probe(pb.ProbeRequest(payload=bytes(PROBE_MAX_BYTES)), Context(member))).payload == b""
    for request, who, code in ((pb.ProbeRequest(reply_bytes=10), stranger, grpc.StatusCode.NOT_FOUND),
                               (pb.ProbeRequest(reply_bytes=PROBE_MAX_BYTES + 1), member,
                                grpc.StatusCode.INVALID_ARGUMENT),
                               (pb.ProbeRequest(payload=bytes(PROBE_MAX_BYTES + 1)), member,
                                grpc.StatusCode.INVALID_ARGUMENT)):
        ctx = Context(who)
        with pytest.raises(Aborted):
            await svc.Probe(request, ctx)
        assert ctx.code == code


async def test_status_shows_each_members_estimates_and_their_age():
    now = [10.0]
    svc = service(clock=now)
    for i, p in enumerate("ab"):
        svc.apply(svc.engine.join(p, bytes([i + 1]) * 32, f"10.0.0.{i}:1", 1, 0.0))
    svc.engine.report_links("a", 2.5e6, 1.25e6, 0.02, now=4.0)
    resp = await svc.GetStatus(pb.StatusRequest(), None)
    a, b = resp.members
    assert (a.up_bytes_per_s, a.down_bytes_per_s, a.links_age_seconds) == (2.5e6, 1.25e6, 6.0)
    assert b.links_age_seconds < 0  # never reported
    table = render_table({"coordinator": "c", "epoch": 0, "round": 0, "rounds_committed": 0, "rounds_aborted": 0,
                          "run_config": {}, "waiting": {},
                          "members": [{"peer_id": "a" * 12, "address": "x", "state": "member", "untrusted": False,
                                       "lease_remaining_seconds": 1.0, "num_samples": 1, "shm_peers": 0,
                                       "links": {"up_bytes_per_s": 2.5e6, "down_bytes_per_s": 1.25e6,
                                                 "rtt_seconds": 0.02, "age_seconds": 6.0}}],
                          "rounds": []})
    assert "links age" in table and "6s" in table and "2.5 MB/s" in table
