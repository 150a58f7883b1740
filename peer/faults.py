"""Fault injection for chaos tests: a peer kills or stops itself at a named point.

Enabled only by the environment variable SHOAL_FAULT="POINT:ACTION[@ROUND][,...]", e.g.
"ag:kill@2" (SIGKILL itself on receiving its first all-gather chunk of round 2) or
"serve-state:kill" (a donor dies while serving state). Points: "rs" (mid reduce-scatter),
"ag" (mid all-gather), "serve-state" (while serving a state range), "train" (during local
training), "commit-event" (the round-event stream delivers the commit of that round). Actions:
"kill" (SIGKILL, a real crash: no cleanup, sockets reset by the kernel), "stop" (SIGSTOP: a
silent peer; the test sends SIGCONT), "drop" (the message at that point is lost, as on a
half-dead connection; only where the code asks `dropped`). Each fault fires at most once.
"""

from __future__ import annotations

import os
import signal

_SPEC: list[tuple[str, str, int | None]] = []
_FIRED: set[int] = set()


def _parse(text: str) -> list[tuple[str, str, int | None]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        point, _, rest = item.partition(":")
        action, _, rnd = rest.partition("@")
        if action not in ("kill", "stop", "drop"):
            raise ValueError(f"SHOAL_FAULT: unknown action {action!r} in {item!r}")
        out.append((point, action, int(rnd) if rnd else None))
    return out


_SPEC = _parse(os.environ.get("SHOAL_FAULT", ""))


def hit(point: str, round_: int | None = None) -> None:
    """Fire the configured fault for `point` (and `round_`), if any; otherwise do nothing."""
    for i, (p, action, rnd) in enumerate(_SPEC):
        if p == point and action != "drop" and i not in _FIRED and (rnd is None or rnd == round_):
            _FIRED.add(i)
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def dropped(point: str, round_: int | None = None) -> bool:
    """True (once) when a "drop" fault is configured for `point` (and `round_`): lose the message."""
    for i, (p, action, rnd) in enumerate(_SPEC):
        if p == point and action == "drop" and i not in _FIRED and (rnd is None or rnd == round_):
            _FIRED.add(i)
            return True
    return False
