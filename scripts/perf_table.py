"""Run the docs/performance.md matrix of `shoal bench allreduce` on shaped links (needs root).

    python scripts/perf_table.py [--peers 2,4,8] [--sizes 1,16,128] [--out runs/perf.jsonl]

For each p, size and link shape (uniform: every peer at B Mbit/s up and down; uneven: the last
peer at B/10) it runs one bench (1 warm-up + `--repeat` timed rounds, auto algorithm) and appends
its JSON to `--out`; then prints the markdown table. B grows with the size so that a run stays
around a minute on a 2-core machine: 1 MB at 20 Mbit/s, 16 MB at 100, 128 MB at 400.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

RATE_FOR_SIZE = {1: 20, 16: 100, 128: 400}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default="2,4,8")
    ap.add_argument("--sizes", default="1,16,128")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default="runs/perf.jsonl")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in [int(s) for s in a.sizes.split(",")]:
        for p in [int(s) for s in a.peers.split(",")]:
            for shape in ("uniform", "uneven"):
                b = RATE_FOR_SIZE.get(size, 100)
                rates = [b] * p if shape == "uniform" else [b] * (p - 1) + [b / 10]
                cmd = [sys.executable, "-m", "shoal.cli", "bench", "allreduce", "--peers", str(p), "--size-mb",
                       str(size), "--link-mbit", ",".join(f"{r:g}" for r in rates), "--repeat", str(a.repeat), "--json"]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    print(f"FAILED: {' '.join(cmd)}\n{proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                rep = json.loads(proc.stdout)
                rep["shape"], rep["command"] = shape, "shoal " + " ".join(cmd[3:])
                with out.open("a") as f:
                    f.write(json.dumps(rep) + "\n")
                rows.append(rep)
                print(f"p={p} {size} MB {shape}: {rep['algorithm']} {rep['seconds_median']:.2f}s "
                      f"bound {rep['bound_seconds']:.2f}s eff {rep['efficiency']:.2f}", file=sys.stderr, flush=True)
    print("| p | size | links (Mbit/s) | algorithm | measured s | bound s | predicted s | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        links = f"{r['up_mbit'][0]:g} x{r['peers']}" if r["shape"] == "uniform" else \
            f"{r['up_mbit'][0]:g} x{r['peers'] - 1}, {r['up_mbit'][-1]:g}"
        print(f"| {r['peers']} | {r['size_bytes'] / 1e6:g} MB | {links} | {r['algorithm']} | "
              f"{r['seconds_median']:.2f} | {r['bound_seconds']:.2f} | {r['predicted_seconds']:.2f} | "
              f"{r['efficiency']:.2f} |")


if __name__ == "__main__":
    main()
