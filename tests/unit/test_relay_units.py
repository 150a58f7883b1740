"""Relays without sockets (docs/nat.md, "Relays"): the signed registration, the end-to-end chunk
signature, the engine's planning around relayed members and its verdict on a relay's fault."""

from __future__ import annotations

import time

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.errors import InvalidArgument
from shoal.common.identity import peer_id_of, public_bytes, sign_metadata
from shoal.common.plan import Plan
from shoal.relay.protocol import (RELAY_ALTERED, check_register, check_relay_ticket, chunk_signature_ok, issue_relay_ticket,
                                  register_line, sign_chunk)
from shoal.common.security import PUSH_CHUNKS
from shoal.common.tickets import issue_ticket, verify_ticket
from shoal.coordinator.planner import LinkSpec, relay_links
from shoal.coordinator.rounds import ReadyInfo, RoundEngine, SendAbort, SendPlan
from shoal.peer.collectives import CollectiveError, _Wire
from shoal.peer.dataplane import Inbox, PeerService, SenderGone, Session
from shoal.relay.server import FLIP_MIN_FRAME, _H2Frames, _Hooks
from shoal.v1 import shoal_pb2 as pb

from kits.engine import engine
from kits.service import service


def _words(line: bytes) -> list[str]:
    return line.decode().split()[2:]


RELAY = "127.0.0.1:7071"


def test_registration_names_the_signer_and_refuses_another_key():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    got = check_register(_words(register_line(key, RELAY)), {RELAY})
    assert got.peer_id == peer_id_of(public_bytes(key)) and len(got.nonce) == 16
    forged = _words(register_line(key, RELAY))
    forged[1] = public_bytes(other).hex()  # claim the other peer's id, signed with our key
    with pytest.raises(ValueError, match="signature"):
        check_register(forged, {RELAY})
    with pytest.raises(ValueError, match="timestamp"):
        check_register(_words(register_line(key, RELAY, now=time.time() - 300)), {RELAY})


def test_a_relay_ticket_admits_its_key_until_it_expires_and_a_registration_names_its_relay():
    coordinator, key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pub = public_bytes(key)
    ticket = issue_relay_ticket(coordinator, pub, 60, now=1000.0)
    assert check_relay_ticket(ticket, [public_bytes(coordinator)], pub, now=1059.0) == pytest.approx(1060.0)
    with pytest.raises(ValueError, match="expired"):
        check_relay_ticket(ticket, [public_bytes(coordinator)], pub, now=1061.0)
    with pytest.raises(ValueError, match="not for this key"):
        check_relay_ticket(ticket, [public_bytes(coordinator)], public_bytes(Ed25519PrivateKey.generate()), now=1.0)
    tampered = ticket[:32] + (2000 * 10**9).to_bytes(8, "big") + ticket[40:]  # a later expiry, same signature
    with pytest.raises(ValueError, match="not signed"):
        check_relay_ticket(tampered, [public_bytes(coordinator)], pub, now=1.0)
    got = check_register(_words(register_line(key, RELAY, 4242, ticket)), {RELAY})
    assert got.port == 4242 and got.ticket == ticket
    moved = _words(register_line(key, RELAY, 4242))
    moved[6] = "4243"  # the held port is signed too
    with pytest.raises(ValueError, match="signature"):
        check_register(moved, {RELAY})
    with pytest.raises(ValueError, match="is for relay"):
        check_register(_words(register_line(key, RELAY)), {"127.0.0.1:7072"})


def test_a_list_of_coordinators_is_checked_against_the_first_host():
    from shoal.common.security import list_tls_name
    from shoal.config import grpc_target

    assert list_tls_name(grpc_target("10.0.0.1:7070,10.0.0.2:7070")) == "10.0.0.1"
    assert list_tls_name(grpc_target("[::1]:7070,[::1]:7071")) == "::1"
    assert list_tls_name("coordinator.example.org:7070") == "" and list_tls_name("ipv4:10.0.0.1:7070") == ""


def test_chunk_signature_covers_data_header_and_ticket():
    key = Ed25519PrivateKey.generate()
    pub = public_bytes(key)
    c = pb.Chunk(round=3, attempt=1, sender=peer_id_of(pub), phase=pb.REDUCE_SCATTER, shard=2, offset=8,
                 dtype=pb.FLOAT32, shape=[4], data=bytes(range(16)), ticket=b"t")
    sign_chunk(key, c)
    assert chunk_signature_ok(pub, c)
    for change in (lambda m: setattr(m, "data", b"\x01" + m.data[1:]), lambda m: setattr(m, "offset", 9),
                   lambda m: setattr(m, "ticket", b"u"), lambda m: setattr(m, "shard", 1)):
        altered = pb.Chunk()
        altered.CopyFrom(c)
        change(altered)
        assert not chunk_signature_ok(pub, altered)
    assert not chunk_signature_ok(public_bytes(Ed25519PrivateKey.generate()), c)


def test_plan_carries_relays_on_the_wire():
    plan = Plan(participants=("a", "b"), collective="butterfly", shard_bounds=(0, 1, 2), shard_owner=(0, 1),
                addresses=("r:1", "r:2"), relays=("r:9", ""))
    back = Plan.from_proto(plan.to_proto())
    assert back.relays == ("r:9", "") and back.relay_of(0) == "r:9" and back.relay_of(1) == ""
    assert Plan.from_proto(Plan(participants=("a",), collective="ring", shard_bounds=(0, 1),
                                shard_owner=(0,)).to_proto()).relays == ()


def _open(e: RoundEngine, relays: dict[str, str]) -> Plan:
    for i, p in enumerate(relays):
        e.join(p, bytes(32), f"10.0.0.{i}:7000", 1, 0.0, relay=relays[p])
        e.connected(p, 0.0)
    acts = []
    for p in relays:
        acts += e.ready(p, 0, ReadyInfo(12, 1, 1, b"", 0, 0.0), 0.1)
    (sent,) = [a for a in acts if isinstance(a, SendPlan)]
    return sent.plan


def test_relayed_peers_own_shards_only_when_no_direct_peer_is_there():
    mixed = _open(engine(), {"a": "", "b": "relay:1", "c": "relay:1"})
    assert mixed.relays == ("", "relay:1", "relay:1")
    assert {mixed.participants[o] for o in mixed.owners()} == {"a"}  # the relayed ones send outbound
    assert {mixed.participants[i] for i in mixed.outbound_only} == {"b", "c"}
    relayed = _open(engine(), {"a": "relay:1", "b": "relay:1", "c": "relay:1"})
    assert relayed.outbound_only == () and len(relayed.owners()) == 3  # nobody direct: through the relay


def test_a_relay_is_a_link_its_relayed_participants_share():
    """relay_links: the k participants of a relay with a declared capacity C each get at most
    C/k up and down (an unreported rate becomes C/k); direct participants and those of a relay
    without a declared capacity keep their links."""
    mb = 1e6
    links = [LinkSpec("a", 100 * mb, 100 * mb, 0.01), LinkSpec("b", 100 * mb, 3 * mb, 0.01),
             LinkSpec("c", 0.0, 0.0, 0.0), LinkSpec("d", 50 * mb, 50 * mb, 0.01)]
    got = relay_links(links, [("", 0.0), ("r:1", 10 * mb), ("r:1", 10 * mb), ("q:1", 0.0)])
    assert got[0] == links[0] and got[3] == links[3]
    assert (got[1].up_bytes_per_s, got[1].down_bytes_per_s) == (5 * mb, 3 * mb)
    assert (got[2].up_bytes_per_s, got[2].down_bytes_per_s) == (5 * mb, 5 * mb)


def test_the_engine_plans_a_relayed_round_on_the_relay_s_capacity():
    """Three peers all reached through one relay declared at 1 MB/s, each on a 100 MB/s link:
    the plan's prediction is that of three links of 1/3 MB/s (the relay), not of 100 MB/s ones."""
    mb = 1e6
    e = engine()
    n = 300_000
    for i, p in enumerate("abc"):
        e.join(p, bytes(32), f"10.0.0.{i}:7000", 1, 0.0, up=100 * mb, down=100 * mb, relay="relay:1",
               relay_bytes_per_s=1 * mb)
        e.connected(p, 0.0)
    acts = []
    for p in "abc":
        acts += e.ready(p, 0, ReadyInfo(n, pb.FLOAT32, 1, b"", 0, 0.0), 0.1)
    (sent,) = [a for a in acts if isinstance(a, SendPlan)]
    # Pipelined butterfly, equal shares: each sends and receives (1 + (p-2)/p) x 1.2 MB over 1/3 MB/s.
    assert sent.plan.predicted_seconds >= 4.0 * n * (1 + 1 / 3) / (mb / 3)
    assert sent.plan.predicted_seconds > 10 * 4.0 * n * (1 + 1 / 3) / (100 * mb)


def test_a_relay_fault_aborts_at_once_excluding_nobody():
    e = engine()
    direct = _open(e, {"x": "", "y": ""})
    acts = e.vote("x", direct.round, direct.attempt, False, b"", b"", 0.5, error="?", relay_failure="relay:1")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]  # no relay in that plan: the voter's own failure
    assert abort.record.excluded == ("x",)
    e = engine()
    plan = _open(e, {"a": "relay:1", "b": "relay:1", "c": "relay:1"})
    acts = e.vote("a", plan.round, plan.attempt, False, b"", b"", 1.0, suspects=("b",), error="no chunk")
    assert not [a for a in acts if isinstance(a, SendAbort)]  # an accusation waits for the blame window
    acts = e.vote("b", plan.round, plan.attempt, False, b"", b"", 1.1, error="chunk_signature",
                  relay_failure="relay:1")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.excluded == () and "relay relay:1" in abort.record.reason and abort.record.will_retry
    assert not e.excluded


async def test_status_says_which_member_is_relayed_and_through_which_relay():
    from shoal.cli.status import render_table

    svc = service(clock=0.0)
    svc.apply(svc.engine.join("a", bytes(32), "10.0.0.1:7000", 1, 0.0))
    svc.apply(svc.engine.join("b", bytes(32), "203.0.113.5:40001", 1, 0.0, relay="203.0.113.5:7071"))
    a, b = (await svc.GetStatus(pb.StatusRequest(), None)).members
    assert (a.relay, b.relay) == ("", "203.0.113.5:7071")
    member = {"address": "x", "state": "member", "untrusted": False, "lease_remaining_seconds": 1.0,
              "num_samples": 1, "shm_peers": 0, "reachability": "reachable", "outbound_only": False,
              "links": {"up_bytes_per_s": 0.0, "down_bytes_per_s": 0.0, "rtt_seconds": 0.0, "age_seconds": None}}
    table = render_table({"coordinator": "c", "epoch": 0, "round": 0, "rounds_committed": 0, "rounds_aborted": 0,
                          "run_config": {}, "waiting": {}, "rounds": [],
                          "members": [{**member, "peer_id": "a" * 12, "relay": ""},
                                      {**member, "peer_id": "b" * 12, "relay": b.relay}]})
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith(("aaaa", "bbbb"))}
    assert "relayed via 203.0.113.5:7071" in rows["b" * 12] and "reachable" in rows["a" * 12]


def test_relay_settings_are_checked_before_anything_starts(capsys):
    from shoal import cli

    assert cli.main(["peer", "--relay", "relay:7071", "--advertise", "10.0.0.1:7000"]) == 2
    assert "relay" in capsys.readouterr().err
    assert cli.main(["relay", "--listen", "nonsense"]) == 2
    assert "listen" in capsys.readouterr().err
    # A wildcard listen address would be advertised (peers elsewhere could not dial it).
    assert cli.main(["relay", "--listen", "0.0.0.0:0"]) == 2
    assert "--advertise" in capsys.readouterr().err
    for bad in ("127.0.0.1:7071", "bad host", "under_score"):  # a host, not HOST:PORT
        assert cli.main(["relay", "--listen", "127.0.0.1:0", "--advertise", bad]) == 2
        assert "advertise" in capsys.readouterr().err
    assert cli.main(["relay", "--listen", "127.0.0.1:0", "--capacity-mbit", "inf"]) == 2
    assert "finite" in capsys.readouterr().err
    assert cli.main(["swarm", "--workload", "lm", "--relay"]) == 2
    assert "--relay is not built for --workload lm" in capsys.readouterr().err


def test_the_swarm_starts_a_relay_when_no_peer_is_reachable(tmp_path):
    from shoal.testbeds.scenario import parse
    from shoal.processes import Process
    from shoal.testbeds.swarm import Swarm, SwarmOptions

    def swarm(peers: list[dict], relay: bool = False) -> Swarm:
        return Swarm(SwarmOptions(peers=len(peers), relay=relay, scenario=parse({"peer": peers}, len(peers))),
                     tmp_path)

    assert swarm([{"nat": True}, {"nat": True}]).wants_relay
    assert swarm([{"nat": True}, {"outbound_only": True}]).wants_relay
    assert not swarm([{"nat": True}, {}]).wants_relay  # one peer can be dialled: outbound-only is enough
    assert not swarm([{"outbound_only": True}, {"outbound_only": True}]).wants_relay  # nobody to relay
    mixed = swarm([{"nat": True}, {}], relay=True)
    assert mixed.wants_relay
    mixed.relays, mixed.relay_addresses = [Process("relay", [], tmp_path / "relay.log")], ["10.0.0.254:7071"]
    assert [mixed.relayed(i) for i in range(2)] == [True, False]  # the NATed one only
    assert "--relay" in mixed.peer_argv(0) and "--relay" not in mixed.peer_argv(1)


# ----------------------------------------------- an altered first chunk (PeerService, no sockets)


class _Aborted(Exception):
    pass


class _Context:
    """The parts of a grpc.aio.ServicerContext that PushChunks uses before anything is admitted."""

    def __init__(self, metadata):
        self.metadata, self.aborted = metadata, None

    def invocation_metadata(self):
        return self.metadata

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise _Aborted(details)


async def _push_altered_first_chunk(ticket_key: Ed25519PrivateKey, coordinator: Ed25519PrivateKey,
                                    sender_key: Ed25519PrivateKey, me_key: Ed25519PrivateKey,
                                    undecodable_second: bool = False):
    """A relayed receiver's inbox and the wait key of the sender's chunk after a stream whose first
    (only) chunk had a bit flipped in transit, the sender's chunk and stream signatures made over
    the original; or (`undecodable_second`) whose first chunk came intact and whose second
    message no longer decodes (as `DecodeErrors` hands it to the handler)."""
    sender, me = peer_id_of(public_bytes(sender_key)), peer_id_of(public_bytes(me_key))
    inbox = Inbox()

    def check(ticket: bytes, who: str) -> None:
        verify_ticket(public_bytes(coordinator), ticket, round=0, attempt=0, sender=who)

    inbox.start(Session(0, 0, frozenset({sender, me}), pb.FLOAT32, check, (0, 16), 16, 30.0, relayed=frozenset({me})))
    service = PeerService(inbox, key=me_key, coordinator_public_key=public_bytes(coordinator), session_wait=1.0)
    c = pb.Chunk(round=0, attempt=0, sender=sender, phase=pb.REDUCE_SCATTER, dtype=pb.FLOAT32, shape=[4],
                 data=bytes(16), ticket=issue_ticket(ticket_key, 0, 0, [sender, me], bytes(32), 60.0))
    sign_chunk(sender_key, c)
    ctx = _Context(sign_metadata(sender_key, PUSH_CHUNKS, c))
    altered = pb.Chunk()
    altered.CopyFrom(c)
    altered.data = b"\x01" + c.data[1:]

    async def stream():
        if undecodable_second:
            yield c
            raise InvalidArgument("request: does not decode as the request message of PushChunks")
        yield altered

    with pytest.raises(_Aborted, match=RELAY_ALTERED):
        await service.PushChunks(stream(), ctx)
    assert ctx.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    return inbox, (0, 0, pb.REDUCE_SCATTER, 0, 4 if undecodable_second else 0, 0, sender)


async def test_an_altered_first_chunk_fails_the_waits_on_its_sender_as_the_relays_fault():
    # The silent path behind a flaky relay test: the refusal of a stream's first chunk ended only
    # that call; the receiver waited out the chunk deadline and blamed the (healthy) sender.
    coordinator, sender_key, me_key = (Ed25519PrivateKey.generate() for _ in range(3))
    inbox, key = await _push_altered_first_chunk(coordinator, coordinator, sender_key, me_key)
    with pytest.raises(SenderGone, match=RELAY_ALTERED):
        await inbox.get(key, 5.0)


async def test_a_later_message_that_no_longer_decodes_on_a_relayed_stream_is_the_relays_fault():
    coordinator, sender_key, me_key = (Ed25519PrivateKey.generate() for _ in range(3))
    inbox, key = await _push_altered_first_chunk(coordinator, coordinator, sender_key, me_key,
                                                 undecodable_second=True)
    with pytest.raises(SenderGone, match=RELAY_ALTERED):
        await inbox.get(key, 5.0)


async def test_an_altered_first_chunk_without_a_valid_ticket_fails_nobodys_waits():
    coordinator, sender_key, me_key = (Ed25519PrivateKey.generate() for _ in range(3))
    inbox, key = await _push_altered_first_chunk(Ed25519PrivateKey.generate(), coordinator, sender_key, me_key)
    with pytest.raises(TimeoutError):  # a stranger cannot fail a participant's waits
        await inbox.get(key, 0.05)


# ----------------------------------------------------------------- the relay's flip hook (pure)


def _frame(kind: int, sid: int, payload: bytes, flags: int = 0) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


def _message(body: bytes) -> bytes:
    return b"\0" + len(body).to_bytes(4, "big") + body


def test_the_flip_hook_changes_one_bit_of_a_calls_later_message_only():
    big = [bytes([i]) * (FLIP_MIN_FRAME + 100 * i) for i in range(6)]
    split = _message(big[4])  # a first message over two DATA frames, then a later one
    frames = [
        _frame(1, 1, b"headers"), _frame(0, 1, _message(big[0])),  # call 1's first message: never
        _frame(1, 3, b"headers"), _frame(0, 3, _message(big[1])),  # call 3's first message: never
        _frame(4, 0, b"settings"), _frame(0, 1, _message(big[2])),  # call 1's second: flip@0
        _frame(0, 3, _message(big[3])),  # call 3's second: flip@1
        _frame(0, 5, split[:3000]), _frame(0, 5, split[3000:]), _frame(0, 5, _message(big[5])),  # flip@2
    ]
    stream = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"".join(frames)
    for k, which in ((0, 5), (1, 6), (2, 9)):
        hooks, parser = _Hooks(f"flip@{k}"), _H2Frames()
        out = b"".join(hooks.forward(stream[i:i + 777], parser) for i in range(0, len(stream), 777))
        changed = [i for i in range(len(stream)) if out[i] != stream[i]]
        start = 24 + sum(len(f) for f in frames[:which]) + 9  # the flipped frame's payload
        length = len(frames[which]) - 9
        assert changed == [start + length // 2] and out[changed[0]] ^ stream[changed[0]] == 1, (k, changed)
    hooks, parser = _Hooks("prefix@0"), _H2Frames()  # the length prefix of the same message instead
    out = hooks.forward(stream, parser)
    start = 24 + sum(len(f) for f in frames[:5]) + 9
    assert [i for i in range(len(stream)) if out[i] != stream[i]] == [start + 2]


async def test_a_chunk_missing_from_an_open_relayed_stream_is_blamed_on_the_relay():
    # A changed length prefix leaves the receiver's gRPC waiting for bytes that never come: the
    # sender's stream stays open and nobody sees an error. Through a relay that is the relay's.
    plan = Plan(participants=("a", "b"), collective="butterfly", shard_bounds=(0, 1, 2), shard_owner=(0, 1),
                addresses=("r:1", "r:2"), relays=("relay:1", "relay:1"), chunk_timeout_seconds=0.05)
    inbox = Inbox()
    wire = _Wire(plan, "a", inbox)
    with pytest.raises(CollectiveError) as silent:  # b never opened a stream: b is the suspect
        await wire.payload(pb.REDUCE_SCATTER, 0, 0, 0, "b")
    assert silent.value.suspects == ("b",) and not silent.value.relay
    inbox.count_stream((0, 0, "b"), +1)
    with pytest.raises(CollectiveError) as stalled:
        await wire.payload(pb.REDUCE_SCATTER, 0, 0, 0, "b")
    assert stalled.value.relay == "relay:1" and not stalled.value.suspects
    inbox.count_stream((0, 0, "b"), -1)
    assert not inbox.streaming(0, 0, "b")
    direct = Plan(participants=("a", "b"), collective="butterfly", shard_bounds=(0, 1, 2), shard_owner=(0, 1),
                  addresses=("r:1", "r:2"), chunk_timeout_seconds=0.05)
    inbox.count_stream((0, 0, "b"), +1)
    with pytest.raises(CollectiveError) as unrelayed:  # no relay on the path: the sender as before
        await _Wire(direct, "a", inbox).payload(pb.REDUCE_SCATTER, 0, 0, 0, "b")
    assert unrelayed.value.suspects == ("b",) and not unrelayed.value.relay
