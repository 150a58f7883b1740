"""Reading a swarm's per-peer event files (`peer-N.jsonl` in its workdir) in system tests."""

from __future__ import annotations

import json
from pathlib import Path

# The coordinator aborts an attempt during which its own event loop did not run (a starved or
# paused host: coordinator/rounds.py), whoever was at fault; on a loaded test machine this is
# the host's doing, not the code under test's.
HOST_STALL = "the coordinator did not run for"


def events(wd: Path, peers: int, kind: str) -> list[dict]:
    """Every event of `kind` ("abort", "commit", "finished", ...) in peer-0..peer-{peers-1}.jsonl."""
    out = []
    for i in range(peers):
        for line in (wd / f"peer-{i}.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] == kind:
                out.append(e)
    return out


def aborts_not_from_host_stalls(wd: Path, peers: int) -> list[str]:
    """The reasons of the attempts the peers saw aborted, except the coordinator's own stalls."""
    return [e["reason"] for e in events(wd, peers, "abort") if not e["reason"].startswith(HOST_STALL)]
