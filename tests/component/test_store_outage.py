"""A coordinator whose etcd store stops answering, without a network: the leadership's backoff,
its metric and its stated limit against a port nobody listens on, and the servicer's step-down
when a store write fails (nothing more is written in that term; the caller is told UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.metrics import CoordinatorMetrics
from shoal.coordinator.etcd_store import EtcdTarget, Failover, NotLeader
from shoal.coordinator.leadership import Leadership, StoreUnreachable
from shoal.coordinator.rounds import EngineConfig, RoundEngine
from shoal.coordinator.server import CoordinatorService, StoreFailed
from shoal.coordinator.store import MemoryStore


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again once the socket is: connections are refused


def _metric(m: CoordinatorMetrics, name: str) -> float:
    value = m.registry.get_sample_value(name)
    assert value is not None, name
    return value


async def test_an_unreachable_etcd_is_retried_with_backoff_then_ends_the_campaign_past_the_limit(caplog):
    target = EtcdTarget.parse(f"etcd://127.0.0.1:{_closed_port()}/p")
    metrics = CoordinatorMetrics()
    lead = Leadership(target, "127.0.0.1:1", poll=0.05, timeout=0.5, unreachable_limit=1.5, metrics=metrics)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.coordinator"):
            with pytest.raises(StoreUnreachable, match="store_unreachable_limit"):
                await asyncio.wait_for(lead.campaign(), 20)
    finally:
        await lead.close()
    assert time.monotonic() - t0 >= 1.5
    lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 1 and "retrying with backoff" in lines[0]  # one line, not one per try
    assert _metric(metrics, "shoal_coordinator_store_reachable") == 0
    assert _metric(metrics, "shoal_coordinator_store_unreachable_total") == 1


async def test_without_a_limit_the_campaign_waits_and_a_step_down_forgets_the_term():
    target = EtcdTarget.parse(f"etcd://127.0.0.1:{_closed_port()}/p")
    lead = Leadership(target, "127.0.0.1:1", poll=0.05, timeout=0.5, unreachable_limit=0)
    try:
        task = asyncio.create_task(lead.campaign())
        await asyncio.sleep(1.0)
        assert not task.done() and lead.unreachable_since is not None
        task.cancel()
        lead.lease_id, lead.revision = 7, 3  # as if it led
        lead.step_down()
        assert lead.revision == 0 and lead.lease_id == 0 and lead._stale_lease == 7
    finally:
        await lead.close()


def test_failover_moves_to_the_endpoint_that_answers_and_raises_other_errors_at_once():
    class Down(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

    calls = []

    def attempt(item):
        calls.append(item)
        if item == "a":
            raise Down(grpc.StatusCode.UNAVAILABLE)
        return item

    f = Failover(["a", "b"])
    assert f.call(attempt) == "b" and f.current == "b"
    assert f.call(attempt) == "b" and calls == ["a", "b", "b"]  # the one that answered is tried first
    with pytest.raises(Down):
        Failover(["x"]).call(lambda item: (_ for _ in ()).throw(Down(grpc.StatusCode.PERMISSION_DENIED)))


class _FailingStore(MemoryStore):
    """A store whose writes fail like an unreachable etcd's (or a fenced one's)."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def save_member(self, m) -> None:
        raise self.error


@pytest.mark.parametrize("error", [NotLeader("fenced"), grpc.RpcError()])
async def test_a_failed_store_write_ends_the_term_and_every_later_write_is_refused(error):
    if type(error) is grpc.RpcError:
        error.code = lambda: grpc.StatusCode.UNAVAILABLE  # type: ignore[method-assign]
    engine = RoundEngine(EngineConfig(min_peers=2))
    svc = CoordinatorService(engine, _FailingStore(error), "{}", Ed25519PrivateKey.generate(), clock=lambda: 0.0)
    with pytest.raises(StoreFailed) as got:
        svc.apply(engine.join("a" * 16, b"k" * 32, "10.0.0.1:1", 1, 0.0))
    assert got.value.code == grpc.StatusCode.UNAVAILABLE and "steps down" in str(got.value)
    assert svc.store_lost.is_set()
    svc.store = MemoryStore()  # even a store that would answer: the engine may be ahead of it
    with pytest.raises(StoreFailed):
        svc.apply(engine.join("b" * 16, b"j" * 32, "10.0.0.2:1", 1, 0.0))


@pytest.mark.integration  # a `shoal coordinator` process
def test_the_coordinator_ends_past_the_limit_with_one_line_naming_it(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "coordinator", "--insecure", "--listen", "127.0.0.1:0",
         "--state", f"etcd://127.0.0.1:{_closed_port()}/p", "--store-unreachable-limit", "1",
         "--key", str(tmp_path / "c.key"), "--log-level", "error"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shoal coordinator: etcd ") and "coordinator.store_unreachable_limit (1 s)" in last
    assert "Traceback" not in proc.stderr


async def test_a_vote_during_a_store_outage_is_answered_unavailable_not_unknown():
    """The commit a Vote decides cannot be written (etcd down: the client raises a grpc.RpcError,
    e.g. _InactiveRpcError): the voter is told UNAVAILABLE (it retries, or follows the next
    leader), never UNKNOWN naming etcd's address."""
    from shoal.common.errors import ShoalError
    from shoal.coordinator.rounds import ReadyInfo, SendPlan
    from shoal.v1 import shoal_pb2 as pb

    class EtcdDown(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses; last error: 127.0.0.1:2379"

    class Context:
        async def abort(self, code, details):
            raise ShoalError(f"{code.name}: {details}")

    store = MemoryStore()
    engine = RoundEngine(EngineConfig(min_peers=2, ready_timeout=5.0))
    svc = CoordinatorService(engine, store, "{}", Ed25519PrivateKey.generate(), clock=lambda: 0.0)
    for p in "ab":
        svc.apply(engine.join(p * 16, p.encode() * 32, f"10.0.0.{ord(p)}:1", 1, 0.0))
        svc.apply(engine.connected(p * 16, 0.0))
    acts = [a for p in "ab" for a in engine.ready(p * 16, 0, ReadyInfo(10, 1, 1, b"", 0, 0.0), 0.0)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    await svc.Vote(pb.VoteRequest(peer_id="a" * 16, round=0, attempt=plan.attempt, ok=True, result_digest=b"r",
                                  state_digest=b"s"), Context())

    def down(*_a, **_k):
        raise EtcdDown()

    store.save_commit = down  # type: ignore[method-assign]
    with pytest.raises(ShoalError) as got:
        await svc.Vote(pb.VoteRequest(peer_id="b" * 16, round=0, attempt=plan.attempt, ok=True, result_digest=b"r",
                                      state_digest=b"s"), Context())
    assert str(got.value).startswith("UNAVAILABLE:") and "steps down" in str(got.value), got.value
    assert svc.store_lost.is_set()
