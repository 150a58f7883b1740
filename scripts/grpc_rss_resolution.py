"""How finely a grpc.aio server's resident size can show growth per round (diagnostic).

A bare grpc.aio server (no Shoal code: generic handlers that answer at once, the coordinator's
server options `shoal.coordinator.daemon.grpc_options`) and N client connections (a member
each), each with a server stream open. Then R rounds of what a coordinator's round is on the
wire, with at most `--concurrency` calls in flight: every member sends a Ready (150 B) and gets
a 300 B answer, the server sends every stream a 300 B commit event, a fifth of the members send
a heartbeat; with `--cohort K` (default 16) K members drawn at random (seeded) get a 2,500 B
plan on their stream and send a Vote, as a cohort does. Nothing is kept from one round to the
next, so whatever the server's resident size does over the rounds is gRPC's, Python's and the
allocators' own doing.

After every round it samples the server's resident size (VmRSS, no collection: what `shoal
bench coordinator` samples); every 10 rounds it reads glibc's C heap in use after a collection
and a `malloc_trim` (as the coordinator's heap policy trims every 10 s). It prints one JSON
object per run: the least-squares slope of the resident size over the second half of the rounds
and its standard error (bytes per round), as `shoal bench coordinator` computes
`rss_growth_bytes_per_round`, the same for the C heap in use, and the resident size's range over
that half. `--runs M` repeats it with M seeds, each in a fresh server.

    python scripts/grpc_rss_resolution.py [--members 1000] [--rounds 200] [--cohort 16]
                                          [--runs 3] [--concurrency 200]

Measured with grpcio 1.85 (at 1,000 connections and identical rounds: -4.2 KB/round ± 2.3-2.5 K, a 2.8-3.1 MB range, the C heap in use flat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys

import grpc

# This directory is on sys.path when the script runs.
from grpc_stream_retention import _in_use, open_streams, serve, with_server

from shoal.bench.coordinator import growth_per_round, growth_stderr
from shoal.bench.collective_job import memory_bytes
from shoal.coordinator.daemon import grpc_options


async def _server(port_file: str) -> None:
    queues: dict[int, asyncio.Queue] = {}

    async def stream(request, context):
        q: asyncio.Queue = asyncio.Queue()
        queues[int(request)] = q
        yield b""
        yield b""
        while True:
            yield await q.get()

    def unary(size: int):
        async def answer(request, context):
            return b"a" * size
        return answer

    async def control(request, context):
        words = request.split()
        if words[0] == b"send":  # send SIZE [member ...]: one message to those streams (all if none)
            msg = bytes(random.getrandbits(8) for _ in range(int(words[1])))
            for q in ([queues[int(w)] for w in words[2:]] if len(words) > 2 else queues.values()):
                q.put_nowait(msg)
            return b"ok"
        if words[0] == b"heap":
            return json.dumps({"in_use": _in_use(), "rss": memory_bytes()[0]}).encode()
        return json.dumps({"rss": memory_bytes()[0]}).encode()

    handlers = {"S": grpc.unary_stream_rpc_method_handler(stream), "C": grpc.unary_unary_rpc_method_handler(control),
                "Ready": grpc.unary_unary_rpc_method_handler(unary(300)),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(unary(20)),
                "Vote": grpc.unary_unary_rpc_method_handler(unary(0))}
    await serve(handlers, port_file, grpc_options())


async def _client(port: int, args: argparse.Namespace, seed: int) -> dict:
    addr = f"127.0.0.1:{port}"
    rng = random.Random(seed)
    n = args.members
    control = grpc.aio.insecure_channel(addr, options=[("t.k", -1)]).unary_unary("/t.T/C")
    channels, streams = await open_streams(addr, n, settle=2 + n / 1000)

    gate = asyncio.Semaphore(args.concurrency)

    async def call(i: int, method: str, size: int) -> None:
        async with gate:
            for attempt in range(5):  # thousands of fresh connections: gRPC may cancel a call, as in the benchmark
                try:
                    await channels[i].unary_unary(f"/t.T/{method}")(b"r" * size, timeout=30)
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE) or attempt == 4:
                        raise
                    await asyncio.sleep(0.1)

    async def calls(method: str, who, size: int) -> None:
        await asyncio.gather(*(call(i, method, size) for i in who))

    rss: list[tuple[int, int]] = []
    heap: list[tuple[int, int]] = []
    for r in range(args.rounds):
        await calls("Ready", range(n), 150)
        await control(b"send 300")
        await calls("Heartbeat", rng.sample(range(n), n // 5), 60)
        if args.cohort:
            cohort = rng.sample(range(n), args.cohort)
            await control(b"send 2500 " + " ".join(map(str, cohort)).encode())
            await asyncio.sleep(0.05)
            await calls("Vote", cohort, 150)
        rss.append((r, json.loads(await control(b"rss"))["rss"]))
        if r % 10 == 9:  # the C heap in use needs a collection and a trim: every 10 rounds only
            heap.append((r, json.loads(await control(b"heap"))["in_use"]))
    for t in streams:
        t.cancel()
    half = [v for r, v in rss if r >= args.rounds // 2]
    slope, err = growth_per_round(rss, args.rounds), growth_stderr(rss, args.rounds)
    heap_slope, heap_err = growth_per_round(heap, args.rounds), growth_stderr(heap, args.rounds)
    return {"seed": seed, "members": n, "rounds": args.rounds, "cohort": args.cohort,
            "rss_bytes": rss[-1][1], "rss_growth_bytes_per_round": round(slope, 1),
            "rss_growth_stderr_bytes_per_round": round(err, 1),
            "rss_range_second_half_bytes": max(half) - min(half),
            "in_use_growth_bytes_per_round": round(heap_slope, 1), "in_use_growth_stderr_bytes_per_round": round(heap_err, 1)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--server":
        asyncio.run(_server(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--cohort", type=int, default=16, help="members drawn per round (0: none)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=200, help="calls in flight at once (all members: 0)")
    args = p.parse_args()
    args.concurrency = args.concurrency or args.members
    for seed in range(args.runs):
        out: dict = {}

        async def client(port: int, seed: int = seed) -> None:
            out.update(await _client(port, args, seed))

        with_server([sys.executable, __file__, "--server"], client)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
