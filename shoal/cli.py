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


AGGREGATOR_CHOICES = ["mean", "fedavg", "median", "trimmed-mean", "centered-clip", "krum", "multi-krum", "bulyan"]
OUTER_CHOICES = ["sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "diloco"]


def _add_aggregation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("aggregation (docs/aggregation.md)")
    g.add_argument("--aggregator", default="mean", choices=AGGREGATOR_CHOICES,
                   help="what shard owners compute; anything but mean runs on the butterfly collective")
    g.add_argument("--trim-beta", type=float, help="trimmed-mean: fraction trimmed from each side (default 0.2)")
    g.add_argument("--krum-f", type=int, help="krum / multi-krum / bulyan: Byzantine peers tolerated (default 1)")
    g.add_argument("--krum-m", type=int, help="multi-krum: rows averaged (default n - f)")
    g.add_argument("--clip-tau", type=float, help="centered-clip: clipping radius (default 1.0)")
    g.add_argument("--clip-iters", type=int, help="centered-clip: iterations (default 5)")
    g.add_argument("--max-norm", type=float, default=0.0, help="L2 bound on each contribution (0 = none)")
    g.add_argument("--on-norm", default="clip", choices=["clip", "reject"], help="what happens beyond --max-norm")
    g.add_argument("--dp-sigma", type=float, default=0.0,
                   help="DP noise multiplier: owners add N(0, (sigma * max_norm / p)^2) once (needs --max-norm)")
    g.add_argument("--outer", choices=OUTER_CHOICES, help="outer optimizer (default: diloco for diloco, sgd for fedavg)")
    g.add_argument("--outer-lr", type=float, help="outer learning rate")
    g.add_argument("--outer-param", action="append", default=[], metavar="KEY=VALUE",
                   help="other outer optimizer parameter (momentum, beta1, beta2, tau); repeatable")
    g.add_argument("--fedprox-mu", type=float, default=0.0, help="FedProx proximal coefficient of the inner loss")
    g.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "int8"],
                   help="per-hop wire codec (int8: blockwise absmax with error feedback)")


def _aggregator_params(a: argparse.Namespace) -> dict:
    names = {"trim_beta": ("trimmed-mean", "beta"), "clip_tau": ("centered-clip", "tau"),
             "clip_iters": ("centered-clip", "iterations"), "krum_m": ("multi-krum", "m")}
    out: dict = {}
    for attr, (agg, key) in names.items():
        if getattr(a, attr) is not None and a.aggregator == agg:
            out[key] = getattr(a, attr)
    if a.krum_f is not None and a.aggregator in ("krum", "multi-krum", "bulyan"):
        out["f"] = a.krum_f
    return out


def _outer_params(a: argparse.Namespace) -> dict:
    out: dict = {}
    for kv in a.outer_param:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--outer-param: expected KEY=VALUE, got {kv!r}")
        out[key.strip()] = float(value)
    if a.outer_lr is not None:
        out["lr"] = a.outer_lr
    return out


def _aggregation_argv(a: argparse.Namespace) -> list[str]:
    """The aggregation flags as given, to pass on to a coordinator process (shoal swarm)."""
    argv = ["--aggregator", a.aggregator, "--max-norm", str(a.max_norm), "--on-norm", a.on_norm,
            "--dp-sigma", str(a.dp_sigma), "--fedprox-mu", str(a.fedprox_mu), "--compression", a.compression]
    for flag in ("trim_beta", "krum_f", "krum_m", "clip_tau", "clip_iters", "outer", "outer_lr"):
        if getattr(a, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    for kv in a.outer_param:
        argv += ["--outer-param", kv]
    return argv


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
                        # Norm bound and DP noise need a shard owner that sees every contribution.
                        algorithm="butterfly" if a.max_norm > 0 or a.dp_sigma > 0 else a.algorithm_collective,
                        aggregator=a.aggregator, compression=a.compression)


def _run_config(a: argparse.Namespace, num_shards: int):
    from peer.training import RunConfig

    return RunConfig(algorithm=a.algorithm, seed=a.seed, inner_steps=a.inner_steps, lr=a.lr, non_iid=a.non_iid,
                     num_shards=num_shards, aggregator=a.aggregator, aggregator_params=_aggregator_params(a),
                     outer=a.outer or "", outer_params=_outer_params(a), fedprox_mu=a.fedprox_mu,
                     compression=a.compression, max_norm=a.max_norm, on_norm=a.on_norm, dp_sigma=a.dp_sigma)


def _check_run_config(a: argparse.Namespace, num_shards: int):
    """The RunConfig, or exit 2 naming the bad setting."""
    from peer.errors import InvalidArgument

    try:
        return _run_config(a, num_shards)
    except InvalidArgument as exc:
        logging.getLogger("shoal").error("bad configuration: %s", exc)
        raise SystemExit(EXIT_USAGE) from None


def cmd_coordinator(a: argparse.Namespace) -> int:
    import dataclasses

    from coordinator.server import CoordinatorConfig, serve

    cfg = CoordinatorConfig(listen=a.listen, state_path=a.state, engine=_engine_config(a),
                            run_config=dataclasses.asdict(_check_run_config(a, a.num_shards)), ready_file=a.ready_file)
    _run(serve(cfg))
    return EXIT_OK


def cmd_peer(a: argparse.Namespace) -> int:
    from peer.agent import PeerConfig, run_peer

    cfg = PeerConfig(coordinator=a.coordinator, listen=a.listen, key_path=a.key, shard=a.shard,
                     events_path=a.events, ready_file=a.ready_file, sync_donors=a.sync_donors,
                     sync_range_bytes=a.sync_range_bytes, attack=a.attack or "", attack_scale=a.attack_scale)
    result: dict = {}

    async def main() -> None:
        result.update(await run_peer(cfg))

    _run(main())
    logging.getLogger("shoal.peer").info("finished: %s", json.dumps(result))
    return EXIT_OK


def cmd_swarm(a: argparse.Namespace) -> int:
    from shoal.swarm import SwarmOptions, run_swarm

    _check_run_config(a, a.peers)
    if not 0 <= a.byzantine <= a.peers or (a.byzantine and not a.attack):
        logging.getLogger("shoal").error("--byzantine: needs 0 <= K <= --peers and an --attack")
        return EXIT_USAGE
    attack_args = ("--attack", a.attack) + (("--attack-scale", str(a.attack_scale)) if a.attack_scale else ())
    rounds = a.rounds if a.rounds is not None else (60 if a.chaos else 20)
    opts = SwarmOptions(byzantine=a.byzantine, attack_args=attack_args if a.byzantine else (),
                        extra_coordinator_args=tuple(_aggregation_argv(a)),
                        aggregator=a.aggregator, compression=a.compression,
                        peers=a.peers, rounds=rounds, chaos=a.chaos, chaos_interval=a.chaos_interval, algorithm=a.algorithm, seed=a.seed,
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
    _add_aggregation(p)
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
    p.add_argument("--attack", choices=["sign-flip", "scale", "nan", "random"],
                   help="testing only: send forged updates instead of honest ones (docs/aggregation.md)")
    p.add_argument("--attack-scale", type=float, help="strength of --attack (defaults per attack)")
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
    p.add_argument("--byzantine", type=int, default=0, help="how many peers send forged updates (the last K)")
    p.add_argument("--attack", choices=["sign-flip", "scale", "nan", "random"], help="what the Byzantine peers send")
    p.add_argument("--attack-scale", type=float, help="strength of --attack (defaults per attack)")
    _add_run_config(p)
    _add_aggregation(p)
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
