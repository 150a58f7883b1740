"""Reproduce the slow- and changing-link cases of docs/performance.md ("Links") on shaped links.

A coordinator in the root namespace and ``--peers`` `shoal peer` processes, each in its own
network namespace behind ``tc tbf`` shaping (shoal.testbeds.netbed.NetBed), train ``--rounds`` rounds;
``--shape-at T --shape-peer I --shape-mbit M`` re-shapes peer I's upload and download to M
Mbit/s T seconds after the coordinator started (``--shape-after-round R`` instead: once R rounds
committed, for a machine where peers take long to start). Prints one JSON object: rounds committed and
aborted, the abort reasons, and per committed round its seconds and the plan the coordinator
logged for it (collective, predicted seconds, demoted peers as indices), plus when the shape
changed. Needs root (network namespaces); every process and namespace is removed at the end.

    python scripts/links_netbed.py --peers 3 --mbit 20 --hidden 16384 --inner-steps 5 --rounds 10
    python scripts/links_netbed.py --peers 4 --mbit 100 --rounds 60 --shape-at 25 --shape-peer 3 --shape-mbit 10

This stands in for `shoal swarm --scenario` with shaping until that exists; it reads the
coordinator's debug log ("round R.A planned: ... predicted Xs") and its state file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sqlite3
import subprocess
import sys
import tempfile
import time

from shoal.testbeds.netbed import NetBed

_PLANNED = re.compile(r"round (\d+)\.(\d+) planned: (\d+) participants, (\w+), predicted ([\d.]+)s"
                      r"(?: \(bound [\d.]+s\))?(?:, non-owners \[(.*?)\])?")


def _wait_file(path: pathlib.Path, timeout: float) -> str:
    end = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} not written in {timeout:.0f}s")
        time.sleep(0.05)
    return path.read_text().strip()


def _shape_due(a: argparse.Namespace, t0: float, wd: pathlib.Path) -> bool:
    """--shape-at seconds after the coordinator started, or --shape-after-round rounds committed."""
    if a.shape_at is not None:
        return time.monotonic() - t0 >= a.shape_at
    if a.shape_after_round is None or not (wd / "coordinator.db").exists():
        return False
    try:
        with sqlite3.connect(f"file:{wd / 'coordinator.db'}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM commits").fetchone()[0] >= a.shape_after_round
    except sqlite3.Error:
        return False


def run(a: argparse.Namespace) -> dict:
    wd = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="shoal-links-"))
    wd.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in a.mbit.split(",")]
    rates = rates * a.peers if len(rates) == 1 else rates
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)}
    result: dict = {"workdir": str(wd), "loadavg_start": os.getloadavg()}
    with NetBed(a.peers, rates, rates, prefix="shlk") as bed:
        t0 = time.monotonic()
        ready = wd / "coordinator.addr"
        coord_log = open(wd / "coordinator.log", "w")
        cproc = subprocess.Popen(  # the coordinator runs in the root namespace, unshaped
            [sys.executable, "-m", "shoal.cli", "coordinator", "--listen", f"{bed.root_ip}:0", "--insecure",
             "--state", str(wd / "coordinator.db"), "--ready-file", str(ready), "--rounds", str(a.rounds),
             "--min-peers", str(min(2, a.peers)), "--initial-peers", str(a.peers),
             "--num-data-shards", str(a.peers), "--inner-steps", str(a.inner_steps), "--hidden", str(a.hidden),
             "--log-level", "debug", *a.coordinator_args],
            stdout=coord_log, stderr=subprocess.STDOUT, env=env, cwd=wd)
        try:
            addr = _wait_file(ready, 60)
            peers = []
            for i in range(a.peers):
                peers.append(bed.popen(i, [
                    sys.executable, "-m", "shoal.cli", "peer", "--coordinator", addr, "--insecure",
                    "--listen", f"{bed.host_ip(i)}:0", "--key", str(wd / f"peer-{i}.key"), "--data-shard", str(i),
                    "--events", str(wd / f"peer-{i}.jsonl"), "--log-level", a.peer_log_level, "--no-shared-memory"],
                    stdout=open(wd / f"peer-{i}.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=wd))
            shaped_at = None
            while cproc.poll() is None and time.monotonic() - t0 < a.timeout:
                if shaped_at is None and _shape_due(a, t0, wd):
                    i = a.shape_peer
                    NetBed._shape(["-n", bed.netns(i)], "eth0", a.shape_mbit)
                    NetBed._shape([], bed.veth_bridge_side(i), a.shape_mbit)
                    shaped_at = time.time()
                    result["shaped_at_unix"] = shaped_at
                time.sleep(0.2)
            result["finished"] = cproc.poll() == 0
            result["elapsed_seconds"] = round(time.monotonic() - t0, 1)
        finally:
            if cproc.poll() is None:
                cproc.terminate()
                try:
                    cproc.wait(10)
                except subprocess.TimeoutExpired:
                    cproc.kill()
            coord_log.close()
    result["loadavg_end"] = os.getloadavg()
    return {**result, **_report(wd, a.peers)}


def _report(wd: pathlib.Path, n: int) -> dict:
    ids = []
    for i in range(n):
        events = wd / f"peer-{i}.jsonl"
        pid = ""
        if events.exists():
            for line in events.read_text().splitlines():
                pid = json.loads(line).get("peer", "") or pid
                if pid:
                    break
        ids.append(pid)
    index = {p[:8]: i for i, p in enumerate(ids) if p}
    db = sqlite3.connect(wd / "coordinator.db")
    commits = db.execute("SELECT round, attempt, seconds, at, participants FROM commits ORDER BY round").fetchall()
    aborts = db.execute("SELECT round, attempt, reason FROM aborts ORDER BY id").fetchall()
    plans = {}
    for line in (wd / "coordinator.log").read_text().splitlines():
        m = _PLANNED.search(line)
        if m:
            demoted = [index.get(d.strip(" '\""), d) for d in (m.group(6) or "").split(",") if d.strip()]
            plans[(int(m.group(1)), int(m.group(2)))] = {"collective": m.group(4),
                                                         "predicted_seconds": float(m.group(5)), "demoted": demoted}
    rounds = [{"round": r, "attempt": att, "seconds": round(s, 3), "at": at,
               **plans.get((r, att), {})} for r, att, s, at, _ in commits]
    reasons: dict[str, int] = {}
    for _, _, reason in aborts:
        key = re.sub(r"[0-9a-f]{8}", "X", reason)[:90]
        reasons[key] = reasons.get(key, 0) + 1
    sent = []  # per peer: data-plane bytes sent per committed round (its "finished" summary)
    for i in range(n):
        events = wd / f"peer-{i}.jsonl"
        fin = [json.loads(x) for x in (events.read_text().splitlines() if events.exists() else ())]
        fin = [e for e in fin if e.get("event") == "finished" and e.get("rounds")]
        sent.append(fin[-1]["bytes_sent"] / fin[-1]["rounds"] if fin else None)
    return {"rounds_committed": len(commits), "attempts_aborted": len(aborts), "abort_reasons": reasons,
            "bytes_sent_per_round": sent, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--mbit", default="20", help="per-peer up = down Mbit/s: one value or a comma list")
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--shape-at", type=float)
    ap.add_argument("--shape-after-round", type=int, help="re-shape once this many rounds committed instead")
    ap.add_argument("--shape-peer", type=int, default=0)
    ap.add_argument("--shape-mbit", type=float, default=10.0)
    ap.add_argument("--workdir")
    ap.add_argument("--peer-log-level", default="info")
    ap.add_argument("coordinator_args", nargs="*", help="after --: extra `shoal coordinator` flags")
    print(json.dumps(run(ap.parse_args()), indent=1))


if __name__ == "__main__":
    main()
