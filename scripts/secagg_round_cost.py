"""Whole-round cost of secure aggregation: `shoal swarm` runs with and without it, bytes and
seconds per round.

    python scripts/secagg_round_cost.py [--peers 6,16] [--rounds 5] [--inner-steps 5] [--hidden 32]
                                        [--workdir DIR]

For each number of peers, runs `shoal swarm --algorithm fedavg` (digits, the default MLP with
`--hidden` units) for `--rounds` rounds, once in the clear and once with `--secure-aggregation`,
and reads the summaries: `seconds_per_round` (wall time of the run / rounds committed: local
training included), `collective_seconds` (per peer and attempt, plan in hand to the result and its
digest: for a secure attempt this includes the shares, the masking, the relay waits and the
unmasking), `secure_seconds` (that secure part alone), `data_bytes_per_peer_round` (data-plane
bytes one peer sent per round: the masked uint32 rows are as large as float32 ones) and
`secure_bytes_per_peer_round` (shares and reveals one peer sent through the coordinator per
round), the accuracy and digest mismatches. The runs share the machine with whatever else runs:
times are as noisy as its load (printed beside them). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def run(peers: int, secure: bool, a, workdir: pathlib.Path) -> dict:
    name = f"p{peers}-{'secure' if secure else 'plain'}"
    summary = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "shoal.cli", "swarm", "--algorithm", "fedavg", "--peers", str(peers),
           "--rounds", str(a.rounds), "--inner-steps", str(a.inner_steps), "--hidden", str(a.hidden),
           "--no-progress", "--timeout", "1200", "--summary", str(summary), "--workdir", str(workdir / name),
           *(["--secure-aggregation"] if secure else [])]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    rounds = max(1, s["rounds_committed"])
    attempts = rounds + s["rounds_aborted"]
    return {"peers": peers, "secure_aggregation": secure, "rounds": s["rounds_committed"],
            "aborted": s["rounds_aborted"], "test_accuracy": round(s["test_accuracy"], 4),
            "digest_mismatches": s["digest_mismatches"], "seconds_per_round": round(s["wall_seconds"] / rounds, 3),
            "collective_seconds": s["collective_seconds_mean"], "secure_seconds": s.get("secure_seconds_mean", 0.0),
            "data_bytes_per_peer_round": round(s["bytes_sent_total"] / peers / rounds),
            "secure_bytes_per_peer_round": round(s.get("secure_bytes_total", 0) / peers / attempts),
            "load_at_start": round(load, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="6,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    workdir = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="secagg-cost-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [run(int(p), secure, a, workdir) for p in a.peers.split(",") for secure in (False, True)]
    print(json.dumps({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
