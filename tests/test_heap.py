"""The coordinator's GC policy (coordinator.heap): freezing must not keep garbage."""

from __future__ import annotations

import gc
import weakref

from shoal.coordinator.heap import HeapPolicy


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
