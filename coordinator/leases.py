"""Lease deadlines in time order: which members' leases have run out, without looking at the others.

The coordinator checks leases every tick (20 times a second). Comparing every member's lease
each time costs O(N) per tick: at 10,000 members it was the largest single cost of an idle
coordinator (docs/performance.md, "One coordinator, many members"). `LeaseSchedule` keeps a
min-heap of (deadline, peer id) entries instead, so a tick costs O(1 + expiring log N).

Renewals do not touch it: a heartbeat only moves a lease *later*, so the entry already in the
heap comes due too early, never too late; when it does, the schedule reads the member's current
deadline and pushes one new entry (at most one per member per lease period, whatever the
heartbeat rate). Each member has one live entry; an entry whose time differs from the member's
recorded one (`_due`) is superseded and skipped when popped (lazy invalidation). A deadline
moved *earlier* (a member leaving, a rejoin with a shorter lease) is noted with `note`, which
pushes a new entry.

Pure: no clock, no I/O; the caller passes the time and each member's current deadline.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class LeaseSchedule:
    """Members' lease deadlines (engine seconds), earliest first; see the module docstring.

    Invariant: every noted member that has not been returned by `expired` (nor dropped because
    its deadline was unknown) has exactly one live heap entry, at or before its current deadline.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._due: dict[str, float] = {}  # peer id -> the time of its live heap entry

    def __len__(self) -> int:
        """Members scheduled (one live entry each)."""
        return len(self._due)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._due

    @property
    def entries(self) -> int:
        """Heap entries, superseded ones included (bounded: each is popped within a lease period)."""
        return len(self._heap)

    def note(self, peer_id: str, deadline: float) -> None:
        """`peer_id`'s lease ends at `deadline` (a join, or a deadline moved earlier). A deadline
        later than the member's live entry needs no call (the entry is rescheduled when it comes
        due); calling anyway is harmless. O(log N)."""
        due = self._due.get(peer_id)
        if due is None or deadline < due:
            self._due[peer_id] = deadline
            heapq.heappush(self._heap, (deadline, peer_id))

    def expired(self, now: float, deadline_of: Callable[[str], float | None]) -> list[str]:
        """The members whose lease has run out at `now` (their current deadline <= now), earliest
        deadline first (ties by peer id); they leave the schedule. `deadline_of(peer_id)` gives a
        member's current deadline, None for a member that is gone (it leaves the schedule too).
        A member whose entry came due but whose lease was renewed is rescheduled at its deadline.
        O((expired + renewed since their entries were pushed) x log N)."""
        heap, gone = self._heap, []
        while heap and heap[0][0] <= now:
            at, peer_id = heapq.heappop(heap)
            if self._due.get(peer_id) != at:
                continue  # superseded by an earlier `note`
            deadline = deadline_of(peer_id)
            if deadline is None:
                del self._due[peer_id]
            elif deadline <= now:
                del self._due[peer_id]
                gone.append((deadline, peer_id))
            else:
                self._due[peer_id] = deadline
                heapq.heappush(heap, (deadline, peer_id))
        # An entry may come due before its member's (later, not noted) deadline: order by the deadline.
        return [p for _, p in sorted(gone)]
