"""The coordinator's GC policy (coordinator.heap): freezing must not keep garbage."""

from __future__ import annotations

import gc
import weakref

import platform

from shoal.coordinator.heap import HeapPolicy, limit_arenas


class _Node:
    pass


def test_cyclic_garbage_in_the_old_generation_is_collected_before_a_freeze_not_frozen():
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the steps below
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a reference cycle: only the cyclic collector frees it
        gone = weakref.ref(a)
        gc.collect()  # the pair survives: now in the old generation, like a round's objects
        del a, b  # garbage now, in the old generation
        HeapPolicy(full_seconds=3600).step()  # no full collection due: collect, then freeze
        assert gone() is None, "the cycle was frozen instead of collected"
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_each_step_trims_the_c_heap_after_the_freeze():
    calls = []
    try:
        HeapPolicy(full_seconds=3600, trim=lambda pad: calls.append(pad) or 1).step()
        HeapPolicy(full_seconds=3600, trim=None).step()  # no trim where there is none (not glibc)
    finally:
        gc.unfreeze()
    assert calls == [0]


def test_a_step_is_due_after_the_period_or_as_soon_as_the_heap_grew_by_a_step():
    size = [0]
    policy = HeapPolicy(freeze_seconds=10.0, full_seconds=3600, trim=None, size=lambda: size[0], grow_step=200)
    start = policy._last_step
    assert not policy.due(start + 1.0)
    size[0] = 199  # members joined, fewer than a step
    assert not policy.due(start + 1.0)
    size[0] = 200
    assert policy.due(start + 1.0)
    try:
        policy.step()  # the step notes the size it ran at
    finally:
        gc.unfreeze()
    assert not policy.due(policy._last_step + 1.0)
    size[0] = 0  # members left: the heap shrinks, garbage to collect
    assert policy.due(policy._last_step + 1.0)
    size[0] = 200
    assert policy.due(policy._last_step + 10.0)  # the period alone


def test_without_a_size_only_the_period_makes_a_step_due():
    policy = HeapPolicy(freeze_seconds=10.0, full_seconds=3600, trim=None)
    assert not policy.due(policy._last_step + 9.0)
    assert policy.due(policy._last_step + 10.0)


def test_the_arena_cap_is_set_where_malloc_is_glibc():
    glibc = platform.libc_ver()[0] == "glibc"
    assert limit_arenas(8) is glibc  # a cap above the arenas this test process uses: it keeps its behaviour


def test_the_full_collection_comes_later_while_it_finds_little_and_soon_again_when_it_finds_much(monkeypatch):
    found = [0]
    monkeypatch.setattr(gc, "collect", lambda *generation: found[0])
    policy = HeapPolicy(full_seconds=600.0, trim=None, full_max_seconds=2400.0, quiet_objects=100)
    try:
        periods = []
        for freed in (3, 99, 5, 100, 0):
            found[0] = freed
            policy._next_full = 0.0  # due now
            policy.step()
            periods.append(policy.full_period)
            assert policy._next_full == policy._last_step + policy.full_period
        # 600 -> 1200 -> 2400 (the cap) -> 2400; 100 found: back to 600; then 1200.
        assert periods == [1200.0, 2400.0, 2400.0, 600.0, 1200.0]
        policy._next_full = policy._last_step + 1e9
        found[0] = 10**6
        policy.step()  # not a full collection: the period stays
        assert policy.full_period == 1200.0
    finally:
        gc.unfreeze()
