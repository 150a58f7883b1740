"""A slow joiner catching up, on kernel-shaped links (needs root: shoal.testbeds.netbed).

    python scripts/catchup_bed.py [--hidden 16384] [--joiner-mbit 4] [--join-at 8] [--timeout 150]

Three unshaped peers train from the start; a fourth, behind `--joiner-mbit` Mbit/s up and down
(tc tbf), starts at `--join-at` seconds. The coordinator runs in the root namespace. Prints one
JSON line: the joiner's state downloads (bytes, seconds, from its events file), the seconds from
its start to its first commit, the commits it took part in, and the load average. Exit status 0
when the joiner committed within the time limit. Until `shoal swarm --scenario` shapes links this
is the reproduction of docs/fault-tolerance.md's "slow joiner" figure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

from shoal.testbeds.netbed import NetBed


def _events(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _joined_at(log: pathlib.Path, after: float) -> float | None:
    """Unix time of the joiner's "joined as" line (its log stamps HH:MM:SS, local time)."""
    for line in log.read_text().splitlines() if log.exists() else ():
        if " joined as " in line:
            hh, mm, ss = (int(x) for x in line[:8].split(":"))
            base = time.localtime(after)
            t = time.mktime((base.tm_year, base.tm_mon, base.tm_mday, hh, mm, ss, 0, 0, -1))
            return t if t >= after - 1 else t + 86400
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--joiner-mbit", type=float, default=4.0)
    ap.add_argument("--join-at", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--extra-peer-args", default="")
    ap.add_argument("--extra-coordinator-args", default="", help='e.g. "--chunk-timeout 10" (until the '
                    'per-chunk deadlines follow measured links)')
    a = ap.parse_args()
    ok, why = NetBed.available()
    if not ok:
        print(json.dumps({"skipped": why}))
        return 2
    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="catchup-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    common = ["--log-level", "info", "--insecure"]
    # Every peer runs on this one host: without this the collective would take the shared-memory
    # lane and bypass the namespaces' shaped links.
    peer_common = ["--no-shared-memory"]
    with NetBed(4, up_mbit=[None, None, None, a.joiner_mbit], down_mbit=[None, None, None, a.joiner_mbit],
                prefix="cat") as bed:
        ready = work / "coordinator.addr"
        coord_log = open(work / "coordinator.log", "w")
        import subprocess
        coord = subprocess.Popen(
            [py, "-m", "shoal.cli", "coordinator", "--listen", f"{bed.root_ip}:0", "--state", str(work / "c.db"),
             "--ready-file", str(ready), "--rounds", "100000", "--min-peers", "2", "--initial-peers", "3",
             "--num-data-shards", "4", "--inner-steps", str(a.inner_steps), "--hidden", str(a.hidden), *common,
             *a.extra_coordinator_args.split()],
            stdout=coord_log, stderr=subprocess.STDOUT)
        procs = [coord]
        try:
            end = time.monotonic() + 30
            while not ready.exists() or not ready.read_text().strip():
                if time.monotonic() > end or coord.poll() is not None:
                    raise SystemExit("coordinator did not start; see " + str(work / "coordinator.log"))
                time.sleep(0.1)
            address = ready.read_text().strip()
            t0 = time.monotonic()

            def start(i: int):
                log = open(work / f"peer-{i}.log", "w")
                return bed.popen(i, [py, "-m", "shoal.cli", "peer", "--coordinator", address,
                                     "--listen", f"{bed.host_ip(i)}:0", "--key", str(work / f"peer-{i}.key"),
                                     "--data-shard", str(i), "--events", str(work / f"peer-{i}.jsonl"), *common, *peer_common,
                                     *a.extra_peer_args.split()],
                                 stdout=log, stderr=subprocess.STDOUT)

            for i in range(3):
                procs.append(start(i))
            while time.monotonic() - t0 < a.join_at:
                time.sleep(0.1)
            joiner_started = time.time()
            procs.append(start(3))
            first_commit = None
            while time.monotonic() - t0 < a.timeout:
                ev = _events(work / "peer-3.jsonl")
                commits = [e for e in ev if e.get("event") == "commit"]
                if commits:
                    first_commit = commits[0]
                    time.sleep(3.0)  # a few more
                    break
                time.sleep(0.5)
            ev = _events(work / "peer-3.jsonl")
            joined_at = _joined_at(work / "peer-3.log", joiner_started)
            syncs = [e for e in ev if e.get("event") == "state_sync"]
            failed = [e for e in ev if e.get("event") == "state_sync_failed"]
            result = {
                "hidden": a.hidden, "joiner_mbit": a.joiner_mbit, "join_at": a.join_at,
                "joiner_first_commit_after_start_s": (round(first_commit["t"] - joiner_started, 2)
                                                      if first_commit and "t" in first_commit else None),
                "joiner_first_commit_after_join_s": (round(first_commit["t"] - joined_at, 2)
                                                     if first_commit and joined_at else None),
                # From the start of its first state download (the sync order) to its first commit.
                "joiner_first_commit_after_sync_start_s": (
                    round(first_commit["t"] - (syncs[0]["t"] - syncs[0]["seconds"]), 2)
                    if first_commit and syncs else None),
                "joiner_commits": sum(e.get("event") == "commit" for e in ev),
                "state_syncs": [{k: s.get(k) for k in ("round", "bytes", "seconds")} for s in syncs],
                "state_syncs_failed": len(failed),
                "donor_precondition_lines": sum(
                    (work / f"peer-{i}.log").read_text().count("holds state of round") for i in range(4)),
                "loadavg": os.getloadavg(),
                "workdir": str(work),
            }
            print(json.dumps(result))
            return 0 if first_commit else 1
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    sys.exit(main())
