"""A coordinator killed with SIGKILL and restarted on the same state file keeps its commits."""

from __future__ import annotations

import sys

import grpc
import pytest

from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.common.security import signing_interceptors
from kits.procs import read_json
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

# Starts a coordinator and collective jobs as processes: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration


async def status(addr: str) -> pb.StatusResponse:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await pb_grpc.CoordinatorStub(ch).GetStatus(pb.StatusRequest(recent_rounds=50), timeout=5)


async def test_commits_survive_kill_9_and_restart(procs):
    coord, addr = procs.coordinator("--rounds", "3", "--min-peers", "2", "--initial-peers", "2")
    jobs = [procs.start(f"job-{r}", [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr,
                                     "--rank", str(r), "--size", "1000", "--key", str(procs.workdir / f"k{r}.key"),
                                     "--out", str(procs.workdir / f"job-{r}.json"), "--timeout", "60"])
            for r in range(2)]
    for j in jobs:
        assert procs.wait_exit(j, 60) == 0, procs.log(j.name)
    before = await status(addr)
    assert before.rounds_committed == 3
    procs.kill(coord)
    coord.wait(timeout=10)
    coord2, addr2 = procs.coordinator("--rounds", "3", name="coordinator-2", listen=addr)
    assert addr2 == addr
    after = await status(addr)
    assert after.rounds_committed == 3
    assert [r.state_digest for r in after.rounds if r.status == "committed"] == \
           [r.state_digest for r in before.rounds if r.status == "committed"]
    last = read_json(procs.workdir / "job-0.json")["last_digest"]
    assert [r for r in after.rounds if r.status == "committed"][-1].state_digest.hex() == last
    assert {m.peer_id for m in after.members} <= {read_json(procs.workdir / f"job-{r}.json")["peer_id"] for r in range(2)}


async def test_garbage_requests_get_clear_errors_and_lose_nothing(procs):
    coord, addr = procs.coordinator("--rounds", "1")
    key = load_or_create_key(procs.workdir / "client.key")
    me = peer_id_of(public_bytes(key))
    async with grpc.aio.insecure_channel(addr, interceptors=signing_interceptors(key)) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Join(pb.JoinRequest(public_key=b"short", data_address="127.0.0.1:1"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "public_key" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Join(pb.JoinRequest(public_key=public_bytes(key), data_address="nowhere"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data_address" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Join(pb.JoinRequest(public_key=public_bytes(key), data_address="127.0.0.1:1", relay="r:1",
                                           relay_bytes_per_s=float("nan")), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "relay_bytes_per_s" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Heartbeat(pb.HeartbeatRequest(peer_id=me), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Ready(pb.ReadyRequest(peer_id=me, num_elements=0, dtype=pb.FLOAT32), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_elements" in e.value.details()
        for bad in (float("nan"), -1.0, float("inf")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Ready(pb.ReadyRequest(peer_id=me, num_elements=4, dtype=pb.FLOAT32, local_steps=3,
                                                 local_seconds=bad), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "local_seconds" in e.value.details()
        st = await stub.GetStatus(pb.StatusRequest(), timeout=5)
        assert st.rounds_committed == 0 and len(st.members) == 0
    assert coord.poll() is None
