"""A process that all-reduces synthetic tensors through a coordinator: the round protocol of
`shoal peer`, with no training.

Used by the tests (all-reduce correctness across real processes) and by `shoal bench`. Each
process runs the peer agent (peer.agent.PeerAgent: join, lease and heartbeats, the round-event
watch, retries, state sync, link measurement; the same RoundClient as `shoal peer`) with an
`ArrayWorkload` whose input in round r is a tensor of `--size` elements drawn from a seeded
generator (`make_input`), and the plain-sum contribution policy: every round commits the SUM
of the participants' inputs (what gloo's all_reduce computes), and that sum is the committed
state. The JSON report has, per collective attempt that produced a result, `rounds[]` (seconds,
bytes_sent, algorithm, participants, predicted_seconds, cpu_seconds, shard_fractions, lanes,
chunk_bytes, aggregator, flagged), and `committed`, `last_digest`, `links`, `peer_id`,
`wall_seconds`, `rss_baseline_bytes` (resident bytes at start, before any tensor),
`rss_before_collective_bytes` (resident bytes when the first plan came: the first input made, no
collective run yet), `peak_rss_bytes` (the process's peak resident bytes, VmHWM) and
`memory_windows` (per plan until the next one: `round`, `attempt`, `rss_at_plan_bytes`,
`held_state_bytes` (the committed state the job held when the plan came), `peak_rss_bytes` (the
peak within the window when `peak_reset`, else the lifetime peak so far)). The result of the last round is saved as PATH.npy next to the JSON report.

    python -m shoal.bench.collective_job --coordinator HOST:PORT --rank I --size N --out PATH \
        (--insecure | --tls-dir DIR) [--join-token T]

With `--aggregators krum,median,...` shard owners run those aggregators (round r uses entry
r mod len; the coordinator must plan the butterfly); `--attack NAME` makes this process send
forged tensors (peer.testing.byzantine). Every round's result is saved in PATH.npz (key "r<round>").
With `--stop-on-abort` (what `shoal bench` passes: a measured round must commit at its first
attempt) the job exits 3 at the first aborted attempt, naming the round and the coordinator's
reason, instead of playing the round again until `--timeout`.
"""

from __future__ import annotations

import argparse
import logging
import asyncio
import contextlib
import functools
import gc
import json
import sys
import time

import numpy as np

from shoal.common.attempts import shown_attempt
from shoal.common.plan import Plan
from shoal.common.security import Security
from shoal.peer.agent import PeerAgent, PeerConfig
from shoal.peer.contribution import Forgery, SumContribution
from shoal.peer.rounds import Aborted, CollectiveRecord, Outcome, RoundListener, RoundOutcome
from shoal.peer.training import RunConfig
from shoal.peer.workloads.base import ArrayWorkload

# Seconds a finished job keeps serving its last state (for a peer that fell behind at the end).
FINISH_LINGER_SECONDS = 0.5
# Committed states a job serves: only the newest. Its state is the whole result (64 MB in the
# benchmark); holding older ones for joiners' downloads, as training peers do, grows the live
# set by one result per round over the first rounds, and each of those rounds pays for fresh
# pages (page faults, ~100 ms of CPU per 64 MB on a busy host) while the timed collectives run.
HELD_STATES = 1
EXIT_ABORTED = 3  # --stop-on-abort: an attempt was aborted


class JobAborted(RuntimeError):
    """An attempt was aborted while the job ran with `stop_on_abort` (the message names the
    round, the attempt and the coordinator's reason)."""


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
    return JobInputs(seed, rank, size, dtype)(round_)


class JobInputs:
    """The job's inputs, `make_input`'s values (the sum in float32, rounded once to `dtype`)
    written round after round into one `(size,)` buffer of `dtype`, so that the
    job holds one input, not the last round's and the next one's side by side (64 MB each in the
    benchmark). Safe because the agent asks for round r+1's input only once round r is over
    (committed, synced or left): no collective still reads the buffer then, and every lane
    copied what it sent (peer.collectives)."""

    def __init__(self, seed: int, rank: int, size: int, dtype: str):
        self.seed, self.rank, self.size, self.dtype = seed, rank, size, np.dtype(dtype)
        self.buf: np.ndarray | None = None

    def __call__(self, round_: int) -> np.ndarray:
        if self.buf is None:
            self.buf = np.empty(self.size, dtype=self.dtype)
        np.add(_base_input(self.seed, self.rank, self.size), np.float32(0.01 * round_), out=self.buf,
               casting="unsafe")
        return self.buf


def reset_peak() -> bool:
    """Reset this process's peak resident size (VmHWM) to its current resident size (Linux >= 4.0:
    /proc/self/clear_refs "5"), so that the next `memory_bytes()[1]` is the peak since now;
    False where it cannot (the peak then stays the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_bytes() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process (VmRSS, VmHWM of /proc/self/status; 0, 0
    where there is none)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def shard_fractions(plan: Plan) -> list[float]:
    """Share of the tensor each participant (in collective order) owns."""
    n = plan.shard_bounds[-1] or 1
    out = [0.0] * plan.size
    for k, owner in enumerate(plan.shard_owner):
        out[owner] += (plan.shard_bounds[k + 1] - plan.shard_bounds[k]) / n
    return out


class JobReport(RoundListener):
    """The job's report (module docstring), filled as rounds go by."""

    def __init__(self, rank: int, size: int, dtype: str, contribution: SumContribution, keep_results: bool):
        self.contribution = contribution
        self.keep_results = keep_results
        self.workload: ArrayWorkload | None = None
        self.report: dict = {"rank": rank, "rounds": [], "size": size, "dtype": dtype, "results": {}}
        self.rss_before_collective: int | None = None  # at the first plan: the first input exists
        self.windows: list[dict] = []  # per plan, until the next one (`memory_window`)
        self._window: dict | None = None
        self.peak_before_plans = 0  # peak resident bytes before the first plan
        self.first_abort: asyncio.Future[Aborted] | None = None  # set by run_job with stop_on_abort

    def on_plan(self, plan: Plan) -> None:
        rss, peak = memory_bytes()
        if self.rss_before_collective is None:
            self.rss_before_collective, self.peak_before_plans = rss, peak
        self.close_window(peak)
        held = self.workload.state.params.nbytes if self.workload is not None else 0
        self._window = {"round": plan.round, "attempt": plan.attempt, "rss_at_plan_bytes": rss,
                        "held_state_bytes": held, "peak_reset": reset_peak()}

    def close_window(self, peak: int | None = None) -> None:
        """End the open memory window: its peak resident bytes `peak` (VmHWM read now when None:
        since its plan when `peak_reset`, else the process's lifetime peak)."""
        if self._window is not None:
            self._window["peak_rss_bytes"] = memory_bytes()[1] if peak is None else peak
            self.windows.append(self._window)
            self._window = None

    def on_collective(self, rec: CollectiveRecord) -> None:
        p = rec.plan
        self.report["rounds"].append({
            "round": p.round, "attempt": p.attempt, "seconds": rec.seconds, "bytes_sent": rec.bytes_sent,
            "algorithm": p.collective, "participants": p.size, "flagged": list(rec.flagged),
            "predicted_seconds": p.predicted_seconds, "cpu_seconds": rec.cpu_seconds,
            "shard_fractions": shard_fractions(p), "lanes": list(rec.lanes), "chunk_bytes": p.chunk_bytes,
            "aggregator": self.contribution.aggregator(p.round),
            "started_at": rec.started_at, "ended_at": rec.ended_at})
        if rec.secure is not None:
            self.report["rounds"][-1].update(
                secure_bytes_sent=rec.secure.bytes_sent, secure_bytes_received=rec.secure.bytes_received,
                secure_seconds=rec.secure.seconds, secure_revealed=rec.secure.revealed)

    def on_abort(self, ev: Aborted) -> None:
        self.report.setdefault("aborts", []).append({"round": ev.round, "attempt": ev.attempt, "reason": ev.reason,
                                                     "excluded": list(ev.excluded), "will_retry": ev.will_retry})
        if self.first_abort is not None and not self.first_abort.done():
            self.first_abort.set_result(ev)

    def on_outcome(self, outcome: RoundOutcome) -> None:
        if outcome.kind is Outcome.COMMITTED and self.keep_results and self.workload is not None:
            self.report["results"][f"r{outcome.round}"] = self.workload.state.params


async def run_job(coordinator: str, rank: int, size: int, dtype: str, key_path: str, seed: int = 0,
                  listen: str = "127.0.0.1:0", timeout: float = 120.0, security: Security | None = None,
                  join_token: str = "", aggregators: tuple[str, ...] = (), attack: str = "",
                  keep_results: bool = True, shared_memory: bool = True, tcp_lane: bool = True,
                  relay: str | None = None, bulk_connections: int = 16, stop_on_abort: bool = False) -> dict:
    """Play rounds until the coordinator finishes the run; returns the report dict (module
    docstring) plus `last_result` (the last committed sum) and `results` (every committed
    round's sum when `keep_results`).

    Failure semantics are the peer agent's: aborted rounds are retried, a job left out of a
    round syncs the committed sum from the others; with `stop_on_abort` the first aborted attempt
    raises JobAborted instead. Raises TimeoutError after `timeout` seconds, or what the agent
    raises (e.g. a refused join).
    """
    rss_baseline = memory_bytes()[0]  # before any tensor: what the collective and its inputs add is on top
    contribution = SumContribution(aggregators, Forgery(attack, None, np.random.default_rng(rank)))
    listener = JobReport(rank, size, dtype, contribution, keep_results)

    def workload(cfg: RunConfig) -> ArrayWorkload:
        listener.workload = ArrayWorkload(cfg, JobInputs(seed, rank, size, dtype), size, dtype)
        return listener.workload

    config = PeerConfig(coordinator=coordinator, listen=listen, key_path=key_path,
                        security=security or Security(insecure=True), join_token=join_token,
                        shared_memory=shared_memory, tcp_lane=tcp_lane, bulk_connections=bulk_connections,
                        connect_timeout=timeout,
                        finish_linger=FINISH_LINGER_SECONDS, held_states=HELD_STATES, relay=relay,
                        freeze_heap=True)
    agent = PeerAgent(config, workload, contribution=contribution, listeners=[listener])
    async with asyncio.timeout(timeout):
        if not stop_on_abort:
            await agent.run()
        else:
            listener.first_abort = asyncio.get_running_loop().create_future()
            run = asyncio.ensure_future(agent.run())
            await asyncio.wait({run, listener.first_abort}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                ev = listener.first_abort.result()
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
                raise JobAborted(f"round {ev.round}.{shown_attempt(ev.attempt)} aborted: {ev.reason}")
            run.result()
    report, st = listener.report, listener.workload.state
    listener.close_window()
    report["peer_id"] = agent.peer_id
    report["memory_windows"] = listener.windows
    report["rss_baseline_bytes"] = rss_baseline
    report["peak_rss_bytes"] = max([memory_bytes()[1], listener.peak_before_plans,
                                    *(w["peak_rss_bytes"] for w in listener.windows)])
    report["rss_before_collective_bytes"] = listener.rss_before_collective or rss_baseline
    report["committed"] = st.rounds
    report["gc_frozen_objects"] = gc.get_freeze_count()  # the startup heap, out of full collections (PeerConfig.freeze_heap)
    if st.rounds:
        report["last_digest"] = st.digest().hex()
        report["last_result"] = st.params
    up, down, rtt = agent.links.aggregate()
    report["links"] = {"up_bytes_per_s": up, "down_bytes_per_s": down, "rtt_seconds": rtt}
    return report


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
    ap.add_argument("--attack", default="", help="send forged tensors (peer.testing.byzantine)")
    ap.add_argument("--no-save", action="store_true", help="write no results (.npy/.npz), only the JSON report")
    ap.add_argument("--relay", default=None, help="relay HOST:PORT to be reached through (docs/nat.md)")
    ap.add_argument("--no-shared-memory", action="store_true",
                    help="send every chunk through the socket, also to peers on this host")
    ap.add_argument("--no-tcp-lane", action="store_true",
                    help="send chunks to peers on other hosts on gRPC, not on the bulk lane (peer.lanes.bulk)")
    ap.add_argument("--bulk-connections", type=int, default=16,
                    help="most TCP connections of the bulk lane to one peer (peer.lanes.pool)")
    ap.add_argument("--stop-on-abort", action="store_true",
                    help=f"exit {EXIT_ABORTED} at the first aborted attempt instead of playing the round again")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="log level of this job's stderr (the bench passes its own)")
    a = ap.parse_args()
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    security = Security(tls_dir=a.tls_dir, insecure=a.insecure or not a.tls_dir)
    aggs = tuple(x for x in a.aggregators.split(",") if x)
    t0 = time.time()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    try:
        report = run(run_job(a.coordinator, a.rank, a.size, a.dtype, a.key, a.seed, a.listen, a.timeout, security,
                             a.join_token, aggs, a.attack, keep_results=not a.no_save,
                             shared_memory=not a.no_shared_memory, tcp_lane=not a.no_tcp_lane, relay=a.relay,
                             bulk_connections=a.bulk_connections, stop_on_abort=a.stop_on_abort))
    except JobAborted as exc:
        print(f"collective_job: {exc}", file=sys.stderr)
        sys.exit(EXIT_ABORTED)
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
