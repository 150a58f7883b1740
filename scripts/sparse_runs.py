"""Dense and sparse DiLoCo swarms with the same seeds and settings, in one invocation.

    python scripts/sparse_runs.py [--codecs none,int8,topk] [--out DIR] -- SWARM_ARGS...

Runs `shoal swarm SWARM_ARGS --compression C` once per codec C, in order (the sparse codecs with
the `--sparse-*` flags given in SWARM_ARGS; dense runs ignore them), each with its own workdir
and summary under --out, and prints one JSON object: per codec the summary's rounds, digest
mismatches, bytes_sent_total, test_accuracy (digits) or val_loss (workload lm) and wall
seconds, and against the first codec (float32 by default) the byte ratio
`first_bytes_over_these` and, for lm, `val_loss_over_first`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

KEYS = ("ok", "rounds_committed", "rounds_aborted", "digest_mismatches", "bytes_sent_total", "test_accuracy",
        "val_loss", "baseline_val_loss", "wall_seconds", "compression")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", default="none,int8,topk", help="compressions, in order (default none,int8,topk)")
    ap.add_argument("--out", default="sparse-runs", help="directory for the workdirs and summaries")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per swarm")
    ap.add_argument("swarm", nargs=argparse.REMAINDER, help="-- then the `shoal swarm` arguments")
    a = ap.parse_args()
    args = [x for x in a.swarm if x != "--"]
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"swarm_args": args, "runs": {}}
    for codec in a.codecs.split(","):
        summary = out / f"{codec}.json"
        cmd = [sys.executable, "-m", "shoal.cli", "swarm", *args, "--compression", codec, "--no-progress",
               "--summary", str(summary), "--workdir", str(out / f"work-{codec}")]
        with open(out / f"{codec}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
        got = json.loads(summary.read_text()) if summary.exists() else {}
        report["runs"][codec] = {"exit": rc, **{k: got[k] for k in KEYS if k in got}}
    runs = list(report["runs"].values())
    first = runs[0]
    for r in runs:
        if r.get("bytes_sent_total"):
            r["first_bytes_over_these"] = first.get("bytes_sent_total", 0) / r["bytes_sent_total"]
        if r.get("val_loss") and first.get("val_loss"):
            r["val_loss_over_first"] = r["val_loss"] / first["val_loss"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
