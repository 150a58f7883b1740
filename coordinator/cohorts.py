"""Cohorts: each round's participants drawn from the ready members (pure; no clock, no I/O).

With a cohort size K > 0 the round engine (`coordinator.rounds`) keeps every member that said
ready in a *pool*, whatever state it holds, and draws the round's K participants from it
(`draw_cohort`). Only the drawn members that hold an older state are sent a sync order: the
others keep the state they have, keep training, and are sent nothing until a draw picks them
(federated learning's client sampling: a client fetches the global model when it is selected).
A drawn member has `cohort_timeout` seconds to fetch the state and say ready; one that does not
is replaced by another draw (`Cohort.refill`).

Why not a sync order for every member at every commit: with N members and cohorts of K, that is
N - K downloads from K donors and N Ready calls per round, for updates that are never used. The
coordinator's cost of a round is then O(K), whatever N is (docs/performance.md, "One coordinator,
many members").
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass


def draw_cohort(ready: Iterable[str], k: int, *, seed: int, round_: int, attempt: int,
                keep: Collection[str] = ()) -> tuple[str, ...]:
    """`k` distinct peers of `ready`, sorted.

    Uniformly at random without replacement, from a generator seeded by (seed, round, attempt), so
    the same inputs always draw the same cohort (a run is reproducible). `keep` (members already
    in the cohort: survivors of an aborted attempt, drawn members that are ready) are kept, and
    only the other places are drawn. k <= 0, or no more ready peers than k: all of `ready`.
    """
    pool = sorted(set(ready))
    if k <= 0 or len(pool) <= k:
        return tuple(pool)
    members = set(pool)
    kept = sorted(p for p in set(keep) if p in members)[:k]
    taken = set(kept)
    rest = [p for p in pool if p not in taken]
    rng = random.Random(f"shoal-cohort:{seed}:{round_}:{attempt}")
    return tuple(sorted(kept + rng.sample(rest, k - len(kept))))


@dataclass(frozen=True)
class Cohort:
    """The members drawn for the round being prepared, and when (engine time).

    `members`: sorted peer ids. `drawn_at`: when the last of them was drawn; each drawn member
    that is not ready with the last committed state by `drawn_at + cohort_timeout` is replaced.
    `draws`: draws made for this round (the next draw's seed index).
    """

    members: tuple[str, ...]
    drawn_at: float
    draws: int = 1

    def refill(self, keep: Iterable[str], pool: Iterable[str], k: int, *, seed: int, round_: int,
               now: float) -> Cohort:
        """A cohort that keeps `keep` and fills the other places up to `k` from `pool` (members
        of this cohort that are not kept are never drawn again for this round)."""
        kept = set(keep)
        candidates = {p for p in pool if p not in set(self.members) or p in kept} | kept
        return Cohort(draw_cohort(candidates, k, seed=seed, round_=round_, attempt=self.draws, keep=kept), now,
                      self.draws + 1)
