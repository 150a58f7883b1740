"""The `shoal` command: coordinator, peer, swarm, status and tools.

Exit codes: 0 success; 1 the job failed (e.g. a swarm process died, a bar was not met); 2 bad
usage or configuration; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger; `fmt` "json" writes one JSON object per record."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        class _Json(logging.Formatter):
            def format(self, r: logging.LogRecord) -> str:
                return json.dumps({"t": r.created, "level": r.levelname.lower(), "logger": r.name,
                                   "msg": r.getMessage()})
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - non-Linux
        asyncio.run(coro)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])


def _add_run_config(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training run")
    g.add_argument("--algorithm", default="diloco", choices=["diloco", "fedavg"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--inner-steps", type=int, default=50, help="local optimizer steps per round (H)")
    g.add_argument("--lr", type=float, default=3e-3, help="inner Adam learning rate")
    g.add_argument("--non-iid", action="store_true", help="label-skewed data split across peers")


def _add_engine(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rounds")
    g.add_argument("--rounds", type=int, default=20, help="committed rounds to run (0 = forever)")
    g.add_argument("--min-peers", type=int, default=2, help="quorum: fewest participants of a round")
    g.add_argument("--initial-peers", type=int, default=0, help="round 0 waits for this many ready peers")
    g.add_argument("--lease-seconds", type=float, default=10.0)
    g.add_argument("--straggler-timeout", type=float, default=5.0,
                   help="after the first ready, wait at most this long for the other members")
    g.add_argument("--collective-timeout", type=float, default=30.0)
    g.add_argument("--chunk-timeout", type=float, default=2.0,
                   help="floor of the per-chunk deadline, seconds (see docs/fault-tolerance.md)")
    g.add_argument("--max-attempts", type=int, default=5, help="attempts of one round (first try + retries)")
    g.add_argument("--retry-backoff", type=float, default=0.05,
                   help="delay before retry k of a round is retry_backoff * 2**(k-1) seconds")
    g.add_argument("--algorithm-collective", default="ring", choices=["ring", "butterfly", "auto"],
                   help="all-reduce algorithm (auto: chosen by the planner from measured links)")


def _engine_config(a: argparse.Namespace):
    from coordinator.rounds import EngineConfig

    return EngineConfig(min_peers=a.min_peers, initial_peers=a.initial_peers, lease_seconds=a.lease_seconds, ready_timeout=a.straggler_timeout,
                        collective_timeout=a.collective_timeout, chunk_timeout=a.chunk_timeout,
                        max_attempts=a.max_attempts, retry_backoff=a.retry_backoff, total_rounds=a.rounds,
                        algorithm=a.algorithm_collective)


def _run_config(a: argparse.Namespace, num_shards: int):
    from peer.training import RunConfig

    return RunConfig(algorithm=a.algorithm, seed=a.seed, inner_steps=a.inner_steps, lr=a.lr, non_iid=a.non_iid,
                     num_shards=num_shards)


def cmd_coordinator(a: argparse.Namespace) -> int:
    import dataclasses

    from coordinator.server import CoordinatorConfig, serve

    cfg = CoordinatorConfig(listen=a.listen, state_path=a.state, engine=_engine_config(a),
                            run_config=dataclasses.asdict(_run_config(a, a.num_shards)), ready_file=a.ready_file)
    _run(serve(cfg))
    return EXIT_OK


def cmd_peer(a: argparse.Namespace) -> int:
    from peer.agent import PeerConfig, run_peer

    cfg = PeerConfig(coordinator=a.coordinator, listen=a.listen, key_path=a.key, shard=a.shard,
                     events_path=a.events, ready_file=a.ready_file, sync_donors=a.sync_donors,
                     sync_range_bytes=a.sync_range_bytes)
    result: dict = {}

    async def main() -> None:
        result.update(await run_peer(cfg))

    _run(main())
    logging.getLogger("shoal.peer").info("finished: %s", json.dumps(result))
    return EXIT_OK


def cmd_swarm(a: argparse.Namespace) -> int:
    from shoal.swarm import SwarmOptions, run_swarm

    rounds = a.rounds if a.rounds is not None else (60 if a.chaos else 20)
    opts = SwarmOptions(peers=a.peers, rounds=rounds, chaos=a.chaos, chaos_interval=a.chaos_interval, algorithm=a.algorithm, seed=a.seed,
                        inner_steps=a.inner_steps, lr=a.lr, non_iid=a.non_iid, summary_path=a.summary,
                        workdir=a.workdir, progress=not a.no_progress, straggler_timeout=a.straggler_timeout,
                        min_peers=a.min_peers)
    summary = run_swarm(opts)
    return EXIT_OK if summary.get("ok") else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Fault-tolerant decentralized training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coordinator", help="run the control-plane daemon")
    p.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to serve on (port 0 = any)")
    p.add_argument("--state", default="shoal-coordinator.db", help="SQLite state file")
    p.add_argument("--ready-file", help="write the bound address here once serving")
    p.add_argument("--num-shards", type=int, default=4, help="data parts of the default workload")
    _add_engine(p)
    _add_run_config(p)
    _add_common(p)
    p.set_defaults(fn=cmd_coordinator)

    p = sub.add_parser("peer", help="run a peer (agent on a volunteer machine)")
    p.add_argument("--coordinator", default="127.0.0.1:7070", help="coordinator HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:0", help="data-plane HOST:PORT (port 0 = any)")
    p.add_argument("--key", default="shoal-peer.key", help="Ed25519 identity key file (created if absent)")
    p.add_argument("--shard", type=int, default=0, help="which part of the training data this peer holds")
    p.add_argument("--events", help="append JSON-lines round events here")
    p.add_argument("--ready-file", help="write the data-plane address here once joined")
    p.add_argument("--sync-donors", type=int, default=3, help="donors used in parallel for state sync")
    p.add_argument("--sync-range-bytes", type=int, default=256 << 10, help="byte range fetched per state-sync request")
    _add_common(p)
    p.set_defaults(fn=cmd_peer)

    p = sub.add_parser("swarm", help="run a whole local swarm: coordinator + N peers on 127.0.0.1")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--summary", help="write the run summary JSON here")
    p.add_argument("--workdir", help="keep keys, state and logs here (default: a temporary directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--rounds", type=int, default=None, help="committed rounds to run (default 20; 60 with --chaos)")
    p.add_argument("--min-peers", type=int, default=2)
    p.add_argument("--chaos", action="store_true",
                   help="kill -9 and restart random peers, SIGSTOP one, kill -9 and restart the coordinator")
    p.add_argument("--chaos-interval", type=float, default=3.0, help="seconds between chaos actions")
    p.add_argument("--straggler-timeout", type=float, default=5.0)
    _add_run_config(p)
    _add_common(p)
    p.set_defaults(fn=cmd_swarm)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
