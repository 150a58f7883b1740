"""A coordinator killed with SIGKILL and restarted on the same state file keeps its commits."""

from __future__ import annotations

import asyncio
import json
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



@pytest.mark.parametrize("flags", [("--compression", "int8"), (), ("--aggregator", "median")],
                         ids=["other-codec", "no-run-flags", "robust-aggregator"])
async def test_a_restart_with_other_run_flags_plans_the_stored_sparse_run(procs, flags):
    """A topk run's coordinator killed -9 and restarted on its state with other [run] flags (another
    codec, none at all, an aggregator topk cannot take): the stored run wins on the wire too,
    not only in status. Every round either side of the restart is a sparse all-gather sending
    exactly one topk payload to the other peer; the warning names what differs."""
    from shoal.peer.sparse import SparseCodec

    sparse = ("--compression", "topk", "--sparse-chunk", "256", "--sparse-k", "8", "--sparse-bits", "4")
    common = ("--rounds", "400", "--min-peers", "2", "--initial-peers", "2", "--lease-seconds", "5")
    coord, addr = procs.coordinator(*common, *sparse)
    jobs = [procs.start(f"job-{r}", [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr,
                                     "--rank", str(r), "--size", "4000", "--key", str(procs.workdir / f"k{r}.key"),
                                     "--out", str(procs.workdir / f"job-{r}.json"), "--timeout", "120", "--no-save"])
            for r in range(2)]

    async def committed(a: str) -> int:
        try:
            return (await status(a)).rounds_committed
        except grpc.aio.AioRpcError:
            return 0
    for _ in range(600):  # a few rounds committed before the kill
        if await committed(addr) >= 5:
            break
        await asyncio.sleep(0.05)
    assert await committed(addr) >= 5, procs.log("coordinator")
    procs.kill(coord)
    coord.wait(timeout=10)
    procs.coordinator(*common, *flags, name="coordinator-2", listen=addr)
    for j in jobs:
        assert await procs.wait_exit_async(j, 120) == 0, procs.log(j.name)
    log = procs.log("coordinator-2")
    assert "keeping the stored one: " in log and "compression 'topk'" in log, log[-3000:]
    payload = SparseCodec("topk", 256, 8, 4).payload_bytes(4000)
    for r in range(2):
        rounds = read_json(procs.workdir / f"job-{r}.json")["rounds"]
        assert len({rd["round"] for rd in rounds}) >= 300
        assert {rd["algorithm"] for rd in rounds} == {"allgather"}, {rd["algorithm"] for rd in rounds}
        assert {rd["bytes_sent"] for rd in rounds} == {payload}
    st = await status(addr)
    assert json.loads(st.run_config_json)["compression"] == "topk"

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
