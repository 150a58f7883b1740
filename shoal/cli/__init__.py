"""The `shoal` command: coordinator, peer, swarm, status and relay.

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
import errno
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import time
import typing

# gRPC core's own log lines (e.g. "I1201 ... ssl_transport_security.cc ... Handshake failed" on
# every retry of a TLS failure, 19 in 15 s) repeat what our one-line messages say; errors only,
# unless the user asks for more. Before grpc is imported: it reads this once.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from shoal import config as config_mod  # noqa: E402
from shoal.common.errors import InvalidArgument
from shoal.config import ConfigError, RunSection, ShoalConfig
from shoal.coordinator.rounds import SECURE_MIN_PEERS

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


class UsageError(Exception):
    """A user error found before anything starts (a missing file, an unusable path): the CLI
    prints it as one line, `shoal <command>: <message>`, and exits 2."""


def _rpc_error(exc: BaseException):
    """The grpc.aio.AioRpcError behind `exc` (also inside an exception group), or None."""
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _rpc_error(inner)
            if found is not None:
                return found
    return None


def _is_unavailable(exc: BaseException) -> bool:
    import grpc

    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _is_refused(exc: BaseException) -> bool:
    from shoal.common.retry import REFUSED

    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() in REFUSED


def _found(exc: BaseException, kind: type[BaseException]):
    """The exception of type `kind` behind `exc` (also inside an exception group), or None."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _found(inner, kind)
            if found is not None:
                return found
    return None


# ------------------------------------------------------------------------------ pre-flight checks


def _parent_dir(flag: str, path: str | None) -> None:
    """`path`'s directory must exist (we never create directories for a file setting)."""
    if not path:
        return
    parent = pathlib.Path(path).expanduser().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")


def _tls_dir(tls_dir: str | None, files: tuple[str, ...]) -> None:
    """The TLS directory exists and holds `files` (made by `shoal certs init`)."""
    if not tls_dir:
        return
    hint = f"create it with `shoal certs init --out {tls_dir}`"
    d = pathlib.Path(tls_dir)
    if not d.is_dir():
        raise UsageError(f"--tls-dir {tls_dir}: no such directory ({hint})")
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise UsageError(f"--tls-dir {tls_dir}: missing {', '.join(missing)} ({hint})")


def _security(tls_dir: str | None, mtls: bool, insecure: bool, who: str, files: tuple[str, ...]):
    """The TLS/plaintext choice of a process, its files checked; raises UsageError."""
    from shoal.common.security import Security

    sec = Security(tls_dir=tls_dir, mtls=mtls, insecure=insecure)
    try:
        sec.check(who)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _tls_dir(tls_dir, files)
    return sec


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


class AddressUnavailable(Exception):
    """An address a process must listen on cannot be bound (another process listens there, or a
    privileged port): printed as one line, `shoal <command>: <message>`, exit 3."""


def _stop_on_signals(got: list[int]) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT on the running loop; each signal received is appended
    to `got` (the command's exit code tells Ctrl-C from SIGTERM)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
    return stop


def _bindable(flag: str, address: str) -> None:
    """`address` (HOST:PORT, as validated by shoal.config) can be listened on right now; port 0
    always can. Binds and closes a probe socket with SO_REUSEADDR, as the servers do, so only a
    listener (not a connection in TIME_WAIT) is in the way. Other errors (an address that is not
    local) are left to the server's own bind. Raises AddressUnavailable naming the flag."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
                s.listen(1)
            except PermissionError:
                raise AddressUnavailable(f"{flag} {address}: permission denied (ports below 1024 need "
                                         f"privileges; pick a higher port)") from None
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AddressUnavailable(f"{flag} {address}: address already in use (another process "
                                             f"listens on port {port}; stop it or pick another port)") from None


def _bind_failure(exc: BaseException, flag: str, address: str) -> AddressUnavailable | None:
    """grpc's own bind error ("Failed to bind to address ...", a RuntimeError), or an OSError of
    the /metrics server, as the one line the CLI prints; None for anything else."""
    if isinstance(exc, RuntimeError) and str(exc).startswith("Failed to bind to address"):
        return AddressUnavailable(f"{flag} {address}: cannot listen there (in use, or not an address of "
                                  f"this host)")
    return None


# ------------------------------------------------------------------------------ subcommands


def cmd_certs_init(a: argparse.Namespace) -> int:
    from shoal.common.certs import CA_KEY, init_certs

    try:
        paths = init_certs(a.out, hosts=a.host or ("127.0.0.1", "localhost"), days=a.days, overwrite=a.force)
    except FileExistsError:
        print(f"shoal certs init: {pathlib.Path(a.out) / CA_KEY} already exists; pass --force to replace the CA "
              f"(certificates made from the old one stop working)", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"shoal certs init: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"shoal certs init: --out {a.out}: {_why(exc)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {paths.dir}: ca.pem ca.key coordinator.pem coordinator.key (keys 0600). The coordinator "
          f"uses the whole directory (ca.key signs each peer's certificate at join); a volunteer needs only "
          f"ca.pem and a join token")
    return EXIT_OK


def cmd_token_create(a: argparse.Namespace) -> int:
    from shoal.coordinator.admission import create_secret, create_token, load_secret

    try:
        if pathlib.Path(a.secret).exists():
            secret = load_secret(a.secret)
        else:
            _parent_dir("--secret", a.secret)
            secret = create_secret(a.secret)
        print(create_token(secret, a.ttl, a.label))
    except (UsageError, ValueError) as exc:
        print(f"shoal token create: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"shoal token create: --secret {a.secret}: {_why(exc)}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _checkpoints_in(path: str) -> list:
    """The checkpoints `path` names: a checkpoint directory (`--checkpoint-dir`, newest first) or one
    checkpoint (`round-N`); UsageError when it holds none."""
    from shoal.peer import checkpoints as ck

    p = pathlib.Path(path)
    if (p / ck.MANIFEST_FILE).is_file():
        try:
            return [ck.read_manifest(p)]
        except ck.CheckpointError as exc:
            raise UsageError(str(exc)) from None
    found = ck.list_checkpoints(p)
    if not found:
        raise UsageError(f"{path}: no checkpoint there (a --checkpoint-dir holds round-N directories)")
    return found


def cmd_checkpoint(a: argparse.Namespace) -> int:
    """`shoal checkpoint list|verify|export DIR` (peer.checkpoints; docs/checkpoints.md)."""
    from shoal.peer import checkpoints as ck

    name = f"shoal checkpoint {a.checkpoint_command}"
    try:
        found = _checkpoints_in(a.dir)
        if a.checkpoint_command == "list":
            print(f"{'round':>7}  {'digest':16}  {'bytes':>10}  {'run':32}  written")
            for c in found:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.manifest.get("written_at", 0)))
                print(f"{c.round:>7}  {c.digest.hex()[:16]}  {c.bytes:>10}  {c.manifest.get('run_id', '?'):32}  "
                      f"{when} UTC")
            return EXIT_OK
        if a.checkpoint_command == "verify":
            bad = 0
            for c in found:
                try:
                    ck.verify(c)
                    print(f"ok       round {c.round}  digest {c.digest.hex()[:16]}  {c.path}")
                except ck.CheckpointError as exc:
                    bad += 1
                    print(f"damaged  round {c.round}  {exc}")
            return EXIT_FAILED if bad else EXIT_OK
        chosen = [c for c in found if a.round is None or c.round == a.round]
        if not chosen:
            raise UsageError(f"{a.dir}: no checkpoint of round {a.round}")
        for c in chosen:  # the newest that verifies
            try:
                out = ck.export(c, a.out, a.format)
            except ck.CheckpointError as exc:
                print(f"{name}: skipping damaged checkpoint: {exc}", file=sys.stderr)
                continue
            print(f"wrote {out}: round {c.round}, {len(c.manifest['model']['layout'])} tensors, digest "
                  f"{c.digest.hex()[:16]} ({a.format})")
            return EXIT_OK
        print(f"{name}: no checkpoint in {a.dir} passes its digest check", file=sys.stderr)
        return EXIT_FAILED
    except UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError:
        print(f"{name}: --format torch needs PyTorch (pip install torch)", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"{name}: {exc.filename or a.dir}: {_why(exc)}", file=sys.stderr)
        return EXIT_FAILED


def cmd_member(a: argparse.Namespace) -> int:
    """`shoal member list|revoke`: signed with the coordinator's key (shoal.cli.members)."""
    from shoal.cli.members import list_members, render_members, revoke_member

    name = f"shoal member {a.member_command}"
    try:
        security = _security(a.tls_dir, False, a.insecure, "member", ("ca.pem",))
        if not pathlib.Path(a.admin_key).is_file():
            raise UsageError(f"--admin-key {a.admin_key}: no such file (the coordinator's --key file; by default its "
                             f"state file with .key)")
        target = config_mod.grpc_target(a.coordinator)
        if a.member_command == "list":
            listing = asyncio.run(list_members(target, a.admin_key, security, a.timeout))
            print(json.dumps(listing, indent=2) if a.json else render_members(listing))
        else:
            rec = asyncio.run(revoke_member(target, a.admin_key, a.member, security, a.timeout))
            print(f"revoked {rec['member']} ({rec['label']}): its next call is refused")
    except (UsageError, ValueError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code, then reported
        rpc = _rpc_error(exc)
        if rpc is None:
            raise
        if _is_unavailable(exc):
            from shoal.peer.diagnosis import diagnose

            print(f"{name}: coordinator {a.coordinator} unreachable: {diagnose(rpc, a.coordinator).line()}",
                  file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"{name}: {rpc.details()}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _key_file(path: str) -> None:
    """An Ed25519 key file that loads, or one that can be created."""
    from shoal.common.identity import load_or_create_key

    if not pathlib.Path(path).exists():
        try:  # like load_or_create_key, which makes the key's directory (e.g. ~/.shoal)
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--key {path}: {_why(exc)}") from None
        _parent_dir("--key", path)
        return
    try:
        load_or_create_key(path)
    except ValueError as exc:
        raise UsageError(f"--key: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--key {path}: {_why(exc)}") from None


def _coordinator_files(c) -> None:
    """Every file the coordinator reads or writes is usable before it starts; raises UsageError."""
    from shoal.coordinator.admission import AllowList, load_secret

    from shoal.coordinator.etcd_store import EtcdTarget, is_etcd

    if is_etcd(c.state):
        try:
            EtcdTarget.parse(c.state)
        except ValueError as exc:
            raise UsageError(f"--state {exc}") from None
        for flag, path in (("--etcd-ca", c.etcd_ca), ("--etcd-cert", c.etcd_cert), ("--etcd-key", c.etcd_key)):
            if path is not None and not os.access(path, os.R_OK):
                raise UsageError(f"{flag} {path}: not a readable file")
        key = c.key or "shoal-coordinator.key"  # shared by every coordinator of the prefix
    else:
        _parent_dir("--state", c.state)
        key = c.key or str(pathlib.Path(c.state).with_suffix(".key"))
    _key_file(key)
    _parent_dir("--ready-file", c.ready_file)
    for flag, path, load, hint in (
            ("--join-token-secret", c.join_token_secret, load_secret,
             f" (create it with `shoal token create --secret {c.join_token_secret}`)"),
            ("--allow-list", c.allow_list, AllowList.from_file, "")):
        if not path:
            continue
        try:
            load(path)
        except FileNotFoundError:
            raise UsageError(f"{flag} {path}: no such file{hint}") from None
        except OSError as exc:
            raise UsageError(f"{flag} {path}: {_why(exc)}") from None
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None


def _recovered_path(state: str) -> str:
    p = pathlib.Path(state)
    return str(p.with_name(f"{p.stem}.recovered{p.suffix or '.db'}"))


def cmd_state_tool(c, backup: str | None, recover: str | None) -> int:
    """`shoal coordinator --state-backup PATH` / `--state-recover [PATH]`: one operation on the
    state file, then exit (0 done; 1 nothing could be recovered; 2 bad paths)."""
    from shoal.coordinator.state_file import backup_state, recover_state
    from shoal.coordinator.store import StateFileError

    try:
        if backup is not None:
            _parent_dir("--state-backup", backup)
            summary = backup_state(c.state, backup)
            print(f"backed up {c.state} to {summary.describe()}")
            return EXIT_OK
        dst = recover or _recovered_path(c.state)
        _parent_dir("--state-recover", dst)
        report = recover_state(c.state, dst)
    except (FileExistsError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    except StateFileError as exc:
        print(f"shoal coordinator: {exc}", file=sys.stderr)
        return EXIT_USAGE if backup is not None else EXIT_FAILED
    s = report.summary
    print(f"recovered {c.state} into {s.describe()}")
    for line in report.lost:
        print(f"  lost: {line}")
    last = "no committed round" if s.last_round is None else f"round {s.last_round}"
    print(f"the last committed round kept is {last}: rounds after it are lost, and peers holding one of them "
          f"must be restarted (they then fetch the kept state). To use it: shoal coordinator --state {dst}")
    return EXIT_OK


def _resume_point(where: str):
    """--resume-from: the newest checkpoint under `where` (DIR or file://DIR) that passes its digest
    check, as the coordinator's ResumePoint; UsageError naming the place when there is none."""
    from shoal.coordinator.daemon import ResumePoint
    from shoal.peer import checkpoints as ck

    path = where.removeprefix("file://")
    if "://" in path:
        raise UsageError(f"--resume-from {where}: a checkpoint directory or file://DIR")
    for found in _checkpoints_in(path):
        try:
            ck.verify(found)
        except ck.CheckpointError as exc:
            log.warning("--resume-from: skipping damaged checkpoint: %s", exc)
            continue
        return ResumePoint(found.round, found.digest, dict(found.manifest["run_config"]), str(found.path))
    raise UsageError(f"--resume-from {where}: no checkpoint there passes its digest check")


def cmd_coordinator(cfg: ShoalConfig, given: frozenset[str] = frozenset(), *, state_backup: str | None = None,
                    state_recover: str | None = None) -> int:
    import dataclasses

    from shoal.coordinator.daemon import CoordinatorConfig, serve
    from shoal.coordinator.etcd_store import EtcdAccess
    from shoal.coordinator.rounds import EngineConfig
    from shoal.coordinator.leadership import StoreUnreachable
    from shoal.coordinator.store import StateFileError

    c = cfg.coordinator
    if state_backup is not None or state_recover is not None:
        if state_backup is not None and state_recover is not None:
            raise UsageError("--state-backup and --state-recover: give one of them")
        if c.state.startswith("etcd://"):
            raise UsageError("--state-backup and --state-recover work on a SQLite state file; back etcd up with "
                             "`etcdctl snapshot save`")
        return cmd_state_tool(c, state_backup, state_recover or None)
    _coordinator_files(c)
    _bindable("--listen", c.listen)
    if c.metrics_port:
        _bindable("--metrics-port", f"{c.metrics_host}:{c.metrics_port}")
    security = _security(c.tls_dir, c.mtls, c.insecure, "coordinator",
                         ("coordinator.pem", "coordinator.key") + (("ca.pem",) if c.mtls else ()))

    def engine_for(run: RunSection) -> EngineConfig:
        return dataclasses.replace(cfg.rounds.to_engine_config(run), history_window=c.history_window)

    server_cfg = CoordinatorConfig(
        listen=c.listen, state_path=c.state, engine=engine_for(cfg.run),
        run_config=dataclasses.asdict(cfg.run.to_run_config(c.num_data_shards)), ready_file=c.ready_file,
        engine_for_run=lambda stored: engine_for(cfg.run.with_stored(stored)),
        key_path=c.key, metrics_port=c.metrics_port, metrics_host=c.metrics_host,
        security=security, join_token_secret=c.join_token_secret, allow_list=c.allow_list,
        join_rate=c.join_rate, join_burst=c.join_burst, request_rate=c.rate_limit,
        request_burst=max(1, int(2 * c.rate_limit)), finish_linger=c.finish_linger, reach_timeout=c.reach_timeout,
        cert_lifetime=c.cert_lifetime, member_retention=c.member_retention, trace_dir=c.trace_dir,
        accept_loops=c.accept_loops, store_unreachable_limit=c.store_unreachable_limit,
        etcd_access=EtcdAccess(c.etcd_ca, c.etcd_cert, c.etcd_key, c.etcd_user, c.etcd_password),
        resume=_resume_point(c.resume_from) if c.resume_from else None)

    got: list[int] = []

    async def main() -> None:
        # SIGTERM (docker stop, kubectl delete) and Ctrl-C shut down in order: health flips to
        # NOT_SERVING, the server drains, the state file is closed.
        stop = _stop_on_signals(got)
        await serve(server_cfg, stop=stop)

    try:
        _run(main())
    except StateFileError as exc:
        # Damaged, foreign or newer: never start afresh over it. One line, the options in it.
        print(f"shoal coordinator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StoreUnreachable as exc:
        print(f"shoal coordinator: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as exc:
        failure = _bind_failure(exc, "--listen", c.listen)
        if failure is None:
            raise
        raise failure from None
    except OSError as exc:
        log.error("coordinator: %s", exc)
        return EXIT_UNAVAILABLE
    return EXIT_INTERRUPTED if signal.SIGINT in got else EXIT_OK


def _peer_files(p) -> None:
    """The identity key loads (or can be created) and the output files' directories exist."""
    _parent_dir("--events", p.events)
    _parent_dir("--ready-file", p.ready_file)
    if p.key:
        _key_file(p.key)


def _hold_peer_key(p) -> str:
    """Lock this peer's key file (--key, else the per-user default: shoal.common.identity
    .hold_default_key) for this process; returns its path. Raises UsageError naming the file and
    the peer id when another process holds it."""
    from shoal.common.identity import KeyInUse, hold_default_key, hold_key

    try:
        held = hold_key(p.key) if p.key else hold_default_key(p.name, int(p.listen.rsplit(":", 1)[1]))
    except KeyInUse as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"key file: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"key: {exc}") from None
    return str(held.path)


def cmd_peer(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    from shoal.peer.agent import PeerConfig, SecureAggregationRequired, run_peer

    from shoal.relay.protocol import RelayRefused, RelayUnreachable
    from shoal.peer.checkpoints import CheckpointMismatch
    from shoal.peer.diagnosis import CoordinatorUnreachable, diagnose

    p = cfg.peer
    _peer_files(p)
    _bindable("--listen", p.listen)
    key_path = _hold_peer_key(p)
    if p.metrics_port:
        _bindable("--metrics-port", f"{p.metrics_host}:{p.metrics_port}")
    security = _security(p.tls_dir, p.mtls, p.insecure, "peer", ("ca.pem",))
    peer_cfg = PeerConfig(security=security, join_token=p.join_token or os.environ.get("SHOAL_JOIN_TOKEN", ""),
                          attack=p.attack, attack_scale=p.attack_scale,
                          coordinator=config_mod.grpc_target(p.coordinator), listen=p.listen, key_path=key_path,
                          data_shard=p.data_shard,
                          events_path=p.events, ready_file=p.ready_file, rpc_timeout=p.rpc_timeout,
                          round_silence=p.round_silence, sync_donors=p.sync_donors,
                          sync_range_bytes=p.sync_range_bytes,
                          connect_timeout=p.connect_timeout, advertise=p.advertise, metrics_port=p.metrics_port,
                          metrics_host=p.metrics_host, shared_memory=p.shared_memory, tcp_lane=p.tcp_lane,
                          bulk_connections=p.bulk_connections, outbound_only=p.outbound_only, relay=p.relay, freeze_heap=True,
                          checkpoint_dir=p.checkpoint_dir, checkpoint_every=p.checkpoint_every,
                          checkpoint_keep=p.checkpoint_keep, checkpoint_url=p.checkpoint_url,
                          require_secure_aggregation=p.require_secure_aggregation)
    result: dict = {}
    got: list[int] = []

    async def main() -> None:
        # SIGTERM (docker stop, kubectl delete, a supervisor) and Ctrl-C are a graceful leave: the
        # round in play may end, the coordinator is told (Leave), slabs and sockets are closed.
        stop = _stop_on_signals(got)
        result.update(await run_peer(peer_cfg, stop=stop))

    try:
        _run(main())
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code, then reported
        unreachable = _found(exc, CoordinatorUnreachable)
        if unreachable is not None:  # the "gave up" line: the most useful error seen, and its fix
            log.error("peer: %s", unreachable)
            return EXIT_UNAVAILABLE
        if _is_unavailable(exc):
            log.error("peer: coordinator %s unreachable (gave up after --connect-timeout %gs)", p.coordinator,
                      p.connect_timeout)
            return EXIT_UNAVAILABLE
        if _is_refused(exc):
            rpc = _rpc_error(exc)
            log.error("peer: coordinator %s %s (key file %s)", p.coordinator,
                      diagnose(rpc, p.coordinator, names=lambda t: []).line(), key_path)
            return EXIT_USAGE
        refused = _found(exc, RelayRefused)
        if refused is not None:
            log.error("peer: %s (key file %s)", refused, key_path)
            return EXIT_USAGE
        required = _found(exc, SecureAggregationRequired)
        if required is not None:
            log.error("peer: %s", required)
            return EXIT_USAGE
        mismatch = _found(exc, CheckpointMismatch)
        if mismatch is not None:  # --checkpoint-dir holds another run's or model's checkpoints
            log.error("peer: %s (--checkpoint-dir %s)", mismatch, p.checkpoint_dir)
            return EXIT_USAGE
        if isinstance(exc, OSError):  # the relay (its message names it), else a local address problem
            log.error("peer: %s" if isinstance(exc, RelayUnreachable) else "peer: address unavailable: %s", exc)
            return EXIT_UNAVAILABLE
        failure = _bind_failure(exc, "--listen", p.listen)
        if failure is not None:
            raise failure from None
        rpc = _rpc_error(exc)
        if rpc is not None:  # the coordinator's final answer (retries spent): its words, one line
            log.error("peer: coordinator %s: %s: %s%s", p.coordinator, rpc.code().name, rpc.details(),
                      _STATE_GONE_HINT if "no live member holds the committed state" in (rpc.details() or "") else "")
            log.debug("peer failed", exc_info=exc)
            return EXIT_FAILED
        log.exception("peer failed")
        return EXIT_FAILED
    logging.getLogger("shoal.peer").info("%s: %s", "left the swarm" if result.get("left") else "finished",
                                         json.dumps(result))
    return EXIT_INTERRUPTED if signal.SIGINT in got else EXIT_OK


_STATE_GONE_HINT = ("; the peers that held that state have lost it (a restart without --checkpoint-dir): restart "
                    "them with their checkpoints (docs/checkpoints.md) or begin a new run on a fresh --state")


def _coordinator_key(value: str | None) -> tuple[bytes, ...]:
    """`--coordinator-key`: 64 hex digits, or a file holding them; () when unset. Raises UsageError."""
    if value is None:
        return ()
    text = value.strip()
    if not (len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)):
        try:
            text = pathlib.Path(value).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--coordinator-key {value}: neither 64 hex digits nor a readable file ({exc})") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UsageError(f"--coordinator-key {value}: not a 32-byte Ed25519 public key in hex (64 digits)")
    return (key,)


def cmd_relay(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    from shoal.relay.server import Limits, run_relay

    r = cfg.relay
    keys = _coordinator_key(r.coordinator_key)
    limits = Limits(max_peers=r.max_peers, per_client_connections=r.per_client_connections,
                    per_peer_connections=r.per_peer_connections, per_dialler_connections=r.per_dialler_connections,
                    idle_seconds=r.idle_seconds)
    if r.advertise is None and r.listen.rsplit(":", 1)[0].strip("[]") in ("0.0.0.0", "::", ""):
        raise UsageError(f"--listen {r.listen} is a wildcard address: give --advertise, the host name or IP peers "
                         f"and the coordinator dial this relay by (the wildcard would be advertised)")
    _bindable("--listen", r.listen)
    if r.metrics_port:
        _bindable("--metrics-port", f"{r.metrics_host}:{r.metrics_port}")
    for flag, path in (("--stats", r.stats), ("--ready-file", r.ready_file)):
        _parent_dir(flag, path)
    got: list[int] = []

    async def main() -> None:
        stop = _stop_on_signals(got)
        stats = await run_relay(r.listen, r.advertise or "", stats_path=r.stats, ready_file=r.ready_file,
                                metrics_port=r.metrics_port, metrics_host=r.metrics_host, stop=stop,
                                capacity_bytes_per_s=r.capacity_mbit * 1e6 / 8, coordinator_keys=keys, limits=limits)
        log.info("relay: %s", json.dumps({k: v for k, v in stats.items() if k != "peers"}))

    try:
        _run(main())
    except OSError as exc:
        failure = _bind_failure(exc, "--listen", r.listen)
        if failure is not None:
            raise failure from None
        log.error("relay: %s", exc)
        return EXIT_UNAVAILABLE
    return EXIT_INTERRUPTED if signal.SIGINT in got else EXIT_OK


def _swarm_files(s) -> None:
    """The workdir can be created, the summary and plot can be written (matplotlib installed)."""
    if s.workdir:
        try:
            pathlib.Path(s.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--workdir {s.workdir}: {_why(exc)}") from None
        if not os.access(s.workdir, os.W_OK):
            raise UsageError(f"--workdir {s.workdir}: not writable")
    _parent_dir("--summary", s.summary)
    if s.plot:
        _parent_dir("--plot", s.plot)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError('--plot needs matplotlib: pip install -e ".[plot]"') from None


CHAOS_ROUNDS = 150

_SWARM_RUN_FIELDS = ("algorithm", "seed", "inner_steps", "lr", "non_iid")
_SWARM_ROUNDS_FIELDS = ("rounds", "min_peers", "initial_peers", "ready_timeout")


def cmd_swarm(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    import dataclasses

    from shoal.testbeds.swarm import SwarmOptions, netns_refusal, run_swarm

    s, r, run = _swarm_size(cfg.swarm, given), cfg.rounds, cfg.run
    run.to_run_config(s.peers)  # validate before starting anything (exit 2 naming the setting)
    # A quorum larger than the swarm could never open a round; the default (2) shrinks to fit
    # a one-peer swarm, a value someone set is an error.
    min_peers = r.min_peers
    if min_peers > s.peers:
        if "rounds.min_peers" in given:
            raise UsageError(f"--min-peers {min_peers} is greater than --peers {s.peers}: the quorum could "
                             f"never be reached")
        min_peers = s.peers
    if run.local_work == "time" and s.workload != "lm":
        raise UsageError("--local-work time needs --workload lm (the digits workload always runs --inner-steps "
                         "steps per round)")
    if s.relay and s.workload == "lm":
        raise UsageError("--relay is not built for --workload lm (its peers are not started through a relay; "
                         "docs/nat.md)")
    if run.overlap and s.workload != "lm":
        raise UsageError("--overlap needs --workload lm (the digits workload waits for every round)")
    if run.fragments > 1 and s.workload != "lm":
        raise UsageError("--fragments needs --workload lm (the digits workload synchronises the whole model)")
    if r.cohort_size > s.peers:
        raise UsageError(f"--cohort-size {r.cohort_size} is greater than --peers {s.peers}: no round could open")
    if r.rounds <= 0:
        raise UsageError(f"--rounds {r.rounds}: a swarm runs a finite number of rounds (>= 1); 0, a coordinator's "
                         f"\"run until stopped\", is for `shoal coordinator`")
    if run.secure_aggregation and s.peers < SECURE_MIN_PEERS:
        raise UsageError(f"--peers {s.peers} with --secure-aggregation: a secure round needs {SECURE_MIN_PEERS} "
                         f"participants (the sum of two contributions shows each to the other)")
    if run.secure_aggregation and s.peers > run.secagg_max_participants():
        raise UsageError(f"--peers {s.peers} with --secure-aggregation: a sum of more than "
                         f"{run.secagg_max_participants()} participants overflows the ring at --secagg-clip "
                         f"{run.secagg_clip:g} and --secagg-frac-bits {run.secagg_frac_bits}; lower either")
    _swarm_files(s)
    lm = _lm_settings(s, run, given)
    plan = None
    if s.scenario:
        from shoal.testbeds.scenario import ScenarioError, load

        try:
            plan = load(s.scenario, s.peers)
        except ScenarioError as exc:
            raise UsageError(str(exc)) from None
        if netns_refusal(plan):  # shaping without root: one line, before anything starts
            raise UsageError(f"--scenario {s.scenario}: {netns_refusal(plan)}")
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
                        workdir=s.workdir, progress=s.progress, ready_timeout=r.ready_timeout,
                        min_peers=min_peers, timeout=s.timeout, plot_path=s.plot, metrics=s.metrics,
                        run_extra=run_extra, extra_coordinator_args=tuple(extra),
                        log_level=cfg.log.level, log_format=cfg.log.format, tls=s.tls,
                        byzantine=s.byzantine, attack_args=attack_args, aggregator=run.aggregator,
                        compression=run.compression, cohort_size=r.cohort_size, scenario=plan,
                        coordinators=s.coordinators, workload=s.workload, lm=lm, baseline=s.baseline,
                        peer_speed=config_mod.parse_speeds(s.peer_speed), target_val_loss=s.target_val_loss,
                        warm_start_steps=s.warm_start_steps,
                        relay=s.relay, relays=s.relays, checkpoint_every=s.checkpoint_every,
                        crash_all_after=s.crash_all_after, crash_disk=s.crash_disk,
                        checkpoint_url=s.checkpoint_url)
    summary = run_swarm(opts)
    return EXIT_OK if summary.get("ok") else EXIT_FAILED


def _swarm_size(s, given: frozenset[str]):
    """The swarm settings with `peers` set by the scenario's [[peer]] tables when it lists some
    and no layer set --peers; one that set fewer peers than the tables is a UsageError. Without
    the etcd binary, --coordinators 2 or more is a UsageError (one line, before anything starts)."""
    import dataclasses
    import shutil

    if s.coordinators > 1 and shutil.which("etcd") is None:
        raise UsageError(f"--coordinators {s.coordinators} needs the etcd binary (the coordinators share their state "
                         f"in a local etcd) and it is not on PATH: apt-get install etcd-server, or run one coordinator")
    if not s.scenario:
        return s
    from shoal.testbeds.scenario import ScenarioError, listed_peers

    try:
        listed = listed_peers(s.scenario)
    except ScenarioError as exc:
        raise UsageError(str(exc)) from None
    if listed and "swarm.peers" not in given:
        return dataclasses.replace(s, peers=listed)
    return s  # scenario.parse names a --peers below the tables' count


def _lm_settings(s, run, given: frozenset[str]):
    """The LM workload's settings (shoal.bench.lm_job.LMSettings): its own defaults, except the run's
    seed and the lr / batch_size someone set. Raises UsageError for --workload lm without torch."""
    from shoal.bench import lm_job

    if s.workload != "lm":
        return lm_job.LMSettings()
    if not lm_job.torch_available():
        raise UsageError(f"--workload lm {lm_job.NEEDS_TORCH}")
    d = lm_job.LMSettings()
    return lm_job.LMSettings(seed=run.seed, lr=run.lr if "run.lr" in given else d.lr,
                             batch_size=run.batch_size if "run.batch_size" in given else d.batch_size)


def cmd_status(cfg: ShoalConfig, given: frozenset[str] = frozenset()) -> int:
    from shoal.cli.status import fetch_status, render_table

    st = cfg.status
    security = _security(st.tls_dir, st.mtls, st.insecure, "status", ("ca.pem",))
    try:
        status = fetch_status(st.coordinator, recent=st.recent, timeout=st.timeout, security=security)
    except Exception as exc:  # noqa: BLE001
        if _is_unavailable(exc):
            from shoal.peer.diagnosis import diagnose

            why = diagnose(_rpc_error(exc), st.coordinator).line()
            print(f"shoal status: coordinator {st.coordinator} unreachable: {why}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        rpc = _rpc_error(exc)
        if rpc is None:
            raise
        import grpc

        answer = f"{rpc.code().name}: {rpc.details()}"
        if rpc.code() is grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server, not a coordinator (a peer's data port)
            print(f"shoal status: {st.coordinator} is not a Shoal coordinator (it answers GetStatus with {answer})",
                  file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"shoal status: coordinator {st.coordinator} refused GetStatus: {answer}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(status, indent=2) if st.json else render_table(status))
    return EXIT_OK


COMMANDS = {
    "coordinator": (cmd_coordinator, "run the control-plane daemon (membership, rounds, durable state)"),
    "peer": (cmd_peer, "run a peer: the agent on a volunteer machine"),
    "swarm": (cmd_swarm, "run a whole local swarm: a coordinator + N peers as processes on 127.0.0.1"),
    "status": (cmd_status, "show a coordinator's members, their links and recent rounds"),
    "relay": (cmd_relay, "run a relay for peers nobody can dial (behind NAT): they register, others reach them "
                         "through it (docs/nat.md)"),
}

_EXIT_CODES = """\
exit codes: 0 success; 1 the job failed; 2 bad usage or configuration;
3 coordinator unreachable or address unavailable; 130 interrupted.
"""
_EPILOG = """\
configuration: defaults < --config FILE (TOML) < SHOAL_<SECTION>_<KEY> environment < flags;
every setting is listed in docs/configuration.md.

""" + _EXIT_CODES


def _version() -> str:
    """`shoal.__version__`: the code's own version, the one a peer sends at Join (an editable
    install's package metadata keeps the version it was installed at)."""
    import shoal

    return shoal.__version__


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser below `parser` (subcommands, their subcommands, ...)."""
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield sub
                yield from _subparsers(sub)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a usage error on one line: `PROG: error: MESSAGE (see PROG --help)`,
    exit 2. argparse prints the whole usage first (38 lines for `shoal swarm`), which buries the one
    line that names the flag. Subcommands' parsers are of this class too (add_subparsers)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, except that a value given to a switch (`--overlap yes`: a flag that takes
        none) is an error naming the switch. argparse leaves the value over as an unrecognized
        argument, which the top parser reports as `shoal: error: unrecognized arguments: yes`,
        naming neither the flag nor the subcommand. Likewise an unknown flag is reported by the
        subcommand that was given it (`shoal swarm: error: unrecognized arguments: --foo`)."""
        args = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        for before, token in zip(args, args[1:]):
            action = self._option_string_actions.get(before)
            if token in extras and action is not None and action.nargs == 0:
                self.error(f"argument {before}: takes no value (got {token!r}); give the flag alone")
        if extras and self.prog != "shoal":  # a subcommand's parser: its own leftovers are its error
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shoal", description="Shoal: fault-tolerant decentralized training over the public internet.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shoal {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, epilog=_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        config_mod.add_flags(p, name)
        p.set_defaults(fn=fn)
        if name == "coordinator":
            g = p.add_argument_group("state file tools", "do one thing with the --state file, then exit")
            g.add_argument("--state-backup", metavar="PATH", help="copy the state file to PATH with SQLite's online "
                           "backup API (the coordinator may be running); never overwrites PATH")
            g.add_argument("--state-recover", metavar="PATH", nargs="?", const="", help="copy every row still "
                           "readable in a damaged state file into a new file (default: STATE.recovered.db) and "
                           "report the last committed round it kept")

    # Tools: plain flags, no configuration layers.
    p = sub.add_parser("certs", help="TLS certificates for both planes")
    csub = p.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("init", help="create a CA and the coordinator's certificate in a directory (peers get "
                                     "theirs from the coordinator at join)")
    c.add_argument("--out", required=True, help="directory to write (ca.pem, ca.key, coordinator.pem, coordinator.key)")
    c.add_argument("--host", action="append", default=None,
                   help="hostname or IP peers dial the coordinator by (repeat; default 127.0.0.1 and localhost)")
    c.add_argument("--days", type=int, default=365, help="days the certificates are valid (default 365)")
    c.add_argument("--force", action="store_true", help="overwrite existing material (invalidates old certificates)")
    c.set_defaults(tool=cmd_certs_init)

    p = sub.add_parser("token", help="join tokens for admission")
    tsub = p.add_subparsers(dest="token_command", required=True)
    t = tsub.add_parser("create", help="print a join token (creates the secret, mode 0600, if absent)")
    t.add_argument("--secret", required=True, help="the coordinator's join_token_secret file")
    t.add_argument("--ttl", type=float, default=86400.0, help="seconds the token is valid (default one day)")
    t.add_argument("--label", default="", help="who the token is for (shows in the coordinator's log)")
    t.set_defaults(tool=cmd_token_create)

    p = sub.add_parser("member", help="the admitted keys (members) of a running coordinator: list, revoke")
    msub = p.add_subparsers(dest="member_command", required=True)
    for cmd, text in (("list", "list the members: id, status, live address, label, admitted, last seen"),
                      ("revoke", "revoke a member: its next call and every later join are refused")):
        m = msub.add_parser(cmd, help=text, description=text + ". Signed with the coordinator's own key: run it "
                            "where that key file is readable.")
        if cmd == "revoke":
            m.add_argument("member", help="peer id, or a unique prefix of at least 8 hex characters")
        m.add_argument("--coordinator", default="127.0.0.1:7070", help="coordinator HOST:PORT")
        m.add_argument("--admin-key", default="shoal-coordinator.key",
                       help="the coordinator's key file (`shoal coordinator --key`; default: shoal-coordinator.key, "
                            "the default state file's)")
        m.add_argument("--tls-dir", default=None, help="TLS directory with the coordinator's ca.pem")
        m.add_argument("--insecure", action="store_true", help="plaintext (a coordinator run with --insecure)")
        m.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
        if cmd == "list":
            m.add_argument("--json", action="store_true", help="print JSON instead of a table")
        m.set_defaults(tool=cmd_member)

    p = sub.add_parser("checkpoint", help="checkpoints a peer wrote (--checkpoint-dir): list, verify, export")
    ksub = p.add_subparsers(dest="checkpoint_command", required=True)
    for cmd, text in (("list", "list the checkpoints in a directory, newest first"),
                      ("verify", "check every checkpoint's digest (exit 1 when one is damaged)"),
                      ("export", "write the newest checkpoint that verifies as one file a user loads without "
                                 "Shoal")):
        k = ksub.add_parser(cmd, help=text, description=text)
        k.add_argument("dir", metavar="DIR", help="a checkpoint directory (--checkpoint-dir) or one round-N in it")
        if cmd == "export":
            k.add_argument("--out", required=True, help="file to write")
            k.add_argument("--format", default="safetensors", choices=("safetensors", "torch"),
                           help="safetensors (default), or torch: a state_dict for torch.load")
            k.add_argument("--round", type=int, default=None, help="export this round (default: the newest)")
        k.set_defaults(tool=cmd_checkpoint)

    from shoal.bench.allreduce import add_bench_parser, cmd_bench

    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(tool=cmd_bench)
    # Every help page ends with the exit codes (the tools' pages too, and any added later).
    for p in _subparsers(parser):
        if not p.epilog:
            p.epilog, p.formatter_class = _EXIT_CODES, argparse.RawDescriptionHelpFormatter
    return parser


def load_config(a: argparse.Namespace, environ=None, sources: dict[str, str] | None = None) -> ShoalConfig:
    """The configuration of a parsed command line (file < environment < flags); `sources`, when
    given, receives "section.key" -> "file" | "env" | "flag" for every setting a layer set."""
    return config_mod.load(a.config, environ, config_mod.flags_from_args(a), sources=sources, command=a.command)


def main(argv: list[str] | None = None) -> int:
    """Run one `shoal` command; returns its exit code (module docstring)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Whoever read stdout stopped reading (`shoal status | head -3`): that is not an error of
        # this command. Point stdout at /dev/null so the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        return EXIT_OK


def _main(argv: list[str] | None) -> int:
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
    tools = {k: getattr(a, k) for k in ("state_backup", "state_recover") if getattr(a, k, None) is not None}
    try:
        return a.fn(cfg, frozenset(sources), **tools)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except UsageError as exc:
        print(f"shoal {a.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AddressUnavailable as exc:
        print(f"shoal {a.command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ConfigError, InvalidArgument) as exc:
        print(f"shoal {a.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
