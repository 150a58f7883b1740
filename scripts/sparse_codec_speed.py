"""Encode and decode time and bytes of the sparse codecs (peer/sparse.py) against int8 and float32.

    python scripts/sparse_codec_speed.py [--sizes 1e6,1e8] [--chunk 4096] [--k 64] [--bits 2]
                                         [--kinds topk,dct] [--repeat 1] [--seed 0]

For each size n (float32 elements, standard normal) and kind, times `encode`, `decode` (dense
`(n,)` result) and, for comparison, the int8 codec of peer/compression.py on the same vector;
each time is the best of `--repeat` runs (`time.perf_counter`, one thread). Bytes are the
sparse wire form (`len(SparseEncoded.to_bytes())`) and int8's `data` plus `scale`. Prints one
JSON object: the settings, then one row per (n, kind) with seconds, bytes, bytes per element,
and the ratios `float32_over_sparse` (4n / sparse bytes) and `int8_over_sparse`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from shoal.peer import compression
from shoal.peer.sparse import SparseCodec, decode, encode


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _int8(x: np.ndarray, repeat: int) -> dict:
    enc_s, enc = _best(lambda: compression.encode(x, "int8"), repeat)
    dec_s, _ = _best(lambda: compression.decode(enc), repeat)
    return {"bytes": len(enc.data) + len(enc.scale), "encode_s": round(enc_s, 4), "decode_s": round(dec_s, 4)}


def _row(x: np.ndarray, codec: SparseCodec, repeat: int, int8: dict) -> dict:
    n = x.shape[0]
    enc_s, enc = _best(lambda: encode(x, codec), repeat)
    dec_s, _ = _best(lambda: decode(enc), repeat)
    sparse_bytes = len(enc.to_bytes())
    return {
        "n": n, "kind": codec.kind, "encode_s": round(enc_s, 4), "decode_s": round(dec_s, 4),
        "bytes": sparse_bytes, "bytes_per_element": sparse_bytes / n,
        "formula_bytes_per_element": codec.bytes_per_element(),
        "float32_bytes": 4 * n, "float32_over_sparse": round(4 * n / sparse_bytes, 2),
        "int8_bytes": int8["bytes"], "int8_over_sparse": round(int8["bytes"] / sparse_bytes, 2),
        "int8_encode_s": int8["encode_s"], "int8_decode_s": int8["decode_s"],
        "sparse_over_float32_bytes": sparse_bytes / (4 * n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,1e8", help="comma-separated element counts")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--kinds", default="topk,dct")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        x = rng.standard_normal(size, dtype=np.float32)
        int8 = _int8(x, args.repeat)
        for kind in args.kinds.split(","):
            rows.append(_row(x, SparseCodec(kind, args.chunk, args.k, args.bits), args.repeat, int8))
    print(json.dumps({
        "chunk": args.chunk, "k": args.k, "density": args.k / args.chunk, "bits": args.bits,
        "repeat": args.repeat, "python": platform.python_version(), "numpy": np.__version__,
        "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
