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

**Evidence.** An accusation alone cannot aim the exclusion at a healthy peer: when every
participant voted, an accusation counts only with evidence the coordinator can check: the
accused is silent, or its own vote failed too (its side of the link broke as well), or a second
voter accuses it. An accuser whose every accusation lacks evidence (the accused voted ok and
nobody else accuses it) is the one excluded (`unproven_accusers`), and the engine strikes it
(`Strikes`): repeated strikes bench it for whole rounds. The same holds for a voter whose
digests disagree with a quorum of identical digests (`digest_dissenters`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


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


def unproven_accusers(participants: Sequence[str], accusations: Mapping[str, Sequence[str]],
                      failed: Collection[str]) -> set[str]:
    """The voters whose every accusation lacks evidence (module docstring, "Evidence").

    participants: the attempt's; accusations: each voter with the peers its vote blamed (empty
    for an ok vote); failed: the voters whose vote failed. An accusation voter -> accused has
    evidence when the accused did not vote, voted failed too, or is accused by another voter.
    Suspects outside the participants, and the voter itself, are ignored; a voter naming no
    participant accuses nobody (a confession, never unproven).
    """
    members = set(participants)
    edges = {v: {s for s in suspects if s in members and s != v}
             for v, suspects in accusations.items() if v in members}
    witnesses: dict[str, set[str]] = {}
    for v, accused in edges.items():
        for s in accused:
            witnesses.setdefault(s, set()).add(v)

    def evidence(s: str) -> bool:
        return s not in accusations or s in failed or len(witnesses[s]) >= 2

    return {v for v, accused in edges.items() if accused and not any(evidence(s) for s in accused)}


def digest_dissenters(digests: Mapping[str, Hashable]) -> tuple[tuple[str, ...], bool]:
    """The voters whose digests differ from the most common ones, and whether those most common
    digests are a quorum (more than half of the voters voted them): then the dissenters alone
    are at fault; otherwise nobody can tell (the dissenters are still left out of the retry)."""
    counts = Counter(digests.values())
    majority, k = counts.most_common(1)[0]
    return tuple(p for p, d in digests.items() if d != majority), 2 * k > len(digests)


@dataclass
class Strikes:
    """Faults a peer cannot excuse (an unproven accusation, a digest against a quorum) and the
    benches they lead to: at `limit` strikes without a commit in between, a peer sits out the
    next `bench_rounds` rounds, doubled at every further bench (a peer that keeps lying is out
    for longer each time; an honest peer with a flaky link is back after a while). A commit the
    peer takes part in clears its strikes (not its bench count). Pure: rounds are passed in.
    """

    limit: int = 2
    bench_rounds: int = 8
    counts: dict[str, int] = field(default_factory=dict)
    benches: dict[str, int] = field(default_factory=dict)
    until: dict[str, int] = field(default_factory=dict)  # peer -> first round it may play again

    def strike(self, peer: str, round_: int) -> int | None:
        """Count one strike against `peer` in round `round_`; the round it is benched until
        when this strike benches it, else None."""
        self.counts[peer] = self.counts.get(peer, 0) + 1
        if self.counts[peer] < self.limit:
            return None
        self.benches[peer] = self.benches.get(peer, 0) + 1
        self.until[peer] = round_ + 1 + self.bench_rounds * 2 ** (self.benches[peer] - 1)
        return self.until[peer]

    def cleared(self, peers: Iterable[str]) -> None:
        """`peers` took part in a commit: their strikes are forgiven."""
        for p in peers:
            self.counts.pop(p, None)

    def benched(self, round_: int) -> set[str]:
        """The peers that may not take part in round `round_`."""
        return {p for p, r in self.until.items() if r > round_}
