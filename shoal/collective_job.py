"""A process that all-reduces synthetic tensors through a coordinator: no training, just rounds.

Used by the tests (all-reduce correctness across real processes) and by `shoal bench`. Each
process joins the coordinator, and for every round: says ready with a tensor of `--size`
elements drawn from a seeded generator (seed = base seed + rank + round), runs the planned
collective, votes with the result digest, and on commit records the digest and the time. The
result of the last round is saved as .npy next to the JSON report.

    python -m shoal.collective_job --coordinator HOST:PORT --rank I --size N --out PATH \
        (--insecure | --tls-dir DIR) [--join-token T]

With `--aggregators krum,median,...` shard owners run those aggregators (round r uses entry
r mod len; the coordinator must plan the butterfly); `--attack NAME` makes this process send
forged tensors (peer.byzantine). Every round's result is saved in PATH.npz (key "r<round>").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time

import grpc
import numpy as np

from shoal.peer.byzantine import forge
from shoal.common.plan import Plan as CollectivePlan
from shoal.peer.collectives import CollectiveError, all_reduce
from shoal.peer.dataplane import Inbox, PeerService, Session, Transport, channel_options, serve_data_plane
from shoal.peer.reduction import OwnerReduction, ReductionSpec
from shoal.common.identity import load_or_create_key, public_bytes
from shoal.peer.links import LinkMeter, probe_missing
from shoal.common.security import Security, open_channel, signing_interceptors
from shoal.common.tensors import dtype_code
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc


@functools.lru_cache(maxsize=4)
def _base_input(seed: int, rank: int, size: int) -> np.ndarray:
    base = np.random.default_rng([seed, rank]).standard_normal(size, dtype=np.float32)
    base.flags.writeable = False
    return base


def make_input(seed: int, rank: int, round_: int, size: int, dtype: str) -> np.ndarray:
    """The tensor rank `rank` contributes in round `round_`: (size,) of `dtype`, a seeded N(0, 1)
    draw per rank plus a per-round offset of 0.01 x round (the draw is cached, so a new round costs
    one elementwise pass, not a fresh 64 MB of random numbers competing with the other peers'
    collectives for the CPU)."""
    return (_base_input(seed, rank, size) + np.float32(0.01 * round_)).astype(dtype, copy=False)


async def _join(stub: pb_grpc.CoordinatorStub, req: pb.JoinRequest) -> pb.JoinResponse:
    delay = 0.1
    while True:  # a rate-limited join (RESOURCE_EXHAUSTED) is retried; the caller's timeout bounds it
        try:
            return await stub.Join(req, wait_for_ready=True, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)


def _fractions(cp: CollectivePlan) -> list[float]:
    """Share of the tensor each participant (in collective order) owns."""
    n = cp.shard_bounds[-1] or 1
    out = [0.0] * len(cp.participants)
    for k, owner in enumerate(cp.shard_owner):
        out[owner] += (cp.shard_bounds[k + 1] - cp.shard_bounds[k]) / n
    return out


async def run_job(coordinator: str, rank: int, size: int, dtype: str, key_path: str, seed: int = 0,
                  listen: str = "127.0.0.1:0", timeout: float = 120.0, security: Security | None = None,
                  join_token: str = "", aggregators: tuple[str, ...] = (), attack: str = "",
                  measure_links: bool = True, keep_results: bool = True, shared_memory: bool = True) -> dict:
    """Play rounds until the coordinator finishes the run; returns a report dict.

    With `measure_links`, streams feed a LinkMeter, and after each commit the process probes the
    round's participants it has no history for and reports its links to the coordinator (before
    saying ready, so the next plan can use them). `keep_results`: keep every round's result in
    the report (`results`), not only the last one.
    """
    security = security or Security(insecure=True)
    key = load_or_create_key(key_path)
    inbox = Inbox()
    transport = Transport(security, key, shared_memory=shared_memory)
    meter = LinkMeter() if measure_links else None
    service = PeerService(inbox, links=meter, shared_memory=shared_memory)
    server, address = await serve_data_plane(service, listen, security)
    channel = open_channel(coordinator, security, channel_options(), signing_interceptors(key))
    stub = pb_grpc.CoordinatorStub(channel)
    report: dict = {"rank": rank, "rounds": [], "size": size, "dtype": dtype, "results": {}}
    try:
        async with asyncio.timeout(timeout):
            resp = await _join(stub, pb.JoinRequest(public_key=public_bytes(key), data_address=address,
                                                    num_samples=1, join_token=join_token))
            me = resp.peer_id
            service.coordinator_public_key = resp.coordinator_public_key
            report["peer_id"] = me
            state_digest, state_round = b"", 0
            code = dtype_code(np.dtype(dtype))
            watch = stub.WatchRounds(pb.WatchRequest(peer_id=me))
            x = make_input(seed, rank, 0, size, dtype)
            await stub.Ready(pb.ReadyRequest(peer_id=me, round=0, num_elements=size, dtype=code, num_samples=1))
            tentative: dict[tuple[int, int], tuple[bytes, np.ndarray]] = {}
            last_plan: CollectivePlan | None = None
            async for ev in watch:
                kind = ev.WhichOneof("event")
                if kind == "finished":
                    break
                if kind == "plan" and ev.plan.round == state_round:
                    cp = last_plan = CollectivePlan.from_proto(ev.plan)
                    inbox.start(Session.from_plan(ev.plan, resp.coordinator_public_key))
                    vote = pb.VoteRequest(peer_id=me, round=ev.plan.round, attempt=ev.plan.attempt)
                    reducer = None
                    if aggregators:
                        spec = ReductionSpec(aggregators[ev.plan.round % len(aggregators)])
                        reducer = OwnerReduction(spec, np.ones(len(cp.participants)), size)
                    sent = forge(attack, x, np.random.default_rng(rank)) if attack else x
                    try:
                        cpu0 = time.process_time()
                        res = await all_reduce(sent, cp, me=me, transport=transport, inbox=inbox, reducer=reducer,
                                               links=meter)
                        cpu = time.process_time() - cpu0
                        tentative[(ev.plan.round, ev.plan.attempt)] = (res.digest, res.values)
                        vote.ok, vote.result_digest, vote.state_digest = True, res.digest, res.digest
                        vote.bytes_sent, vote.collective_seconds = res.bytes_sent, res.seconds
                        report["rounds"].append({"round": ev.plan.round, "attempt": ev.plan.attempt,
                                                 "seconds": res.seconds, "bytes_sent": res.bytes_sent,
                                                 "algorithm": cp.collective, "participants": len(cp.participants),
                                                 "flagged": list(res.flagged),
                                                 "predicted_seconds": ev.plan.predicted_seconds,
                                                 "cpu_seconds": cpu, "shard_fractions": _fractions(cp),
                                                 "lanes": sorted(set(transport.lanes().values())),
                                                 "chunk_bytes": cp.chunk_bytes,
                                                 "aggregator": spec.aggregator if reducer else "sum"})
                    except CollectiveError as exc:
                        vote.ok, vote.error = False, str(exc)
                        vote.suspects.extend(exc.suspects)
                    finally:
                        inbox.finish(ev.plan.round, ev.plan.attempt)
                    await stub.Vote(vote)
                elif kind == "commit" and ev.commit.round == state_round:
                    d, values = tentative.pop((ev.commit.round, ev.commit.attempt), (b"", None))
                    if d != ev.commit.state_digest or values is None:
                        raise RuntimeError(f"round {state_round} committed a digest this process does not hold")
                    state_digest, state_round = d, state_round + 1
                    report["last_digest"] = d.hex()
                    report["last_result"] = values
                    if keep_results:
                        report["results"][f"r{state_round - 1}"] = values
                    x = make_input(seed, rank, state_round, size, dtype)
                    if meter is not None and last_plan is not None:
                        await probe_missing(meter, transport, zip(last_plan.participants, last_plan.addresses), me)
                        await transport.probe_lanes(a for pid, a in zip(last_plan.participants, last_plan.addresses)
                                                    if pid != me)
                        try:  # a lost report only leaves the coordinator with older estimates
                            lr = meter.report(me)
                            lr.shm_peers.extend(transport.shm_peers(zip(last_plan.participants, last_plan.addresses)))
                            await stub.ReportLinks(lr)
                        except grpc.aio.AioRpcError:
                            pass
                        up, down, rtt = meter.aggregate()
                        report["links"] = {"up_bytes_per_s": up, "down_bytes_per_s": down, "rtt_seconds": rtt}
                    await stub.Ready(pb.ReadyRequest(peer_id=me, round=state_round, num_elements=size, dtype=code,
                                                     num_samples=1, state_digest=state_digest, state_round=state_round))
                elif kind == "abort" and ev.abort.round == state_round and (
                        me in ev.abort.excluded or not ev.abort.will_retry):
                    raise RuntimeError(f"excluded from round {state_round}: {ev.abort.reason}")
            report["committed"] = state_round
            return report
    finally:
        await transport.close()
        await channel.close()
        await server.stop(grace=0.2)
        service.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True, help="elements per tensor")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--key", required=True)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--out", required=True, help="JSON report path; the last result goes to PATH.npy")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--tls-dir", help="TLS directory from `shoal certs init`")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC")
    ap.add_argument("--join-token", default="")
    ap.add_argument("--aggregators", default="", help="comma-separated owner aggregators, one per round, cycled")
    ap.add_argument("--attack", default="", help="send forged tensors (peer.byzantine)")
    ap.add_argument("--no-save", action="store_true", help="write no results (.npy/.npz), only the JSON report")
    ap.add_argument("--no-shared-memory", action="store_true",
                    help="send every chunk through the socket, also to peers on this host")
    a = ap.parse_args()
    security = Security(tls_dir=a.tls_dir, insecure=a.insecure or not a.tls_dir)
    aggs = tuple(x for x in a.aggregators.split(",") if x)
    t0 = time.time()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    report = run(run_job(a.coordinator, a.rank, a.size, a.dtype, a.key, a.seed, a.listen, a.timeout, security,
                         a.join_token, aggs, a.attack, keep_results=not a.no_save,
                         shared_memory=not a.no_shared_memory))
    result = report.pop("last_result", None)
    results = report.pop("results")
    if result is not None and not a.no_save:
        np.save(a.out + ".npy", result)
    if not a.no_save:
        np.savez(a.out + ".npz", **results)
    report["wall_seconds"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
