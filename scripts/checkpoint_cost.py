"""What checkpoints cost a swarm run, from its events files (docs/checkpoints.md "Cost").

    shoal swarm --peers 2 --rounds 100 --inner-steps 10 --checkpoint-every 10 --workdir run
    python scripts/checkpoint_cost.py run [--every 10]

Reads `peer-*.jsonl` in the workdir. Per peer, the gap from one `commit` event to the next (its
`t`, seconds) is split in two: the gaps that follow a commit that made a checkpoint due (its state
reflects a multiple of `--every` committed rounds: commit event `round` r with (r + 1) % every == 0)
and the others. The cost of a checkpoint is the median gap after a checkpointing commit minus the
median of the others; the cost of checkpointing is that over `every` median gaps (the share of the
rounds per minute it takes). `cost_percent_3_rounds` also counts what a write in a worker thread
takes from the two rounds after (the first three gaps' medians against the median of the rest);
`gap_median_by_position_s` shows the whole cycle. Both medians come from one run, so the machine's load, which moves two
runs' rounds per minute by far more, weighs on both alike. Also: the `checkpoint` events' seconds
(the write, fsync included) and bytes, the `checkpoint_uploaded` events' seconds, the rounds per
minute between the first and last commit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics


def _events(path: pathlib.Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            continue
    return out


def _span(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4), "mean": round(statistics.fmean(xs), 4)}


def peer_cost(events: list[dict], every: int) -> dict:
    """The gaps and the cost for one peer's events (see the module docstring)."""
    commits: dict[int, float] = {}
    for e in events:
        if e.get("event") == "commit":
            commits[int(e["round"])] = float(e["t"])  # the last commit of a round (after a rewind)
    rounds = sorted(commits)
    by_position: list[list[float]] = [[] for _ in range(every)]  # 0: the gap right after a checkpointing commit
    for r in rounds:
        if r + 1 in commits and r > 0:  # round 0's gap includes the first round's start
            by_position[(r + 1) % every].append(commits[r + 1] - commits[r])
    after, other = by_position[0], [g for pos in by_position[1:] for g in pos]
    out = {"commits": len(rounds), "gap_after_checkpoint_s": _span(after), "gap_other_s": _span(other),
           "gap_median_by_position_s": [round(statistics.median(p), 4) if p else None for p in by_position]}
    if after and other:
        extra = statistics.median(after) - statistics.median(other)
        out["extra_per_checkpoint_s"] = round(extra, 4)
        out["cost_percent"] = round(100 * extra / (every * statistics.median(other)), 2)
    if every > 4 and all(by_position):
        # A write in a worker thread can slow the next rounds too: the first three positions
        # against the medians of the rest.
        base = statistics.median([g for pos in by_position[3:] for g in pos])
        spill = sum(statistics.median(p) - base for p in by_position[:3])
        out["cost_percent_3_rounds"] = round(100 * spill / (every * base), 2)
    if len(rounds) > 1:
        out["rounds_per_minute"] = round(60 * (len(rounds) - 1) / (commits[rounds[-1]] - commits[rounds[0]]), 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", help="a `shoal swarm --workdir` directory")
    ap.add_argument("--every", type=int, default=10, help="the run's --checkpoint-every")
    a = ap.parse_args(argv)
    files = sorted(pathlib.Path(a.workdir).glob("peer-*.jsonl"))
    if not files:
        raise SystemExit(f"workdir: no peer-*.jsonl in {a.workdir}")
    peers, writes, nbytes, uploads = {}, [], [], []
    for f in files:
        ev = _events(f)
        peers[f.stem] = peer_cost(ev, a.every)
        writes += [float(e["seconds"]) for e in ev if e.get("event") == "checkpoint"]
        nbytes += [int(e["bytes"]) for e in ev if e.get("event") == "checkpoint"]
        uploads += [float(e["seconds"]) for e in ev if e.get("event") == "checkpoint_uploaded"]
    result = {"every": a.every, "peers": peers, "checkpoint_write_s": _span(writes),
              "checkpoint_bytes": {"min": min(nbytes), "max": max(nbytes)} if nbytes else {},
              "upload_s": _span(uploads)}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
