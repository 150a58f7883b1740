"""`shoal bench allreduce`: time Shoal's all-reduce against the lower bound and against gloo.
(`shoal bench coordinator`, one coordinator against N simulated members, is shoal.bench.coordinator.)

One invocation starts a coordinator and ``--peers`` collective-job processes
(`shoal.bench.collective_job`), runs ``--warmup`` untimed rounds (default 2: the first opens the
connections and measures the links, the second is the first that reuses pooled result buffers
instead of faulting in fresh pages; steady state, as nccl-tests' warm-up iterations) plus
``--repeat`` timed rounds of a float32 all-reduce of ``--size-mb`` MB, and, with ``--baseline
gloo``, runs torch.distributed's gloo ``all_reduce`` of the same tensor the same number of times
(warm-up included) on the same network. With link lists (``--link-mbit`` or ``--up-mbit``/``--down-mbit``) every peer (and its
gloo rank) runs in its own network namespace behind kernel-shaped links (`shoal.testbeds.netbed.NetBed`,
needs root); without them everything runs on 127.0.0.1. The bed's hosts use the TCP congestion
control ``--tcp-congestion`` (default: the machine's; reported as ``tcp_congestion``), Shoal and
gloo alike: the bed has a ~10 µs base RTT, at which BBR's model of the path (bandwidth x minimum
RTT) is erratic, so a machine whose default is bbr measures a different bed than one whose
default is cubic (docs/performance.md).

On loopback the peers share a host, so chunks take the shared-memory lane (`peer.lanes.shm`, reported
as ``lane`` "shm") unless ``--no-shared-memory``; ``--also-socket`` times the socket-only data
plane too, in the same invocation (``socket_lane``). Shaped runs never use shared memory: their
namespaces stand for separate hosts. Between hosts (and on loopback without shared memory) chunks
take the bulk TCP lane (`peer.lanes.bulk`, ``lane`` "tcp"; over mutual TLS with ``--tls``: "tcp-tls"),
or gRPC streams with ``--no-tcp-lane`` (``lane`` "socket").

Every measured round must commit at its first attempt (the coordinator runs with one attempt and
deadlines of 30x the bound): the jobs run with ``--stop-on-abort``, so an aborted attempt (a
peer whose collective raises, a chunk that never comes) fails the bench at once with the round
and the coordinator's reason, rather than at ``--timeout``.

Accounting: ``cpu_seconds_median`` is the CPU time (all threads) of all participants in one timed
round, summed, median over rounds; for gloo (``baseline.cpu_seconds_median``) the ranks' CPU time
inside ``all_reduce``. ``peak_rss_bytes_max`` is the largest peak resident size (VmHWM) of a
participant process; ``peak_rss_ratio`` the largest (peak - resident size once the input existed,
before the first collective) / tensor size, ``peak_rss_ratio_from_start`` the same from the
process's start (before any tensor); the gloo ranks report the same fields.

The time of one round (``seconds_median``, ``efficiency``: the round figure) is the slowest
participant's collective time, each from its own plan's arrival to its result and the result's
vote digest: it includes the spread of the plan's arrival between peers (a peer that got its plan
first waits for the others' chunks) and the digest, neither of which gloo's timer holds. The time
of one gloo all-reduce is the slowest rank's ``all_reduce`` call after a barrier. The collective
figure (``collective_seconds_median``, ``collective_efficiency``) is gloo's definition applied to
Shoal: from the moment the last participant had its plan (every peer could start: gloo's barrier)
to the moment the last one held the result and its digest (wall clocks of one host);
``plan_skew_seconds_median`` is the plan's arrival spread (first to last peer). The report gives
the median over the timed rounds, the algorithm bandwidth ``size/time``, the bus bandwidth
``algbw·2(p-1)/p`` (the nccl-tests convention), the lower bound of
`coordinator.planner.allreduce_lower_bound` for the shaped links (0 on loopback: no shaped links
to bound it) plus, with ``--rtt-ms``, one one-way delay (the α-β bound: the last byte sent still
crosses a path), and the efficiency ``bound/measured``. ``--rtt-ms``/``--jitter-ms``/``--loss`` put
every path through the bed's packet-level delay line (shoal.testbeds.delayline), for Shoal and
gloo alike; ``--bulk-connections`` caps Shoal's connection pool per peer (peer.lanes.pool).

Compression: ``--compression none,int8,topk`` runs Shoal once per codec, in that order, in the same
invocation on the same bed (``compressions``: per codec its time, ``bytes_sent_per_peer_median``,
its bound, ``speedup_vs_float32`` and ``float32_bytes_over_these``). A dense codec's bound is
`allreduce_lower_bound` of its wire bytes; a sparse codec's (topk, dct: the sparse all-gather of
one payload per peer, ``--sparse-chunk``/``--sparse-k``/``--sparse-bits``) is ``(p-1)·S / min_i
d_i``: every peer must receive the other p-1 payloads of S bytes. The sparse runs' input is the
same tensor, its error-feedback accumulator is each job's own (peer.sparse).

Every process it starts is killed and every namespace deleted when it returns, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from shoal.bench import coordinator as bench_coordinator
from shoal.processes import ProcessGroup
from shoal.common.certs import init_certs
from shoal.common.limits import MAX_BULK_CHUNK_BYTES
from shoal.common.procexit import exit_after_gloo

log = logging.getLogger("shoal.bench")

MBIT = 1e6 / 8  # bytes/s per Mbit/s
_ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the repository root


@dataclass(frozen=True)
class BenchOptions:
    """What to run. ``up_mbit``/``down_mbit``: one entry per peer (Mbit/s, 10^6 bit/s), or empty
    for loopback. ``algorithm``: "auto" (the planner), "ring", "butterfly" or "sparse_rs" (a sparse
    compression's reduce-scatter; "auto" for the dense ones)."""

    peers: int = 4
    size_mb: float = 64.0
    up_mbit: tuple[float, ...] = ()
    down_mbit: tuple[float, ...] = ()
    baseline: str | None = None
    repeat: int = 3
    warmup: int = 2  # untimed rounds before the timed ones, Shoal and gloo alike
    algorithm: str = "auto"
    chunk_bytes: int = 1 << 20
    bulk_chunk_bytes: int = 4 << 20  # the cap when every pair has the bulk lane (rounds.bulk_chunk_bytes)
    timeout: float = 600.0
    workdir: str | None = None
    shared_memory: bool = True  # loopback only: namespaces emulate separate hosts
    also_socket: bool = False  # loopback: also time the socket-only data plane in the same run
    tcp_lane: bool = True  # between hosts (shaped): the bulk lane (peer.lanes.bulk); False: gRPC streams
    tls: bool = False  # Shoal's planes with TLS (certificates issued at join); gloo stays plaintext
    tcp_congestion: str = ""  # shaped: the hosts' TCP congestion control (NetBed), both systems alike; "" = the machine's
    rtt_ms: float = 0.0  # shaped: every path's round-trip time through the bed's delay line, Shoal and gloo alike
    jitter_ms: float = 0.0  # ... each packet's one-way delay varies by ± this
    loss: float = 0.0  # ... probability that a packet is lost, each direction
    bulk_connections: int = 16  # most connections of the bulk lane's pool to one peer (peer.lanes.pool)
    compression: tuple[str, ...] = ("none",)  # Shoal runs once per entry, in this order ([run] compression)
    sparse_chunk: int = 4096  # topk / dct: the [run] sparse_* settings
    sparse_k: int = 64
    sparse_bits: int = 2
    sparse_beta: float = 0.95  # the error-feedback accumulator's decay (it does not change the bytes or the time)
    log_level: str = "warning"  # the peer jobs' stderr (their logs in --workdir)

    @property
    def shaped(self) -> bool:
        return bool(self.up_mbit)

    @property
    def num_elements(self) -> int:
        return max(1, int(self.size_mb * 1e6) // 4)


def _summary(times: Sequence[float], size_bytes: int, p: int, bound: float) -> dict:
    med = statistics.median(times)
    algbw = size_bytes / med / 1e9 if med > 0 else 0.0
    return {
        "seconds_median": med,
        "seconds_all": list(times),
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (p - 1) / p,
        "bound_seconds": bound,
        "efficiency": bound / med if med > 0 else 0.0,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Procs(ProcessGroup):
    """Processes of one bench run (ProcessGroup), each placed on a host of the network bed when
    one is given; `close` kills them all and removes the slabs of jobs killed at the deadline."""

    def __init__(self, workdir: pathlib.Path, bed=None):
        super().__init__(workdir, cwd=_ROOT, env={"PYTHONPATH": _ROOT}, clean_slabs=True)
        self.bed = bed

    def start(self, name: str, argv: list[str], host: int | None = None, env: dict | None = None) -> subprocess.Popen:
        return super().start(name, argv, env=env,
                             popen=subprocess.Popen if host is None else functools.partial(self.bed.popen, host))

    def wait(self, name: str, proc: subprocess.Popen, deadline: float) -> None:
        self.wait_ok(proc, deadline)


def _wait_file(path: pathlib.Path, deadline: float, procs: _Procs, name: str, proc: subprocess.Popen) -> str:
    while not path.exists() or not path.read_text().strip():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{procs.log(name, 3000)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become ready")
        time.sleep(0.05)
    return path.read_text().strip()


SPARSE = ("topk", "dct")


def wire_bytes(opts: BenchOptions, compression: str) -> float:
    """Bytes of one peer's whole input on the wire under `compression`: 4n (none), 2n (fp16,
    bf16), n + 4·ceil(n/256) (int8), one sparse payload (topk, dct: peer.sparse)."""
    n = opts.num_elements
    if compression in SPARSE:
        from shoal.peer.sparse import SparseCodec

        return SparseCodec(compression, opts.sparse_chunk, opts.sparse_k, opts.sparse_bits).payload_bytes(n)
    return {"none": 4.0 * n, "fp16": 2.0 * n, "bf16": 2.0 * n}.get(compression, n + 4.0 * -(-n // 256))


def compression_bound(opts: BenchOptions, compression: str) -> float:
    """The lower bound (seconds) of the collective under `compression` on the shaped links (0 on
    loopback): dense codecs, `allreduce_lower_bound` of their wire bytes; sparse ones, every peer
    must receive the p-1 other payloads: ``(p-1)·S / min_i d_i`` (any all-gather of them)."""
    from shoal.coordinator.planner import allreduce_lower_bound

    if not opts.shaped:
        return 0.0
    up, down = [u * MBIT for u in opts.up_mbit], [d * MBIT for d in opts.down_mbit]
    size = wire_bytes(opts, compression)
    if compression in SPARSE:
        return (opts.peers - 1) * size / min(down)
    return allreduce_lower_bound(up, down, size)


def _run_shoal(opts: BenchOptions, procs: _Procs, wd: pathlib.Path, deadline: float, hosts: list[str],
               coord_host: str, bound: float, shared_memory: bool = True, compression: str = "none") -> dict:
    p = opts.peers
    n = opts.num_elements
    codec = ["--compression", compression]
    if compression in SPARSE:
        codec += ["--sparse-chunk", str(opts.sparse_chunk), "--sparse-k", str(opts.sparse_k),
                  "--sparse-bits", str(opts.sparse_bits), "--sparse-beta", repr(opts.sparse_beta)]
    # Generous deadlines: the bench measures, it must not abort a slow (shaped) round.
    per_round = max(60.0, 30 * bound)
    ready = wd / "coordinator.addr"
    coord = procs.start("coordinator", [
        sys.executable, "-m", "shoal.cli", "coordinator", "--listen", f"{coord_host}:0",
        "--state", str(wd / "coordinator.db"), "--ready-file", str(ready),
        "--rounds", str(opts.warmup + opts.repeat), "--min-peers", str(p), "--initial-peers", str(p),
        "--ready-timeout", str(per_round), "--collective-timeout", str(per_round),
        "--chunk-timeout", str(per_round), "--lease-seconds", str(max(30.0, per_round)), "--max-attempts", "1",
        "--collective", "auto" if opts.algorithm == "sparse_rs" and compression not in SPARSE else opts.algorithm,
        "--chunk-bytes", str(opts.chunk_bytes),
        "--bulk-chunk-bytes", str(opts.bulk_chunk_bytes), "--log-level", "warning", *codec,
        *_security_args(opts, wd, coord_host, "coordinator")])  # plaintext, like gloo, unless --tls
    addr = _wait_file(ready, deadline, procs, "coordinator", coord)
    jobs = []
    for r in range(p):
        out = wd / f"job-{r}.json"
        argv = [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r),
                "--size", str(n), "--key", str(wd / f"job-{r}.key"), "--out", str(out),
                "--listen", f"{hosts[r]}:0", "--timeout", str(max(60.0, deadline - time.monotonic())),
                "--no-save", "--stop-on-abort", *_security_args(opts, wd, coord_host, "peer")]
        if opts.shaped or not shared_memory:  # shaped namespaces stand for separate hosts
            argv.append("--no-shared-memory")
        if not opts.tcp_lane:
            argv.append("--no-tcp-lane")
        argv += ["--bulk-connections", str(opts.bulk_connections), "--log-level", opts.log_level]
        name = f"job-{r}"
        jobs.append((name, procs.start(name, argv, host=r if opts.shaped else None), out))
    for name, proc, _ in jobs:
        procs.wait(name, proc, deadline)
    reports = [json.loads(out.read_text()) for _, _, out in jobs]
    rounds: dict[int, list[dict]] = {}
    for rep in reports:
        for rd in rep["rounds"]:
            rounds.setdefault(rd["round"], []).append(rd)
    timed = sorted(r for r in rounds if r >= opts.warmup)
    if not timed:
        raise RuntimeError("no timed round committed")
    times = [max(rd["seconds"] for rd in rounds[r]) for r in timed]
    last = rounds[timed[-1]]
    result = {"algorithm": last[0]["algorithm"], "compression": compression, **_summary(times, n * 4, p, bound)}
    if compression in SPARSE:
        result["sparse"] = {"chunk": opts.sparse_chunk, "k": opts.sparse_k, "bits": opts.sparse_bits,
                            "beta": opts.sparse_beta}
    # Bytes one peer sent in a timed round (its chunks' payload and scales), the largest peer, median over rounds.
    result["bytes_sent_per_peer_median"] = statistics.median(max(rd.get("bytes_sent", 0) for rd in rounds[r])
                                                             for r in timed)
    predicted = [rd.get("predicted_seconds", 0.0) for rd in last]
    result["predicted_seconds"] = max(predicted) if predicted else 0.0
    result.update(_collective_figure(rounds, timed, bound))
    result["shard_fractions"] = last[0].get("shard_fractions")
    # CPU seconds (all threads) the participants spent per timed round, summed over them.
    result["cpu_seconds_median"] = statistics.median(sum(rd.get("cpu_seconds", 0.0) for rd in rounds[r]) for r in timed)
    result["links_reported"] = [rep.get("links") for rep in reports]
    # The data lane the timed rounds used: "shm" (peers on one host, peer.lanes.shm), "socket" or both.
    result["lane"] = "+".join(sorted({lane for r in timed for rd in rounds[r] for lane in rd.get("lanes", ())}))
    result.update(_memory(reports, n * 4))
    return result


def _collective_figure(rounds: dict[int, list[dict]], timed: Sequence[int], bound: float) -> dict:
    """Last plan arrival → last result, per timed round (module docstring); empty when a job did
    not report wall-clock times."""
    spans = [[(rd.get("started_at", 0.0), rd.get("ended_at", 0.0)) for rd in rounds[r]] for r in timed]
    if not spans or any(not s or not e for sp in spans for s, e in sp):
        return {}
    coll = [max(e for _, e in sp) - max(s for s, _ in sp) for sp in spans]
    med = statistics.median(coll)
    return {"collective_seconds_all": coll, "collective_seconds_median": med,
            "collective_efficiency": bound / med if bound > 0 and med > 0 else 0.0,
            "plan_skew_seconds_median": statistics.median(max(s for s, _ in sp) - min(s for s, _ in sp)
                                                          for sp in spans)}


def _memory(reports: Sequence[dict], size_bytes: int) -> dict:
    """Peak resident memory per process (VmHWM): the largest (`peak_rss_bytes_max`); per process
    what the collective and the rounds add to a process that holds its input and its committed
    state, over the tensor size, the largest (`peak_rss_ratio`) and each (`peak_rss_ratios`):
    per memory window of the job (a plan until the next, `memory_windows`) its peak minus the
    resident size once the first input existed (before the first collective) minus the committed
    state it held when the plan came (a training peer holds its model anyway; the benchmark's
    committed state is the last result), the largest window; the result buffer, the slabs,
    buffers and the next input are all in it. Reports without windows (gloo) take their
    lifetime peak. `peak_rss_ratio_first_plan`: lifetime peak minus the resident size at the
    first plan (the committed state counted too); `peak_rss_ratio_from_start`: minus the size
    at the process's start, before any tensor (its input and the cached draw included)."""
    peaks = [rep.get("peak_rss_bytes", 0) for rep in reports]

    def ratios(key: str) -> list[float]:
        return [(rep.get("peak_rss_bytes", 0) - rep.get(key, 0)) / size_bytes for rep in reports]

    def held(rep: dict) -> float:
        wins, base = rep.get("memory_windows"), rep.get("rss_before_collective_bytes", 0)
        if not wins:
            return (rep.get("peak_rss_bytes", 0) - base) / size_bytes
        # A window whose peak could not be reset is the lifetime peak: no held state is subtracted then.
        reset = all(w.get("peak_reset") for w in wins)
        return max((w["peak_rss_bytes"] - base - (w["held_state_bytes"] if reset else 0)) / size_bytes for w in wins)

    ratios_held = [held(rep) for rep in reports]
    return {"peak_rss_bytes_max": max(peaks, default=0), "peak_rss_ratio": max(ratios_held, default=0.0),
            "peak_rss_ratios": ratios_held,
            "peak_rss_ratio_first_plan": max(ratios("rss_before_collective_bytes"), default=0.0),
            "peak_rss_ratio_from_start": max(ratios("rss_baseline_bytes"), default=0.0)}


def _security_args(opts: BenchOptions, wd: pathlib.Path, coord_host: str, role: str) -> list[str]:
    """`--insecure`, or with `opts.tls` a CA and coordinator certificate for `coord_host` in
    wd/tls (made once) and, for peers, a directory with the CA certificate only: peers get their
    data-plane certificates at join, as volunteers do (docs/security.md)."""
    if not opts.tls:
        return ["--insecure"]
    tls, peer_dir = wd / "tls", wd / "tls-peer"
    if not (tls / "ca.key").exists():
        init_certs(tls, hosts=(coord_host, "127.0.0.1", "localhost"))
        peer_dir.mkdir(exist_ok=True)
        (peer_dir / "ca.pem").write_bytes((tls / "ca.pem").read_bytes())
    return ["--tls-dir", str(tls if role == "coordinator" else peer_dir)]


def _run_gloo(opts: BenchOptions, procs: _Procs, wd: pathlib.Path, deadline: float, hosts: list[str],
              bound: float) -> dict:
    p = opts.peers
    n = opts.num_elements
    port = _free_port()
    ifname = "eth0" if opts.shaped else "lo"
    jobs = []
    for r in range(p):
        out = wd / f"gloo-{r}.json"
        argv = [sys.executable, "-m", "shoal.bench.allreduce", "gloo-worker", "--rank", str(r), "--world", str(p),
                "--master", f"{hosts[0]}:{port}", "--size", str(n), "--repeat", str(opts.repeat),
                "--warmup", str(opts.warmup), "--out", str(out)]
        name = f"gloo-{r}"
        env = {"GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"}
        jobs.append((name, procs.start(name, argv, host=r if opts.shaped else None, env=env), out))
    for name, proc, _ in jobs:
        procs.wait(name, proc, deadline)
    reports = [json.loads(out.read_text()) for _, _, out in jobs]
    times = [max(ts) for ts in zip(*(rep["seconds"] for rep in reports))]
    # CPU seconds (all threads) the ranks spent in all_reduce per timed call, summed over them.
    cpu = [sum(cs) for cs in zip(*(rep.get("cpu_seconds", ()) for rep in reports))]
    return {"peers": p, "size_bytes": n * 4, "algorithm": "gloo", **_summary(times, n * 4, p, bound),
            "cpu_seconds_median": statistics.median(cpu) if cpu else 0.0, **_memory(reports, n * 4)}


def run_bench(opts: BenchOptions) -> dict:
    """Run the benchmark; returns the report dict (see the module docstring).

    Raises RuntimeError when a process fails or the run passes ``opts.timeout``; ValueError for
    inconsistent options. Every process and namespace is gone when it returns or raises.
    """
    from shoal.coordinator.planner import allreduce_lower_bound

    p = opts.peers
    if p < 2:
        raise ValueError("--peers must be at least 2")
    if opts.shaped and (len(opts.up_mbit) != p or len(opts.down_mbit) != p):
        raise ValueError("link lists need one entry per peer")
    size_bytes = opts.num_elements * 4
    bound = 0.0
    if opts.shaped:
        bound = allreduce_lower_bound([u * MBIT for u in opts.up_mbit], [d * MBIT for d in opts.down_mbit], size_bytes)
        # The α-β bound: the last byte still crosses one path after it was sent (α = one-way delay).
        bound += opts.rtt_ms / 2000.0
    deadline = time.monotonic() + opts.timeout
    with contextlib.ExitStack() as stack:
        if opts.workdir:
            wd = pathlib.Path(opts.workdir)
            wd.mkdir(parents=True, exist_ok=True)
        else:
            wd = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shoal-bench-")))
        bed = None
        if opts.shaped:
            from shoal.testbeds.netbed import NetBed, machine_congestion

            ok, why = NetBed.available()
            if not ok:
                raise RuntimeError(f"shaped links need network namespaces: {why}")
            from shoal.testbeds.netbed import Latency

            lat = Latency(opts.rtt_ms, opts.jitter_ms, opts.loss) if opts.rtt_ms or opts.loss else None
            bed = stack.enter_context(NetBed(p, list(opts.up_mbit), list(opts.down_mbit), prefix="shlb",
                                             tcp_congestion=opts.tcp_congestion or None, latency=[lat] * p))
            hosts = [bed.host_ip(i) for i in range(p)]
            coord_host = bed.root_ip
        else:
            hosts = ["127.0.0.1"] * p
            coord_host = "127.0.0.1"
        procs = _Procs(wd, bed)
        stack.callback(procs.close)
        report: dict = {"peers": p, "size_bytes": size_bytes, "network": "shaped" if opts.shaped else "loopback",
                        "tls": opts.tls, "warmup_rounds": opts.warmup, "timed_rounds": opts.repeat}
        if opts.shaped:
            report["up_mbit"], report["down_mbit"] = list(opts.up_mbit), list(opts.down_mbit)
            report["tcp_congestion"] = opts.tcp_congestion or machine_congestion()
            report.update(rtt_ms=opts.rtt_ms, jitter_ms=opts.jitter_ms, loss=opts.loss,
                          bulk_connections=opts.bulk_connections)
        first = opts.compression[0]
        report.update(_run_shoal(opts, procs, wd, deadline, hosts, coord_host,
                                 compression_bound(opts, first) if first != "none" else bound,
                                 shared_memory=opts.shared_memory, compression=first))
        if len(opts.compression) > 1:
            report["compressions"] = {first: {k: report[k] for k in _COMPARED if k in report}}
            for c in opts.compression[1:]:
                sub = wd / f"compression-{c}"
                sub.mkdir(exist_ok=True)
                cprocs = _Procs(sub, bed)
                stack.callback(cprocs.close)
                got = _run_shoal(opts, cprocs, sub, deadline, hosts, coord_host, compression_bound(opts, c),
                                 shared_memory=opts.shared_memory, compression=c)
                report["compressions"][c] = {k: got[k] for k in _COMPARED if k in got}
            _compare(report["compressions"])
        if opts.also_socket and not opts.shaped and opts.shared_memory:
            sub = wd / "socket-lane"
            sub.mkdir(exist_ok=True)
            sprocs = _Procs(sub, None)
            stack.callback(sprocs.close)
            report["socket_lane"] = _run_shoal(opts, sprocs, sub, deadline, hosts, coord_host, bound,
                                               shared_memory=False)
        if opts.baseline == "gloo":
            report["baseline"] = _run_gloo(opts, procs, wd, deadline, hosts, bound)
            b = report["baseline"]["seconds_median"]
            report["speedup_vs_baseline"] = b / report["seconds_median"] if report["seconds_median"] > 0 else 0.0
        return report


# What the report keeps of each compression's run when several are compared (`--compression a,b`).
_COMPARED = ("compression", "algorithm", "seconds_median", "seconds_all", "bound_seconds", "efficiency",
             "predicted_seconds", "bytes_sent_per_peer_median", "cpu_seconds_median", "lane", "peak_rss_ratio",
             "peak_rss_bytes_max", "sparse")


def _compare(runs: dict[str, dict]) -> None:
    """Each run's speed-up and byte ratio against the float32 run ("none"), when there is one."""
    dense = runs.get("none")
    if dense is None:
        return
    for r in runs.values():
        r["speedup_vs_float32"] = dense["seconds_median"] / r["seconds_median"] if r["seconds_median"] > 0 else 0.0
        sent = r.get("bytes_sent_per_peer_median", 0)
        r["float32_bytes_over_these"] = dense.get("bytes_sent_per_peer_median", 0) / sent if sent else 0.0


# ------------------------------------------------------------------------------- gloo worker


def gloo_worker(rank: int, world: int, master: str, size: int, repeat: int, out: str, warmup: int) -> None:
    """One torch.distributed gloo rank: ``repeat`` timed all-reduces (after ``warmup`` untimed ones) of the
    same float32 tensor the Shoal run reduces; writes {"seconds": [...]} to ``out``."""
    import datetime

    import torch
    import torch.distributed as dist

    from shoal.bench.collective_job import make_input, memory_bytes

    rss_baseline = memory_bytes()[0]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        base = torch.from_numpy(make_input(0, rank, 0, size, "float32"))
        times, cpu = [], []
        rss_before = memory_bytes()[0]  # the input made, no all_reduce run yet
        for k in range(warmup + repeat):
            x = base.clone()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            dist.all_reduce(x)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if k >= warmup:
                times.append(dt)
                cpu.append(dc)
        pathlib.Path(out).write_text(json.dumps({"seconds": times, "cpu_seconds": cpu,
                                                 "rss_baseline_bytes": rss_baseline,
                                                 "rss_before_collective_bytes": rss_before,
                                                 "peak_rss_bytes": memory_bytes()[1]}))
    finally:
        dist.destroy_process_group()


def _parse_list(s: str | None) -> tuple[float, ...]:
    if not s:
        return ()
    return tuple(float(v) for v in s.replace(" ", "").strip("[]").split(",") if v)


def options_from_args(a: argparse.Namespace) -> BenchOptions:
    """BenchOptions from `shoal bench allreduce` flags. Raises ValueError on inconsistent lists."""
    link = _parse_list(a.link_mbit)
    up, down = _parse_list(a.up_mbit), _parse_list(a.down_mbit)
    if link and (up or down):
        raise ValueError("give either --link-mbit or --up-mbit/--down-mbit")
    if link:
        up = down = link
    if bool(up) != bool(down):
        raise ValueError("--up-mbit and --down-mbit go together")
    if len(up) == 1:
        up, down = up * a.peers, down * a.peers
    if up and (len(up) != a.peers or len(down) != a.peers):
        raise ValueError(f"link lists need 1 or {a.peers} entries")
    for flag, value, ok, rule in (("--peers", a.peers, a.peers >= 2, ">= 2"),
                                  ("--size-mb", a.size_mb, 0 < a.size_mb < float("inf"), "> 0"),
                                  ("--repeat", a.repeat, a.repeat >= 1, ">= 1"),
                                  ("--warmup", a.warmup, a.warmup >= 1, ">= 1"),
                                  ("--chunk-bytes", a.chunk_bytes, a.chunk_bytes >= 1024, ">= 1024"),
                                  ("--bulk-chunk-bytes", a.bulk_chunk_bytes,
                                   1024 <= a.bulk_chunk_bytes <= MAX_BULK_CHUNK_BYTES, f"in 1024..{MAX_BULK_CHUNK_BYTES}"),
                                  ("--timeout", a.timeout, 0 < a.timeout < float("inf"), "> 0 seconds")):
        if not ok:
            raise ValueError(f"{flag} must be {rule}, got {value:g}")
    if any(not 0 < v < float("inf") for v in up + down):
        raise ValueError("link rates must be > 0 Mbit/s")
    from shoal.testbeds.netbed import is_congestion_name

    cc = a.tcp_congestion
    if cc and not up:
        raise ValueError("--tcp-congestion needs shaped links (--link-mbit or --up-mbit/--down-mbit)")
    if cc and not is_congestion_name(cc):
        raise ValueError(f"--tcp-congestion: not a congestion control name: {cc!r}")
    if (a.rtt_ms or a.loss or a.jitter_ms) and not up:
        raise ValueError("--rtt-ms, --jitter-ms and --loss need shaped links (--link-mbit or --up-mbit/--down-mbit)")
    if not 1 <= a.bulk_connections <= 256:
        raise ValueError(f"--bulk-connections must be in 1..256, got {a.bulk_connections}")
    from shoal.testbeds.netbed import Latency

    try:
        Latency(a.rtt_ms, a.jitter_ms, a.loss)
    except ValueError as exc:
        raise ValueError(f"--rtt-ms/--jitter-ms/--loss: {exc}") from None
    compression = tuple(c.strip() for c in a.compression.split(","))
    known = _run_codecs()
    if not all(compression) or any(c not in known for c in compression) or len(set(compression)) != len(compression):
        raise ValueError(f"--compression must be distinct entries of {', '.join(known)}, got {a.compression!r}")
    # The [run] section's own checks, so the bench's messages are `shoal swarm`'s ("--sparse-k: must be ...").
    from shoal.config import ConfigError, RunSection

    try:
        RunSection(sparse_chunk=a.sparse_chunk, sparse_k=a.sparse_k, sparse_bits=a.sparse_bits,
                   sparse_beta=a.sparse_beta).validate()
    except ConfigError as exc:
        raise ValueError(f"--{exc.setting.rpartition('.')[2].replace('_', '-')}: {exc}") from None
    return BenchOptions(peers=a.peers, size_mb=a.size_mb, up_mbit=up, down_mbit=down, baseline=a.baseline,
                        compression=compression, sparse_chunk=a.sparse_chunk, sparse_k=a.sparse_k,
                        sparse_bits=a.sparse_bits, sparse_beta=a.sparse_beta,
                        repeat=a.repeat, warmup=a.warmup, algorithm=a.algorithm, chunk_bytes=a.chunk_bytes,
                        bulk_chunk_bytes=a.bulk_chunk_bytes, timeout=a.timeout,
                        workdir=a.workdir, shared_memory=not a.no_shared_memory, also_socket=a.also_socket,
                        tcp_lane=not a.no_tcp_lane, tls=a.tls, tcp_congestion=a.tcp_congestion,
                        rtt_ms=a.rtt_ms, jitter_ms=a.jitter_ms, loss=a.loss, bulk_connections=a.bulk_connections,
                        log_level=getattr(a, "log_level", "warning"))


def _run_codecs() -> tuple[str, ...]:
    """The wire codecs `[run] compression` takes (its setting's choices): the ones the bench runs."""
    import dataclasses

    from shoal.config import RunSection

    return next(f.metadata["choices"] for f in dataclasses.fields(RunSection) if f.name == "compression")


def add_bench_parser(sub) -> None:
    """Register `shoal bench allreduce` and `shoal bench coordinator` on the CLI's subparsers."""
    from shoal.config import RunSection

    run = RunSection()  # the sparse flags' defaults are the [run] settings'
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    bench_coordinator.add_parser(bsub)
    b = bsub.add_parser("allreduce", help="time the all-reduce against the bound and against gloo")
    b.add_argument("--peers", type=int, default=4, help="peer processes (and gloo ranks) (default 4)")
    b.add_argument("--size-mb", type=float, default=64.0, help="tensor size in MB (10^6 bytes), float32 (default 64)")
    b.add_argument("--link-mbit", help="per-peer up and down Mbit/s: one value or a comma list (shaped netns)")
    b.add_argument("--up-mbit", help="per-peer upload Mbit/s (comma list)")
    b.add_argument("--down-mbit", help="per-peer download Mbit/s (comma list)")
    b.add_argument("--baseline", choices=["gloo"], help="also run torch.distributed gloo all_reduce (needs .[torch])")
    b.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up rounds (default 3)")
    b.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds first, Shoal and gloo alike (default 2: connections and link probes, then "
                        "the first round on reused result buffers); at least 1")
    b.add_argument("--algorithm", default="auto", choices=["auto", "ring", "butterfly", "sparse_rs"],
                   help="collective; auto = the planner's choice from measured links (default); sparse_rs = the "
                        "sparse reduce-scatter for a sparse --compression (the dense ones then take auto)")
    b.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="largest chunk through gRPC streams, bytes (default 1 MiB, the coordinator's default)")
    b.add_argument("--bulk-chunk-bytes", type=int, default=4 << 20,
                   help="largest chunk when every pair of peers has the bulk TCP lane or shared memory, bytes "
                        "(default 4 MiB, the coordinator's default)")
    b.add_argument("--no-shared-memory", action="store_true",
                   help="loopback: send every chunk through the socket (no shared-memory lane)")
    b.add_argument("--no-tcp-lane", action="store_true",
                   help="between hosts (shaped links): chunks on gRPC streams, not the bulk TCP lane")
    b.add_argument("--tls", action="store_true",
                   help="Shoal's control and data planes with TLS (gloo stays plaintext); between hosts tensor "
                        "bytes then go on the bulk lane over mutual TLS (lane tcp-tls)")
    b.add_argument("--tcp-congestion", default="", metavar="NAME",
                   help="shaped links: the TCP congestion control of every host, Shoal's and gloo's alike, e.g. "
                        "cubic or bbr (default: the machine's, which new namespaces inherit; reported as "
                        "tcp_congestion; docs/performance.md shows why it matters on this bed)")
    b.add_argument("--rtt-ms", type=float, default=0.0,
                   help="shaped links: every path's round-trip time in ms, through the bed's packet-level delay line "
                        "(shoal.testbeds.delayline), Shoal and gloo alike (default 0)")
    b.add_argument("--jitter-ms", type=float, default=0.0, help="shaped links: ± this on each packet's one-way delay")
    b.add_argument("--loss", type=float, default=0.0,
                   help="shaped links: probability that a packet is lost, each direction (e.g. 0.001)")
    b.add_argument("--bulk-connections", type=int, default=16,
                   help="most TCP connections of Shoal's bulk lane to one peer (peer.lanes.pool; 1 = one connection, "
                        "as gloo; default 16)")
    b.add_argument("--compression", default="none", metavar="LIST",
                   help=f"wire codecs, comma list of {', '.join(_run_codecs())}: Shoal runs once per entry in "
                        "the same invocation, each with its bound (sparse: (p-1) payloads into the slowest "
                        "download); key compressions (default none)")
    b.add_argument("--sparse-chunk", type=int, default=run.sparse_chunk,
                   help=f"topk / dct: elements per chunk (default {run.sparse_chunk})")
    b.add_argument("--sparse-k", type=int, default=run.sparse_k, help=f"topk / dct: kept per chunk (default {run.sparse_k})")
    b.add_argument("--sparse-bits", type=int, default=run.sparse_bits,
                   help=f"topk / dct: bits per kept value (default {run.sparse_bits})")
    b.add_argument("--sparse-beta", type=float, default=run.sparse_beta,
                   help=f"topk / dct: decay of each job's error-feedback accumulator, in [0, 1] (default {run.sparse_beta})")
    b.add_argument("--also-socket", action="store_true",
                   help="loopback: also time the socket-only data plane in the same run (key socket_lane)")
    b.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    b.add_argument("--workdir", help="keep logs and reports here")
    b.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    b.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="log level (default warning: stdout stays one JSON object)")
    b.add_argument("--log-format", default="text", choices=["text", "json"], help="log record format")


def check_extras(opts: BenchOptions) -> None:
    """What the options need is installed, before anything runs (a missing extra found after the
    Shoal part would lose its results). Raises ValueError saying what to install or choose."""
    if opts.baseline == "gloo":
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            raise ValueError('--baseline gloo needs PyTorch: pip install -e ".[torch]"') from None
    if opts.shaped and opts.tcp_congestion:
        from shoal.testbeds.netbed import NetBed

        ok, avail = NetBed.congestion_available(opts.tcp_congestion)
        if not ok:
            raise ValueError(f"--tcp-congestion: this kernel has no {opts.tcp_congestion!r} (it has: {avail})")


def cmd_bench(a: argparse.Namespace) -> int:
    try:
        opts = bench_coordinator.options_from_args(a) if a.bench == "coordinator" else options_from_args(a)
        if a.bench != "coordinator":
            check_extras(opts)
    except ValueError as exc:
        print(f"shoal bench: {exc}", file=sys.stderr)
        return 2

    def _interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C, so processes and namespaces go
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if a.bench == "coordinator":
            report = bench_coordinator.run_coordinator_bench(opts)
        else:
            report = run_bench(opts)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, ValueError) as exc:  # a process failed or the deadline passed: what it logged follows
        if isinstance(exc, ValueError) and a.bench != "coordinator":
            raise
        print(f"shoal bench{' coordinator' if a.bench == 'coordinator' else ''}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=None if a.json else 2))
    return 0


def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--repeat", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    gloo_worker(a.rank, a.world, a.master, a.size, a.repeat, a.out, a.warmup)
    exit_after_gloo(0)  # the timings are written (shoal.common.procexit)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "gloo-worker":
        _worker_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m shoal.bench.allreduce gloo-worker ...  (or: shoal bench allreduce ...)")
