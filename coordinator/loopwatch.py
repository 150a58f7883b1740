"""Where a call's time goes inside the coordinator, second by second (`--trace-dir`).

A member measures a heartbeat from its call to the answer; the coordinator's part of that splits
into three, and this module records each of them once a second, so that a slow heartbeat can be
put next to what the coordinator was doing at that second:

- **waiting in gRPC core** before the coordinator's event loop takes the call: the caller's
  timeout (which the handler does not see: `CallTimer` is given it, 10 s for heartbeats, what
  the benchmark's members set; shoal peers set `rpc_timeout`, 5 s by default, and then the
  column reads 5 s high) minus what is left of the deadline when the first interceptor runs.
  The caller sends its timeout as a relative `grpc-timeout`, which gRPC core turns into a
  deadline when it reads the headers; HPACK sends a timeout up to 3 % shorter than one sent
  before on the connection as that earlier one, so the caller's own delay before sending
  (up to ~0.3 s of 10 s) hides in it: the column is the wait in the coordinator's gRPC core
  and accept path, plus only what the caller's delay exceeds that by;
- **in the handler**: from the outermost interceptor (`CallTimer`) to the answer: gRPC handing
  over the request message, the interceptors (signature check, rate limit, membership), the
  engine;
- **the event loop's lag**: a 10 ms ticker's delay (a stall of the loop: a collection, a commit,
  a cohort draw, a long callback) and the garbage collector's pauses (`gc.callbacks`);
- **the threads** (from /proc): the event loop's thread's CPU and its voluntary and involuntary
  context switches, and the CPU of the process's other threads (gRPC core's);
- **the machine** (/proc/stat): the CPU time all cores spent busy and the time the hypervisor
  took from this virtual machine's CPUs (steal: every process of the machine stops together,
  whatever its priority).

`SecondStats` is the pure accumulator (one CSV row per second); `LoopWatch` feeds it and writes
`loop.csv`. The cost is one `perf_counter()` pair per call and a 10 ms ticker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import pathlib
import threading
import time
import sys
from typing import TextIO

import grpc

from shoal.coordinator.heap import malloc_stats

TICK_SECONDS = 0.01
COLUMNS = ("t", "ticks", "lag_max_ms", "lag_mean_ms", "gc_count", "gc_ms", "gc_max_ms", "calls", "streams",
           "heartbeats", "hb_wait_max_ms", "hb_wait_mean_ms", "hb_handler_max_ms", "hb_handler_mean_ms",
           "hb_slow", "call_wait_max_ms", "call_handler_max_ms", "in_flight_max", "loop_cpu_ms", "threads_cpu_ms",
           "loop_preempted", "loop_waits", "machine_busy_ms", "machine_steal_ms")
MEMORY_COLUMNS = ("t", "py_blocks", "malloc_in_use_bytes", "malloc_free_bytes", "malloc_mmapped_bytes",
                  "rss_anon_bytes")
MEMORY_EVERY_SECONDS = 5.0  # memory.csv's period (glibc's mallinfo2 walks the free lists)
SLOW_SECONDS = 0.1  # a heartbeat slower than this inside the coordinator counts in hb_slow (the bar)


@dataclasses.dataclass
class SecondStats:
    """What one second held (times in seconds; the row prints milliseconds)."""

    t: int
    ticks: int = 0
    lag_max: float = 0.0
    lag_sum: float = 0.0
    gc_count: int = 0
    gc_sum: float = 0.0
    gc_max: float = 0.0
    calls: int = 0
    streams: int = 0
    heartbeats: int = 0
    hb_wait_max: float = 0.0
    hb_wait_sum: float = 0.0
    hb_handler_max: float = 0.0
    hb_handler_sum: float = 0.0
    hb_slow: int = 0
    call_wait_max: float = 0.0
    call_handler_max: float = 0.0
    in_flight_max: int = 0
    loop_cpu: float = 0.0  # CPU seconds of the event loop's thread in this second
    threads_cpu: float = 0.0  # of the process's other threads (gRPC core's)
    loop_preempted: int = 0  # involuntary context switches of the loop's thread (it wanted a core)
    loop_waits: int = 0  # voluntary ones (it slept: epoll, a lock, I/O)
    machine_busy: float = 0.0  # CPU seconds every core of the machine spent busy (not idle, iowait or steal)
    machine_steal: float = 0.0  # CPU seconds the hypervisor took from the machine's virtual CPUs

    def tick(self, lag: float) -> None:
        self.ticks += 1
        self.lag_max = max(self.lag_max, lag)
        self.lag_sum += lag

    def collection(self, seconds: float) -> None:
        self.gc_count += 1
        self.gc_sum += seconds
        self.gc_max = max(self.gc_max, seconds)

    def call(self, heartbeat: bool, wait: float, handler: float, in_flight: int) -> None:
        """A unary call ended: `wait` in gRPC core before the loop took it (0 when the caller set no
        deadline), `handler` from the first interceptor to the answer."""
        self.calls += 1
        self.call_wait_max = max(self.call_wait_max, wait)
        self.call_handler_max = max(self.call_handler_max, handler)
        self.in_flight_max = max(self.in_flight_max, in_flight)
        if heartbeat:
            self.heartbeats += 1
            self.hb_wait_max = max(self.hb_wait_max, wait)
            self.hb_wait_sum += wait
            self.hb_handler_max = max(self.hb_handler_max, handler)
            self.hb_handler_sum += handler
            self.hb_slow += wait + handler > SLOW_SECONDS

    def row(self) -> str:
        ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
        mean = lambda s, n: ms(s / n) if n else "0.0"  # noqa: E731
        return ",".join((str(self.t), str(self.ticks), ms(self.lag_max), mean(self.lag_sum, self.ticks),
                         str(self.gc_count), ms(self.gc_sum), ms(self.gc_max), str(self.calls), str(self.streams),
                         str(self.heartbeats), ms(self.hb_wait_max), mean(self.hb_wait_sum, self.heartbeats),
                         ms(self.hb_handler_max), mean(self.hb_handler_sum, self.heartbeats), str(self.hb_slow),
                         ms(self.call_wait_max), ms(self.call_handler_max), str(self.in_flight_max),
                         ms(self.loop_cpu), ms(self.threads_cpu), str(self.loop_preempted),
                         str(self.loop_waits), ms(self.machine_busy), ms(self.machine_steal))) + "\n"


def wait_in_core(timeout: float | None, left: float | None, since_intercept: float) -> float:
    """Seconds a call waited in gRPC core before its first interceptor ran: the caller's
    `timeout` minus the deadline `left` when read, `since_intercept` seconds after that
    interceptor started; 0.0 when either is unknown."""
    if timeout is None or left is None:
        return 0.0
    return max(0.0, timeout - left - since_intercept)


def rss_anon() -> int:
    """This process's anonymous resident memory (bytes, /proc/self/status RssAnon; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_row(t: float) -> str:
    """One row of memory.csv (MEMORY_COLUMNS): Python's allocated blocks (`sys.getallocatedblocks`,
    every object and buffer from Python's allocators), the C heap's bytes in use, free (kept by
    the arenas) and mapped (`heap.malloc_stats`; empty where unknown), the anonymous resident
    size. What grows tells where a growth of the resident size is: Python objects, C allocations
    (gRPC core, protobuf, SQLite, OpenSSL), or free memory the allocator keeps."""
    m = malloc_stats()
    c = (str(m["in_use"]), str(m["free"]), str(m["mmapped"])) if m is not None else ("", "", "")
    return ",".join((f"{t:.1f}", str(sys.getallocatedblocks()), *c, str(rss_anon()))) + "\n"


class LoopWatch:
    """Feeds `SecondStats` and writes one CSV row a second to `dir/loop.csv`, and one every
    MEMORY_EVERY_SECONDS to `dir/memory.csv` (`memory_row`), until cancelled."""

    def __init__(self, directory: str):
        self.path = pathlib.Path(directory) / "loop.csv"
        self.memory_path = pathlib.Path(directory) / "memory.csv"
        self._memory_due = 0.0
        self._memory: TextIO | None = None
        self.now = SecondStats(int(time.time()))
        self.in_flight = 0
        self._gc_t0 = 0.0
        self._out: TextIO | None = None
        self._last_threads = (0.0, 0.0, 0, 0)  # `_threads()` at the last row written

    def _threads(self) -> tuple[float, float, int, int]:
        """(CPU seconds of the loop's thread, of the others, the loop thread's involuntary and
        voluntary context switches), cumulative, from /proc (zeros where there is none)."""
        loop = others = 0.0
        preempted = waits = 0
        me = threading.get_native_id()
        hz = os.sysconf("SC_CLK_TCK")
        try:
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / hz
                if int(tid) == me:
                    loop = cpu
                    with open(f"/proc/self/task/{tid}/status") as f:
                        for line in f:
                            if line.startswith("nonvoluntary_ctxt_switches"):
                                preempted = int(line.split()[1])
                            elif line.startswith("voluntary_ctxt_switches"):
                                waits = int(line.split()[1])
                else:
                    others += cpu
        except OSError:  # not Linux, or a thread ended while being read
            pass
        return loop, others, preempted, waits

    @staticmethod
    def _machine() -> tuple[float, float]:
        """(busy, steal) CPU seconds of all cores together since boot, from /proc/stat's "cpu"
        line (zeros where there is none). Busy: user, nice, system, irq, softirq."""
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return 0.0, 0.0
        ticks = [int(x) for x in fields[1:9]] + [0] * (8 - len(fields[1:9]))
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        return (user + nice + system + irq + softirq) / hz, steal / hz

    def _roll(self) -> None:
        t = int(time.time())
        if t != self.now.t and self._out is not None:
            self._write_row()
            self.now = SecondStats(t)
            if self._memory is not None and t >= self._memory_due:
                self._memory_due = t + MEMORY_EVERY_SECONDS
                self._memory.write(memory_row(time.time()))
                self._memory.flush()

    def _write_row(self) -> None:
        """Write `now` with the threads' CPU and context switches since the last row."""
        assert self._out is not None
        threads = self._threads()
        last, self._last_threads = self._last_threads, threads
        self.now.loop_cpu, self.now.threads_cpu = threads[0] - last[0], threads[1] - last[1]
        self.now.loop_preempted, self.now.loop_waits = threads[2] - last[2], threads[3] - last[3]
        machine = self._machine()
        last_m, self._last_machine = self._last_machine, machine
        self.now.machine_busy, self.now.machine_steal = machine[0] - last_m[0], machine[1] - last_m[1]
        self._out.write(self.now.row())
        self._out.flush()

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.now.collection(time.perf_counter() - self._gc_t0)

    async def run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = self.path.open("w")
        self._memory = self.memory_path.open("w")
        self._memory.write(",".join(MEMORY_COLUMNS) + "\n")
        self._last_threads = self._threads()
        self._last_machine = self._machine()
        self._out.write(",".join(COLUMNS) + "\n")
        gc.callbacks.append(self._gc)
        try:
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(TICK_SECONDS)
                self.now.tick(max(0.0, time.perf_counter() - t0 - TICK_SECONDS))
                self._roll()
        finally:
            gc.callbacks.remove(self._gc)
            self._write_row()  # the last, partial second (a run's end is worth seeing)
            self._out.close()
            self._memory.close()


class CallTimer(grpc.aio.ServerInterceptor):
    """The outermost interceptor: each unary call's core wait and handler time into `watch`
    (`heartbeat`: the method whose figures get their own columns). `timeouts`: the timeout
    (seconds) callers set per method, which the core wait is computed from (see the module
    docstring); a method not in it, or a call without a deadline, counts a wait of 0. Streams
    are counted, not timed."""

    def __init__(self, watch: LoopWatch, heartbeat: str, timeouts: dict[str, float]):
        self.watch = watch
        self.heartbeat = heartbeat
        self.timeouts = timeouts

    async def intercept_service(self, continuation, handler_call_details):
        t0 = time.perf_counter()
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is None:
            self.watch.now.streams += 1
            return handler
        inner = handler.unary_unary
        beat = handler_call_details.method == self.heartbeat
        watch = self.watch

        sent = self.timeouts.get(handler_call_details.method)

        async def unary_unary(request, context):
            watch.in_flight += 1
            left, t1 = context.time_remaining(), time.perf_counter()
            try:
                return await inner(request, context)
            finally:
                watch.in_flight -= 1
                wait = wait_in_core(sent, left, t1 - t0)
                watch.now.call(beat, wait, time.perf_counter() - t0, watch.in_flight + 1)

        return handler._replace(unary_unary=unary_unary)
