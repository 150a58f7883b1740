"""Blame: which participants of a failed collective attempt sit out the retry.

Pure: a function of the attempt's participants, the votes that arrived, and what the
coordinator knows of each participant (when it last heard from it, whether its advertised
address answered the dial-back). `coordinator.rounds.RoundEngine` calls it when an attempt
fails on a peer's accusation ("no chunk from X", "stream to X broke"), after waiting a short
blame window for the other participants' votes.

Why not believe the first accusation: when one peer stalls (SIGSTOP, a suspended VM, a long
GC pause) or cannot be dialled, its healthy neighbours fail *because of it* and accuse
whoever they were waiting for at that moment, often another healthy peer (a shard owner that
was itself waiting for the stalled peer's contribution; a ring neighbour that stopped
forwarding). The signals that name the faulty peer are:

1. **Silence.** A healthy participant votes within a chunk deadline of the failure (its
   collective fails and it says so); a stalled or dead process cannot vote. Participants that
   did not vote within the blame window are the suspects, and nobody else is.
2. **Accusations, by direction.** When everyone voted, each failed vote's suspects are edges
   voter -> suspect. A peer that nobody can reach is accused by many (every peer that had to
   dial it) *and* accuses many (it heard from nobody); a healthy peer is accused by at most
   the peers that waited on it. The suspicion of an accused peer is the number of distinct
   peers accusing it plus the number it accuses; the most suspicious are blamed.
3. **Lease renewals and reachability** break ties: among equally suspicious peers, those
   whose heartbeats stopped (`stale`) or whose address failed the coordinator's dial-back
   (`unreachable`) are blamed alone.

A failed vote naming no suspect is a confession (the voter's own collective failed: an
aggregator error, a bad input) and never reaches this module: the engine aborts at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence


def blame(participants: Sequence[str], accusations: Mapping[str, Sequence[str]], *,
          stale: Collection[str] = (), unreachable: Collection[str] = ()) -> tuple[str, ...]:
    """The participants to exclude from the retry of a failed attempt (sorted, never empty
    when `participants` is not).

    participants: the attempt's participants (peer ids). accusations: the participants that
    voted, each with the peers its vote blamed (empty for a successful vote); voters that are
    not participants and suspects that are not participants are ignored. stale: participants
    whose lease renewals stopped (no heartbeat for a while); unreachable: participants whose
    advertised address did not answer the dial-back.

    Rule (module docstring): the silent participants, if any; else the most suspicious
    accused ones (accusers + accused), narrowed to the stale or unreachable among them when
    there are any. With no accusation at all (every vote ok or empty), the stale or
    unreachable participants, else all of them.
    """
    members = set(participants)
    voters = {v for v in accusations if v in members}
    silent = sorted(members - voters)
    if silent:
        return tuple(silent)
    edges = {(v, s) for v, suspects in accusations.items() if v in members
             for s in suspects if s in members and s != v}
    accused_by = Counter(s for _, s in edges)
    accuses = Counter(v for v, _ in edges)
    if not accused_by:
        flagged = sorted((set(stale) | set(unreachable)) & members)
        return tuple(flagged) if flagged else tuple(sorted(members))
    suspicion = {s: accused_by[s] + accuses[s] for s in accused_by}
    top = max(suspicion.values())
    worst = {s for s, k in suspicion.items() if k == top}
    flagged = worst & (set(stale) | set(unreachable))
    return tuple(sorted(flagged or worst))
