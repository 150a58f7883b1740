"""The coordinator's per-second trace (coordinator.loopwatch): its pure parts, and loop.csv as
LoopWatch writes it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import types

from shoal.coordinator import loopwatch
from shoal.coordinator.loopwatch import COLUMNS, SLOW_SECONDS, LoopWatch, SecondStats, wait_in_core


def test_a_calls_wait_in_core_is_its_timeout_less_what_was_left_when_the_handler_ran():
    assert wait_in_core(10.0, 9.75, 0.05) == 0.2  # 0.05 s of it passed inside the interceptors
    assert wait_in_core(None, 9.75, 0.0) == 0.0  # the method's timeout is not known
    assert wait_in_core(10.0, None, 0.0) == 0.0  # the caller set no deadline
    assert wait_in_core(10.0, 10.0, 0.01) == 0.0  # never negative (clock granularity)


def test_a_second_keeps_maxima_means_and_counts_of_what_it_saw():
    s = SecondStats(t=100)
    for lag in (0.001, 0.003, 0.002):
        s.tick(lag)
    s.collection(0.004)
    s.collection(0.001)
    s.call(True, wait=0.02, handler=0.001, in_flight=1)
    s.call(True, wait=SLOW_SECONDS, handler=0.001, in_flight=2)  # slower than the bar inside the coordinator
    s.call(False, wait=0.5, handler=0.3, in_flight=1)  # not a heartbeat: only the all-call columns
    row = dict(zip(COLUMNS, s.row().strip().split(",")))
    assert row["t"] == "100" and row["ticks"] == "3"
    assert row["lag_max_ms"] == "3.0" and row["lag_mean_ms"] == "2.0"
    assert row["gc_count"] == "2" and row["gc_ms"] == "5.0" and row["gc_max_ms"] == "4.0"
    assert row["calls"] == "3" and row["heartbeats"] == "2" and row["hb_slow"] == "1"
    assert row["hb_wait_max_ms"] == "100.0" and row["hb_wait_mean_ms"] == "60.0"
    assert row["call_wait_max_ms"] == "500.0" and row["call_handler_max_ms"] == "300.0"
    assert row["in_flight_max"] == "2"


def test_an_empty_second_prints_zeros_not_a_division_error():
    row = dict(zip(COLUMNS, SecondStats(t=7).row().strip().split(",")))
    assert row["lag_mean_ms"] == "0.0" and row["hb_wait_mean_ms"] == "0.0" and row["calls"] == "0"


async def test_the_last_partial_second_carries_the_threads_columns_too(tmp_path, monkeypatch):
    # loop.csv's last row (the second the trace stopped in) was written without the threads'
    # figures: its loop_waits read 0 although the loop slept on every tick. The wall clock is
    # held at one second, so that row is the only one.
    monkeypatch.setattr(loopwatch, "time", types.SimpleNamespace(perf_counter=time.perf_counter, time=lambda: 100.0))
    watch = LoopWatch(str(tmp_path))
    task = asyncio.ensure_future(watch.run())
    await asyncio.sleep(0.1)  # ~10 ticks, each a sleep of the loop's thread in epoll
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    lines = (tmp_path / "loop.csv").read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 2
    last = dict(zip(COLUMNS, lines[1].split(",")))
    assert last["t"] == "100" and int(last["ticks"]) >= 1 and int(last["loop_waits"]) > 0, last


def test_a_memory_row_names_every_column_and_sees_a_c_allocation(monkeypatch):
    import ctypes
    import ctypes.util

    import pytest

    from shoal.coordinator import heap
    from shoal.coordinator.loopwatch import MEMORY_COLUMNS, memory_row

    row = dict(zip(MEMORY_COLUMNS, memory_row(12.0).strip().split(",")))
    assert set(row) == set(MEMORY_COLUMNS) and row["t"] == "12.0" and int(row["py_blocks"]) > 0
    if heap.malloc_stats() is None:
        pytest.skip("no glibc mallinfo2 here: the C heap's columns are empty")
    assert int(row["malloc_in_use_bytes"]) > 0 and int(row["rss_anon_bytes"]) > 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = heap.malloc_stats()["in_use"]
    blocks = [libc.malloc(1000) for _ in range(1000)]  # 1 MB in small blocks: from the arenas, not mmap
    try:
        assert heap.malloc_stats()["in_use"] - before >= 1000 * 1000
    finally:
        for b in blocks:
            libc.free(b)
    monkeypatch.setattr(heap, "MALLINFO2", None)
    row = dict(zip(MEMORY_COLUMNS, memory_row(12.0).strip().split(",")))
    assert row["malloc_in_use_bytes"] == "" and row["malloc_free_bytes"] == ""  # not glibc: unknown, not 0


async def test_the_trace_writes_a_row_a_second_with_the_machines_cpu_and_steal(tmp_path):
    watch = LoopWatch(str(tmp_path))
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(2.2)  # at least one whole second and the partial last one
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    lines = (tmp_path / "loop.csv").read_text().splitlines()
    assert lines[0].split(",") == list(COLUMNS) and len(lines) >= 3
    rows = [dict(zip(COLUMNS, line.split(","))) for line in lines[1:]]
    assert all(len(line.split(",")) == len(COLUMNS) for line in lines[1:])
    assert all(float(r["machine_busy_ms"]) >= 0 and float(r["machine_steal_ms"]) >= 0 for r in rows)
    # This process alone kept the machine busy for some of the time the rows cover.
    assert sum(float(r["machine_busy_ms"]) for r in rows) > 0
