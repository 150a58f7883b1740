"""Relays without sockets (docs/nat.md, "Relays"): the signed registration, the end-to-end chunk
signature, the engine's planning around relayed members and its verdict on a relay's fault."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.identity import peer_id_of, public_bytes
from shoal.common.plan import Plan
from shoal.common.relaying import check_register, chunk_signature_ok, register_line, sign_chunk
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendPlan
from shoal.v1 import shoal_pb2 as pb


def _words(line: bytes) -> list[str]:
    return line.decode().split()[2:]


def test_registration_names_the_signer_and_refuses_another_key():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    peer, nonce = check_register(_words(register_line(key)))
    assert peer == peer_id_of(public_bytes(key)) and len(nonce) == 16
    forged = _words(register_line(key))
    forged[1] = public_bytes(other).hex()  # claim the other peer's id, signed with our key
    with pytest.raises(ValueError, match="signature"):
        check_register(forged)
    with pytest.raises(ValueError, match="timestamp"):
        check_register(_words(register_line(key, now=time.time() - 300)))


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


def _engine() -> RoundEngine:
    return RoundEngine(EngineConfig(min_peers=2, lease_seconds=10.0, ready_timeout=5.0, collective_timeout=30.0,
                                    max_attempts=3, retry_backoff=0.0))


def _open(e: RoundEngine, relays: dict[str, str]) -> Plan:
    for i, p in enumerate(relays):
        e.join(p, bytes(32), f"10.0.0.{i}:7000", 1, 0.0, relay=relays[p])
        e.connected(p, 0.0)
    acts = []
    for p in relays:
        acts += e.ready_(p, 0, ReadyInfo(12, 1, 1, b"", 0, 0.0), 0.1)
    (sent,) = [a for a in acts if isinstance(a, SendPlan)]
    return sent.plan


def test_relayed_peers_own_shards_only_when_no_direct_peer_is_there():
    mixed = _open(_engine(), {"a": "", "b": "relay:1", "c": "relay:1"})
    assert mixed.relays == ("", "relay:1", "relay:1")
    assert {mixed.participants[o] for o in mixed.owners()} == {"a"}  # the relayed ones send outbound
    assert {mixed.participants[i] for i in mixed.outbound_only} == {"b", "c"}
    relayed = _open(_engine(), {"a": "relay:1", "b": "relay:1", "c": "relay:1"})
    assert relayed.outbound_only == () and len(relayed.owners()) == 3  # nobody direct: through the relay


def test_a_relay_fault_aborts_at_once_excluding_nobody():
    e = _engine()
    direct = _open(e, {"x": "", "y": ""})
    acts = e.vote("x", direct.round, direct.attempt, False, b"", b"", 0.5, error="?", relay_failure="relay:1")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]  # no relay in that plan: the voter's own failure
    assert abort.record.excluded == ("x",)
    e = _engine()
    plan = _open(e, {"a": "relay:1", "b": "relay:1", "c": "relay:1"})
    acts = e.vote("a", plan.round, plan.attempt, False, b"", b"", 1.0, suspects=("b",), error="no chunk")
    assert not [a for a in acts if isinstance(a, SendAbort)]  # an accusation waits for the blame window
    acts = e.vote("b", plan.round, plan.attempt, False, b"", b"", 1.1, error="chunk_signature",
                  relay_failure="relay:1")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.excluded == () and "relay relay:1" in abort.record.reason and abort.record.will_retry
    assert not e.excluded


async def test_status_says_which_member_is_relayed_and_through_which_relay():
    from shoal.coordinator.server import CoordinatorService
    from shoal.coordinator.store import MemoryStore
    from shoal.status import render_table

    svc = CoordinatorService(RoundEngine(EngineConfig()), MemoryStore(), "{}", Ed25519PrivateKey.generate(),
                             clock=lambda: 0.0)
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


def test_the_swarm_starts_a_relay_when_no_peer_is_reachable(tmp_path):
    from shoal.scenario import parse
    from shoal.swarm import Swarm, SwarmOptions, _Proc

    def swarm(peers: list[dict], relay: bool = False) -> Swarm:
        return Swarm(SwarmOptions(peers=len(peers), relay=relay, scenario=parse({"peer": peers}, len(peers))),
                     tmp_path)

    assert swarm([{"nat": True}, {"nat": True}]).wants_relay
    assert swarm([{"nat": True}, {"outbound_only": True}]).wants_relay
    assert not swarm([{"nat": True}, {}]).wants_relay  # one peer can be dialled: outbound-only is enough
    assert not swarm([{"outbound_only": True}, {"outbound_only": True}]).wants_relay  # nobody to relay
    mixed = swarm([{"nat": True}, {}], relay=True)
    assert mixed.wants_relay
    mixed.relay, mixed.relay_address = _Proc("relay", [], tmp_path / "relay.log"), "10.0.0.254:7071"
    assert [mixed.relayed(i) for i in range(2)] == [True, False]  # the NATed one only
    assert "--relay" in mixed.peer_argv(0) and "--relay" not in mixed.peer_argv(1)
