"""Compute and byte cost of one secure-aggregation round (peer/secagg.py, SecAgg+) per participant.

    python scripts/secagg_cost.py [--peers 6,16] [--sizes 4810,1000000] [--degree 6] [--threshold 3]
                                  [--drop-after 1] [--drop-before 1] [--repeat 3]

For each number of participants p and vector length n (float32 elements, normal), runs the whole
protocol in one process: key and share generation (`shares`), masking (`mask`), the mod-2^32 sum
of the senders' rows, the survivors' reveals and `unmask`, with `--drop-after` participants that
send and then vanish and `--drop-before` that hand out shares and never send. Times are the best
of `--repeat` runs (`time.perf_counter`, one thread): `shares_s` and `mask_s` per participant,
`sum_s` (what the reducer adds: the same uint32 additions as a float32 sum), `unmask_s` once per
round. Bytes per participant per round beyond the plain collective: its public key (32), one
share of its seed and of its key per neighbour (2 x 66 each, sent and received), and the reveals
(66 per neighbour). The masked row itself is 4 bytes per element, the size of an uncompressed
float32 row. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from shoal.peer.secagg import SHARE_BYTES, SecAggParams, SecAggParticipant, neighbour_graph, unmask

CTX = b"cost"


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def one(p: int, n: int, params: SecAggParams, drop_after: int, drop_before: int, repeat: int) -> dict:
    graph = neighbour_graph(p, params, b"cost-graph")
    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 0.5, n).astype(np.float32) for _ in range(p)]
    parts = [SecAggParticipant(i, graph, params, CTX) for i in range(p)]
    keys = {i: parts[i].public_key for i in range(p)}
    shares_s, all_shares = _best(lambda: [a.shares() for a in parts], repeat)
    for sh in all_shares:
        for j, s in sh.items():
            parts[j].receive(s)
    sent = list(range(drop_before, p))
    survivors = sent[drop_after:]
    mask_s, rows = _best(lambda: {i: parts[i].mask(xs[i], keys) for i in sent}, repeat)

    def add():
        total = np.zeros(n, np.uint32)
        for i in sent:
            total += rows[i]
        return total

    sum_s, total = _best(add, repeat)
    revealed = {i: parts[i].reveal(sent) for i in survivors}
    unmask_s, got = _best(lambda: unmask(total, sent, revealed, keys, graph, params, CTX), repeat)
    exact = float(np.abs(got - np.sum([xs[i] for i in sent], axis=0)).max())
    k = params.degree_for(p)
    return {"peers": p, "elements": n, "degree": k, "threshold": params.threshold, "sent": len(sent),
            "survivors": len(survivors), "shares_s": shares_s / p, "mask_s": mask_s / len(sent), "sum_s": sum_s,
            "unmask_s": unmask_s, "max_abs_error": exact,
            "extra_bytes_per_peer": 32 + 2 * 2 * SHARE_BYTES * k + SHARE_BYTES * k,
            "masked_row_bytes": 4 * n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="6,16")
    ap.add_argument("--sizes", default="4810,1000000")
    ap.add_argument("--degree", type=int, default=6)
    ap.add_argument("--threshold", type=int, default=3)
    ap.add_argument("--drop-after", type=int, default=1)
    ap.add_argument("--drop-before", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    params = SecAggParams(degree=a.degree, threshold=a.threshold)
    rows = [one(int(p), int(float(n)), params, a.drop_after, a.drop_before, a.repeat)
            for p in a.peers.split(",") for n in a.sizes.split(",")]
    print(json.dumps({"machine": platform.processor() or platform.machine(), "settings": vars(a), "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
