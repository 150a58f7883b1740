"""The coordinator's servicer over a real RoundEngine and MemoryStore, without sockets: the wire
plan it sends (Plan.to_proto + ticket), GetStatus's wait reason, and the wait-reason metric."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.identity import public_bytes
from shoal.common.plan import Plan
from shoal.common.tickets import plan_digest, verify_ticket
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, WaitReason
from shoal.coordinator.server import CoordinatorService
from shoal.coordinator.store import MemoryStore
from shoal.common.reach import Reachability
from shoal.cli.status import render_table
from shoal.v1 import shoal_pb2 as pb

from kits.service import service as coordinator_service

KEYS = {p: bytes([i]) * 32 for i, p in enumerate("abc", 1)}


def service(now: list[float], **cfg) -> CoordinatorService:
    """Three peers make a round here."""
    return coordinator_service(RoundEngine(EngineConfig(**{"min_peers": 3, "ready_timeout": 5.0, **cfg})), clock=now)


async def test_plan_on_the_wire_carries_the_engine_plan_and_a_ticket():
    now = [0.0]
    svc = service(now)
    queues = {p: asyncio.Queue() for p in "abc"}
    for i, p in enumerate("abc"):
        svc.apply(svc.engine.join(p, KEYS[p], f"10.0.0.{i}:1", 1, 0.0))
        svc.watchers[p] = queues[p]
        svc.apply(svc.engine.connected(p, 0.0))
    for i, p in enumerate("abc"):
        svc.apply(svc.engine.ready(p, 0, ReadyInfo(10, pb.FLOAT32, 7 + i, b"", 0, 0.1), 0.1))
    events = [queues[p].get_nowait() for p in "abc"]
    assert all(ev == events[0] for ev in events)  # everyone gets the same plan, ticket included
    wire = events[0].plan
    assert wire.collective == "butterfly" and list(wire.shard_bounds) == [0, 3, 6, 10]
    assert [(q.peer_id, q.address, q.num_samples, q.owner, q.public_key) for q in wire.participants] == [
        (p, f"10.0.0.{i}:1", 7 + i, True, KEYS[p]) for i, p in enumerate("abc")]
    assert Plan.from_proto(wire).participants == svc.engine.running.plan.participants
    verify_ticket(public_bytes(svc.key), wire.ticket, round=0, attempt=0, sender="b", now=0.2,
                  expected_plan_digest=plan_digest(wire))


async def test_status_and_metric_say_why_the_round_does_not_open():
    now = [1.0]
    svc = service(now, min_peers=2)
    svc.apply(svc.engine.join("a", KEYS["a"], "10.0.0.1:1", 1, 0.0))
    svc.apply(svc.engine.ready("a", 0, ReadyInfo(10, pb.FLOAT32, 1, b"", 0, 0.5), 0.5))
    resp = await svc.GetStatus(pb.StatusRequest(), None)
    assert resp.waiting.reason == WaitReason.QUORUM.value
    assert resp.waiting.message == "waiting for 1 more ready peer (1/1 ready, quorum 2)"
    assert [m.state for m in resp.members] == ["pending"]
    svc.observe()
    gauge = svc.metrics.registry.get_sample_value
    assert gauge("shoal_coordinator_round_waiting", {"reason": "quorum"}) == 1.0
    assert sum(gauge("shoal_coordinator_round_waiting", {"reason": r.value}) for r in WaitReason) == 1.0
    # b says ready, c is connected but does not: quorum reached, waiting for the straggler.
    for p in "bc":
        svc.apply(svc.engine.join(p, KEYS[p], f"10.0.0.{p}:1", 1, 1.0))
        svc.apply(svc.engine.connected(p, 1.0))
    svc.apply(svc.engine.ready("b", 0, ReadyInfo(10, pb.FLOAT32, 1, b"", 0, 1.0), 1.0))
    now[0] = 2.0
    resp = await svc.GetStatus(pb.StatusRequest(), None)
    assert (resp.waiting.reason, list(resp.waiting.peers)) == ("stragglers", ["c"])
    assert resp.waiting.seconds_left == 3.5  # the first ready was at 0.5, the ready timeout is 5 s
    svc.observe()
    assert gauge("shoal_coordinator_round_waiting", {"reason": "stragglers"}) == 1.0
    assert gauge("shoal_coordinator_round_waiting", {"reason": "quorum"}) == 0.0
    table = render_table({"coordinator": "x:1", "epoch": 0, "round": 0, "rounds_committed": 0, "rounds_aborted": 0,
                          "run_config": {}, "members": [], "rounds": [],
                          "waiting": {"reason": resp.waiting.reason, "message": resp.waiting.message}})
    assert "next round: waiting up to 3.5 s for 1 straggler" in table


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, details):
        raise _Aborted(f"{code}: {details}")


async def _reconnect(svc: CoordinatorService, peer_id: str) -> None:
    """Open `peer_id`'s round-event stream, let the handler run up to its first wait, close it."""
    stream = svc.WatchRounds(pb.WatchRequest(peer_id=peer_id), _Context())
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await task
    await stream.aclose()


async def test_a_restored_member_is_dialled_back_when_its_stream_reconnects():
    # A restarted coordinator restores members from its store without their reachability (it
    # is not kept): a NATed member would be made a shard owner and break the next attempt. Its
    # stream reconnecting triggers the dial-back; unreachable -> outbound-only from the next plan.
    now = [0.0]
    svc = service(now)
    dialled = []

    async def reach(address, key):
        dialled.append(address)
        return Reachability(address != "10.0.0.2:1", "no answer within 2 s")

    svc.reach = reach
    for i, p in enumerate("abc"):
        svc.engine.join(p, KEYS[p], f"10.0.0.{i}:1", 1, 0.0)  # as restored: reachability unknown
    for p in "abc":
        await _reconnect(svc, p)
    assert dialled == ["10.0.0.0:1", "10.0.0.1:1", "10.0.0.2:1"]
    c = svc.engine.members["c"]
    assert c.reachable is False and c.outbound_only and "c" in svc.engine.unreachable
    assert svc.engine.members["a"].reachable is True and not svc.engine.members["a"].outbound_only
    # Known already: not dialled again on the next reconnect.
    await _reconnect(svc, "a")
    assert len(dialled) == 3


TIMED_OUT = Reachability(False, "no answer within 2 s", timed_out=True)


def _scripted_reach(svc: CoordinatorService, answers: dict[str, list[Reachability]]) -> list[str]:
    """Make `svc`'s dial-back answer each address with its next scripted outcome; returns the
    list the dialled addresses are appended to, in order."""
    dialled: list[str] = []

    async def reach(address, key):
        dialled.append(address)
        return answers[address].pop(0)

    svc.reach = reach
    return dialled


async def test_a_restored_member_too_busy_to_answer_once_is_dialled_again():
    # After a coordinator restart every member reconnects at once; one that does not answer the
    # dial-back in time once (busy, not NATed) was marked unreachable until it joined again
    # (seen in the compose test under load). A timed-out dial-back is made once more; a
    # refusal, or a second timeout, still makes the member outbound-only.
    now = [0.0]
    svc = service(now)
    dialled = _scripted_reach(svc, {"10.0.0.0:1": [TIMED_OUT, Reachability(True)],
                                    "10.0.0.1:1": [Reachability(False, "refused")],
                                    "10.0.0.2:1": [TIMED_OUT, TIMED_OUT]})
    for i, p in enumerate("abc"):
        svc.engine.join(p, KEYS[p], f"10.0.0.{i}:1", 1, 0.0)  # as restored: reachability unknown
    for p in "abc":
        await _reconnect(svc, p)
    assert dialled == ["10.0.0.0:1", "10.0.0.0:1", "10.0.0.1:1", "10.0.0.2:1", "10.0.0.2:1"]
    m = svc.engine.members
    assert m["a"].reachable is True and not m["a"].outbound_only
    assert m["b"].reachable is False and m["b"].outbound_only
    assert m["c"].reachable is False and m["c"].outbound_only


async def test_a_joiner_too_busy_to_answer_the_dial_back_once_is_dialled_again():
    # The join path retries as the restored-member path does (CoordinatorService._dial_back): a
    # single timed-out dial-back at join made the member outbound-only until it joined again. A
    # refusal is final at once; a second timeout makes the joiner outbound-only, told why.
    now = [0.0]
    svc = service(now)
    keys = {p: Ed25519PrivateKey.generate() for p in "abc"}
    dialled = _scripted_reach(svc, {"10.0.1.0:1": [TIMED_OUT, Reachability(True)],
                                    "10.0.1.1:1": [Reachability(False, "refused")],
                                    "10.0.1.2:1": [TIMED_OUT, TIMED_OUT]})
    resps = {p: await svc.Join(pb.JoinRequest(public_key=public_bytes(keys[p]), data_address=f"10.0.1.{i}:1"), None)
             for i, p in enumerate("abc")}
    assert dialled == ["10.0.1.0:1", "10.0.1.0:1", "10.0.1.1:1", "10.0.1.2:1", "10.0.1.2:1"]
    m = {p: svc.engine.members[resps[p].peer_id] for p in "abc"}
    assert m["a"].reachable is True and not m["a"].outbound_only and resps["a"].unreachable == ""
    assert m["b"].reachable is False and m["b"].outbound_only and resps["b"].unreachable == "refused"
    assert m["c"].reachable is False and m["c"].outbound_only and "no answer" in resps["c"].unreachable


async def test_a_round_event_stream_starts_and_ends_each_burst_with_an_empty_event():
    # gRPC keeps a copy of a server stream's last message until the next one: a stream that ends
    # every burst with an empty event holds the same whether its member was ever drawn or not
    # (docs/performance.md). It opens with two (gRPC's setup for a stream's first two
    # messages, paid at connect, not at the member's first draw). Peers skip the empty events.
    from shoal.coordinator.server import EMPTY_EVENT, OPENING_EVENTS
    from shoal.peer.rounds import event_of

    now = [0.0]
    svc = service(now)
    svc.apply(svc.engine.join("a", KEYS["a"], "10.0.0.1:1", 1, 0.0))
    stream = svc.WatchRounds(pb.WatchRequest(peer_id="a"), _Context())
    try:
        async with asyncio.timeout(5):
            opening = [await anext(stream) for _ in range(OPENING_EVENTS)]
            assert OPENING_EVENTS == 2 and opening == [EMPTY_EVENT] * 2
            assert opening[0].WhichOneof("event") is None and opening[0].ByteSize() == 0
            commit = pb.RoundEvent(commit=pb.Commit(round=3, participants=["a", "b"]))
            abort = pb.RoundEvent(abort=pb.Abort(round=4, reason="x"))
            refs = sys.getrefcount(commit), sys.getrefcount(abort)
            svc._send("a", commit)
            svc._send("a", abort)  # a burst: one empty event after both, not after each
            got = [await anext(stream) for _ in range(3)]
            assert got == [commit, abort, EMPTY_EVENT]
            del got
            wait = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.01)
            assert not wait.done()  # nothing more until the next event
            # ... and, waiting, the stream holds no sent event (a commit is shared by its cohort).
            assert (sys.getrefcount(commit), sys.getrefcount(abort)) == refs
            svc._send("a", commit)
            assert await wait == commit and await anext(stream) == EMPTY_EVENT
    finally:
        await stream.aclose()
    assert event_of(EMPTY_EVENT) is None  # what a peer makes of it: nothing to queue


async def test_a_participant_that_reconnects_mid_round_gets_the_plan_then_one_empty_event():
    # Two messages at a stream's start either way: the running round's plan counts as one.
    from shoal.coordinator.server import EMPTY_EVENT

    now = [0.0]
    svc = service(now)
    for i, p in enumerate("abc"):
        svc.apply(svc.engine.join(p, KEYS[p], f"10.0.0.{i}:1", 1, 0.0))
        svc.watchers[p] = asyncio.Queue()
        svc.apply(svc.engine.connected(p, 0.0))
    for p in "abc":
        svc.apply(svc.engine.ready(p, 0, ReadyInfo(10, pb.FLOAT32, 1, b"", 0, 0.1), 0.1))
    assert svc.engine.running is not None
    stream = svc.WatchRounds(pb.WatchRequest(peer_id="b"), _Context())
    try:
        async with asyncio.timeout(5):
            first, second = await anext(stream), await anext(stream)
            assert first.WhichOneof("event") == "plan" and first.plan.round == 0
            assert second == EMPTY_EVENT
            wait = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.01)
            assert not wait.done()  # nothing more until the next event
            wait.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await wait
    finally:
        await stream.aclose()


async def test_a_peer_that_joins_after_the_run_finished_is_told_so_and_not_made_a_member():
    # A late joiner (seen: a scenario's joiner started 1 s before the coordinator exited) got a
    # lease, then "connection refused" for 120 s and exit 3; now its Join answer says it is over.
    from shoal.coordinator.rounds import SendFinished

    now = [0.0]
    svc = service(now)
    svc.apply([SendFinished(7, "run complete")])
    key = Ed25519PrivateKey.generate()
    resp = await svc.Join(pb.JoinRequest(public_key=public_bytes(key), data_address="10.0.2.1:1"), None)
    assert resp.HasField("finished") and resp.finished.rounds_committed == 7
    assert resp.peer_id and resp.peer_id not in svc.engine.members and not resp.HasField("sync")


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0", "0.2.9"])
async def test_a_peer_older_than_the_digest_changes_is_refused_at_join(version):
    """0.2.0 changed the vote's result digest and 0.3.0 the all-reduce job's state digest: an
    older peer would dissent on every round, so its Join is refused naming the version; tools and
    hand-written clients (no semantic version) and current peers join."""
    import shoal

    svc = service([0.0])
    old = pb.JoinRequest(public_key=public_bytes(Ed25519PrivateKey.generate()), data_address="10.0.3.1:1",
                         version=version)
    try:
        await svc.Join(old, _Context())
        raise AssertionError(f"a {version} peer joined")
    except _Aborted as exc:
        assert "FAILED_PRECONDITION" in str(exc) and f"version: peer {version}" in str(exc)
    assert not svc.engine.members
    for i, version in enumerate((shoal.__version__, "", "bench", "1.0.0")):
        req = pb.JoinRequest(public_key=public_bytes(Ed25519PrivateKey.generate()), data_address=f"10.0.3.{i + 2}:1",
                             version=version)
        assert (await svc.Join(req, None)).peer_id
    assert len(svc.engine.members) == 4


async def test_link_reports_carry_the_bulk_lane_peers_and_an_overlong_list_is_refused():
    """LinkReport.bulk_peers reaches the engine (the planner's chunk cap, docs/protocol.md); more
    than 4096 entries is INVALID_ARGUMENT naming the field, and the member's last report stays."""
    now = [0.0]
    svc = service(now)
    svc.apply(svc.engine.join("a", KEYS["a"], "10.0.0.1:1", 1, 0.0))
    report = pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e9, bulk_peers=["b", "c"])
    await svc.ReportLinks(report, _Context())
    assert svc.engine.members["a"].bulk_peers == frozenset("bc")
    report = pb.LinkReport(peer_id="a", up_bytes_per_s=5e8, down_bytes_per_s=5e8, bulk_peers=["x"] * 4097)
    try:
        await svc.ReportLinks(report, _Context())
        raise AssertionError("4097 bulk peers accepted")
    except _Aborted as exc:
        assert "INVALID_ARGUMENT" in str(exc) and "bulk_peers" in str(exc)
    m = svc.engine.members["a"]
    assert m.bulk_peers == frozenset("bc") and m.up_bytes_per_s == 1e9


@pytest.mark.parametrize("field, report", [
    ("up_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=1e-6, down_bytes_per_s=1e9)),
    ("down_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e-6)),
    ("up_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=2e12, down_bytes_per_s=1e9)),
    ("down_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=float("nan"))),
    ("up_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=-5.0, down_bytes_per_s=1e9)),
    ("links[0].rtt_seconds", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e9,
                                           links=[pb.LinkEstimate(peer_id="b", rtt_seconds=1000.0)])),
    ("links[0].rtt_seconds", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e9,
                                           links=[pb.LinkEstimate(peer_id="b", rtt_seconds=-1.0)])),
    ("links[0].rtt_seconds", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e9,
                                           links=[pb.LinkEstimate(peer_id="b", rtt_seconds=float("inf"))])),
    ("links[0].up_bytes_per_s", pb.LinkReport(peer_id="a", up_bytes_per_s=1e9, down_bytes_per_s=1e9,
                                              links=[pb.LinkEstimate(peer_id="b", up_bytes_per_s=1e-6)])),
])
async def test_a_link_report_outside_physical_bounds_is_refused_and_rounds_are_unaffected(field, report):
    """A rate below 1 kB/s or above 1 TB/s, a round trip <= 0 or above 60 s, a non-finite value:
    INVALID_ARGUMENT naming the field; the member keeps its last report and the next plan is the
    one its honest report gives (0 = not measured stays allowed)."""
    plans = []
    for bad in (None, report):
        now = [0.0]
        svc = service(now)
        queues = {p: asyncio.Queue() for p in "abc"}
        for i, p in enumerate("abc"):
            svc.apply(svc.engine.join(p, KEYS[p], f"10.0.0.{i}:1", 1, 0.0))
            svc.watchers[p] = queues[p]
            svc.apply(svc.engine.connected(p, 0.0))
            await svc.ReportLinks(pb.LinkReport(peer_id=p, up_bytes_per_s=1e8, down_bytes_per_s=1e8,
                                                links=[pb.LinkEstimate(peer_id="x", rtt_seconds=0.0)]), _Context())
        if bad is not None:
            try:
                await svc.ReportLinks(bad, _Context())
                raise AssertionError(f"accepted {bad}")
            except _Aborted as exc:
                assert "INVALID_ARGUMENT" in str(exc) and f"{field}:" in str(exc), str(exc)
            m = svc.engine.members["a"]
            assert (m.up_bytes_per_s, m.down_bytes_per_s) == (1e8, 1e8)
        for p in "abc":
            svc.apply(svc.engine.ready(p, 0, ReadyInfo(1000, pb.FLOAT32, 1, b"", 0, 0.1), 0.1))
        plans.append(svc.engine.running.plan)
    assert plans[0] == plans[1]


async def test_a_join_with_a_rate_outside_physical_bounds_is_refused():
    svc = service([0.0])
    req = pb.JoinRequest(public_key=public_bytes(Ed25519PrivateKey.generate()), data_address="10.0.4.1:1",
                         up_bytes_per_s=1e-6)
    try:
        await svc.Join(req, _Context())
        raise AssertionError("joined with 1e-6 B/s")
    except _Aborted as exc:
        assert "INVALID_ARGUMENT" in str(exc) and "up_bytes_per_s:" in str(exc)
    assert not svc.engine.members


class _ProcessContext(_Context):
    """A call from one peer process (its instance id in the metadata)."""

    def __init__(self, instance: str):
        self.instance = instance

    def invocation_metadata(self):
        from shoal.common.identity import MD_INSTANCE

        return ((MD_INSTANCE, self.instance),)


async def test_a_join_that_lost_the_identity_during_its_dial_back_is_refused_and_changes_nothing():
    """Two processes with one key: B's Join waits on its dial-back while A joins (and takes the
    identity); B's Join is then refused (ABORTED, one line) and the member keeps A's address."""
    release = asyncio.Event()

    async def reach(address: str, public_key: bytes) -> Reachability:
        if address.startswith("10.0.5.2"):  # B's address: the dial-back hangs until released
            await release.wait()
            return Reachability(False, "timed out", timed_out=False)
        return Reachability(True)

    engine = RoundEngine(EngineConfig(min_peers=3, ready_timeout=5.0))
    svc = CoordinatorService(engine, MemoryStore(), "{}", Ed25519PrivateKey.generate(), clock=lambda: 0.0,
                             reach=reach)
    key = public_bytes(Ed25519PrivateKey.generate())
    b = asyncio.ensure_future(svc.Join(pb.JoinRequest(public_key=key, data_address="10.0.5.2:1"), _ProcessContext("B")))
    await asyncio.sleep(0.01)
    resp = await svc.Join(pb.JoinRequest(public_key=key, data_address="10.0.5.1:1"), _ProcessContext("A"))
    release.set()
    try:
        await b
        raise AssertionError("the stale Join was applied")
    except _Aborted as exc:
        assert "ABORTED" in str(exc) and "took over the identity" in str(exc) and "\n" not in str(exc)
    m = svc.engine.members[resp.peer_id]
    assert m.address == "10.0.5.1:1" and m.reachable is True
    assert svc.memberships.holds(resp.peer_id, "A")


class _PeerContext(_Context):
    """A call arriving from `host` (context.peer())."""

    def __init__(self, host: str):
        self.host = host

    def peer(self) -> str:
        return f"ipv4:{self.host}:40000"

    def invocation_metadata(self):
        return ()


async def test_the_dial_back_reaches_only_the_joiners_own_host_and_is_rate_limited():
    """JoinResponse.unreachable is no port scanner: an address on another host than the Join's
    source is never dialled (the joiner is told so and takes part outbound-only); an address on
    its own host (or its relay's, for a relayed one) is; dial-backs per host are rate limited."""
    from shoal.coordinator import server

    dialled = []

    async def reach(address: str, public_key: bytes) -> Reachability:
        dialled.append(address)
        return Reachability(True)

    engine = RoundEngine(EngineConfig(min_peers=3))
    svc = CoordinatorService(engine, MemoryStore(), "{}", Ed25519PrivateKey.generate(), clock=lambda: 0.0, reach=reach)

    def join(address: str, relay: str = "") -> pb.JoinRequest:
        return pb.JoinRequest(public_key=public_bytes(Ed25519PrivateKey.generate()), data_address=address, relay=relay)

    resp = await svc.Join(join("192.0.2.7:22"), _PeerContext("10.0.6.1"))
    assert "not on the host this Join came from" in resp.unreachable and dialled == []
    assert svc.engine.members[resp.peer_id].outbound_only
    assert (await svc.Join(join("10.0.6.1:7000"), _PeerContext("10.0.6.1"))).unreachable == ""
    assert (await svc.Join(join("127.0.0.1:7000"), _PeerContext("127.0.0.2"))).unreachable == ""  # loopback
    assert (await svc.Join(join("198.51.100.9:4001", relay="198.51.100.9:4000"), _PeerContext("10.0.6.1"))
            ).unreachable == ""
    assert dialled == ["10.0.6.1:7000", "127.0.0.1:7000", "198.51.100.9:4001"]
    for _ in range(server.DIAL_BACK_BURST + 1):
        try:
            await svc.Join(join("10.0.6.9:7000"), _PeerContext("10.0.6.9"))
        except _Aborted as exc:
            assert "RESOURCE_EXHAUSTED" in str(exc) and "rate limit" in str(exc)
            break
    else:
        raise AssertionError("no rate limit on dial-backs")


async def test_same_host_resolves_names_and_counts_loopback_as_one_host():
    from shoal.coordinator.server import _same_host

    assert await _same_host("localhost", "127.0.0.1") and await _same_host("127.0.0.1", "::1")
    assert await _same_host("::ffff:10.0.0.1", "10.0.0.1")
    assert not await _same_host("10.0.0.2", "10.0.0.1")
    assert not await _same_host("no-such-host.invalid", "10.0.0.1")


async def test_a_restored_members_redial_does_not_mark_the_member_that_joined_meanwhile():
    release = asyncio.Event()

    async def reach(address: str, public_key: bytes) -> Reachability:
        if address == "10.0.7.1:1":  # the restored (old) address: hangs, then fails
            await release.wait()
            return Reachability(False, "refused")
        return Reachability(True)

    engine = RoundEngine(EngineConfig(min_peers=3))
    svc = CoordinatorService(engine, MemoryStore(), "{}", Ed25519PrivateKey.generate(), clock=lambda: 0.0, reach=reach)
    svc.apply(engine.join("a", KEYS["a"], "10.0.7.1:1", 1, 0.0))  # restored: reachability unknown
    redial = asyncio.ensure_future(svc._recheck_reach("a"))
    await asyncio.sleep(0.01)
    svc.apply(engine.join("a", KEYS["a"], "10.0.7.2:1", 1, 0.0, reachable=True))  # it joined again meanwhile
    release.set()
    await redial
    m = engine.members["a"]
    assert m.address == "10.0.7.2:1" and m.reachable is True and not m.outbound_only
