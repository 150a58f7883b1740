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
   did not vote within the blame window are the suspects, and nobody else is. A healthy peer
   can be silent too (its send to the stalled peer blocks under flow control, bounded only by
   the collective deadline), so among the silent the blame goes to those whose lease renewals
   stopped as well (a stalled process stops heartbeating), else to those others accuse.
2. **Accusations, by direction and order.** When everyone voted (a short stall ended within the
   window, or a peer is cut off), each failed vote's suspects are edges voter -> suspect. An
   accusation is credible if it came in the first cascade of failures (within one chunk
   deadline of the first failed vote: healthy peers waiting on each other all fail within one
   deadline, in any order), or before the accused gave up itself (voted). A late accusation
   against a peer that had already voted is not: once a peer has voted failed it abandons the
   attempt, and whatever a latecomer (typically the stalled peer itself, back from its pause)
   then reports about it is an effect, not a cause. Among credible edges:
   - a peer cut off from the others (its address drops packets) accuses several peers whom
     nobody else accuses: it is the suspect ("accused by many and accusing many");
   - otherwise the suspects are the accused peers whose own silence nothing explains (they
     accuse nobody credibly): the end of the wait-for chain, where a healthy peer that only
     waited on the stalled one is excused;
   - in a cycle, the peers with the most accusations made and received.
3. **Lease renewals and reachability** break ties: among equally suspicious peers, those
   whose heartbeats stopped (`stale`) or whose address failed the coordinator's dial-back
   (`unreachable`) are blamed alone.

A failed vote naming no suspect is a confession (the voter's own collective failed: an
aggregator error, a bad input) and never reaches this module: the engine aborts at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence


def blame(participants: Sequence[str], accusations: Mapping[str, Sequence[str]], *,
          voted_at: Mapping[str, float] | None = None, cascade: float = 0.0, stale: Collection[str] = (),
          unreachable: Collection[str] = ()) -> tuple[str, ...]:
    """The participants to exclude from the retry of a failed attempt (sorted, never empty
    when `participants` is not).

    participants: the attempt's participants (peer ids). accusations: the participants that
    voted, each with the peers its vote blamed (empty for a successful vote); voters that are
    not participants and suspects that are not participants are ignored. voted_at: when each
    vote arrived (seconds); without it every accusation is credible. cascade: seconds after the
    first failed vote within which every accusation is credible (the plan's chunk deadline). stale:
    participants whose lease renewals stopped (no heartbeat for a while); unreachable:
    participants whose advertised address did not answer the dial-back.

    Rule (module docstring): the silent participants, if any (narrowed to the stale among
    them, else to the accused among them, when there are any); else, over the credible
    accusations, a peer cut off from the others, else the unexplained accused, else the most
    suspicious; narrowed to the stale or unreachable among them when there are any. With no
    accusation at all (every vote ok or empty), the stale or unreachable participants, else
    all of them.
    """
    members = set(participants)
    voters = {v for v in accusations if v in members}
    silent = members - voters
    edges = {(v, s) for v, suspects in accusations.items() if v in members
             for s in suspects if s in members and s != v}
    if silent:
        accused = {s for _, s in edges}
        return tuple(sorted((silent & set(stale)) or (silent & accused) or silent))
    if voted_at is not None:
        failed_at = [voted_at[v] for v, suspects in accusations.items() if v in voted_at and suspects]
        early = (min(failed_at) if failed_at else -math.inf) + cascade
        credible = {(v, s) for v, s in edges
                    if voted_at.get(v, 0.0) <= early or voted_at.get(v, 0.0) <= voted_at.get(s, math.inf)}
        edges = credible or edges  # every accusation came late: judge them all alike
    flagged_all = (set(stale) | set(unreachable)) & members
    if not edges:
        return tuple(sorted(flagged_all)) if flagged_all else tuple(sorted(members))
    return tuple(sorted(_narrow(_suspects(edges), flagged_all)))


def _suspects(edges: set[tuple[str, str]]) -> set[str]:
    """The suspects of a set of credible accusations (voter, accused); see `blame`."""
    accusers: dict[str, set[str]] = {}
    targets: dict[str, set[str]] = {}
    for v, s in edges:
        accusers.setdefault(s, set()).add(v)
        targets.setdefault(v, set()).add(s)
    cut_off = {v for v, ts in targets.items() if len(ts) >= 2 and all(accusers[t] == {v} for t in ts)}
    if cut_off:
        return cut_off
    unexplained = {s for s in accusers if not targets.get(s)}
    if unexplained:
        most = max(len(accusers[s]) for s in unexplained)
        return {s for s in unexplained if len(accusers[s]) == most}
    suspicion = Counter({s: len(accusers[s]) + len(targets.get(s, ())) for s in accusers})
    top = max(suspicion.values())
    return {s for s, k in suspicion.items() if k == top}


def _narrow(suspects: set[str], flagged: set[str]) -> set[str]:
    """The stale or unreachable among `suspects`, when there are any; else all of them."""
    return (suspects & flagged) or suspects
