"""`shoal status`: the operator's view of a coordinator (members, their links, recent rounds, and
why the next round is not open). A member's links are the estimates the planner uses now (its
last report, up and down bytes/s and RTT) and their age (seconds since that report; reports come
before every Ready, re-measured after a round slower than predicted).

One GetStatus call (bounded by `timeout`) over TLS or explicit plaintext (`shoal.common.security
.Security`, like every other connection), rendered either as JSON (stable keys, for scripts and
tests) or as plain-text tables for humans. Failure: an unreachable coordinator (or a TLS
handshake that fails) raises the grpc.aio.AioRpcError (UNAVAILABLE / DEADLINE_EXCEEDED), which
the CLI maps to exit code 3.
"""

from __future__ import annotations

import asyncio
import json

from shoal.common.attempts import shown_attempt
from shoal.common.security import Security, open_channel
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc


async def fetch_status_async(address: str, *, recent: int = 10, timeout: float = 5.0,
                             security: Security = Security(insecure=True)) -> dict:
    """GetStatus as a JSON-ready dict: epoch, round, counts, run_config, members, rounds, and
    `waiting` ({reason, message, peers, seconds_left}: why the next round is not open)."""
    async with open_channel(address, security, options=[]) as channel:
        resp: pb.StatusResponse = await pb_grpc.CoordinatorStub(channel).GetStatus(
            pb.StatusRequest(recent_rounds=recent), timeout=timeout, wait_for_ready=False)
    try:
        run_config = json.loads(resp.run_config_json) if resp.run_config_json else {}
    except ValueError:
        run_config = {"raw": resp.run_config_json}
    return {
        "coordinator": address,
        "epoch": resp.epoch,
        "round": resp.round,
        "rounds_committed": resp.rounds_committed,
        "rounds_aborted": resp.rounds_aborted,
        # differential privacy: epsilon spent at delta (both 0 without DP; docs/aggregation.md)
        "epsilon": resp.epsilon,
        "dp_delta": resp.dp_delta,
        "run_config": run_config,
        # the wire codec and what one peer's contribution costs per model element (compression_cost)
        "compression": compression_cost(run_config),
        # the newest committed round a peer's checkpoint holds (0 = none; docs/checkpoints.md)
        "durable": {"round": resp.durable_round, "state_digest": resp.durable_digest.hex(),
                    "peers": list(resp.durable_peers)},
        "rounds_lost": resp.rounds_lost,
        "waiting": {"reason": resp.waiting.reason, "message": resp.waiting.message,
                    "peers": list(resp.waiting.peers), "seconds_left": round(resp.waiting.seconds_left, 3)},
        "members": [
            {"peer_id": m.peer_id, "address": m.address, "state": m.state,
             "lease_remaining_seconds": round(m.lease_remaining_seconds, 3), "num_samples": m.num_samples,
             "links": {"up_bytes_per_s": m.up_bytes_per_s, "down_bytes_per_s": m.down_bytes_per_s,
                       "rtt_seconds": m.rtt_seconds,
                       # since the member's last link report; None when it never reported one
                       "age_seconds": round(m.links_age_seconds, 1) if m.links_age_seconds >= 0 else None},
             "untrusted": m.untrusted, "shm_peers": m.shm_peers,
             # the coordinator's dial-back: "reachable" | "unreachable" | "unchecked"; outbound_only:
             # it takes part without being dialled (unreachable, or --outbound-only; docs/nat.md)
             "reachability": m.reachability or "unchecked", "outbound_only": m.outbound_only,
             # the relay it is reached through (joined with --relay), "" when dialled directly
             "relay": m.relay}
            for m in resp.members
        ],
        "rounds": [
            {"round": r.round, "attempt": r.attempt, "status": r.status, "participants": r.participants,
             "seconds": round(r.seconds, 4), "train_loss": r.train_loss, "reason": r.reason,
             "state_digest": r.state_digest.hex()}
            for r in resp.rounds
        ],
    }


def fetch_status(address: str, *, recent: int = 10, timeout: float = 5.0,
                 security: Security = Security(insecure=True)) -> dict:
    return asyncio.run(fetch_status_async(address, recent=recent, timeout=timeout, security=security))


def _rate(bps: float) -> str:
    if bps <= 0:
        return "-"
    for unit in ("B/s", "KB/s", "MB/s", "GB/s"):
        if bps < 1000:
            return f"{bps:.1f} {unit}"
        bps /= 1000
    return f"{bps:.1f} TB/s"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}s"


def compression_cost(rc: dict) -> dict:
    """The run's wire codec from the run configuration `rc`, for `shoal status --json`: `name`,
    `bytes_per_element` (what one peer's contribution takes per model element, bytes; float32 = 4;
    None for a codec this build does not know) and `float32_over_these` (4 / bytes_per_element)."""
    name = rc.get("compression", "none") or "none"
    if name in ("topk", "dct"):
        from shoal.peer.sparse import SparseCodec

        per = SparseCodec(name, rc.get("sparse_chunk", 4096), rc.get("sparse_k", 64),
                          rc.get("sparse_bits", 2)).bytes_per_element()
    else:
        from shoal.peer.compression import CODECS, payload_bytes

        n = 1 << 20  # large enough that the per-block scales count at their limit
        per = payload_bytes(n, name) / n if name in CODECS else None
    return {"name": name, "bytes_per_element": per, "float32_over_these": 4 / per if per else None}


def compression_line(rc: dict) -> str:
    """The run's wire codec for `shoal status`: its name, parameters and the bytes one peer's
    contribution takes per model element (float32 = 4), from the run configuration `rc`."""
    cost = compression_cost(rc)
    name, per = cost["name"], cost["bytes_per_element"]
    if per is None:
        return f"compression {name}"
    if name in ("topk", "dct"):
        chunk, k, bits = rc.get("sparse_chunk", 4096), rc.get("sparse_k", 64), rc.get("sparse_bits", 2)
        return (f"compression {name} (k {k} of {chunk} = {100 * k / chunk:.2f} %, {bits}-bit values, "
                f"beta {rc.get('sparse_beta', 0.95):g}): {per:.4f} bytes per element "
                f"({cost['float32_over_these']:.0f}x less than float32)")
    return f"compression {name}: {per:.4f} bytes per element"


def render_table(s: dict) -> str:
    """Human view of `fetch_status`'s dict."""
    algo = s["run_config"].get("algorithm", "?")
    head = (f"coordinator {s['coordinator']}  epoch {s['epoch']}  round {s['round']}  "
            f"committed {s['rounds_committed']}  aborted {s['rounds_aborted']}  algorithm {algo}")
    if s["run_config"]:
        head += "\n" + compression_line(s["run_config"])
        rc = s["run_config"]
        if rc.get("secure_aggregation"):
            head += (f"\nsecure aggregation on (degree {rc.get('secagg_degree')}, threshold "
                     f"{rc.get('secagg_threshold')}, clip {rc.get('secagg_clip')}, {rc.get('secagg_frac_bits')} "
                     f"fraction bits)")
    if s.get("dp_delta"):
        head += f"  epsilon {s['epsilon']:.3f} (delta {s['dp_delta']:g})"
    d = s.get("durable") or {}
    if d.get("round"):
        head += (f"\nlast durable round {d['round']} (checkpoint digest {d['state_digest'][:16]}, held by "
                 f"{len(d['peers'])} peers)")
    else:
        head += "\nlast durable round: none (no peer reported a checkpoint of a committed round)"
    if s.get("rounds_lost"):
        head += f"; {s['rounds_lost']} committed rounds lost to rewinds"
    members = _table(
        ["peer", "address", "state", "reach", "lease", "samples", "up", "down", "rtt", "links age", "shm peers"],
        [[m["peer_id"][:12], m["address"], m["state"] + (" (untrusted)" if m["untrusted"] else ""),
          "outbound-only" if m.get("outbound_only") else f"relayed via {m['relay']}" if m.get("relay")
          else m.get("reachability", "unchecked"),
          f"{m['lease_remaining_seconds']:.1f}s", str(m["num_samples"]),
          _rate(m["links"]["up_bytes_per_s"]), _rate(m["links"]["down_bytes_per_s"]),
          f"{m['links']['rtt_seconds'] * 1000:.1f}ms" if m["links"]["rtt_seconds"] else "-",
          _age(m["links"].get("age_seconds")), str(m["shm_peers"])]
         for m in s["members"]])
    rounds = _table(
        ["round", "attempt", "status", "peers", "seconds", "loss", "reason"],
        [[str(r["round"]), str(shown_attempt(r["attempt"])), r["status"], str(r["participants"]),
          f"{r['seconds']:.3f}" if r["seconds"] else "-", f"{r['train_loss']:.4f}" if r["status"] == "committed" else "-",
          r["reason"][:60]] for r in s["rounds"]])
    waiting = s.get("waiting") or {}
    nxt = f"next round: {waiting['message']}\n\n" if waiting.get("message") else ""
    return f"{head}\n\n{nxt}members ({len(s['members'])})\n{members}\n\nrecent rounds\n{rounds}"
