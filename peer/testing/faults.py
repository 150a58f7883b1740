"""Fault injection for chaos tests: a peer kills or stops itself at a named point.

Enabled only by the environment variable SHOAL_FAULT="POINT:ACTION[@ROUND][,...]", e.g.
"ag:kill@2" (SIGKILL itself on receiving its first all-gather chunk of round 2) or
"serve-state:kill" (a donor dies while serving state). Points: "rs" (mid reduce-scatter),
"ag" (mid all-gather), "serve-state" (while serving a state range), "train" (during local
training), "commit-event" (the round-event stream delivers the commit of that round), "reduce"
(this peer's shard-owner reduction, where an owner reducer runs: the butterfly with an
aggregator), "secagg-shared" (a secure round: this participant's encrypted shares are posted and
its neighbours' received, before it sends its masked row), "secagg-sent" (a secure round: its
masked row is summed, before it reveals its shares). Actions: "kill" (SIGKILL, a real crash: no cleanup, sockets reset by the kernel),
"stop" (SIGSTOP: a silent peer; the test sends SIGCONT), "drop" (the message at that point is
lost, as on a half-dead connection; only where the code asks `dropped`), "raise" (the code at
that point raises `InjectedFault`, as a buggy aggregator would; only where the code calls
`fail`). Each fault fires at most once.

A scenario can also ask a running peer for one long local update (`shoal swarm --scenario`,
action "local-work"): SHOAL_LOCAL_WORK_FILE names a file; when it exists, the peer's next local
update takes the number of seconds it holds (`local_work`), the process staying up and
connected throughout (unlike "stop").
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("shoal.peer.testing.faults")
ACTIONS = ("kill", "stop", "drop", "raise")
POINTS = ("rs", "ag", "serve-state", "train", "commit-event", "reduce", "secagg-shared", "secagg-sent")

_SPEC: list[tuple[str, str, int | None]] = []
_FIRED: set[int] = set()


def parse_spec(text: str) -> list[tuple[str, str, int | None]]:
    """A SHOAL_FAULT value ("POINT:ACTION[@ROUND][,...]") as (point, action, round or None)
    items. Raises ValueError naming the bad item (an unknown point or action, a round that is not
    a whole number >= 0)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        point, _, rest = item.partition(":")
        action, _, rnd = rest.partition("@")
        if point not in POINTS:
            raise ValueError(f"unknown point {point!r} in {item!r} (points: {', '.join(POINTS)})")
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} in {item!r} (actions: {', '.join(ACTIONS)})")
        if rnd and not rnd.isdigit():
            raise ValueError(f"round {rnd!r} in {item!r} is not a whole number >= 0")
        out.append((point, action, int(rnd) if rnd else None))
    return out


_SPEC = parse_spec(os.environ.get("SHOAL_FAULT", ""))


class InjectedFault(ValueError):
    """Raised by `fail` where a "raise" fault is configured (a stand-in for a failing aggregator)."""


def _take(point: str, actions: tuple[str, ...], round_: int | None) -> str | None:
    """The action of the first unfired fault for `point` (and `round_`) among `actions`, now fired."""
    for i, (p, action, rnd) in enumerate(_SPEC):
        if p == point and action in actions and i not in _FIRED and (rnd is None or rnd == round_):
            _FIRED.add(i)
            return action
    return None


def hit(point: str, round_: int | None = None) -> None:
    """Fire the configured "kill"/"stop" fault for `point` (and `round_`), if any; otherwise do nothing."""
    action = _take(point, ("kill", "stop"), round_)
    if action is not None:
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def dropped(point: str, round_: int | None = None) -> bool:
    """True (once) when a "drop" fault is configured for `point` (and `round_`): lose the message."""
    return _take(point, ("drop",), round_) is not None


def armed(point: str) -> bool:
    """Whether any fault is configured for `point` (fired or not): lets callers skip wrapping."""
    return any(p == point for p, _, _ in _SPEC)


def fail(point: str, round_: int | None = None) -> None:
    """Raise `InjectedFault` (once) when a "raise" fault is configured for `point` (and `round_`)."""
    if _take(point, ("raise",), round_) is not None:
        log.warning("fault injection: %s raises in round %s", point, round_)
        raise InjectedFault(f"fault injection: {point} raised in round {round_}")


def local_work() -> float:
    """Seconds of extra local work asked for by a scenario (0 when none): reads and removes the
    file named by SHOAL_LOCAL_WORK_FILE. A malformed file counts as no request (logged)."""
    path = os.environ.get("SHOAL_LOCAL_WORK_FILE", "")
    if not path or not os.path.exists(path):
        return 0.0
    try:
        with open(path) as f:
            text = f.read().strip()
        os.unlink(path)
        seconds = float(text)
    except (OSError, ValueError) as exc:
        log.warning("local-work request %s not understood: %s", path, exc)
        return 0.0
    return max(0.0, seconds)
