"""One attempt of a round: its plan, the participants' votes, and what they decide.

Responsible for the running attempt (`Attempt`): recording each participant's `Vote` and deciding
from the votes whether the attempt commits (every participant voted ok with the same digests),
aborts at once (a failed vote that names nobody else, a failed owner audit, a relay that altered
a chunk, a digest disagreement) and whom it excludes, or waits for the blame window (a failed vote
that accuses others: `coordinator.blame` names whom to exclude once every participant voted or the
window passed). A secure attempt (SecAgg+, shoal.peer.secure_round) also commits without the votes
of participants lost after sending (`Attempt.lose`): its survivors unmask the sum with the lost
ones' contributions in it. Also how much longer the next attempts' deadlines are after timeouts
(`DeadlineGrowth`).

Not responsible for what a decision leads to (the engine, `coordinator.rounds.RoundEngine`, aborts,
retries, commits and tells the peers) nor for whether a vote belongs to this attempt (the engine
checks the round, the attempt and the voter first). Pure: times are passed in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.common.plan import Plan, auditor_positions
from shoal.coordinator.blame import blame, digest_dissenters, unproven_accusers
from shoal.coordinator.planner import MAX_DEADLINE_SCALE


@dataclass(frozen=True)
class Vote:
    """One participant's vote on an attempt (shoal.v1.VoteRequest).

    ok: the collective succeeded. result_digest: `shoal.common.tensors.result_digest` of the
    all-reduced result (BLAKE3-256 over its 1 MiB blocks' digests); state_digest: BLAKE3-256 of
    the state it leads to. loss: mean inner training loss (may be non-finite: never
    recorded). suspects: peers the failure points at. flagged: contributions rejected by the
    aggregator. error: why it failed. audit: the failure is a failed owner audit.
    """

    ok: bool
    result_digest: bytes = b""
    state_digest: bytes = b""
    loss: float = 0.0
    suspects: tuple[str, ...] = ()
    flagged: tuple[str, ...] = ()
    error: str = ""
    audit: bool = False

    @property
    def digests(self) -> tuple[bytes, bytes]:
        return self.result_digest, self.state_digest


@dataclass(frozen=True)
class CommitRecord:
    round: int
    attempt: int
    result_digest: bytes
    state_digest: bytes
    participants: tuple[str, ...]
    train_loss: float
    seconds: float
    flagged: tuple[str, ...] = ()
    at: float = 0.0


class Tally(enum.Enum):
    """What the votes so far decide, short of an abort (`Attempt.record`)."""

    PENDING = "pending"  # votes are missing (or the blame window is open and some are missing)
    BLAME = "blame"  # the blame window is open and every participant voted: decide whom to exclude now
    COMMIT = "commit"  # every participant voted ok with the same digests


@dataclass(frozen=True)
class Abort:
    """The attempt fails: why, whom it excludes, who may never own a shard again (a failed
    owner audit costs the accused owner and the accusing auditor their ownership), and whose
    fault it is beyond doubt (`struck`: an unproven accusation, digests against a quorum; the
    engine's `coordinator.blame.Strikes` counts them)."""

    reason: str
    excluded: tuple[str, ...]
    untrusted: tuple[str, ...] = ()
    struck: tuple[str, ...] = ()
    relay: str = ""  # the relay of the plan that failed (a chunk altered on it, or it is down): nobody is excluded


@dataclass
class Attempt:
    """The attempt in flight: its plan (participants, deadlines), when it started, the votes."""

    plan: Plan
    started: float
    votes: dict[str, Vote] = field(default_factory=dict)
    blame_at: float | None = None  # a failed vote accused others: decide whom to exclude by then
    voted_at: dict[str, float] = field(default_factory=dict)  # when each vote arrived (blame's order)
    # Secure attempts: participants gone before voting (stream broken, lease expired, silent at the
    # deadline) whose vote the attempt no longer waits for (`lose`).
    lost: set[str] = field(default_factory=set)
    quorum: int = 2  # fewest votes a secure attempt commits with when participants are lost
    # Secure attempts: every vote in but the silent ones' agrees (a quorum of them): by then the
    # silent are lost (`lose`) unless they vote (`record`).
    grace_at: float | None = None

    @property
    def secure(self) -> bool:
        return bool(self.plan.secagg_seed)

    def record(self, peer_id: str, v: Vote, now: float, *, blame_window: float,
               relay_failure: str = "") -> Tally | Abort:
        """Record participant `peer_id`'s vote and say what the votes decide.

        A failed vote naming no suspect among the participants blames the voter: abort at once.
        One that accuses others opens the blame window (`blame_window`, at least twice the plan's
        chunk deadline): BLAME once every participant voted, else PENDING until `blame_at`. A
        failed owner audit that fits the plan excludes the accused owner and the auditor and makes
        both untrusted. A failed vote blaming a relay of this plan (`relay_failure`: a chunk
        through it failed its end-to-end check, or the relay refused the connection: it is down) aborts
        at once excluding nobody: the peers are
        healthy, the path between them is not. All votes in and equal: COMMIT; unequal: abort
        excluding the dissenters from the most common digests.
        """
        plan = self.plan
        self.votes[peer_id] = v
        self.voted_at[peer_id] = now
        why = f"{peer_id[:8]} failed: {v.error or 'collective error'}"
        if not v.ok and relay_failure and relay_failure in plan.relays:
            return Abort(f"relay {relay_failure} failed ({peer_id[:8]}: {v.error or 'chunk signature'})", (),
                         relay=relay_failure)
        if not v.ok and self.lost:  # the lost participant took the collective down with it
            return Abort(f"{self._lost_text()}; {why}", tuple(sorted(self.lost)))
        if not v.ok:
            accused = audited_owner(plan, peer_id, v.suspects) if v.audit else None
            if accused is not None:
                return Abort(why, (accused, peer_id), untrusted=(accused, peer_id))
            if not any(s in plan.participants and s != peer_id for s in v.suspects) \
                    or cut_off_outbound(plan, peer_id, v.suspects):
                return Abort(why, (peer_id,))
            if self.blame_at is None:
                self.blame_at = now + max(blame_window, 2.0 * plan.chunk_timeout_seconds)
        if self.blame_at is not None:
            return Tally.BLAME if len(self.votes) == len(plan.participants) else Tally.PENDING
        verdict = self._tally()
        if verdict is Tally.PENDING and self.secure and self.grace_at is None and self._agree():
            # The silent may have died after sending: their vote proves nothing the others' do not
            # (the sum could not be unmasked without their rows), so wait for it a grace only.
            self.grace_at = now + max(blame_window, 2.0 * plan.chunk_timeout_seconds)
        return verdict

    def _agree(self) -> bool:
        """The votes so far are ok, equal, and at least a quorum."""
        votes = list(self.votes.values())
        return len(votes) >= self.quorum and all(v.ok and v.digests == votes[0].digests for v in votes)

    def lose(self, peers: Sequence[str], why: str) -> Tally | Abort:
        """Participants `peers` of a secure attempt are gone before voting (`why`: disconnected,
        lease expired, silent at the deadline). Their contributions are in the sum if and only if
        the survivors finish: the masked all-reduce completes only with every participant's row,
        and the survivors unmask it with the lost ones' self-mask seeds reconstructed from t of
        their neighbours' shares (SecAgg+, Bell et al. 2020). So the attempt does not abort: it
        waits for the others' votes and commits when they all voted ok with the same digests (at
        least `quorum` of them). A failed vote, before or after, aborts it excluding the lost
        (`record`). Only for secure attempts: elsewhere a lost participant aborts at once (the
        engine's rule)."""
        assert self.secure
        self.lost.update(p for p in peers if p in self.plan.participants and p not in self.votes)
        if any(not v.ok for v in self.votes.values()):
            return Abort(f"{self._lost_text()} ({why})", tuple(sorted(self.lost)))
        return self._tally()

    def _lost_text(self) -> str:
        return f"{', '.join(sorted(p[:8] for p in self.lost))} lost before voting"

    def _tally(self) -> Tally | Abort:
        """Every vote awaited is in: commit on equal digests, abort on a disagreement."""
        if any(p not in self.votes and p not in self.lost for p in self.plan.participants):
            return Tally.PENDING
        if self.lost and len(self.votes) < self.quorum:
            return Abort(f"{self._lost_text()}: {len(self.votes)} votes left, fewer than {self.quorum}",
                         tuple(sorted(self.lost)))
        dissenters, quorum = digest_dissenters({p: v.digests for p, v in self.votes.items()})
        if dissenters:
            return Abort("digest mismatch", tuple(dissenters) + tuple(sorted(self.lost)),
                         struck=dissenters if quorum else ())
        return Tally.COMMIT

    def silent(self) -> tuple[str, ...]:
        """The participants that have not voted."""
        return tuple(p for p in self.plan.participants if p not in self.votes)

    def timed_out(self, now: float) -> bool:
        """Whether the attempt's deadline passed."""
        return now - self.started > self.plan.deadline_seconds

    def blame(self, stale: Sequence[str], unreachable: Sequence[str]) -> Abort:
        """The abort after a failed vote that accused others: whom `coordinator.blame.blame`
        names from the votes so far, the participants whose lease renewals are `stale` and those
        others had to dial that are `unreachable`. With every vote in, an accusation without
        evidence (`coordinator.blame.unproven_accusers`) aims at nobody: its accuser is excluded
        (and struck) instead; the accusations with evidence are judged as before."""
        accusations = {p: (v.suspects if not v.ok else ()) for p, v in self.votes.items()}
        silent = self.silent()
        liars: set[str] = set()
        dissenters: tuple[str, ...] = ()
        quorum = False
        if not silent:
            failed = {p for p, v in self.votes.items() if not v.ok}
            liars = unproven_accusers(self.plan.participants, accusations, failed)
            accusations = {p: (() if p in liars else a) for p, a in accusations.items()}
            oks = {p: v.digests for p, v in self.votes.items() if v.ok}
            dissenters, quorum = digest_dissenters(oks) if oks else ((), False)
        blamed = blame(self.plan.participants, accusations, voted_at=self.voted_at,
                       cascade=self.plan.chunk_timeout_seconds, stale=stale, unreachable=unreachable) \
            if not liars or any(accusations.values()) else ()
        first, vote = next((p, v) for p, v in self.votes.items() if not v.ok)
        why = f"{first[:8]} failed: {vote.error or 'collective error'}"
        if silent:
            why += f"; no vote from {[p[:8] for p in silent]}"
        if liars:
            why += f"; no evidence for the accusations of {sorted(p[:8] for p in liars)}"
            if quorum and dissenters:  # the ok votes judge the digests too: one abort for both faults
                why += f"; digests of {sorted(p[:8] for p in dissenters)} against a quorum"
                liars.update(dissenters)
        return Abort(why, tuple(sorted(set(blamed) | liars)), struck=tuple(sorted(liars)))

    def commit_record(self, now: float) -> CommitRecord:
        """The record of this attempt's commit at `now` (every vote awaited is in and agrees). Its
        participants are the plan's: a secure attempt's lost participants contributed to the sum."""
        votes = self.votes.values()
        any_vote = next(iter(votes))
        # A peer may report a non-finite loss (diverged, or lying): it never reaches the record.
        losses = [v.loss for v in votes if math.isfinite(v.loss)]
        return CommitRecord(
            round=self.plan.round,
            attempt=self.plan.attempt,
            result_digest=any_vote.result_digest,
            state_digest=any_vote.state_digest,
            participants=self.plan.participants,
            train_loss=float(sum(losses) / len(losses)) if losses else 0.0,
            seconds=now - self.started,
            flagged=tuple(sorted({f for v in votes for f in v.flagged})),
            at=now,
        )


def cut_off_outbound(plan: Plan, voter: str, suspects: tuple[str, ...]) -> bool:
    """Whether a failed vote is an outbound-only participant's own link failing (docs/nat.md):
    it names every shard owner (at least two), as when all the calls it opened broke at once
    (its NAT forgot the mapping). It then sits out the retry alone, at once: the owners cannot
    see its link break (their side of each call just goes quiet) and would accuse it and each
    other a chunk deadline later. An owner that really died is silent, and its lease or the
    retry's blame excludes it; the outbound-only peer is back in the round after."""
    if voter not in plan.participants or plan.dialable(plan.position(voter)):
        return False
    owners = {plan.participants[o] for o in plan.owners()}
    return len(owners) >= 2 and owners <= set(suspects)


def audited_owner(plan: Plan, voter: str, suspects: tuple[str, ...]) -> str | None:
    """The owner a failed audit vote accuses, if the claim fits the plan: an audited plan, one
    accused peer besides the voter, and the voter audits a shard that peer owns. Otherwise
    None: the vote counts as an ordinary failure (no peer loses ownership on a peer's say-so
    beyond what the plan lets that peer check)."""
    if not plan.audit_owners or voter not in plan.participants:
        return None
    accused = [s for s in dict.fromkeys(suspects) if s != voter]
    if len(accused) != 1 or accused[0] not in plan.participants:
        return None
    me, owner = plan.position(voter), plan.position(accused[0])
    audits = auditor_positions(plan.shard_owner)
    if any(o == owner and a == me for o, a in zip(plan.shard_owner, audits)):
        return accused[0]
    return None


# An abort reason that says a deadline passed: a chunk that did not come (peer.collectives) or
# the attempt's deadline (the peer's or the engine's own `tick`).
_TIMEOUT_MARKERS = ("no chunk from", "deadline")


@dataclass
class DeadlineGrowth:
    """How much longer than planned the next attempt's deadlines are (`scale`, 1..MAX_DEADLINE_SCALE).

    One timeout abort may be a stalled peer (excluded on the retry); a round that times out
    again is more likely held by links slower than their estimates: from the second consecutive
    timeout abort of a round on, every further one doubles the scale, up to the cap. Another
    abort breaks the streak (the scale stays); a commit halves the scale (a link that needed it
    may still be slow), down to 1. `on_abort` returns the line to log when the scale grows.
    """

    scale: float = 1.0
    streak: int = 0  # consecutive timeout aborts of `round`
    round: int = -1

    def on_abort(self, round_: int, reason: str) -> str | None:
        if round_ != self.round:
            self.round, self.streak = round_, 0
        if not any(m in reason for m in _TIMEOUT_MARKERS):
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < 2 or self.scale >= MAX_DEADLINE_SCALE:
            return None
        self.scale = min(MAX_DEADLINE_SCALE, 2 * self.scale)
        return (f"round {round_} timed out {self.streak} times in a row ({reason}): the links are slower "
                f"than their estimates; deadlines of its next attempts x{self.scale:g} (at most "
                f"x{MAX_DEADLINE_SCALE:g})")

    def on_commit(self) -> None:
        self.scale, self.streak, self.round = max(1.0, self.scale / 2), 0, -1
