"""Rate-limited log lines: a record per round is useful to a person at one round a minute and
noise at ten rounds a second.

`Throttle.due()` says whether the next line may be written now (at most one per `seconds`) and
how many were held back since the last one, so a line can say "(+12 more since the last line)".
Pure bookkeeping: no logging, no threads; the caller passes a clock for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Throttle:
    """At most one line per `seconds` (monotonic clock)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.next_at = float("-inf")
        self.held = 0

    def due(self) -> int | None:
        """None while lines are held back (the caller logs at debug instead); otherwise the number
        held back since the last line written, and the window starts again."""
        now = self.clock()
        if now < self.next_at:
            self.held += 1
            return None
        held, self.held = self.held, 0
        self.next_at = now + self.seconds
        return held


def more(held: int) -> str:
    """The suffix of a line written after `held` were held back: "" or " (+N more since the last line)"."""
    return f" (+{held} more since the last line)" if held else ""
