"""`shoal bench coordinator`: one real coordinator against N simulated members.

The driver starts a `shoal coordinator` process (its own state file, plaintext on loopback) and
``--processes`` member processes (``python -m shoal.bench.coordinator members``) that share the
N members between them. A simulated member is a few coroutines that make the calls a peer makes,
signed with its own Ed25519 key, over its own connection (or ``--members-per-connection``
members per connection): Join, a WatchRounds stream, a Heartbeat every heartbeat interval the
coordinator gives it, Ready for every round, and, when it is in the round's cohort, a Vote.
A member left out of a round does what a peer does: it says ready holding the previous state,
takes the sync order, adopts the ordered state (a simulated download: no bytes move) and says
ready again. Nothing else runs: no tensors, no training, so every CPU second and byte of the
coordinator is the control plane's.

The report (one JSON object):
- ``joins_per_second``: N / (last join answered - first join sent).
- ``heartbeat_p50_seconds`` / ``heartbeat_p99_seconds``: latency of the heartbeats sent after
  round 0 committed (every member joined), measured by the members (call to answer).
- ``round_open_to_plan_p99_seconds``: per round, from the last Ready that let it open to the
  last participant holding the plan.
- A member in a round's cohort spends ``--train-seconds`` (uniformly 0.5x to 1.5x) of simulated
  local work after the commit, or after its state sync, before it says ready: the rounds come at
  the pace of training, not as fast as the coordinator can answer.
- ``rss_bytes``: the coordinator's peak resident memory (VmHWM); ``rss_growth_bytes_per_round``:
  the slope of its resident memory over the committed rounds of the second half of the run (up
  to the last commit: not the run's end, when every member is told and leaves);
  ``rss_growth_stderr_bytes_per_round``: its standard error (the resident size swings by
  megabytes with the requests in flight: a slope within about two standard errors of 0 is no
  measured growth). ``rss_growth_steady_bytes_per_round`` (and its ``_stderr_``): the same slope
  from ``all_members_drawn_round``, the round after which every member had taken part in a
  round (None when not reached with 50 rounds to spare): with cohorts, the rounds before it
  still draw members for the first time (docs/performance.md, "Coordinator scale"). The bounds use the
  first figure.
- ``cpu_seconds_per_second``: the coordinator's CPU time (user + system) per wall second from the
  first join to the end; ``members_cpu_seconds_per_second``: the same for the member processes
  together (what the simulated members took from the cores the coordinator shares with them).
- ``bounds`` and ``within_bounds``: the targets of docs/performance.md next to the figures.

Members, coordinator and driver share this machine, so the latencies include the members' own
scheduling delays: a loaded machine reads as a slower coordinator, never a faster one.
Every process it starts is killed when it returns, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import pathlib
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.identity import public_bytes, sign_metadata
from shoal.coordinator.heap import HeapPolicy
from shoal.coordinator.store import SQLiteStore
from shoal.processes import ProcessGroup
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.bench")

SERVICE = "/shoal.v1.Coordinator/"
BOUNDS = {"heartbeat_p99_seconds": 0.1, "rss_bytes": 1 << 30, "rss_growth_bytes_per_round": 100.0}
_ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the repository root


@dataclasses.dataclass(frozen=True)
class CoordinatorBenchOptions:
    """What to run. lease_seconds: the coordinator's lease (members heartbeat every lease / 4;
    60 s: a heartbeat every 15 s, what a deployment of thousands of volunteers runs with, since
    every heartbeat costs the coordinator a signature check and a gRPC call, ~0.3 ms of CPU).
    ready_timeout: the coordinator's ready deadline (the rounds wait at most this long for the
    last members' Ready). processes: member processes. members_per_connection: members that
    share one gRPC connection (1 = one TCP connection per member, as volunteers have).
    members_nice: the member processes' niceness (negative: ahead of other load, so that a shared
    machine's load delays the simulated members less; their delays are part of every latency).
    coordinator_profile: run the coordinator under cProfile and write its profile (pstats) to
    this path (the coordinator is then stopped with SIGTERM, not killed; its CPU figures include
    the profiler's overhead, ~1.5-2x)."""

    members: int = 1000
    rounds: int = 50
    cohort_size: int = 16
    processes: int = 4
    lease_seconds: float = 60.0
    ready_timeout: float = 10.0
    members_per_connection: int = 1
    train_seconds: float = 1.0
    coordinator_nice: int = 0
    members_nice: int = 0
    coordinator_profile: str | None = None
    accept_loops: int = 0  # the coordinator's --accept-loops (0: its default)
    timeout: float = 3600.0
    workdir: str | None = None
    seed: int = 0


# ------------------------------------------------------------------------------ measurements


class Histogram:
    """Latencies in log-spaced bins (2 % wide from 10 us): percentiles within 2 %, any count,
    a few hundred numbers to merge across processes."""

    BASE, RATIO = 1e-5, 1.02

    def __init__(self, bins: dict[int, int] | None = None) -> None:
        self.bins: dict[int, int] = dict(bins or {})

    def add(self, seconds: float) -> None:
        b = 0 if seconds <= self.BASE else int(math.log(seconds / self.BASE) / math.log(self.RATIO)) + 1
        self.bins[b] = self.bins.get(b, 0) + 1

    def merge(self, other: Histogram) -> None:
        for b, n in other.bins.items():
            self.bins[b] = self.bins.get(b, 0) + n

    @property
    def count(self) -> int:
        return sum(self.bins.values())

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding quantile `q` (seconds); 0 when empty."""
        total = self.count
        if not total:
            return 0.0
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= q * total:
                return self.BASE * self.RATIO ** b
        return self.BASE * self.RATIO ** max(self.bins)


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _second_half(samples: Iterable[tuple[int, int]], rounds: int) -> list[tuple[int, int]]:
    return [(r, rss) for r, rss in samples if rounds // 2 <= r < rounds]


def growth_per_round(samples: Iterable[tuple[int, int]], rounds: int) -> float:
    """Least-squares slope (bytes per round) of (committed rounds, RSS bytes) samples taken in
    the second half of a run of `rounds` rounds, while rounds were still running (the samples
    after the last commit measure the run's end: every member told the run finished and
    leaving); 0 with fewer than two distinct rounds."""
    return _slope(_second_half(samples, rounds))[0]


def growth_stderr(samples: Iterable[tuple[int, int]], rounds: int) -> float:
    """The standard error of `growth_per_round` (bytes per round): how far the resident size's
    swings (requests in flight, allocator pages) alone move the slope; 0 with fewer than three
    samples or two distinct rounds."""
    return _slope(_second_half(samples, rounds))[1]


def all_drawn_round(participants: Iterable[tuple[int, Iterable[str]]], members: int) -> int | None:
    """The first round after which every one of `members` members has taken part in a round,
    from (round, participants) of the committed rounds; None when some member never did.

    With cohorts of K among N members that takes ~N/K ln N rounds (a coupon collector: ~470 at
    1,000 members and K = 16); until then, each round draws members for the first time, and
    what a member costs the coordinator after its first round (its connection's buffers for
    larger messages) is still being set up (docs/performance.md, "Coordinator scale")."""
    seen: set[str] = set()
    for r, ps in sorted(participants, key=lambda x: x[0]):
        seen.update(ps)
        if len(seen) >= members:
            return r + 1
    return None


def steady_growth(samples: Iterable[tuple[int, int]], rounds: int, start: int | None,
                  min_rounds: int = 50) -> tuple[float, float] | None:
    """(slope, standard error) in bytes per round of the samples from round `start` (e.g.
    `all_drawn_round`) to the run's last commit, or None when `start` is None or fewer than
    `min_rounds` rounds are left after it."""
    if start is None or rounds - start < min_rounds:
        return None
    return _slope([(r, rss) for r, rss in samples if start <= r < rounds])


def _slope(pts: list[tuple[int, int]]) -> tuple[float, float]:
    """(slope, its standard error) of a least-squares line through `pts`."""
    if len({r for r, _ in pts}) < 2:
        return 0.0, 0.0
    n = len(pts)
    mx = sum(r for r, _ in pts) / n
    my = sum(v for _, v in pts) / n
    var = sum((r - mx) ** 2 for r, _ in pts)
    slope = sum((r - mx) * (v - my) for r, v in pts) / var
    if n < 3:
        return slope, 0.0
    residual = sum((v - my - slope * (r - mx)) ** 2 for r, v in pts)
    return slope, math.sqrt(residual / (n - 2) / var)


# ------------------------------------------------------------------------------ simulated members


_PEER_ID = re.compile(r"\b[0-9a-f]{8,}\b")
_NUDGE = pb.RoundEvent()  # from the heartbeat loop: the run moved past this member's round
ROUND_SILENCE = 15.0  # peer.agent's default round_silence


def _digest(label: str, r: int) -> bytes:
    return hashlib.blake2b(f"{label}:{r}".encode(), digest_size=32).digest()


# The columns of one second in `_Stats.beats_at`: heartbeats sent, of them slower than the bar,
# the member process's loop lag and garbage-collector pause (max, ms).
_SECOND = SENT, SLOW, LAG_MS, GC_MS = range(4)


@dataclasses.dataclass
class _Stats:
    """What one member process measured."""

    join_first: float = math.inf
    join_last: float = 0.0
    joins: int = 0
    heartbeats: Histogram = dataclasses.field(default_factory=Histogram)
    loop_lag: Histogram = dataclasses.field(default_factory=Histogram)  # this process's own scheduling delay
    heartbeat_errors: int = 0
    # second -> [heartbeats sent, of them slower than the bar, this process's loop lag and
    # garbage-collector pause (max, ms)]: indexed by SENT, SLOW, LAG_MS, GC_MS (`second`)
    beats_at: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    ready_at: dict[int, float] = dataclasses.field(default_factory=dict)  # round -> last in-sync Ready sent
    plan_at: dict[int, float] = dataclasses.field(default_factory=dict)  # round -> last plan received
    votes: int = 0
    syncs: int = 0
    finished: int = 0
    steady: bool = False  # round 0 committed: every member joined

    def error(self, **call: grpc.aio.AioRpcError) -> None:
        """Count a failed call by method, status code and the first words of its details (peer
        ids replaced by <id>, so one kind of error is one entry whatever the member)."""
        ((what, exc),) = call.items()
        details = _PEER_ID.sub("<id>", exc.details() or "")
        key = f"{what} {exc.code().name}: {details[:48]}"
        self.errors[key] = self.errors.get(key, 0) + 1

    def to_json(self) -> dict:
        return {"join_first": self.join_first if self.joins else None, "join_last": self.join_last,
                "joins": self.joins, "heartbeats": self.heartbeats.bins, "loop_lag": self.loop_lag.bins, "heartbeat_errors": self.heartbeat_errors,
                "beats_at": self.beats_at,
                "errors": self.errors, "ready_at": self.ready_at, "plan_at": self.plan_at, "votes": self.votes,
                "syncs": self.syncs, "finished": self.finished}

    def second(self, t: int) -> list[int]:
        """`beats_at`'s row of unix second `t` (made at first use)."""
        return self.beats_at.setdefault(t, [0] * len(_SECOND))


class SimulatedMember:
    """One member: the control-plane calls of a peer, no data plane (see the module docstring)."""

    def __init__(self, index: int, key: Ed25519PrivateKey, channel: grpc.aio.Channel, stats: _Stats,
                 train_seconds: float = 0.0):
        self.index, self.key, self.stats, self.train_seconds = index, key, stats, train_seconds
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.peer_id = ""
        self.state_round = 0
        self.state_digest = b""
        self.events: asyncio.Queue[pb.RoundEvent] = asyncio.Queue()
        self.interval = 2.5
        self.pooled = False  # the coordinator's last answer: this member's Ready waits in the pool
        self.done = asyncio.Event()

    async def _call(self, name: str, request, **kw):
        method = getattr(self.stub, name)
        return await method(request, metadata=sign_metadata(self.key, SERVICE + name, request), **kw)

    async def run(self) -> None:
        """Join, then play rounds until the run finishes; heartbeats and the event stream run beside."""
        await self._join()
        async with asyncio.TaskGroup() as tg:
            watch = tg.create_task(self._watch())
            beat = tg.create_task(self._heartbeats())
            try:
                await self._rounds()
            finally:
                self.done.set()
                watch.cancel()
                beat.cancel()

    async def _join(self, again: bool = False) -> None:
        """Join (again=True: after the coordinator dropped this member, as a peer rejoins; not
        counted in the join figures)."""
        req = pb.JoinRequest(public_key=public_bytes(self.key), data_address=f"127.0.0.1:{20000 + self.index % 40000}",
                             num_samples=100, version="bench")
        t0 = time.time()
        while True:
            try:
                resp = await self._call("Join", req, timeout=30.0)
                break
            except grpc.aio.AioRpcError as exc:
                self.stats.error(join=exc)
                await asyncio.sleep(random.uniform(0.1, 1.0))
        if not again:
            self.stats.join_first = min(self.stats.join_first, t0)
            self.stats.join_last = max(self.stats.join_last, time.time())
            self.stats.joins += 1
        self.peer_id = resp.peer_id
        self.interval = resp.heartbeat_interval_seconds
        if resp.HasField("sync"):
            self._adopt(resp.sync)

    async def _watch(self) -> None:
        while not self.done.is_set():
            req = pb.WatchRequest(peer_id=self.peer_id)
            try:
                async for ev in self.stub.WatchRounds(req, metadata=sign_metadata(self.key, SERVICE + "WatchRounds",
                                                                                  req)):
                    if ev.WhichOneof("event") is None:
                        continue  # an empty event (the coordinator's, after each burst): nothing to do
                    self.events.put_nowait(ev)
                    if ev.HasField("finished"):
                        return
            except grpc.aio.AioRpcError as exc:
                self.stats.error(watch=exc)
            await asyncio.sleep(random.uniform(0.05, 0.5))

    async def _heartbeats(self) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))  # members' phases spread over the interval
        behind = False
        while not self.done.is_set():
            req = pb.HeartbeatRequest(peer_id=self.peer_id)
            t0 = time.perf_counter()
            sent = int(time.time())
            # Measured when sent after round 0 committed (the report's definition): a heartbeat sent
            # during the join phase waits behind its backlog (thousands of Joins, streams and Readys
            # in the coordinator's accept queue) and was counted when its answer came after the commit.
            measured = self.stats.steady
            try:
                resp = await self._call("Heartbeat", req, timeout=10.0)
                if measured:
                    took = time.perf_counter() - t0
                    self.stats.heartbeats.add(took)
                    at = self.stats.second(sent)
                    at[SENT] += 1
                    at[SLOW] += took > BOUNDS["heartbeat_p99_seconds"]
                # A peer's safety net for a lost event (its stream opened after a commit was sent):
                # two heartbeats in a row saying the run is past this member's round, unless its
                # Ready waits in the cohort pool.
                self.pooled = resp.pooled
                late = resp.round > self.state_round and not resp.pooled
                if late and behind:
                    self.events.put_nowait(_NUDGE)
                behind = late
            except grpc.aio.AioRpcError as exc:
                self.stats.heartbeat_errors += 1
                self.stats.error(heartbeat=exc)
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # Dropped (its lease expired, e.g. while a slow Join was retried): a peer joins
                    # again and announces itself, else a round waiting for it never opens.
                    await self._join(again=True)
                    self.events.put_nowait(_NUDGE)
            await asyncio.sleep(max(0.0, self.interval - (time.perf_counter() - t0)))

    def _adopt(self, order: pb.SyncOrder) -> bool:
        """A simulated state sync: take the ordered state (no bytes move). False when not newer."""
        if order.round < self.state_round or (order.round == self.state_round and order.state_digest == self.state_digest):
            return False
        self.state_round, self.state_digest = order.round, order.state_digest
        self.stats.syncs += 1
        return True

    async def _ready(self, round_: int) -> None:
        req = pb.ReadyRequest(peer_id=self.peer_id, round=round_, num_elements=1000, dtype=pb.FLOAT32,
                              num_samples=100, state_digest=self.state_digest, state_round=self.state_round)
        in_sync = round_ == self.state_round
        while True:
            sent = time.time()
            try:
                resp = await self._call("Ready", req, timeout=30.0)
                break
            except grpc.aio.AioRpcError as exc:
                self.stats.error(ready=exc)
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return  # the round moved on meanwhile: the events say what to do
                await asyncio.sleep(random.uniform(0.05, 0.5))
        self.pooled = resp.pooled
        if in_sync:
            self.stats.ready_at[round_] = max(self.stats.ready_at.get(round_, 0.0), sent)
        if resp.HasField("sync") and self._adopt(resp.sync):
            await self._ready(self.state_round)

    async def _train(self) -> None:
        """Simulated local work of one round."""
        if self.train_seconds > 0:
            await asyncio.sleep(random.uniform(0.5, 1.5) * self.train_seconds)

    async def _rounds(self) -> None:
        await self._ready(self.state_round)
        while True:
            try:
                # Held in the pool: nothing to say until an event (or a heartbeat's nudge) comes. No
                # timer then: the round-0 commit reaches every member at once, and 10,000 timers
                # re-armed together fired together every 15 s, a burst of every member process on
                # the coordinator's cores (heartbeat tails 15 s apart: docs/performance.md).
                ev = await asyncio.wait_for(self.events.get(), None if self.pooled else ROUND_SILENCE)
            except TimeoutError:
                if self.pooled:
                    continue  # held in the pool: nothing to say
                ev = _NUDGE  # a peer announces itself again after `round_silence` without events
            if ev is _NUDGE:
                await self._ready(self.state_round)
                continue
            kind = ev.WhichOneof("event")
            if kind == "finished":
                self.stats.finished += 1
                return
            if kind == "sync":
                self.stats.steady = True  # a commit reached this member as its sync order
                if self._adopt(ev.sync):
                    await self._train()
                    await self._ready(self.state_round)
            elif kind == "plan" and ev.plan.round == self.state_round:
                p = ev.plan
                self.stats.plan_at[p.round] = max(self.stats.plan_at.get(p.round, 0.0), time.time())
                req = pb.VoteRequest(peer_id=self.peer_id, round=p.round, attempt=p.attempt, ok=True,
                                     result_digest=_digest("result", p.round),
                                     state_digest=_digest("state", p.round + 1))
                try:
                    await self._call("Vote", req, timeout=30.0)
                    self.stats.votes += 1
                except grpc.aio.AioRpcError as exc:
                    self.stats.error(vote=exc)
            elif kind == "commit":
                c = ev.commit
                self.stats.steady = True
                if c.round == self.state_round and self.peer_id in c.participants:
                    self.state_round, self.state_digest = c.round + 1, c.state_digest
                    await self._train()
                    await self._ready(self.state_round)
                elif c.round >= self.state_round:
                    # Left out of the round: say ready holding the old state; the answer is a sync order.
                    await self._ready(c.round + 1)


def member_key(seed: int, index: int) -> Ed25519PrivateKey:
    """The deterministic identity of simulated member `index`."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.blake2b(f"shoal-bench:{seed}:{index}".encode(),
                                                                digest_size=32).digest())


async def run_members(address: str, first: int, count: int, *, seed: int, per_connection: int,
                      join_rate: float, train_seconds: float, out: str) -> None:
    """Run members first .. first+count-1 against `address` until the run finishes; write the
    process's `_Stats` as JSON to `out`. Joins are spread at `join_rate` per second."""
    stats = _Stats()
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channels: list[grpc.aio.Channel] = []
    members: list[SimulatedMember] = []
    for k in range(count):
        if k % max(1, per_connection) == 0:
            # A distinct channel argument keeps grpc from sharing one connection between channels.
            channels.append(grpc.aio.insecure_channel(address, options=options + [("shoal.bench.member", first + k)]))
        members.append(SimulatedMember(first + k, member_key(seed, first + k), channels[-1], stats, train_seconds))
    async def lag() -> None:
        # How late this process's own event loop runs: the part of a measured latency that is
        # the member's, not the coordinator's.
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            if stats.steady:
                late = max(1e-6, time.perf_counter() - t0 - 0.01)
                stats.loop_lag.add(late)
                at = stats.second(int(time.time()))
                at[LAG_MS] = max(at[LAG_MS], round(1e3 * late))

    gc_started = [0.0]

    def collection(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        elif stats.steady:
            at = stats.second(int(time.time()))
            at[GC_MS] = max(at[GC_MS], round(1e3 * (time.perf_counter() - gc_started[0])))

    gc.callbacks.append(collection)
    # The coordinator's garbage-collector policy here too: 2,500 members a process are millions
    # of long-lived objects, and a full collection of them stopped a member process for up to
    # 0.9 s at 10,000 members, every heartbeat of its members then late (docs/performance.md,
    # "Coordinator scale"): the benchmark would measure its own clients.
    # Without the policy's full collection every 10 minutes: unfrozen and collected at once, the
    # heap of 2,500 members stopped their process for 0.5-1 s (the 23:29 burst of the run in
    # docs/performance.md, "Coordinator scale"). Garbage frozen here (objects alive at a freeze
    # that later die in a cycle) is kept until the process ends: a run of minutes, not a daemon.
    heap = HeapPolicy(size=lambda: stats.joins, trim=None, full_seconds=math.inf)
    try:
        async with asyncio.TaskGroup() as tg:
            lag_task = tg.create_task(lag())
            heap_task = tg.create_task(heap.run())
            for k, m in enumerate(members):
                tg.create_task(m.run())
                if join_rate > 0:
                    await asyncio.sleep(1.0 / join_rate)
            await asyncio.gather(*(m.done.wait() for m in members))
            lag_task.cancel()
            heap_task.cancel()
    finally:
        gc.callbacks.remove(collection)
        for ch in channels:
            await ch.close()
        pathlib.Path(out).write_text(json.dumps(stats.to_json()))


# ------------------------------------------------------------------------------ the driver


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and VmRSS's parts RssAnon, RssFile, RssShmem (bytes), utime + stime
    (seconds x CLK_TCK) of `pid`."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["cpu_ticks"] = int(fields[11]) + int(fields[12])
    return out


def _size(path: pathlib.Path) -> int:
    """`path`'s size in bytes, 0 when it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _coordinator_argv(opts: CoordinatorBenchOptions, wd: pathlib.Path) -> list[str]:
    n = opts.members
    profile = ["-m", "cProfile", "-o", str(pathlib.Path(opts.coordinator_profile).resolve())] \
        if opts.coordinator_profile else []
    return [sys.executable, *profile, "-m", "shoal.cli", "coordinator", "--insecure", "--listen", "127.0.0.1:0",
            "--state", str(wd / "coordinator.db"), "--ready-file", str(wd / "coordinator.addr"),
            "--rounds", str(opts.rounds), "--min-peers", "2", "--initial-peers", str(n),
            "--cohort-size", str(opts.cohort_size), "--lease-seconds", str(opts.lease_seconds),
            "--ready-timeout", str(opts.ready_timeout), "--collective-timeout", "120",
            # Every member runs on 127.0.0.1: the per-host limits are for the internet, not this.
            "--rate-limit", "1000000", "--join-rate", "1000000", "--join-burst", str(max(50, n)),
            "--reach-timeout", "0",  # simulated members serve no data plane to dial back
            "--trace-dir", str(wd),  # loop.csv: the coordinator's side of each second (coordinator.loopwatch)
            *(["--accept-loops", str(opts.accept_loops)] if opts.accept_loops else []),
            "--log-level", "warning"]


def run_coordinator_bench(opts: CoordinatorBenchOptions) -> dict:
    """Run the benchmark; returns the report (see the module docstring).

    Raises RuntimeError when a process fails or the run passes `opts.timeout`. Every process it
    started is gone when it returns or raises.
    """
    if opts.members < 2:
        raise ValueError("--members must be at least 2")
    deadline = time.monotonic() + opts.timeout
    with contextlib.ExitStack() as stack:
        if opts.workdir:
            wd = pathlib.Path(opts.workdir)
            wd.mkdir(parents=True, exist_ok=True)
        else:
            wd = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shoal-bench-coord-")))
        procs = ProcessGroup(wd, cwd=_ROOT, env={"PYTHONPATH": _ROOT})
        stack.callback(procs.close)
        ready = wd / "coordinator.addr"
        ready.unlink(missing_ok=True)
        coord = procs.start("coordinator", _coordinator_argv(opts, wd), nice=opts.coordinator_nice)
        while not ready.exists():
            if coord.poll() is not None:
                raise RuntimeError(f"coordinator exited {coord.returncode}:\n{procs.log('coordinator', 3000)}")
            if time.monotonic() > deadline:
                raise RuntimeError("coordinator did not start")
            time.sleep(0.05)
        address = ready.read_text().strip()
        base = _proc_status(coord.pid)
        base["members_cpu"] = _children_cpu()
        t_start = time.time()
        k = max(1, min(opts.processes, opts.members))
        share = [opts.members // k + (1 if i < opts.members % k else 0) for i in range(k)]
        workers = []
        first = 0
        for i, count in enumerate(share):
            out = wd / f"members-{i}.json"
            out.unlink(missing_ok=True)
            workers.append((f"members-{i}", out, procs.start(f"members-{i}", [
                sys.executable, "-m", "shoal.bench.coordinator", "members", "--coordinator", address,
                "--first", str(first), "--count", str(count), "--seed", str(opts.seed),
                "--per-connection", str(opts.members_per_connection), "--join-rate", str(max(50.0, 2000.0 / k)),
                "--train-seconds", str(opts.train_seconds), "--out", str(out)], nice=opts.members_nice)))
            first += count
        samples: list[tuple[int, int]] = []  # (rounds committed, RSS)
        parts: list[str] = []  # rss.csv's other columns: what the resident size is made of, the state file's size
        last_round = -1
        while any(p.poll() is None for _, _, p in workers):
            for name, _, p in workers:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{procs.log(name, 3000)}")
            if coord.poll() is not None:
                raise RuntimeError(f"coordinator exited {coord.returncode}:\n{procs.log('coordinator', 3000)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run did not finish within {opts.timeout:.0f} s (round {last_round})")
            with contextlib.suppress(Exception), SQLiteStore.reader(str(wd / "coordinator.db")) as store:
                last = store.last_commit()
                last_round = last.round if last is not None else -1
            st = _proc_status(coord.pid)
            samples.append((last_round + 1, st["VmRSS"]))
            parts.append(f"{time.time():.1f},{st.get('RssAnon', 0)},{st.get('RssFile', 0)},{st.get('RssShmem', 0)},"
                         f"{_size(wd / 'coordinator.db')},{_size(wd / 'coordinator.db-wal')}")
            time.sleep(0.5)
        end = _proc_status(coord.pid)
        end["members_cpu"] = _children_cpu()  # the member processes, reaped by poll(); not the coordinator
        t_end = time.time()
        if opts.coordinator_profile:
            # A graceful stop, so that cProfile writes the profile on the way out.
            coord.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                coord.wait(timeout=60)
        # The coordinator's resident memory over the rounds, for a look beyond the one slope.
        (wd / "rss.csv").write_text("rounds,rss_bytes,t,anon_bytes,file_bytes,shmem_bytes,state_bytes,wal_bytes\n"
                                    + "".join(f"{r},{v},{x}\n" for (r, v), x in zip(samples, parts)))
        stats = [json.loads(out.read_text()) for _, out, _ in workers]
        with contextlib.closing(SQLiteStore.reader(str(wd / "coordinator.db"))) as store:
            drawn = all_drawn_round(((c.round, c.participants) for c in store.load_commits()), opts.members)
        # The members' side of each second, to put next to the coordinator's loop.csv.
        # Per member process: heartbeats slow / loop lag and GC pause (max ms), "/"-separated.
        (wd / "heartbeats.csv").write_text("t,sent,slow,slow_by_process,lag_max_ms_by_process,gc_max_ms_by_process\n"
                                           + "".join(f"{t},{n},{slow},{by},{lags},{gcs}\n" for t, (n, slow, by, lags, gcs)
                                                     in sorted(_beats_at(stats).items())))
    return _report(opts, stats, samples, base, end, t_start, t_end, drawn)


def _beats_at(stats: list[dict]) -> dict[int, tuple[int, int, str, str, str]]:
    """Second -> (heartbeats sent, of them slower than the bar, then per member process and
    "/"-separated: the slow ones, its loop lag (max ms), its garbage-collector pause (max ms))."""
    seconds = sorted({int(t) for s in stats for t in s.get("beats_at", {})})
    out: dict[int, tuple[int, int, str, str, str]] = {}
    for t in seconds:
        per = [s.get("beats_at", {}).get(str(t), [0] * len(_SECOND)) for s in stats]
        out[t] = (sum(p[SENT] for p in per), sum(p[SLOW] for p in per), "/".join(str(p[SLOW]) for p in per),
                  "/".join(str(p[LAG_MS]) for p in per), "/".join(str(p[GC_MS]) for p in per))
    return out


def _report(opts: CoordinatorBenchOptions, stats: list[dict], samples: list[tuple[int, int]], base: dict,
            end: dict, t_start: float, t_end: float, drawn: int | None = None) -> dict:
    beats, lag = Histogram(), Histogram()
    for s in stats:
        beats.merge(Histogram({int(b): n for b, n in s["heartbeats"].items()}))
        lag.merge(Histogram({int(b): n for b, n in s["loop_lag"].items()}))
    join_first = min(s["join_first"] for s in stats if s["join_first"] is not None)
    join_last = max(s["join_last"] for s in stats)
    ready_at: dict[int, float] = {}
    plan_at: dict[int, float] = {}
    for s in stats:
        for r, t in s["ready_at"].items():
            ready_at[int(r)] = max(ready_at.get(int(r), 0.0), t)
        for r, t in s["plan_at"].items():
            plan_at[int(r)] = max(plan_at.get(int(r), 0.0), t)
    open_to_plan = [max(0.0, plan_at[r] - ready_at[r]) for r in plan_at if r in ready_at]
    errors: dict[str, int] = {}
    for s in stats:
        for k, n in s["errors"].items():
            errors[k] = errors.get(k, 0) + n
    wall = t_end - t_start
    hz = os.sysconf("SC_CLK_TCK")
    steady = steady_growth(samples, opts.rounds, drawn)
    report = {
        "members": opts.members,
        "rounds": opts.rounds,
        "cohort_size": opts.cohort_size,
        "processes": len(stats),
        "members_per_connection": opts.members_per_connection,
        "heartbeat_interval_seconds": opts.lease_seconds / 4,
        "train_seconds": opts.train_seconds,
        "coordinator_nice": opts.coordinator_nice,
        "members_nice": opts.members_nice,
        "accept_loops": opts.accept_loops or None,
        "joins_per_second": round(sum(s["joins"] for s in stats) / max(1e-9, join_last - join_first), 1),
        "heartbeats_measured": beats.count,
        "heartbeat_p50_seconds": round(beats.quantile(0.5), 5),
        "heartbeat_p99_seconds": round(beats.quantile(0.99), 5),
        "member_loop_lag_p99_seconds": round(lag.quantile(0.99), 5),
        "load_average": os.getloadavg()[0],
        "round_open_to_plan_p50_seconds": round(_quantile(open_to_plan, 0.5), 5),
        "round_open_to_plan_p99_seconds": round(_quantile(open_to_plan, 0.99), 5),
        "seconds_per_round": round((t_end - join_last) / max(1, opts.rounds), 3),
        "rss_bytes": end["VmHWM"],
        "rss_growth_bytes_per_round": round(growth_per_round(samples, opts.rounds), 1),
        "rss_growth_stderr_bytes_per_round": round(growth_stderr(samples, opts.rounds), 1),
        # The same slope from the round after which every member had taken part in a round (None:
        # not reached, or fewer than 50 rounds after it): growth in a steady state, beside the
        # figure of the bounds (docs/performance.md, "Coordinator scale").
        "all_members_drawn_round": drawn,
        "rss_growth_steady_bytes_per_round": (round(steady[0], 1) if steady else None),
        "rss_growth_steady_stderr_bytes_per_round": (round(steady[1], 1) if steady else None),
        "cpu_seconds_per_second": round((end["cpu_ticks"] - base["cpu_ticks"]) / hz / max(1e-9, wall), 3),
        "members_cpu_seconds_per_second": round((end["members_cpu"] - base["members_cpu"]) / max(1e-9, wall), 3),
        "wall_seconds": round(wall, 1),
        "votes": sum(s["votes"] for s in stats),
        "state_syncs": sum(s["syncs"] for s in stats),
        "members_finished": sum(s["finished"] for s in stats),
        "errors": errors,
        "bounds": dict(BOUNDS),
    }
    report["within_bounds"] = (report["heartbeat_p99_seconds"] < BOUNDS["heartbeat_p99_seconds"]
                               and report["rss_bytes"] < BOUNDS["rss_bytes"]
                               and report["rss_growth_bytes_per_round"] < BOUNDS["rss_growth_bytes_per_round"])
    return report


def add_parser(bsub) -> None:
    """Register `shoal bench coordinator` on the bench subparsers."""
    d = CoordinatorBenchOptions()
    b = bsub.add_parser("coordinator", help="one real coordinator against N simulated members")
    b.add_argument("--members", type=int, default=d.members, help=f"simulated members (default {d.members})")
    b.add_argument("--rounds", type=int, default=d.rounds, help=f"committed rounds to run (default {d.rounds})")
    b.add_argument("--cohort-size", type=int, default=d.cohort_size,
                   help=f"participants per round (default {d.cohort_size})")
    b.add_argument("--processes", type=int, default=d.processes,
                   help=f"member processes (default {d.processes})")
    b.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                   help=f"the coordinator's lease; members heartbeat every lease/4 (default {d.lease_seconds:g})")
    b.add_argument("--ready-timeout", type=float, default=d.ready_timeout,
                   help=f"the coordinator's ready deadline (default {d.ready_timeout:g})")
    b.add_argument("--members-per-connection", type=int, default=d.members_per_connection,
                   help="members sharing one gRPC connection (default 1: one each)")
    b.add_argument("--train-seconds", type=float, default=d.train_seconds,
                   help=f"simulated local work of a cohort member per round (default {d.train_seconds:g})")
    b.add_argument("--coordinator-nice", type=int, default=d.coordinator_nice,
                   help="scheduling niceness of the coordinator process (negative: ahead of the members and of "
                        "other load on a shared machine, as on a host of its own; needs root)")
    b.add_argument("--members-nice", type=int, default=d.members_nice,
                   help="scheduling niceness of the member processes (negative: the simulated members ahead of "
                        "other load on a shared machine, so that their own delays do not read as the "
                        "coordinator's; needs root)")
    b.add_argument("--coordinator-profile", metavar="PATH",
                   help="run the coordinator under cProfile and write its profile (pstats) to PATH; "
                        "read it with `python -m pstats PATH`")
    b.add_argument("--accept-loops", type=int, default=d.accept_loops,
                   help="the coordinator's --accept-loops (gRPC servers on its port; default: the coordinator's own)")
    b.add_argument("--seed", type=int, default=d.seed, help="seed of the members' keys")
    b.add_argument("--timeout", type=float, default=d.timeout, help="give up after this many seconds")
    b.add_argument("--workdir", help="keep the state file, logs and member reports here")
    b.add_argument("--json", action="store_true", help="print one JSON object on one line")


def options_from_args(a: argparse.Namespace) -> CoordinatorBenchOptions:
    return CoordinatorBenchOptions(members=a.members, rounds=a.rounds, cohort_size=a.cohort_size,
                                   processes=a.processes, lease_seconds=a.lease_seconds,
                                   ready_timeout=a.ready_timeout, members_per_connection=a.members_per_connection,
                                   train_seconds=a.train_seconds, coordinator_nice=a.coordinator_nice,
                                   members_nice=a.members_nice,
                                   coordinator_profile=a.coordinator_profile, accept_loops=a.accept_loops,
                                   timeout=a.timeout, workdir=a.workdir, seed=a.seed)


def _members_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.coordinator members")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-connection", type=int, default=1)
    ap.add_argument("--join-rate", type=float, default=500.0)
    ap.add_argument("--train-seconds", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # the time: to put a member process's stall next to the traces
    try:
        import uvloop
    except ImportError:  # pragma: no cover - non-Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(run_members(a.coordinator, a.first, a.count, seed=a.seed, per_connection=a.per_connection,
                       join_rate=a.join_rate, train_seconds=a.train_seconds, out=a.out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "members":
        _members_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m shoal.bench.coordinator members ...  (or: shoal bench coordinator ...)")
