"""The `shoal` command: coordinator, peer, swarm, status and tools.

Exit codes: 0 success; 1 the job failed (e.g. a swarm process died, a bar was not met); 2 bad
usage or configuration; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
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


def _add_security(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("security (docs/security.md)")
    g.add_argument("--tls-dir", help="TLS directory made by `shoal certs init` (ca.pem, coordinator.*, peer.*)")
    g.add_argument("--mtls", action="store_true",
                   help="mutual TLS: demand a client certificate signed by ca.pem"
                        + (" on the data plane" if role == "peer" else ""))
    g.add_argument("--insecure", action="store_true", help="plaintext gRPC (logs a warning); only for local tests")
    if role == "coordinator":
        g.add_argument("--join-token-secret", metavar="PATH",
                       help="admit only peers with a join token made from this secret (`shoal token create`)")
        g.add_argument("--allow-list", metavar="PATH", help="admit only these Ed25519 public keys (hex, one a line)")
        g.add_argument("--join-rate", type=float, default=5.0, help="joins per second per host (burst --join-burst)")
        g.add_argument("--join-burst", type=int, default=50)
        g.add_argument("--rate-limit", type=float, default=500.0, help="calls per second per host (burst 2x)")
    else:
        g.add_argument("--join-token", default=os.environ.get("SHOAL_JOIN_TOKEN", ""),
                       help="join token from the operator (default: $SHOAL_JOIN_TOKEN)")


def _security(a: argparse.Namespace, who: str):
    from peer.security import Security

    sec = Security(tls_dir=a.tls_dir, mtls=a.mtls, insecure=a.insecure)
    sec.check(who)
    return sec


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

    try:
        security = _security(a, "coordinator")
    except ValueError as exc:
        logging.getLogger("shoal.coordinator").error("%s", exc)
        return EXIT_USAGE
    cfg = CoordinatorConfig(listen=a.listen, state_path=a.state, engine=_engine_config(a),
                            run_config=dataclasses.asdict(_run_config(a, a.num_shards)), ready_file=a.ready_file,
                            security=security, join_token_secret=a.join_token_secret, allow_list=a.allow_list,
                            join_rate=a.join_rate, join_burst=a.join_burst, request_rate=a.rate_limit,
                            request_burst=max(1, int(2 * a.rate_limit)))
    _run(serve(cfg))
    return EXIT_OK


def cmd_peer(a: argparse.Namespace) -> int:
    from peer.agent import PeerConfig, run_peer

    try:
        security = _security(a, "peer")
    except ValueError as exc:
        logging.getLogger("shoal.peer").error("%s", exc)
        return EXIT_USAGE
    cfg = PeerConfig(coordinator=a.coordinator, listen=a.listen, key_path=a.key, shard=a.shard,
                     events_path=a.events, ready_file=a.ready_file, sync_donors=a.sync_donors,
                     sync_range_bytes=a.sync_range_bytes, security=security, join_token=a.join_token)
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
                        min_peers=a.min_peers, tls=a.tls)
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
    _add_security(p, "coordinator")
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
    _add_security(p, "peer")
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
    p.add_argument("--tls", action="store_true",
                   help="secure swarm: mutual TLS on both planes (certificates made in the workdir) and "
                        "admission by join token; without it the swarm runs plaintext (--insecure)")
    _add_run_config(p)
    _add_common(p)
    p.set_defaults(fn=cmd_swarm)

    p = sub.add_parser("certs", help="TLS certificates for both planes")
    csub = p.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("init", help="create a CA, a coordinator and a peer certificate in a directory")
    c.add_argument("--out", required=True, help="directory to write (ca.pem, ca.key, coordinator.*, peer.*)")
    c.add_argument("--host", action="append", default=None,
                   help="hostname or IP the certificates are valid for (repeat; default 127.0.0.1 and localhost)")
    c.add_argument("--days", type=int, default=365)
    c.add_argument("--force", action="store_true", help="overwrite existing material (invalidates old certificates)")
    _add_common(c)
    c.set_defaults(fn=cmd_certs_init)

    p = sub.add_parser("token", help="join tokens for admission")
    tsub = p.add_subparsers(dest="token_command", required=True)
    t = tsub.add_parser("create", help="print a join token (creates the secret, mode 0600, if absent)")
    t.add_argument("--secret", required=True, help="the coordinator's --join-token-secret file")
    t.add_argument("--ttl", type=float, default=86400.0, help="seconds the token is valid (default one day)")
    t.add_argument("--label", default="", help="who the token is for (shows in the coordinator's log)")
    _add_common(t)
    t.set_defaults(fn=cmd_token_create)
    return parser


def cmd_certs_init(a: argparse.Namespace) -> int:
    from shoal.certs import init_certs

    try:
        paths = init_certs(a.out, hosts=a.host or ("127.0.0.1", "localhost"), days=a.days, overwrite=a.force)
    except (FileExistsError, ValueError) as exc:
        print(f"shoal certs init: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {paths.dir}: ca.pem ca.key coordinator.pem coordinator.key peer.pem peer.key "
          f"(keys 0600; keep ca.key offline)")
    return EXIT_OK


def cmd_token_create(a: argparse.Namespace) -> int:
    import pathlib

    from coordinator.admission import create_secret, create_token, load_secret

    try:
        secret = load_secret(a.secret) if pathlib.Path(a.secret).exists() else create_secret(a.secret)
        print(create_token(secret, a.ttl, a.label))
    except ValueError as exc:
        print(f"shoal token create: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


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
