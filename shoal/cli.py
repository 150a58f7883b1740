"""The `shoal` command: coordinator, peer, swarm and status.

Every subcommand takes `--config shoal.toml`, `--log-level` and `--log-format text|json`, and
one flag per setting of the configuration sections it reads (shoal.config; precedence: defaults
< TOML file < SHOAL_<SECTION>_<KEY> environment < flags; all listed in docs/configuration.md).

Exit codes (the same for every subcommand):
    0    success (the run finished, the status was printed)
    1    the job failed (a swarm process died, the run timed out, a peer gave up)
    2    bad usage or configuration (unknown flag, bad TOML, wrong type, invalid value)
    3    unavailable: the coordinator cannot be reached, or an address cannot be bound
    130  interrupted (Ctrl-C / SIGINT)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from shoal import config as config_mod
from peer.errors import InvalidArgument
from shoal.config import ConfigError, ShoalConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

log = logging.getLogger("shoal.cli")


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger; `fmt` "json" writes one JSON object per record."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        class _Json(logging.Formatter):
            def format(self, r: logging.LogRecord) -> str:
                rec = {"t": r.created, "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
                if r.exc_info:
                    rec["exc"] = self.formatException(r.exc_info)
                return json.dumps(rec)
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - non-Linux
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _is_unavailable(exc: BaseException) -> bool:
    import grpc

    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ------------------------------------------------------------------------------ subcommands


def _security(tls_dir: str | None, mtls: bool, insecure: bool, who: str):
    """The TLS/plaintext choice of a process; raises ValueError when neither is given."""
    from peer.security import Security

    sec = Security(tls_dir=tls_dir, mtls=mtls, insecure=insecure)
    sec.check(who)
    return sec


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


def cmd_coordinator(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    import dataclasses

    from coordinator.server import CoordinatorConfig, serve

    c = cfg.coordinator
    try:
        security = _security(c.tls_dir, c.mtls, c.insecure, "coordinator")
    except ValueError as exc:
        log.error("coordinator: %s", exc)
        return EXIT_USAGE
    server_cfg = CoordinatorConfig(
        listen=c.listen, state_path=c.state, engine=cfg.rounds.to_engine_config(cfg.run),
        run_config=dataclasses.asdict(cfg.run.to_run_config(c.num_shards)), ready_file=c.ready_file,
        key_path=c.key, metrics_port=c.metrics_port, metrics_host=c.metrics_host,
        security=security, join_token_secret=c.join_token_secret, allow_list=c.allow_list,
        join_rate=c.join_rate, join_burst=c.join_burst, request_rate=c.rate_limit,
        request_burst=max(1, int(2 * c.rate_limit)))

    got: list[int] = []

    async def main() -> None:
        # SIGTERM (docker stop, kubectl delete) and Ctrl-C shut down in order: health flips to
        # NOT_SERVING, the server drains, the state file is closed.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
        await serve(server_cfg, stop=stop)

    try:
        _run(main())
    except OSError as exc:
        log.error("coordinator: %s", exc)
        return EXIT_UNAVAILABLE
    return EXIT_INTERRUPTED if signal.SIGINT in got else EXIT_OK


def cmd_peer(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    from peer.agent import PeerConfig, run_peer

    p = cfg.peer
    try:
        security = _security(p.tls_dir, p.mtls, p.insecure, "peer")
    except ValueError as exc:
        log.error("peer: %s", exc)
        return EXIT_USAGE
    peer_cfg = PeerConfig(security=security, join_token=p.join_token or os.environ.get("SHOAL_JOIN_TOKEN", ""),
                          attack=p.attack, attack_scale=p.attack_scale,
                          coordinator=p.coordinator, listen=p.listen, key_path=p.key, shard=p.shard,
                          events_path=p.events, ready_file=p.ready_file, rpc_timeout=p.rpc_timeout,
                          round_silence=p.round_silence, sync_donors=p.sync_donors,
                          sync_range_bytes=p.sync_range_bytes,
                          connect_timeout=p.connect_timeout, advertise=p.advertise, metrics_port=p.metrics_port,
                          metrics_host=p.metrics_host)
    result: dict = {}

    async def main() -> None:
        result.update(await run_peer(peer_cfg))

    try:
        _run(main())
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code, then reported
        if _is_unavailable(exc) or isinstance(exc, OSError):
            log.error("peer: coordinator %s unreachable or address unavailable: %s", p.coordinator, exc)
            return EXIT_UNAVAILABLE
        log.exception("peer failed")
        return EXIT_FAILED
    logging.getLogger("shoal.peer").info("finished: %s", json.dumps(result))
    return EXIT_OK


CHAOS_ROUNDS = 150
_SWARM_RUN_FIELDS = ("algorithm", "seed", "inner_steps", "lr", "non_iid")
_SWARM_ROUNDS_FIELDS = ("rounds", "min_peers", "initial_peers", "straggler_timeout")


def cmd_swarm(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    import dataclasses

    from shoal.swarm import SwarmOptions, run_swarm

    s, r, run = cfg.swarm, cfg.rounds, cfg.run
    run.to_run_config(s.peers)  # validate before starting anything (exit 2 naming the setting)
    if not 0 <= s.byzantine <= s.peers or (s.byzantine and not s.attack):
        log.error("swarm: byzantine needs 0 <= K <= peers and an attack")
        return EXIT_USAGE
    attack_args: tuple[str, ...] = ()
    if s.byzantine:
        attack_args = ("--attack", s.attack) + (("--attack-scale", str(s.attack_scale)) if s.attack_scale else ())
    run_extra = tuple((f.name, getattr(run, f.name)) for f in dataclasses.fields(run)
                      if f.name not in _SWARM_RUN_FIELDS and getattr(run, f.name) != f.default)
    rounds_flags = config_mod.to_flags(cfg, "rounds")
    keep = [config_mod.flag_name("rounds", n) for n in _SWARM_ROUNDS_FIELDS]
    extra = []
    for i in range(0, len(rounds_flags), 2):
        if rounds_flags[i] not in keep:
            extra += rounds_flags[i:i + 2]
    # --chaos runs longer by default (CHAOS_ROUNDS) unless a layer set `rounds` explicitly: the chaos
    # monkey needs time to act several times and then leave a calm end.
    rounds = CHAOS_ROUNDS if s.chaos and "rounds.rounds" not in given else r.rounds
    opts = SwarmOptions(peers=s.peers, rounds=rounds, chaos=s.chaos, chaos_interval=s.chaos_interval, algorithm=run.algorithm, seed=run.seed,
                        inner_steps=run.inner_steps, lr=run.lr, non_iid=run.non_iid, summary_path=s.summary,
                        workdir=s.workdir, progress=s.progress, straggler_timeout=r.straggler_timeout,
                        min_peers=r.min_peers, timeout=s.timeout, plot_path=s.plot, metrics=s.metrics,
                        run_extra=run_extra, extra_coordinator_args=tuple(extra),
                        log_level=cfg.log.level, log_format=cfg.log.format, tls=s.tls,
                        byzantine=s.byzantine, attack_args=attack_args, aggregator=run.aggregator,
                        compression=run.compression)
    summary = run_swarm(opts)
    return EXIT_OK if summary.get("ok") else EXIT_FAILED


def cmd_status(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    from shoal.status import fetch_status, render_table

    st = cfg.status
    try:
        status = fetch_status(st.coordinator, recent=st.recent, timeout=st.timeout)
    except Exception as exc:  # noqa: BLE001
        if _is_unavailable(exc):
            print(f"shoal status: coordinator {st.coordinator} unreachable ({exc.code().name})", file=sys.stderr)
            return EXIT_UNAVAILABLE
        raise
    print(json.dumps(status, indent=2) if st.json else render_table(status))
    return EXIT_OK


COMMANDS = {
    "coordinator": (cmd_coordinator, "run the control-plane daemon (membership, rounds, durable state)"),
    "peer": (cmd_peer, "run a peer: the agent on a volunteer machine"),
    "swarm": (cmd_swarm, "run a whole local swarm: a coordinator + N peers as processes on 127.0.0.1"),
    "status": (cmd_status, "show a coordinator's members, their links and recent rounds"),
}

_EPILOG = """\
configuration: defaults < --config FILE (TOML) < SHOAL_<SECTION>_<KEY> environment < flags;
every setting is listed in docs/configuration.md.

exit codes: 0 success; 1 the job failed; 2 bad usage or configuration;
3 coordinator unreachable or address unavailable; 130 interrupted.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal", description="Shoal: fault-tolerant decentralized training over the public internet.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, epilog=_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        config_mod.add_flags(p, name)
        p.set_defaults(fn=fn)

    # Tools: plain flags, no configuration layers.
    p = sub.add_parser("certs", help="TLS certificates for both planes")
    csub = p.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("init", help="create a CA, a coordinator and a peer certificate in a directory")
    c.add_argument("--out", required=True, help="directory to write (ca.pem, ca.key, coordinator.*, peer.*)")
    c.add_argument("--host", action="append", default=None,
                   help="hostname or IP the certificates are valid for (repeat; default 127.0.0.1 and localhost)")
    c.add_argument("--days", type=int, default=365)
    c.add_argument("--force", action="store_true", help="overwrite existing material (invalidates old certificates)")
    c.set_defaults(tool=cmd_certs_init)

    p = sub.add_parser("token", help="join tokens for admission")
    tsub = p.add_subparsers(dest="token_command", required=True)
    t = tsub.add_parser("create", help="print a join token (creates the secret, mode 0600, if absent)")
    t.add_argument("--secret", required=True, help="the coordinator's join_token_secret file")
    t.add_argument("--ttl", type=float, default=86400.0, help="seconds the token is valid (default one day)")
    t.add_argument("--label", default="", help="who the token is for (shows in the coordinator's log)")
    t.set_defaults(tool=cmd_token_create)

    from shoal.bench import add_bench_parser, cmd_bench

    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(tool=cmd_bench)
    return parser


def load_config(a: argparse.Namespace, environ=None, sources: dict[str, str] | None = None) -> ShoalConfig:
    """The configuration of a parsed command line (file < environment < flags); `sources`, when
    given, receives "section.key" -> "file" | "env" | "flag" for every setting a layer set."""
    return config_mod.load(a.config, environ, config_mod.flags_from_args(a), sources=sources)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)  # exits 2 on bad usage
    if getattr(a, "tool", None) is not None:
        setup_logging("info", "text")
        return a.tool(a)
    sources: dict[str, str] = {}
    try:
        cfg = load_config(a, sources=sources)
    except ConfigError as exc:
        print(f"shoal {a.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(cfg.log.level, cfg.log.format)
    try:
        return a.fn(cfg, frozenset(sources))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (ConfigError, InvalidArgument) as exc:
        print(f"shoal {a.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
