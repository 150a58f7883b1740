"""Scenarios for `shoal swarm --scenario FILE`: what happens to which peer, and when.

A scenario is a TOML file (examples in examples/scenarios/, schema in docs/fault-tolerance.md):

    [[peer]]              # one table per peer, in order; more --peers than tables = plain peers
    start = 0.0           # seconds after the coordinator starts; > 0 = a late joiner
    fault = ""            # SHOAL_FAULT for this peer (shoal.peer.faults), e.g. "rs:stop@4"
    advertise = ""        # override the advertised data-plane address

    [[event]]
    at = 10.0             # seconds after the coordinator starts
    action = "local-work" # see ACTIONS
    peer = 3              # index into the peers (not for coordinator-* actions)
    seconds = 90.0        # local-work: how long that peer's next local update takes

This module is pure: it parses and checks a scenario (`load`, `parse`; errors name the field,
e.g. "event[1].peer: 7 is not a peer index (0..3)") and turns what happened into the summary's
`events` entries (`event_report`). Carrying the actions out belongs to shoal.swarm.

Link shaping (`up_mbit`/`down_mbit`, action "shape") needs the network-namespace test bed; this
version refuses those keys with a clear error instead of ignoring them.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PEER_ACTIONS = ("local-work", "kill", "stop", "cont", "restart")
COORDINATOR_ACTIONS = ("coordinator-kill", "coordinator-restart", "coordinator-stop", "coordinator-cont")
ACTIONS = PEER_ACTIONS + COORDINATOR_ACTIONS
GAP_WINDOW_SECONDS = 30.0  # max_commit_gap_seconds_30s looks this far past an action's end
_SHAPING = ("up_mbit", "down_mbit")


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the file and the field."""


@dataclass(frozen=True)
class PeerSpec:
    """One peer of a scenario. start: seconds after the coordinator starts (0 = at once)."""

    start: float = 0.0
    fault: str = ""
    advertise: str = ""


@dataclass(frozen=True)
class Event:
    """One action at `at` seconds after the coordinator starts. peer: index (None for the
    coordinator's actions); seconds: the duration of a local-work action."""

    at: float
    action: str
    peer: int | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Scenario:
    peers: tuple[PeerSpec, ...] = ()
    events: tuple[Event, ...] = ()  # sorted by `at` (stable: file order breaks ties)

    def peer_spec(self, i: int) -> PeerSpec:
        """Peer i's spec (a plain peer beyond the listed ones)."""
        return self.peers[i] if i < len(self.peers) else PeerSpec()


@dataclass(frozen=True)
class CommitPoint:
    """A committed round as the summary sees it: t (seconds after the coordinator started), the
    round number and the participants as peer indices."""

    t: float
    round: int
    participants: frozenset[int]


def load(path: str, num_peers: int) -> Scenario:
    """Read and check a scenario file for a swarm of `num_peers` peers. Raises ScenarioError."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ScenarioError(f"--scenario {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"--scenario {path}: {exc}") from None
    try:
        return parse(raw, num_peers)
    except ScenarioError as exc:
        raise ScenarioError(f"--scenario {path}: {exc}") from None


def _number(table: Mapping[str, Any], key: str, where: str, default: float, *, lo: float = 0.0) -> float:
    v = table.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ScenarioError(f"{where}.{key}: must be a number >= {lo:g}, got {v!r}")
    return float(v)


def _string(table: Mapping[str, Any], key: str, where: str) -> str:
    v = table.get(key, "")
    if not isinstance(v, str):
        raise ScenarioError(f"{where}.{key}: must be a string, got {v!r}")
    return v


def _known(table: Any, allowed: Sequence[str], where: str) -> Mapping[str, Any]:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: must be a table, got {table!r}")
    for key in table:
        if key in _SHAPING:
            raise ScenarioError(f"{where}.{key}: link shaping needs the network-namespace test bed, which this "
                                "version of `shoal swarm --scenario` does not run")
        if key not in allowed:
            raise ScenarioError(f"{where}.{key}: unknown key (known: {', '.join(allowed)})")
    return table


def parse(raw: Mapping[str, Any], num_peers: int) -> Scenario:
    """Check a parsed TOML scenario against a swarm of `num_peers` peers. Raises ScenarioError
    naming the first bad field."""
    unknown = set(raw) - {"peer", "event"}
    if unknown:
        raise ScenarioError(f"unknown table {sorted(unknown)[0]!r} (known: peer, event)")
    peers_raw = raw.get("peer", [])
    if not isinstance(peers_raw, list) or len(peers_raw) > num_peers:
        raise ScenarioError(f"peer: {len(peers_raw) if isinstance(peers_raw, list) else peers_raw!r} tables for "
                            f"{num_peers} peers (--peers)")
    peers = []
    for i, t in enumerate(peers_raw):
        w = f"peer[{i}]"
        t = _known(t, ("start", "fault", "advertise"), w)
        peers.append(PeerSpec(_number(t, "start", w, 0.0), _string(t, "fault", w), _string(t, "advertise", w)))
    events = []
    for i, t in enumerate(raw.get("event", [])):
        w = f"event[{i}]"
        t = _known(t, ("at", "action", "peer", "seconds"), w)
        action = _string(t, "action", w)
        if action == "shape":
            raise ScenarioError(f"{w}.action: shape needs the network-namespace test bed, which this version of "
                                "`shoal swarm --scenario` does not run")
        if action not in ACTIONS:
            raise ScenarioError(f"{w}.action: {action!r} is not one of {', '.join(ACTIONS)}")
        peer = t.get("peer")
        if action in PEER_ACTIONS:
            if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < num_peers:
                raise ScenarioError(f"{w}.peer: {peer!r} is not a peer index (0..{num_peers - 1})")
        elif peer is not None:
            raise ScenarioError(f"{w}.peer: {action} acts on the coordinator; remove peer")
        seconds = _number(t, "seconds", w, 0.0)
        if action == "local-work" and seconds <= 0:
            raise ScenarioError(f"{w}.seconds: local-work needs seconds > 0")
        events.append(Event(_number(t, "at", w, 0.0), action, peer, seconds))
    events.sort(key=lambda e: e.at)
    return Scenario(tuple(peers), tuple(events))


def max_commit_gap(commit_times: Sequence[float], start: float, window: float = GAP_WINDOW_SECONDS) -> float | None:
    """The longest gap (seconds) between consecutive commits among those in [start, start + window],
    counting from the last commit before `start` (so a stall that began just before is seen).
    None with fewer than two such commits."""
    times = sorted(commit_times)
    before = [t for t in times if t < start]
    inside = [t for t in times if start <= t <= start + window]
    points = before[-1:] + inside
    if not points:
        return None
    gaps = [b - a for a, b in zip(points, points[1:])]
    return max(gaps) if gaps else None


def event_report(event: Event, done_at: float | None, commits: Sequence[CommitPoint]) -> dict:
    """The summary's entry for one scenario event.

    done_at: when the action finished (seconds after the coordinator started; e.g. the end of a
    local work, the restart of a killed peer), None if it never did. peer_next_commit_seconds:
    from done_at to the first later commit the peer took part in. max_commit_gap_seconds_30s:
    `max_commit_gap` over every commit in the GAP_WINDOW_SECONDS after done_at.
    """
    out: dict = {"at": event.at, "action": event.action, "peer": event.peer,
                 "done_after_start_seconds": None if done_at is None else round(done_at, 3),
                 "peer_next_commit_seconds": None, "max_commit_gap_seconds_30s": None}
    if event.action == "local-work":
        out["seconds"] = event.seconds
    if done_at is None:
        return out
    if event.peer is not None:
        mine = [c.t for c in commits if c.t >= done_at and event.peer in c.participants]
        out["peer_next_commit_seconds"] = round(min(mine) - done_at, 3) if mine else None
    gap = max_commit_gap([c.t for c in commits], done_at)
    out["max_commit_gap_seconds_30s"] = None if gap is None else round(gap, 3)
    return out
