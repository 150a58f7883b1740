"""Scenarios for `shoal swarm --scenario FILE`: what happens to which peer, and when.

A scenario is a TOML file (examples in examples/scenarios/, schema in docs/fault-tolerance.md):

    [[peer]]              # one table per peer, in order: their count is the swarm's size unless
                          # --peers is given; more --peers than tables = plain peers
    up_mbit = 20          # upload shaping in Mbit/s (tc tbf); omit = unshaped
    down_mbit = 20        # download shaping in Mbit/s; omit = unshaped
    start = 0.0           # seconds after the coordinator starts; > 0 = a late joiner
    fault = ""            # SHOAL_FAULT for this peer (shoal.peer.testing.faults), e.g. "rs:stop@4"
    resume_after = 8.0    # a peer its fault SIGSTOPped gets SIGCONT this long after (0 = never; all are
                          # resumed once the last round committed, so that they can leave)
    advertise = ""        # override the advertised data-plane address: "HOST:PORT", "refuse" (a
                          # closed port) or "drop" (its real address behind a firewall that drops)
    nat = false           # behind a NAT router of its own: it dials out, nobody can dial it
                          # (an outbound-only peer, docs/nat.md)
    outbound_only = false # start it with --outbound-only (runs on loopback too)
    rtt_ms = 100          # round-trip time of every path of this peer (to peers and to the
                          # coordinator); two peers with their own: the larger. Omit = none
    jitter_ms = 2         # each packet's one-way delay varies by ± this (≤ rtt_ms / 2)
    loss = 0.001          # probability that a packet is lost, each direction

    [[path]]              # one pair's own path (both directions), over the peers' own values
    a = 0                 # a peer index, or "coordinator"
    b = 2
    rtt_ms = 250
    jitter_ms = 0.0
    loss = 0.0005

    [[event]]
    at = 10.0             # seconds after the coordinator starts
    action = "shape"      # see ACTIONS
    peer = 3              # index into the peers (not for coordinator-* and relay-* actions)
    relay = 0             # relay-kill / relay-start: index into the swarm's relays (`--relays`)
    up_mbit = 10          # shape: the new rates (omitted = unshaped)
    down_mbit = 10
    seconds = 90.0        # local-work: how long that peer's next local update takes
                          # (action "nat-rebind": that peer's NAT router gets a new public address;
                          # "black-hole": its host drops every packet others send on connections
                          # they opened to it, established ones too: its data ports go dark)
    rtt_ms = 300          # latency: the peer's new rtt_ms / jitter_ms / loss (omitted = 0)

Shaping (`up_mbit`/`down_mbit`, action "shape"), latency (`rtt_ms`/`jitter_ms`/`loss`, [[path]],
action "latency": the bed's delay line), `nat` (and "nat-rebind") and `advertise = "drop"` need the
network-namespace runner (root: one namespace per peer, shoal.testbeds.netbed); `needs_netns` names
the first field that does.

This module is pure: it parses and checks a scenario (`load`, `parse`; errors name the field,
e.g. "event[1].peer: 7 is not a peer index (0..3)") and turns what happened into the summary:
`event_report` (the `events` entries), `per_peer_report`, `rounds_report`, `touch_windows` and
`wrongful_exclusions`. Carrying the actions out belongs to shoal.testbeds.swarm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.common.attempts import shown_attempt
from shoal.config import read_toml
from shoal.peer.testing import faults

PEER_ACTIONS = ("local-work", "kill", "stop", "cont", "restart", "shape", "nat-rebind", "black-hole", "latency")
LATENCY_KEYS = ("rtt_ms", "jitter_ms", "loss")
COORDINATOR = "coordinator"  # a [[path]] end that is the coordinator (the bed's root namespace)
COORDINATOR_ACTIONS = ("coordinator-kill", "coordinator-restart", "coordinator-stop", "coordinator-cont")
RELAY_ACTIONS = ("relay-kill", "relay-start")  # kill -9 relay `relay` (an index); start it again on its port
ACTIONS = PEER_ACTIONS + COORDINATOR_ACTIONS + RELAY_ACTIONS
GAP_WINDOW_SECONDS = 30.0  # max_commit_gap_seconds_30s looks this far past an action's end
TOUCH_GRACE_SECONDS = 10.0  # a peer stays "touched" this long after what touched it ended (wrongful_exclusions)
RESUME_AFTER_SECONDS = 8.0  # default `resume_after`: a stall shorter than the default 10 s lease
ADVERTISE_SPECIAL = ("drop", "refuse")


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the file and the field."""


@dataclass(frozen=True)
class LatencySpec:
    """A path's latency as a scenario gives it: rtt_ms and jitter_ms in milliseconds, loss a
    probability per packet and direction (shoal.testbeds.netbed.Latency)."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0


@dataclass(frozen=True)
class PathSpec:
    """One [[path]] table: ends a and b (peer indices; -1 = the coordinator) and their latency."""

    a: int
    b: int
    latency: LatencySpec


@dataclass(frozen=True)
class PeerSpec:
    """One peer of a scenario. up_mbit/down_mbit: link rates in Mbit/s (10^6 bit/s), None =
    unshaped; start: seconds after the coordinator starts (0 = at once); resume_after: seconds
    from a fault's SIGSTOP to the swarm's SIGCONT (0 = never)."""

    start: float = 0.0
    fault: str = ""
    advertise: str = ""
    up_mbit: float | None = None
    down_mbit: float | None = None
    resume_after: float = RESUME_AFTER_SECONDS
    nat: bool = False  # behind a NAT router namespace of its own (shoal.testbeds.netbed)
    outbound_only: bool = False  # started with --outbound-only
    latency: LatencySpec | None = None  # rtt_ms / jitter_ms / loss of every path of this peer

    @property
    def shaped(self) -> bool:
        return self.up_mbit is not None or self.down_mbit is not None


@dataclass(frozen=True)
class Event:
    """One action at `at` seconds after the coordinator starts. peer: index (None for the
    coordinator's actions); seconds: the duration of a local-work action; up_mbit/down_mbit: the
    rates a shape action sets (None = unshaped)."""

    at: float
    action: str
    peer: int | None = None
    seconds: float = 0.0
    up_mbit: float | None = None
    down_mbit: float | None = None
    relay: int | None = None  # relay-* actions: the relay's index
    latency: LatencySpec | None = None  # a latency action's new values (None = no latency)


@dataclass(frozen=True)
class Scenario:
    peers: tuple[PeerSpec, ...] = ()
    events: tuple[Event, ...] = ()  # sorted by `at` (stable: file order breaks ties)
    paths: tuple[PathSpec, ...] = ()

    def peer_spec(self, i: int) -> PeerSpec:
        """Peer i's spec (a plain peer beyond the listed ones)."""
        return self.peers[i] if i < len(self.peers) else PeerSpec()

    @property
    def needs_netns(self) -> str:
        """The first field that needs the network-namespace runner ("peer[0].up_mbit",
        "event[2].action"), "" when the scenario runs on loopback."""
        for i, p in enumerate(self.peers):
            for key in ("up_mbit", "down_mbit"):
                if getattr(p, key) is not None:
                    return f"peer[{i}].{key}"
            if p.advertise == "drop":
                return f"peer[{i}].advertise"
            if p.nat:
                return f"peer[{i}].nat"
            if p.latency is not None:
                return f"peer[{i}].rtt_ms"
        if self.paths:
            return "path[0]"
        for e in self.events:
            if e.action in ("shape", "nat-rebind", "black-hole", "latency"):
                return f"the {e.action} event at {e.at:g}s"
        return ""

    @property
    def has_latency(self) -> bool:
        """Whether the scenario needs the bed's delay line (a peer's latency, a [[path]], or a
        latency event)."""
        return (any(p.latency is not None for p in self.peers) or bool(self.paths)
                or any(e.action == "latency" for e in self.events))


@dataclass(frozen=True)
class CommitPoint:
    """A committed round as the summary sees it: t (seconds after the coordinator started), the
    round number and the participants as peer indices."""

    t: float
    round: int
    participants: frozenset[int]


def listed_peers(path: str) -> int:
    """How many [[peer]] tables the scenario file lists: the swarm's size when --peers is not
    given (0: it lists none). Raises ScenarioError when the file cannot be read."""
    peers = read_toml(path, "--scenario", ScenarioError).get("peer", [])
    return len(peers) if isinstance(peers, list) else 0


def load(path: str, num_peers: int) -> Scenario:
    """Read and check a scenario file for a swarm of `num_peers` peers. Raises ScenarioError."""
    raw = read_toml(path, "--scenario", ScenarioError)
    try:
        return parse(raw, num_peers)
    except ScenarioError as exc:
        raise ScenarioError(f"--scenario {path}: {exc}") from None


def _number(table: Mapping[str, Any], key: str, where: str, default: float, *, lo: float = 0.0) -> float:
    v = table.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ScenarioError(f"{where}.{key}: must be a number >= {lo:g}, got {v!r}")
    return float(v)


def _rate(table: Mapping[str, Any], key: str, where: str) -> float | None:
    """A link rate in Mbit/s: None when omitted; else a number > 0."""
    if key not in table:
        return None
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ScenarioError(f"{where}.{key}: must be a rate in Mbit/s > 0 (omit it for an unshaped link), got {v!r}")
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
        if key not in allowed:
            raise ScenarioError(f"{where}.{key}: unknown key (known: {', '.join(allowed)})")
    return table


def _advertise(t: Mapping[str, Any], where: str) -> str:
    v = _string(t, "advertise", where)
    if v and v not in ADVERTISE_SPECIAL:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ScenarioError(f"{where}.advertise: {v!r} is neither HOST:PORT nor one of "
                                f"{', '.join(ADVERTISE_SPECIAL)}")
    return v


def _latency(t: Mapping[str, Any], where: str) -> LatencySpec | None:
    """rtt_ms / jitter_ms / loss of a table: None when it has none of them."""
    if not any(k in t for k in LATENCY_KEYS):
        return None
    rtt = _number(t, "rtt_ms", where, 0.0)
    if rtt >= 60_000:
        raise ScenarioError(f"{where}.rtt_ms: must be below 60000 ms, got {rtt:g}")
    jitter = _number(t, "jitter_ms", where, 0.0)
    if jitter > rtt / 2:
        raise ScenarioError(f"{where}.jitter_ms: {jitter:g} is more than half the rtt_ms ({rtt:g})")
    loss = _number(t, "loss", where, 0.0)
    if loss >= 1:
        raise ScenarioError(f"{where}.loss: must be a probability below 1, got {loss:g}")
    return LatencySpec(rtt, jitter, loss)


def _path(t: Any, where: str, num_peers: int) -> PathSpec:
    t = _known(t, ("a", "b", *LATENCY_KEYS), where)
    ends = []
    for key in ("a", "b"):
        v = t.get(key)
        if v == COORDINATOR:
            ends.append(-1)
        elif isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_peers:
            ends.append(v)
        else:
            raise ScenarioError(f"{where}.{key}: {v!r} is neither a peer index (0..{num_peers - 1}) "
                                f"nor {COORDINATOR!r}")
    if ends[0] == ends[1]:
        raise ScenarioError(f"{where}.b: a path joins two different ends, got {ends[0]} twice")
    return PathSpec(ends[0], ends[1], _latency(t, where) or LatencySpec())


def _peer(t: Any, where: str) -> PeerSpec:
    t = _known(t, ("start", "fault", "advertise", "up_mbit", "down_mbit", "resume_after", "nat", "outbound_only",
                   *LATENCY_KEYS), where)
    for key in ("nat", "outbound_only"):
        if not isinstance(t.get(key, False), bool):
            raise ScenarioError(f"{where}.{key}: must be true or false, got {t[key]!r}")
    nat = t.get("nat", False)
    if nat and t.get("advertise"):
        raise ScenarioError(f"{where}.advertise: a peer behind NAT advertises its private address; remove one")
    fault = _string(t, "fault", where)
    try:
        faults.parse_spec(fault)
    except ValueError as exc:
        raise ScenarioError(f"{where}.fault: {exc}") from None
    return PeerSpec(start=_number(t, "start", where, 0.0), fault=fault,
                    advertise=_advertise(t, where), up_mbit=_rate(t, "up_mbit", where),
                    down_mbit=_rate(t, "down_mbit", where),
                    resume_after=_number(t, "resume_after", where, RESUME_AFTER_SECONDS), nat=nat,
                    outbound_only=t.get("outbound_only", False), latency=_latency(t, where))


def _event(t: Any, where: str, num_peers: int) -> Event:
    t = _known(t, ("at", "action", "peer", "seconds", "up_mbit", "down_mbit", "relay", *LATENCY_KEYS), where)
    action = _string(t, "action", where)
    if action not in ACTIONS:
        raise ScenarioError(f"{where}.action: {action!r} is not one of {', '.join(ACTIONS)}")
    peer = t.get("peer")
    if action in PEER_ACTIONS:
        if peer is None:
            raise ScenarioError(f"{where}.peer: missing (a {action} event acts on a peer: its index, 0..{num_peers - 1})")
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < num_peers:
            raise ScenarioError(f"{where}.peer: {peer!r} is not a peer index (0..{num_peers - 1})")
    elif peer is not None:
        raise ScenarioError(f"{where}.peer: {action} acts on the {action.split('-')[0]}; remove peer")
    relay = t.get("relay", 0 if action in RELAY_ACTIONS else None)
    if action in RELAY_ACTIONS and (isinstance(relay, bool) or not isinstance(relay, int) or relay < 0):
        raise ScenarioError(f"{where}.relay: {relay!r} is not a relay index (0, 1, ...)")
    if action not in RELAY_ACTIONS and relay is not None:
        raise ScenarioError(f"{where}.relay: only relay-kill and relay-start name a relay")
    seconds = _number(t, "seconds", where, 0.0)
    if action == "local-work" and seconds <= 0:
        raise ScenarioError(f"{where}.seconds: local-work needs seconds > 0")
    if action != "shape":
        for key in ("up_mbit", "down_mbit"):
            if key in t:
                raise ScenarioError(f"{where}.{key}: only a shape action sets rates")
    if action != "latency":
        for key in LATENCY_KEYS:
            if key in t:
                raise ScenarioError(f"{where}.{key}: only a latency action sets {key}")
    return Event(_number(t, "at", where, 0.0), action, peer, seconds,
                 _rate(t, "up_mbit", where), _rate(t, "down_mbit", where), relay, _latency(t, where))


def parse(raw: Mapping[str, Any], num_peers: int) -> Scenario:
    """Check a parsed TOML scenario against a swarm of `num_peers` peers. Raises ScenarioError
    naming the first bad field."""
    unknown = set(raw) - {"peer", "event", "path"}
    if unknown:
        raise ScenarioError(f"unknown table {sorted(unknown)[0]!r} (known: peer, event, path)")
    peers_raw = raw.get("peer", [])
    if not isinstance(peers_raw, list) or len(peers_raw) > num_peers:
        if not isinstance(peers_raw, list):
            raise ScenarioError(f"peer: {peers_raw!r} is not a list of [[peer]] tables")
        raise ScenarioError(f"peer: the scenario lists {len(peers_raw)} peers ([[peer]] tables) but --peers is {num_peers}: "
                            f"drop --peers (the scenario's tables set the count) or give at least {len(peers_raw)}")
    peers = [_peer(t, f"peer[{i}]") for i, t in enumerate(peers_raw)]
    events = [_event(t, f"event[{i}]", num_peers) for i, t in enumerate(raw.get("event", []))]
    for i, e in enumerate(events):
        if e.action == "nat-rebind" and not (e.peer is not None and e.peer < len(peers) and peers[e.peer].nat):
            raise ScenarioError(f"event[{i}].peer: nat-rebind needs a peer with nat = true, got peer {e.peer}")
        if e.action == "latency" and e.peer is not None and e.peer < len(peers) and peers[e.peer].nat:
            raise ScenarioError(f"event[{i}].peer: the bed's delay line does not combine with NAT hosts (peer {e.peer})")
    events.sort(key=lambda e: e.at)
    paths_raw = raw.get("path", [])
    if not isinstance(paths_raw, list):
        raise ScenarioError(f"path: {paths_raw!r} is not a list of [[path]] tables")
    paths = [_path(t, f"path[{i}]", num_peers) for i, t in enumerate(paths_raw)]
    for i, p in enumerate(peers):
        if p.nat and (p.latency is not None or any(i in (q.a, q.b) for q in paths)):
            raise ScenarioError(f"peer[{i}].nat: the bed's delay line does not combine with NAT hosts; "
                                "drop nat or the latency")
    return Scenario(tuple(peers), tuple(events), tuple(paths))


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


def event_report(event: Event, done_at: float | None, commits: Sequence[CommitPoint], num_peers: int = 0) -> dict:
    """The summary's entry for one scenario event.

    done_at: when the action finished (seconds after the coordinator started; e.g. the end of a
    local work, the restart of a killed peer), None if it never did. peer_next_commit_seconds:
    from done_at to the first later commit the peer took part in. max_commit_gap_seconds_30s:
    `max_commit_gap` over every commit in the GAP_WINDOW_SECONDS after done_at. For the
    coordinator's actions, peers_next_commit_seconds: the same per peer index (0..num_peers-1;
    None for a peer with no later commit).
    """
    out: dict = {"at": event.at, "action": event.action, "peer": event.peer,
                 "done_after_start_seconds": None if done_at is None else round(done_at, 3),
                 "peer_next_commit_seconds": None, "max_commit_gap_seconds_30s": None}
    if event.action == "local-work":
        out["seconds"] = event.seconds
    if event.action == "shape":
        out["up_mbit"], out["down_mbit"] = event.up_mbit, event.down_mbit
    if event.relay is not None:
        out["relay"], out["next_commit_seconds"] = event.relay, None
        later = [c.t for c in commits if done_at is not None and c.t >= done_at]
        if later:
            out["next_commit_seconds"] = round(min(later) - done_at, 3)
    if event.action == "latency":
        lat = event.latency or LatencySpec()
        out["rtt_ms"], out["jitter_ms"], out["loss"] = lat.rtt_ms, lat.jitter_ms, lat.loss
    if event.peer is None:
        out["peers_next_commit_seconds"] = [None] * num_peers
    if done_at is None:
        return out
    if event.peer is None:
        for i in range(num_peers):
            mine = [c.t for c in commits if c.t >= done_at and i in c.participants]
            out["peers_next_commit_seconds"][i] = round(min(mine) - done_at, 3) if mine else None
    if event.peer is not None:
        mine = [c.t for c in commits if c.t >= done_at and event.peer in c.participants]
        out["peer_next_commit_seconds"] = round(min(mine) - done_at, 3) if mine else None
    gap = max_commit_gap([c.t for c in commits], done_at)
    out["max_commit_gap_seconds_30s"] = None if gap is None else round(gap, 3)
    return out


# ------------------------------------------------------------------ the summary of a scenario run


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, as the coordinator recorded it (its durable state). Ids are peer
    ids; attempt is the raw attempt id (shoal.common.attempts); participants: commits only (an
    abort record does not list them); seconds: commits only, plan to commit on the coordinator's
    clock."""

    round: int
    attempt: int
    committed: bool
    participants: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()
    seconds: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Observed:
    """What the swarm saw happen, in seconds after the coordinator started: per peer index, the
    times its fault stopped it (SIGSTOP seen) and the swarm resumed it (None: never)."""

    fault_stops: Mapping[int, Sequence[tuple[float, float | None]]] = field(default_factory=dict)


def peer_ids(events_by_peer: Mapping[int, Sequence[dict]]) -> dict[str, int]:
    """{peer id: peer index} from the peers' event records (each names its writer's id)."""
    return {e["peer"]: i for i, evs in events_by_peer.items() for e in evs if "peer" in e}


def _first_t(events_by_peer: Mapping[int, Sequence[dict]], kinds: tuple[str, ...]) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for evs in events_by_peer.values():
        for e in evs:
            if e.get("event") in kinds:
                k = (e["round"], e["attempt"])
                out[k] = min(e["t"], out.get(k, math.inf))
    return out


def _first_plans(events_by_peer: Mapping[int, Sequence[dict]]) -> dict[tuple[int, int], dict]:
    plans: dict[tuple[int, int], dict] = {}
    for evs in events_by_peer.values():
        for e in evs:
            if e.get("event") == "plan":
                k = (e["round"], e["attempt"])
                if k not in plans or e["t"] < plans[k]["t"]:
                    plans[k] = e
    return plans


def rounds_report(ends: Sequence[AttemptEnd], events_by_peer: Mapping[int, Sequence[dict]], t0: float,
                  ids: Mapping[str, int]) -> list[dict]:
    """The summary's `rounds`: one entry per attempt the coordinator ended, in (round, attempt) order.

    Peers are indices (`ids`; -1 for an id no peer of the swarm wrote). attempt: within its round
    (0 = first try). collective_algorithm / demoted / predicted_seconds (the collective) /
    predicted_round_seconds (the attempt, control plane included: comparable with `seconds`): the
    plan as the peers received it ("plan" events; None when no peer recorded it). seconds: a commit's from the
    coordinator; an abort's from the first peer that received the plan to the first that heard the
    abort (None without both). at_seconds: when the first peer heard the outcome, seconds after t0
    (wall clock, the time base of the events files).
    """
    plans = _first_plans(events_by_peer)
    outcome_t = _first_t(events_by_peer, ("commit", "abort"))

    def idx(pids) -> list[int]:
        return sorted(ids.get(p, -1) for p in pids)

    rows = []
    for end in sorted(ends, key=lambda e: (e.round, e.attempt)):
        k = (end.round, end.attempt)
        plan = plans.get(k)
        t = outcome_t.get(k)
        seconds = end.seconds
        if not end.committed:
            seconds = t - plan["t"] if plan is not None and t is not None else None
        rows.append({
            "round": end.round, "attempt": shown_attempt(end.attempt),
            "status": "committed" if end.committed else "aborted",
            "participants": idx(end.participants or (plan["participants"] if plan else ())),
            "collective_algorithm": plan["collective"] if plan else None,
            "demoted": idx(plan["demoted"]) if plan else [],
            "predicted_seconds": round(plan["predicted_seconds"], 4) if plan else None,
            "predicted_round_seconds": round(plan.get("predicted_round_seconds", 0.0), 4) if plan else None,
            "seconds": None if seconds is None else round(seconds, 4),
            "excluded": idx(end.excluded),
            "reason": end.reason,
            "at_seconds": None if t is None else round(t - t0, 3),
        })
    return rows


def per_peer_report(events_by_peer: Mapping[int, Sequence[dict]], starts: Mapping[int, float], rows: Sequence[dict],
                    num_peers: int, joins: Sequence[int] | None = None) -> list[dict]:
    """The summary's `per_peer`, by index. starts: wall time each peer slot's first process
    started (absent: never started). rounds_committed: distinct rounds the peer recorded a commit
    of; first_commit_after_start_seconds: from its start to its first commit (None: none);
    state_syncs: completed downloads; first_state_sync_seconds / _bytes: the first download's time
    and size; times_excluded: attempts whose abort excluded it (`rows`, from rounds_report);
    joins: from `joins_from_log` (None when unknown)."""
    out = []
    for i in range(num_peers):
        evs = events_by_peer.get(i, ())
        commits = [e for e in evs if e.get("event") == "commit"]
        syncs = [e for e in evs if e.get("event") == "state_sync"]
        start = starts.get(i)
        first = min((e["t"] for e in commits), default=None)
        out.append({
            "peer": i,
            "rounds_committed": len({e["round"] for e in commits}),
            "first_commit_after_start_seconds": None if first is None or start is None else round(first - start, 3),
            "state_syncs": len(syncs),
            "first_state_sync_seconds": round(syncs[0]["seconds"], 3) if syncs else None,
            "first_state_sync_bytes": syncs[0]["bytes"] if syncs else None,
            "times_excluded": sum(1 for r in rows if i in r["excluded"]),
            "joins": joins[i] if joins is not None else None,
        })
    return out


_JOINED = re.compile(r"peer ([0-9a-f]{8}) joined from")


def joins_from_log(lines: Iterable[str], ids: Mapping[str, int], num_peers: int) -> list[int] | None:
    """Joins per peer index, counted from the coordinator's log lines "peer <id8> joined from"
    (a join after the first is an eviction or a restart). None when the log holds no join line
    at all (a coordinator logging above INFO)."""
    by_prefix = {pid[:8]: i for pid, i in ids.items()}
    counts, seen = [0] * num_peers, False
    for line in lines:
        m = _JOINED.search(line)
        if m:
            seen = True
            i = by_prefix.get(m.group(1))
            if i is not None and i < num_peers:
                counts[i] += 1
    return counts if seen else None


def _stop_faults_only(fault: str) -> bool:
    items = [t.strip() for t in fault.split(",") if t.strip()]
    return bool(items) and all(t.partition(":")[2].partition("@")[0] == "stop" for t in items)


def touch_windows(plan: Scenario, num_peers: int, observed: Observed,
                  grace: float = TOUCH_GRACE_SECONDS) -> dict[int, list[tuple[float, float]]]:
    """When the scenario touched each peer: {index: [(from, to), ...]} in seconds after the
    coordinator started (to = inf: for the rest of the run).

    - `advertise` set, or a `fault` other than SIGSTOP faults: the whole run;
    - a SIGSTOP fault: from the stop the swarm saw to its resume + grace (never resumed: inf);
    - event stop: from `at` to the peer's next cont + grace; kill: to its next restart + grace;
      restart, shape, latency and nat-rebind: [at, at + grace]; black-hole: from `at` on; local-work: [at, at + seconds + grace];
    - coordinator-* events and static shaping touch no peer (they are not the peers' fault).
    """
    win: dict[int, list[tuple[float, float]]] = {i: [] for i in range(num_peers)}
    for i in range(num_peers):
        spec = plan.peer_spec(i)
        if spec.advertise or (spec.fault and not _stop_faults_only(spec.fault)):
            win[i].append((0.0, math.inf))
        for stopped, resumed in observed.fault_stops.get(i, ()):
            win[i].append((stopped, math.inf if resumed is None else resumed + grace))
    for k, ev in enumerate(plan.events):
        if ev.peer is None or ev.peer not in win:
            continue
        later = plan.events[k + 1:]
        if ev.action in ("stop", "kill"):
            ender = "cont" if ev.action == "stop" else "restart"
            end = next((e.at for e in later if e.peer == ev.peer and e.action == ender), None)
            win[ev.peer].append((ev.at, math.inf if end is None else end + grace))
        elif ev.action in ("restart", "shape", "nat-rebind", "latency"):
            win[ev.peer].append((ev.at, ev.at + grace))
        elif ev.action == "local-work":
            win[ev.peer].append((ev.at, ev.at + ev.seconds + grace))
        elif ev.action == "black-hole":
            win[ev.peer].append((ev.at, math.inf))
    return win


def wrongful_exclusions(rows: Sequence[dict], windows: Mapping[int, Sequence[tuple[float, float]]]) -> list[dict]:
    """Exclusions (`rows`, from rounds_report) of a peer no window of `touch_windows` covered at
    the abort's `at_seconds`; an abort with no time counts when the peer was never touched.
    Returns [{round, attempt, peer, at_seconds}]."""
    out = []
    for r in rows:
        t = r["at_seconds"]
        for p in r["excluded"]:
            spans = windows.get(p, ())
            touched = any(a <= t <= b for a, b in spans) if t is not None else bool(spans)
            if not touched:
                out.append({"round": r["round"], "attempt": r["attempt"], "peer": p, "at_seconds": t})
    return out
