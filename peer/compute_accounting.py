"""Compute accounting of a PyTorch trainer in a swarm: where its time went, and the training window.

`TrainerTimes` sums the trainer thread's seconds by phase (inner steps, hand-over, waiting on a
round, landing the committed parameters); `ComputeLedger` turns the inner steps' times into the
training window's compute and length, the `compute_utilization` of shoal.bench.lm_worker
(docs/training.md, "Compute utilization"). Both are pure (no clock of their own: times are
given), filled by `shoal.torch`'s optimizers (`opt.times`, `opt.ledger`); this module is the
benchmark's measurement, not part of the training API.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerTimes:
    """Where the trainer thread's time inside the wrapper went, seconds (monotonic clock).

    steps: the inner steps, whole (the caller's batch, forward and backward as measured by
        `step()`, see there, plus the inner optimizer's step); inner_optimizer: the part of
        `steps` in the inner optimizer's step; handover: flattening the local parameters and
        handing them to the agent; wait: blocked on a round (without overlap the whole round;
        with it only `outer_step()` called directly while a round is in flight); land: loading the
        committed parameters into the model (with overlap: folding them in)."""

    steps: float = 0.0
    inner_optimizer: float = 0.0
    handover: float = 0.0
    wait: float = 0.0
    land: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in vars(self).items()}


class ComputeLedger:
    """Inner-step seconds against the training window, from times it is given (pure, no clock).

    The training window runs from the start of the first inner step to the hand-over of the last
    local phase that a committed state answered (the end of the last phase whose work reached a
    commit); the compute in it is the seconds of the inner steps of those phases. Steps of a
    phase the run discarded (the phase after the last commit, answered by the end of the run)
    are outside it, with or without overlap; so are the join and the end of the run. This is
    the figure INTELLECT-1 reports (Jaghouar et al. 2024, arXiv:2412.01152, 83-96 %: the share of
    the training time spent computing rather than blocked in the outer step's all-reduce).

    step(start, seconds): an inner step that began at `start` and computed `seconds`.
    handed_over(t): the current phase ended, its parameters handed over at `t` (one in flight).
    answered(committed): the round in flight ended: with a committed state (its phase counts)
        or not (the run finished; its phase does not).
    """

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.compute = 0.0  # all inner steps so far
        self._in_flight: tuple[float, float] | None = None  # (hand-over time, compute at it)
        self._last: tuple[float, float] | None = None  # the same, of the last committed phase

    def step(self, start: float, seconds: float) -> None:
        if self.first_start is None:
            self.first_start = start
        self.compute += seconds

    def handed_over(self, t: float) -> None:
        self._in_flight = (t, self.compute)

    def answered(self, committed: bool) -> None:
        if self._in_flight is not None and committed:
            self._last = self._in_flight
        self._in_flight = None

    def window(self) -> tuple[float, float]:
        """(compute seconds, window seconds) of the training window; (0, 0) before a commit."""
        if self._last is None or self.first_start is None:
            return 0.0, 0.0
        end, compute = self._last
        return compute, max(0.0, end - self.first_start)


def utilization(compute_seconds: float, wall_seconds: float) -> float:
    """compute / wall, rounded to 4 digits; 0.0 for an empty or negative wall time."""
    return round(compute_seconds / wall_seconds, 4) if wall_seconds > 0 else 0.0
