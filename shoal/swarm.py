"""`shoal swarm`: a whole local swarm — a coordinator and N peers as OS processes on 127.0.0.1.

It trains the default workload, shows a progress bar over committed rounds, compares the final
held-out accuracy with a single-process baseline given the same total number of optimizer steps,
writes a JSON summary, and stops every process it started: on success, on failure of any of
them, and on Ctrl-C (processes run in their own process groups and are killed as groups).
With `metrics` every process serves Prometheus /metrics on a free loopback port (listed in the
log, in `<workdir>/metrics.json` and in the summary); with `plot_path` the loss and accuracy per
round are drawn (shoal.plots) from the peers' event logs.

With a `--scenario` that shapes links (shoal.scenario.Scenario.needs_netns), every peer runs in a
network namespace of its own behind tc-shaped links (shoal.netbed; root), the coordinator in the
root namespace on the bridge; `ScenarioDriver` carries out the scenario's timed events and builds
the summary's `events`, `per_peer`, `rounds` and `wrongful_exclusions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal import lm_job
from shoal import scenario as scenario_mod
from shoal.netbed import NetBed, cleanup_stale
from shoal.scenario import Event, Scenario

from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget
from shoal.coordinator.store import SQLiteStore

log = logging.getLogger("shoal.swarm")


@dataclass(frozen=True)
class SwarmOptions:
    peers: int = 4
    rounds: int = 20
    algorithm: str = "diloco"
    seed: int = 0
    inner_steps: int = 50
    lr: float = 3e-3
    non_iid: bool = False
    summary_path: str | None = None
    workdir: str | None = None
    progress: bool = True
    ready_timeout: float = 5.0
    min_peers: int = 2
    timeout: float = 600.0
    chaos: bool = False
    chaos_interval: float = 2.0
    tls: bool = False  # mutual TLS on both planes + join-token admission (material in the workdir)
    extra_coordinator_args: tuple[str, ...] = ()
    extra_peer_args: tuple[str, ...] = ()
    plot_path: str | None = None
    metrics: bool = False
    run_extra: tuple[tuple[str, object], ...] = ()  # further RunConfig fields (batch_size, hidden, ...)
    log_level: str = "info"
    log_format: str = "text"
    byzantine: int = 0  # the last `byzantine` peers get `attack_args` (e.g. ("--attack", "scale"))
    attack_args: tuple[str, ...] = ()
    aggregator: str = "mean"  # reported in the summary (the coordinator gets it via run_extra)
    compression: str = "none"
    cohort_size: int = 0  # reported in the summary (the coordinator gets it via extra_coordinator_args)
    coordinators: int = 1  # 2+: standby coordinators sharing their state in a local etcd
    scenario: Scenario | None = None  # `--scenario FILE` (shoal.scenario), already checked
    workload: str = "digits"  # "lm": the transformer language model (shoal.lm_job), needs torch
    lm: lm_job.LMSettings = lm_job.LMSettings()
    baseline: str = ""  # "ddp" (workload lm): the synchronous data-parallel baseline after the swarm
    peer_speed: tuple[float, ...] = ()  # per peer slot, compute speed (1 = full; workload lm)
    target_val_loss: float = 0.0  # workload lm: seconds_to_target's loss (0 = 1.05 x baseline_val_loss)
    warm_start_steps: int = 0  # workload lm: both the swarm and the baseline start from this many sync steps
    relay: bool = False  # start a relay and the NATed peers (all peers, without NAT) with --relay

    def run_config(self):
        from shoal.peer.training import RunConfig

        known = {f.name for f in dataclasses.fields(RunConfig)}
        return RunConfig(algorithm=self.algorithm, seed=self.seed, inner_steps=self.inner_steps, lr=self.lr,
                         num_data_shards=self.peers, non_iid=self.non_iid,
                         **{k: v for k, v in self.run_extra if k in known})


NETNS_PEER_PORT = 7000  # the data-plane port of a peer in its own namespace
CLOSED_PORT = 1  # advertise = "refuse": nothing listens there (tcpmux), a dial is refused at once


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS may hand it out again; good enough locally)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(address: tuple[str, int]) -> bool:
    """Something accepts TCP connections at `address` now (0.2 s connect timeout)."""
    try:
        socket.create_connection(address, timeout=0.2).close()
    except OSError:
        return False
    return True


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log_path: pathlib.Path
    popen: subprocess.Popen | None = None
    starts: int = 0

    env: dict[str, str] | None = None  # extra environment (scenario faults and hooks)
    netns: str | None = None  # run inside this network namespace (`ip netns exec` execs the command)
    first_started: float | None = None  # wall time (time.time) of the first start

    def start(self) -> None:
        out = open(self.log_path, "ab")
        env = {**os.environ, **self.env} if self.env else None
        argv = ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv
        self.popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=env)
        out.close()
        self.starts += 1
        if self.first_started is None:
            self.first_started = time.time()

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP: state T in /proc)."""
        if not self.alive():
            return False
        try:
            stat = pathlib.Path(f"/proc/{self.popen.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] in ("T", "t")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `ready` every 50 ms until it is true.

        Raises:
            RuntimeError: the process exited first (its log's tail in the message).
            TimeoutError: `timeout` seconds passed first.
        """
        end = time.monotonic() + timeout
        while not ready():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before {what}:\n{self.tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name}: {what} did not happen within {timeout:.0f} s")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, grace: float = 3.0) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Swarm:
    """The processes of a local swarm and their files; every method is bounded in time."""

    opts: SwarmOptions
    workdir: pathlib.Path
    coordinator: _Proc | None = None  # the one that serves (with standbys: the leader, last seen)
    peers: list[_Proc] = field(default_factory=list)
    standbys: list[_Proc] = field(default_factory=list)  # every coordinator process, with opts.coordinators > 1
    etcd: _Proc | None = None
    etcd_endpoint: str = ""
    coordinator_ports: list[int] = field(default_factory=list)
    address: str = ""
    join_token: str = ""
    # Per slot: (bytes of the events file already parsed, the events parsed so far). The files
    # only grow (a restarted peer appends), so each monitor tick reads just the new lines.
    _events: dict[int, tuple[int, list[dict]]] = field(default_factory=dict)
    # The network-namespace runner (`--scenario` with shaping): peer i runs in bed.netns(i) on
    # bed.host_ip(i), the coordinator in the root namespace on bed.root_ip. None: all on loopback.
    bed: NetBed | None = None
    relay: _Proc | None = None  # `shoal relay` (docs/nat.md), in the root (public) namespace
    relay_address: str = ""

    def peer_host(self, i: int) -> str:
        return self.bed.host_ip(i) if self.bed is not None else "127.0.0.1"

    @property
    def coordinator_host(self) -> str:
        return self.bed.root_ip if self.bed is not None else "127.0.0.1"

    def secure(self) -> None:
        """With `opts.tls`: create the CA and certificates, the join-token secret and one token
        (valid for the swarm's timeout) in the workdir; no-op otherwise."""
        if not self.opts.tls or self.join_token:
            return
        from shoal.coordinator.admission import create_secret, create_token, load_secret
        from shoal.common.certs import init_certs

        tls = self.workdir / "tls"
        if not (tls / "ca.key").exists():
            # The peers dial the coordinator by the bed's address in network namespaces.
            init_certs(tls, hosts=tuple(dict.fromkeys(("127.0.0.1", "localhost", self.coordinator_host))))
        # What a volunteer gets: the CA certificate only (its own certificate is issued at join).
        (self.workdir / "tls-peer").mkdir(exist_ok=True)
        shutil.copyfile(tls / "ca.pem", self.workdir / "tls-peer" / "ca.pem")
        secret_path = self.workdir / "join-token.secret"
        secret = load_secret(secret_path) if secret_path.exists() else create_secret(secret_path)
        self.join_token = create_token(secret, self.opts.timeout + 60.0, label="shoal-swarm")

    def security_args(self, role: str) -> list[str]:
        if not self.opts.tls:
            return ["--insecure"]
        if role == "coordinator":
            return ["--tls-dir", str(self.workdir / "tls"), "--join-token-secret",
                    str(self.workdir / "join-token.secret")]
        return ["--tls-dir", str(self.workdir / "tls-peer"), "--mtls", "--join-token", self.join_token]
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def metrics_port(self, name: str) -> int:
        """The /metrics port of process `name` ("coordinator", "peer-0", ...), chosen once."""
        if name not in self.metrics_ports:
            self.metrics_ports[name] = free_port()
            (self.workdir / "metrics.json").write_text(json.dumps(self.metrics_urls(), indent=2))
        return self.metrics_ports[name]

    def metrics_urls(self) -> dict[str, str]:
        return {n: f"http://{self._metrics_host(n)}:{p}/metrics" for n, p in self.metrics_ports.items()}

    def _metrics_host(self, name: str) -> str:
        """Where process `name` serves /metrics: loopback, or its namespace's address."""
        return self.peer_host(int(name.removeprefix("peer-"))) if name.startswith("peer-") else "127.0.0.1"

    def _common_args(self, name: str) -> list[str]:
        o = self.opts
        args = ["--log-level", o.log_level, "--log-format", o.log_format]
        if o.metrics:
            args += ["--metrics-port", str(self.metrics_port(name)), "--metrics-host", self._metrics_host(name)]
        return args

    @property
    def replicated(self) -> bool:
        """Standby coordinators sharing a local etcd (opts.coordinators > 1)."""
        return self.opts.coordinators > 1

    @property
    def state(self) -> str:
        """The coordinators' --state: the SQLite file, or the etcd URL."""
        if self.replicated:
            return f"etcd://{self.etcd_endpoint}/shoal-swarm"
        return str(self.workdir / "coordinator.db")

    def state_reader(self) -> contextlib.AbstractContextManager:
        """A read-only view of the coordinators' durable state (a context manager giving a Store)."""
        if not self.replicated:
            return SQLiteStore.reader(str(self.workdir / "coordinator.db"))
        return contextlib.closing(EtcdStore(EtcdTarget.parse(self.state)))

    def coordinator_argv(self, i: int = 0) -> list[str]:
        o = self.opts
        if self.replicated:
            where = ["--listen", f"{self.coordinator_host}:{self.coordinator_ports[i]}", "--state", self.state,
                     "--ready-file", str(self.workdir / f"coordinator-{i}.addr"),
                     "--key", str(self.workdir / "coordinator.key")]
        else:
            where = ["--listen", f"{self.coordinator_host}:0", "--state", str(self.workdir / "coordinator.db"),
                     "--ready-file", str(self.workdir / "coordinator.addr")]
        return [sys.executable, "-m", "shoal.cli", "coordinator", *where,
                "--rounds", str(o.rounds), "--min-peers", str(o.min_peers),
                "--initial-peers", str(self.initial_peers()), "--num-data-shards", str(o.peers),
                "--ready-timeout", str(o.ready_timeout), "--algorithm", o.algorithm, "--seed", str(o.seed),
                "--inner-steps", str(o.inner_steps), "--lr", str(o.lr),
                *(["--non-iid"] if o.non_iid else []), *self._run_extra_args(), *self._common_args("coordinator"),
                *(lm_job.COORDINATOR_ARGS if o.workload == "lm" else ()),
                *self.security_args("coordinator"), *o.extra_coordinator_args]

    def initial_peers(self) -> int:
        """Peers that start with the coordinator (round 0 waits for them): a scenario's late
        joiners (`start` > 0) join a running swarm, as joiners do."""
        sc = self.opts.scenario
        if sc is None:
            return self.opts.peers
        return max(1, sum(sc.peer_spec(i).start <= 0 for i in range(self.opts.peers)))

    def _run_extra_args(self) -> list[str]:
        args: list[str] = []
        for k, v in self.opts.run_extra:
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                args += [flag] if v else []
            else:
                args += [flag, str(v)]
        return args

    @property
    def wants_relay(self) -> bool:
        """`--relay`, or a scenario that leaves no peer reachable (every peer nat or outbound-only,
        some behind NAT: those go through the relay)."""
        sc = self.opts.scenario
        if self.opts.relay:
            return True
        specs = [sc.peer_spec(i) for i in range(self.opts.peers)] if sc is not None else []
        return any(p.nat for p in specs) and all(p.nat or p.outbound_only for p in specs)

    def relayed(self, i: int) -> bool:
        """Peer i starts with --relay: the NATed peers, or every peer when none is NATed (a loopback
        swarm with --relay). Never outbound-only ones (they need no relay) nor the LM workload."""
        sc = self.opts.scenario
        if self.relay is None or self.opts.workload != "digits" or (sc is not None and sc.peer_spec(i).outbound_only):
            return False
        nat = [sc is not None and sc.peer_spec(k).nat for k in range(self.opts.peers)]
        return nat[i] if any(nat) else True

    def start_relay(self, timeout: float = 30.0) -> str:
        """Start `shoal relay` on the coordinator's host (the bed's public side), as an operator
        would on a public host; returns its HOST:PORT. Its counters go to relay.json."""
        ready = self.workdir / "relay.addr"
        ready.unlink(missing_ok=True)
        self.relay = _Proc("relay", [sys.executable, "-m", "shoal.cli", "relay", "--listen",
                                     f"{self.coordinator_host}:0", "--stats", str(self.workdir / "relay.json"),
                                     "--ready-file", str(ready), "--log-level", self.opts.log_level,
                                     "--log-format", self.opts.log_format], self.workdir / "relay.log")
        self.relay.start()
        self.relay.wait_until(ready.exists, timeout, "writing its ready file")
        self.relay_address = ready.read_text().strip()
        return self.relay_address

    def relay_summary(self) -> dict:
        """relayed_bytes (the relay's count, both directions; relayed_bytes_to_peers: towards the
        relayed peers) and relayed_plan_bytes (chunk bytes the peers sent to relayed participants,
        from their "finished" events), for comparison."""
        try:
            stats = json.loads((self.workdir / "relay.json").read_text())
        except (OSError, ValueError):
            stats = {}
        sent = 0
        for i in range(len(self.peers)):
            fin = [e for e in self.events(i) if e["event"] in ("finished", "left")]
            sent += fin[-1].get("relayed_bytes_sent", 0) if fin else 0
        return {"relay": self.relay_address, "relayed_bytes": stats.get("relayed_bytes", 0),
                "relayed_bytes_to_peers": stats.get("relayed_bytes_to_peers", 0), "relayed_plan_bytes": sent}

    def start_coordinator(self, timeout: float = 30.0) -> str:
        if self.replicated:
            return self._start_coordinators(timeout)
        ready = self.workdir / "coordinator.addr"
        self.secure()
        if self.coordinator is None:
            self.coordinator = _Proc("coordinator", self.coordinator_argv(), self.workdir / "coordinator.log")
        if self.address:
            # A restart must come back on the same address: the peers know only that one.
            argv = self.coordinator.argv
            argv[argv.index("--listen") + 1] = self.address
        ready.unlink(missing_ok=True)
        self.coordinator.start()
        self.coordinator.wait_until(ready.exists, timeout, "writing its ready file")
        self.address = ready.read_text().strip()
        return self.address

    def _start_etcd(self, timeout: float = 30.0) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("--coordinators > 1 needs the etcd binary (apt-get install etcd-server)")
        client, peer = free_port(), free_port()
        self.etcd_endpoint = f"127.0.0.1:{client}"
        self.etcd = _Proc("etcd", [
            binary, "--name", "swarm", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", f"http://{self.etcd_endpoint}", "--advertise-client-urls",
            f"http://{self.etcd_endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"swarm=http://127.0.0.1:{peer}"], self.workdir / "etcd.log")
        self.etcd.start()
        self.etcd.wait_until(lambda: _accepts(("127.0.0.1", client)), timeout, "accepting connections")

    def _start_coordinators(self, timeout: float) -> str:
        """Start etcd (once) and every coordinator not running; wait for a leader. The peers get
        every coordinator's address (fixed ports: a standby binds its port only once it leads)."""
        self.secure()
        if self.etcd is None:
            self._start_etcd()
            self.coordinator_ports = [free_port() for _ in range(self.opts.coordinators)]
            self.standbys = [_Proc(f"coordinator-{i}", self.coordinator_argv(i), self.workdir / f"coordinator-{i}.log")
                             for i in range(self.opts.coordinators)]
        for i, proc in enumerate(self.standbys):
            if not proc.alive():
                (self.workdir / f"coordinator-{i}.addr").unlink(missing_ok=True)
                proc.start()
        self.address = ",".join(f"{self.coordinator_host}:{port}" for port in self.coordinator_ports)
        end = time.monotonic() + timeout
        while self.leader() is None:
            if not any(p.alive() for p in self.standbys):
                raise RuntimeError(f"every coordinator exited:\n{self.standbys[0].tail()}")
            if time.monotonic() > end:
                raise TimeoutError("no coordinator was elected in time")
            time.sleep(0.05)
        return self.address

    def leader(self) -> _Proc | None:
        """The coordinator that serves: alive, and it wrote its ready file (it binds its port and
        writes the file only once elected); the last elected when several did."""
        serving = [(os.path.getmtime(self.workdir / f"coordinator-{i}.addr"), p) for i, p in enumerate(self.standbys)
                   if p.alive() and (self.workdir / f"coordinator-{i}.addr").exists()]
        if not serving:
            return None
        self.coordinator = max(serving, key=lambda tp: tp[0])[1]
        return self.coordinator

    def coordinators_alive(self) -> bool:
        return any(p.alive() for p in self.standbys) if self.replicated else (
            self.coordinator is not None and self.coordinator.alive())

    def coordinator_finished(self) -> bool:
        """A coordinator exited 0: the run finished (every peer was told)."""
        procs = self.standbys if self.replicated else [self.coordinator]
        return any(p is not None and p.popen is not None and p.popen.returncode == 0 for p in procs)

    def advertised(self, i: int) -> str:
        """Peer i's --advertise ("" = its bound address): a scenario's HOST:PORT as written,
        "refuse" a closed port on its host, "drop" its own address (its namespace drops inbound
        connections: `run_swarm` sets that up)."""
        spec = self.opts.scenario.peer_spec(i).advertise if self.opts.scenario is not None else ""
        if spec == "refuse":
            return f"{self.peer_host(i)}:{CLOSED_PORT}"
        if spec == "drop":
            return f"{self.peer_host(i)}:{NETNS_PEER_PORT}"
        return spec

    def peer_argv(self, i: int) -> list[str]:
        advertise = self.advertised(i)
        # In a namespace each peer has a host of its own: a fixed port (it is known before the
        # start, e.g. to firewall it), and no shared-memory lane (the namespaces stand for hosts).
        listen = f"{self.peer_host(i)}:{NETNS_PEER_PORT}" if self.bed is not None else "127.0.0.1:0"
        if self.opts.workload == "lm":
            return self._lm_peer_argv(i, advertise, listen)
        return [sys.executable, "-m", "shoal.cli", "peer", "--coordinator", self.address, "--listen", listen,
                *(["--advertise", advertise] if advertise else []),
                *(["--relay", self.relay_address] if self.relayed(i) else []),
                *(["--no-shared-memory"] if self.bed is not None else []),
                *(["--outbound-only"] if self.opts.scenario is not None
                  and self.opts.scenario.peer_spec(i).outbound_only else []),
                "--key", str(self.workdir / f"peer-{i}.key"), "--data-shard", str(i),
                "--events", str(self.workdir / f"peer-{i}.jsonl"), *self._common_args(f"peer-{i}"),
                *self.security_args("peer"), *self.opts.extra_peer_args,
                *(self.opts.attack_args if i >= self.opts.peers - self.opts.byzantine else ())]

    def _lm_peer_argv(self, i: int, advertise: str, listen: str) -> list[str]:
        o = self.opts
        speed = o.peer_speed[i] if i < len(o.peer_speed) else 1.0
        return lm_job.peer_argv(o.lm, coordinator=self.address, key=str(self.workdir / f"peer-{i}.key"), data_shard=i,
                                num_data_shards=o.peers, events=str(self.workdir / f"peer-{i}.jsonl"),
                                algorithm=o.algorithm, speed=speed, advertise=advertise, listen=listen,
                                shared_memory=self.bed is None,
                                extra=[*self._common_args(f"peer-{i}"), *self.security_args("peer")])

    def start_peer(self, i: int) -> None:
        while len(self.peers) <= i:
            n = len(self.peers)
            self.peers.append(_Proc(f"peer-{n}", self.peer_argv(n), self.workdir / f"peer-{n}.log",
                                    env=self.peer_env(n), netns=self.bed.netns(n) if self.bed is not None else None))
        self.peers[i].start()

    def local_work_file(self, i: int) -> pathlib.Path:
        """Where a scenario asks peer i for a long local update (shoal.peer.faults.local_work)."""
        return self.workdir / f"peer-{i}.local-work"

    def peer_env(self, i: int) -> dict[str, str] | None:
        sc = self.opts.scenario
        if sc is None:
            return None
        env = {"SHOAL_LOCAL_WORK_FILE": str(self.local_work_file(i))}
        if sc.peer_spec(i).fault:
            env["SHOAL_FAULT"] = sc.peer_spec(i).fault
        return env

    def stop_all(self, state_too: bool = True) -> None:
        """Stop every process; `state_too=False` leaves etcd running (the summary reads it)."""
        for p in self.peers:
            p.stop()
        if self.relay is not None:
            self.relay.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        for p in self.standbys:
            p.stop()
        if self.etcd is not None and state_too:
            self.etcd.stop()
        from shoal.peer.shm import remove_stale_of_keys

        remove_stale_of_keys(self.workdir)  # slabs of peers the chaos monkey killed

    def events(self, i: int) -> list[dict]:
        """Events of peer slot `i` so far (every process that ran in the slot), in file order."""
        path = self.workdir / f"peer-{i}.jsonl"
        done, parsed = self._events.get(i, (0, []))
        if not path.exists():
            return list(parsed)
        with open(path, "rb") as f:
            f.seek(done)
            new = f.read()
        complete = new[:new.rfind(b"\n") + 1]  # a line still being written is read next time
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                parsed.append(json.loads(line))
        self._events[i] = (done + len(complete), parsed)
        return list(parsed)

    def all_events(self) -> list[dict]:
        return [e for i in range(len(self.peers)) for e in self.events(i)]

    def coordinator_joins(self, ids: dict[str, int]) -> list[int] | None:
        """Joins per peer index from the coordinator logs (shoal.scenario.joins_from_log)."""
        lines: list[str] = []
        for proc in self.standbys if self.replicated else [self.coordinator]:
            if proc is not None and proc.log_path.exists():
                lines += proc.log_path.read_text(errors="replace").splitlines()
        return scenario_mod.joins_from_log(lines, ids, self.opts.peers)

    def key_ids(self) -> dict[str, int]:
        """{peer id: index} of the peer slots whose key file exists (peers create it at start)."""
        out = {}
        for i in range(len(self.peers)):
            path = self.workdir / f"peer-{i}.key"
            if path.exists():
                with contextlib.suppress(OSError, ValueError):
                    out[peer_id_of(public_bytes(load_or_create_key(path)))] = i
        return out

    def durable_counts(self) -> tuple[int, int]:
        """(rounds committed, attempts aborted) read from the coordinator's durable state."""
        with self.state_reader() as store:
            return store.count_commits(), store.count_aborts()

    def cohort_sizes(self) -> dict[str, int]:
        """{participants of a committed round: how many rounds had that many}, from the durable state."""
        with self.state_reader() as store:
            commits = store.recent_commits(store.count_commits())
        sizes: dict[str, int] = {}
        for c in commits:
            sizes[str(len(c.participants))] = sizes.get(str(len(c.participants)), 0) + 1
        return dict(sorted(sizes.items(), key=lambda kv: int(kv[0])))


def abort_kind(reason: str) -> str:
    """The kind of an abort reason, for the summary's `abort_reasons` counts: the voter's error
    (after "<id> failed: ") with peer ids and numbers replaced, cut to its first six words, e.g.
    "no chunk from <peer> within Ns" (it was the first word only: every timeout counted as "no")."""
    text = reason.split("failed: ", 1)[1] if "failed: " in reason else reason
    text = re.sub(r"\b[0-9a-f]{8,32}\b", "<peer>", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return " ".join(text.split()[:6]).rstrip(":;,")


def _last_commit_digest(swarm: "Swarm") -> str:
    with swarm.state_reader() as store:
        last = store.last_commit()
    return last.state_digest.hex() if last is not None else ""


def summarize(swarm: Swarm, wall: float, baseline: float, chaos: "ChaosLog | None" = None) -> dict:
    """The run summary (see docs/quickstart.md and docs/fault-tolerance.md for the fields).

    A digest mismatch is a round for which two peers recorded different committed states, or a
    peer that finished the run holding a state other than the last one the coordinator committed.
    """
    events = swarm.all_events()
    commits = [e for e in events if e["event"] == "commit"]
    by_round: dict[int, set[str]] = {}
    for e in commits:
        by_round.setdefault(e["round"], set()).add(e["state_digest"])
    mismatches = sum(1 for d in by_round.values() if len(d) > 1)
    committed, aborted = swarm.durable_counts()
    last = _last_commit_digest(swarm)
    # The last process of each peer slot; its "finished" event is its final state.
    finals = []
    for i in range(len(swarm.peers)):
        fin = [e for e in swarm.events(i) if e["event"] == "finished"]
        if fin:
            finals.append(fin[-1])
    up_to_date = [e for e in finals if e["rounds"] == committed]
    # A finished peer behind the last commit is not a disagreement (it holds an older committed
    # state); it is counted apart.
    mismatches += sum(1 for e in up_to_date if e["state_digest"] != last)
    acc = max((e["test_accuracy"] for e in up_to_date), default=0.0)
    aborts = {(e["round"], e["attempt"]): e for e in events if e["event"] == "abort"}
    retried = {k for k, e in aborts.items() if e.get("will_retry")}
    reasons: dict[str, int] = {}
    for e in aborts.values():
        kind = abort_kind(e["reason"])
        reasons[kind] = reasons.get(kind, 0) + 1
    summary = {
        "test_accuracy": acc,
        "baseline_accuracy": baseline,
        "rounds_committed": committed,
        "rounds_aborted": aborted,
        "rounds_retried": len(retried),
        "abort_reasons": reasons,
        "digest_mismatches": mismatches,
        "peers": swarm.opts.peers,
        "peers_finished": len(finals),
        "peers_up_to_date": len(up_to_date),
        "peers_stale_at_end": len(finals) - len(up_to_date),
        "wall_seconds": round(wall, 3),
        "bytes_sent_total": sum(e.get("bytes_sent", 0) for e in finals),
        "state_syncs": sum(1 for e in events if e["event"] == "state_sync"),
        "algorithm": swarm.opts.algorithm,
        "seed": swarm.opts.seed,
        "aggregator": swarm.opts.aggregator,
        "compression": swarm.opts.compression,
        "byzantine": swarm.opts.byzantine,
        "attack": swarm.opts.attack_args[1] if swarm.opts.attack_args else "",
        "rounds_with_flagged": len({e["round"] for e in commits if e.get("flagged")}),
        "flagged_peers": sorted({f for e in commits for f in e.get("flagged", [])}),
        "coordinators": swarm.opts.coordinators,
        "cohort_size": swarm.opts.cohort_size,
        "cohort_sizes": swarm.cohort_sizes(),
    }
    if chaos is not None:
        summary.update(chaos.summary(commits))
    return summary


@dataclass
class _CommitAcc:
    """A committed round seen from the peers' event files: earliest commit time, participants."""

    t: float = float("inf")
    participants: set[int] = field(default_factory=set)


class ScenarioDriver:
    """Carries out a scenario's late starts and timed events (`shoal swarm --scenario`), driven
    by the swarm's monitor loop (no threads), and reports each event for the summary.

    Times are seconds after the coordinator started (`t0`, wall clock, the time base of the
    peers' event files). An action is *done* when it took effect: a local work when the peer
    reports its end (event `local_work`), anything else when the driver carried it out.
    """

    def __init__(self, swarm: Swarm, plan: Scenario, t0: float):
        self.swarm, self.plan, self.t0 = swarm, plan, t0
        self.pending = list(plan.events)
        self.late = sorted((spec.start, i) for i, spec in enumerate(plan.peers) if spec.start > 0)
        self.not_started: set[int] = set()  # late joiners whose start came after the run finished
        self.done: dict[int, float] = {}  # event index -> done time (seconds after t0)
        self.fired: list[tuple[int, Event]] = []
        # Peers whose fault may SIGSTOP them: [stopped at, resumed at (None: not yet)] per stop seen.
        self.watch = [i for i, spec in enumerate(plan.peers) if ":stop" in spec.fault]
        self.fault_stops: dict[int, list[list]] = {}
        self.event_stopped: set[int] = set()  # stopped by a `stop` event (not their fault's doing)

    def early_peers(self) -> set[int]:
        """Peers started with the coordinator (the others start at their `start`)."""
        late = {i for _, i in self.late}
        return {i for i in range(self.swarm.opts.peers) if i not in late}

    def tick(self, committed: int = 0) -> None:
        """One step of the monitor loop; `committed`: rounds committed so far (at the last one,
        peers their fault stopped are resumed at once, so that they can learn the run is over
        and leave while the coordinator still waits for them)."""
        now = time.time() - self.t0
        if committed >= self.swarm.opts.rounds:
            self.finish(now)
            for start, i in self.late:  # nothing left to join (a quiet machine got there first)
                log.warning("scenario: peer-%d not started: the run finished before its start at %.1fs (use more "
                            "--rounds)", i, start)
                self.not_started.add(i)
            self.late.clear()
        while self.late and self.late[0][0] <= now:
            _, i = self.late.pop(0)
            log.info("scenario: peer-%d joins at %.1fs", i, now)
            self.swarm.start_peer(i)
        while self.pending and self.pending[0].at <= now:
            ev = self.pending.pop(0)
            k = len(self.fired)
            self.fired.append((k, ev))
            log.info("scenario: %s%s at %.1fs", ev.action, "" if ev.peer is None else f" peer-{ev.peer}", now)
            self._act(ev)
            if ev.action != "local-work":
                self.done[k] = time.time() - self.t0
        self._watch_fault_stops(now)

    def _watch_fault_stops(self, now: float) -> None:
        """Note when a peer's own fault SIGSTOPs it; SIGCONT it `resume_after` seconds later."""
        for i in self.watch:
            if i >= len(self.swarm.peers) or i in self.event_stopped:
                continue
            proc, spans = self.swarm.peers[i], self.fault_stops.setdefault(i, [])
            if spans and spans[-1][1] is None:
                resume = self.plan.peer_spec(i).resume_after
                if resume > 0 and now >= spans[-1][0] + resume:
                    log.info("scenario: peer-%d stopped by its fault at %.1fs; SIGCONT at %.1fs", i, spans[-1][0], now)
                    proc.signal(signal.SIGCONT)
                    spans[-1][1] = now
            elif proc.stopped():
                spans.append([now, None])

    def finish(self, now: float | None = None) -> None:
        """Resume every peer a fault stopped (the run ends; they must be able to leave)."""
        for i, spans in self.fault_stops.items():
            if spans and spans[-1][1] is None:
                self.swarm.peers[i].signal(signal.SIGCONT)
                spans[-1][1] = time.time() - self.t0 if now is None else now

    def _act(self, ev: Event) -> None:
        sw = self.swarm
        proc = sw.coordinator if ev.peer is None else sw.peers[ev.peer]
        action = ev.action.removeprefix("coordinator-")
        if action == "local-work":
            sw.local_work_file(ev.peer).write_text(f"{ev.seconds}\n")
        elif action in ("shape", "nat-rebind"):
            if sw.bed is None:  # Scenario.needs_netns made run_swarm build the bed
                raise RuntimeError(f"a {action} event needs the network-namespace runner")
            if action == "shape":
                sw.bed.shape(ev.peer, ev.up_mbit, ev.down_mbit)
            else:
                sw.bed.nat_rebind(ev.peer)
        elif action in ("kill", "restart"):
            proc.signal(signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait(timeout=10)
            if action == "restart":
                sw.start_coordinator() if ev.peer is None else sw.start_peer(ev.peer)
        else:
            proc.signal(signal.SIGSTOP if action == "stop" else signal.SIGCONT)
            if ev.peer is not None:
                (self.event_stopped.add if action == "stop" else self.event_stopped.discard)(ev.peer)

    def report(self) -> list[dict]:
        """The summary's `events`: one entry per event that fired, in order (shoal.scenario.event_report)."""
        commits: dict[int, _CommitAcc] = {}
        local_work_ends: dict[int, list[float]] = {}
        for i in range(len(self.swarm.peers)):
            for e in self.swarm.events(i):
                if e["event"] == "commit":
                    acc = commits.setdefault(e["round"], _CommitAcc())
                    acc.t = min(acc.t, e["t"] - self.t0)
                    acc.participants.add(i)
                elif e["event"] == "local_work":
                    local_work_ends.setdefault(i, []).append(e["t"] - self.t0)
        points = [scenario_mod.CommitPoint(a.t, r, frozenset(a.participants)) for r, a in sorted(commits.items())]
        out = []
        for k, ev in self.fired:
            done = self.done.get(k)
            if ev.action == "local-work":
                done = next((t for t in local_work_ends.get(ev.peer, []) if t >= ev.at), None)
            out.append(scenario_mod.event_report(ev, done, points, self.swarm.opts.peers))
        return out

    def tables(self) -> dict:
        """The summary's `per_peer`, `rounds`, `wrongful_exclusions` (a count) and
        `wrongful_exclusion_list` (shoal.scenario: rounds_report, per_peer_report, touch_windows)."""
        sw, n = self.swarm, self.swarm.opts.peers
        evs = {i: sw.events(i) for i in range(len(sw.peers))}
        with sw.state_reader() as store:
            commits = store.recent_commits(store.count_commits())
            aborts = store.recent_aborts(store.count_aborts())
        ends = [scenario_mod.AttemptEnd(c.round, c.attempt, True, tuple(c.participants), (), c.seconds)
                for c in commits]
        ends += [scenario_mod.AttemptEnd(a.round, a.attempt, False, (), tuple(a.excluded), None, a.reason)
                 for a in aborts]
        ids = {**sw.key_ids(), **scenario_mod.peer_ids(evs)}
        rows = scenario_mod.rounds_report(ends, evs, self.t0, ids)
        starts = {i: p.first_started for i, p in enumerate(sw.peers) if p.first_started is not None}
        observed = scenario_mod.Observed({i: [(a, b) for a, b in spans] for i, spans in self.fault_stops.items()})
        wrong = scenario_mod.wrongful_exclusions(rows, scenario_mod.touch_windows(self.plan, n, observed))
        return {"network": "netns" if sw.bed is not None else "loopback",
                "per_peer": scenario_mod.per_peer_report(evs, starts, rows, n, sw.coordinator_joins(ids)), "rounds": rows,
                "wrongful_exclusions": len(wrong), "wrongful_exclusion_list": wrong,
                "peers_not_started": sorted(self.not_started),
                "fault_stops": {str(i): [[round(a, 3), None if b is None else round(b, 3)] for a, b in spans]
                                for i, spans in self.fault_stops.items()}}


@dataclass
class ChaosLog:
    """What the chaos monkey did, and when (unix seconds)."""

    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (time, what, rounds committed then)
    peers_killed: int = 0
    peers_joined: int = 0
    peers_stopped: int = 0
    coordinator_restarts: int = 0
    coordinator_failovers: int = 0  # leaders killed while a standby was there to take over

    def summary(self, commits: list[dict]) -> dict:
        first_commit: dict[int, float] = {}
        for e in commits:
            first_commit[e["round"]] = min(e["t"], first_commit.get(e["round"], e["t"]))
        per_kill = []
        for t, what, committed in self.kills:
            # Recovery: from the kill to the first commit of a round not yet committed at the kill.
            nxt = min((ct for r, ct in first_commit.items() if r >= committed), default=None)
            if nxt is not None:
                per_kill.append((what, max(0.0, nxt - t)))
        recovery = sorted(r for _, r in per_kill)
        p50 = recovery[(len(recovery) - 1) // 2] if recovery else None
        failovers = [r for w, r in per_kill if w == "coordinator-leader"]
        return {
            "coordinator_failovers": self.coordinator_failovers,
            "failover_seconds_max": round(max(failovers), 3) if failovers else None,
            "peers_killed": self.peers_killed,
            "peers_joined": self.peers_joined,
            "peers_stopped": self.peers_stopped,
            "coordinator_restarts": self.coordinator_restarts,
            "recovery_seconds_p50": round(p50, 3) if p50 is not None else None,
            "recovery_seconds_max": round(recovery[-1], 3) if recovery else None,
            "recoveries": [{"what": w, "seconds": round(r, 3)} for w, r in per_kill],
        }


CALM_SECONDS = 8.0


class Chaos:
    """The chaos monkey of `shoal swarm --chaos`, driven by the swarm's monitor loop (no threads).

    Every `interval` seconds it SIGKILLs a random running peer and starts a fresh process with
    the same identity; once it SIGSTOPs another peer for `stop_seconds` (longer than the
    straggler timeout), and once it SIGKILLs the coordinator and restarts it on the same state
    file and address. It stops acting near the end of the run so every peer can finish.
    """

    def __init__(self, swarm: Swarm, seed: int, interval: float, stop_seconds: float):
        import random

        self.swarm, self.rng = swarm, random.Random(seed)
        self.interval, self.stop_seconds = interval, stop_seconds
        self.log = ChaosLog()
        self.next_at: float | None = None  # chaos starts once the swarm has committed a round
        self.step = 0
        self.stopped: tuple[int, float] | None = None  # (peer index, resume at)
        self.started = (0.0, 0)  # (time, committed rounds) when chaos began
        self.recovering_from: int | None = None  # rounds committed at the last kill

    def tick(self, committed: int) -> None:
        now = time.monotonic()
        if self.stopped is not None and now >= self.stopped[1]:
            self.swarm.peers[self.stopped[0]].signal(signal.SIGCONT)
            log.info("chaos: resumed peer-%d", self.stopped[0])
            self.stopped = None
        if committed < 1:
            return
        if self.recovering_from is not None:
            # After a kill nothing else happens until a round commits again: each recovery is
            # measured on its own, and kills faster than the swarm recovers could take the last
            # copies of the state with them (restarted peers sync from those that hold it; on a
            # loaded machine a restart takes seconds, longer than the interval).
            if committed <= self.recovering_from:
                return
            self.recovering_from = None
            self.next_at = now + self.interval
        if self.next_at is None:
            self.next_at = now + self.interval / 2
            self.started = (now, committed)
        # Calm at the end: no action in the last fifth of the rounds, nor when the rounds left
        # will take less than CALM_SECONDS at the pace so far (a restarted peer needs seconds to
        # start, join and sync before the run ends).
        t0, c0 = self.started
        pace = (committed - c0) / (now - t0) if now > t0 and committed > c0 else 0.0
        left = self.swarm.opts.rounds - committed
        if now < self.next_at or left <= max(3, self.swarm.opts.rounds // 5) or (pace and left / pace < CALM_SECONDS):
            return
        if self.swarm.replicated and self.stopped is not None and self.log.coordinator_restarts == 0:
            # The leader's kill waits until the stopped peer is back (it comes at the next step
            # after the resume): the new leader's first round waits for its known members, so a
            # failover overlapping a straggler would measure the straggler, not the failover.
            self.next_at = now + self.interval
            return
        self.next_at = now + self.interval
        self.step += 1
        candidates = [i for i, p in enumerate(self.swarm.peers) if p.alive() and (self.stopped is None or self.stopped[0] != i)]
        # With standby coordinators the leader goes first (the failover is what such a run is
        # for; a short run on a fast machine may be calm before a second action); alone, the
        # coordinator's kill is the second action.
        if self.step == (1 if self.swarm.replicated else 2) and self.log.coordinator_restarts == 0:
            victim = self.swarm.leader() if self.swarm.replicated else self.swarm.coordinator
            log.info("chaos: kill -9 coordinator%s", f" {victim.name} (the leader)" if self.swarm.replicated else "")
            victim.signal(signal.SIGKILL)
            killed_at = time.time()
            victim.popen.wait(timeout=10)
            what = "coordinator-leader" if self.swarm.replicated else "coordinator"
            self.recovering_from = self.swarm.durable_counts()[0]
            self.log.kills.append((killed_at, what, self.recovering_from))
            # Alone: restarted on the same state. With standbys: one of them takes over; the killed
            # one comes back as a standby.
            self.swarm.start_coordinator()
            self.log.coordinator_restarts += 1
            # A failover only when a standby was running to take over (else it is a restart).
            self.log.coordinator_failovers += int(self.swarm.replicated and any(
                p.alive() for p in self.swarm.standbys if p is not victim))
            return
        if self.step == 1 and self.stopped is None and len(candidates) > 2:
            i = self.rng.choice(candidates)
            log.info("chaos: SIGSTOP peer-%d for %.1fs", i, self.stop_seconds)
            self.swarm.peers[i].signal(signal.SIGSTOP)
            self.stopped = (i, now + self.stop_seconds)
            self.log.peers_stopped += 1
            return  # kills come at later steps, so each recovery is measured on its own
        if len(candidates) > 2:
            i = self.rng.choice(candidates)
            log.info("chaos: kill -9 peer-%d and restart it with the same identity", i)
            self.swarm.peers[i].signal(signal.SIGKILL)
            killed_at = time.time()
            self.swarm.peers[i].popen.wait(timeout=10)
            self.recovering_from = self.swarm.durable_counts()[0]
            self.log.kills.append((killed_at, f"peer-{i}", self.recovering_from))
            self.log.peers_killed += 1
            self.swarm.start_peer(i)
            self.log.peers_joined += 1

    def finish(self) -> None:
        if self.stopped is not None:
            self.swarm.peers[self.stopped[0]].signal(signal.SIGCONT)
            self.stopped = None


def _progress(opts: SwarmOptions):
    if not opts.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=opts.rounds, desc="rounds", unit="round", file=sys.stderr, dynamic_ncols=True)


class _BarStream:
    """A stream for log handlers while the bar is drawn: each record goes through the bar's own
    write, which clears the bar line, prints the record on a line of its own and redraws the bar
    (a plain write to stderr would be glued onto the bar)."""

    def __init__(self, bar):
        self.bar = bar

    def write(self, text: str) -> None:
        if text.strip():
            self.bar.write(text.rstrip("\n"), file=sys.stderr)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _logs_through(bar):
    """Route the root logger's stderr handlers through `bar` (no-op without a bar)."""
    moved = []
    if bar is not None:
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stderr:
                moved.append((h, h.setStream(_BarStream(bar))))
    try:
        yield
    finally:
        for h, stream in moved:
            h.setStream(stream)


def _say(bar, text: str) -> None:
    """A line for the person watching: above the bar when there is one, else on stderr."""
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


NETBED_PREFIX = "shls"  # namespaces and links of `shoal swarm --scenario` beds (shoal.netbed names)


def netns_refusal(plan: Scenario) -> str:
    """"" when `plan` can run here; else the one line saying why not (a field that needs network
    namespaces, and what is missing)."""
    what = plan.needs_netns
    if not what:
        return ""
    ok, why = NetBed.available()
    return "" if ok else f"{what} needs the network-namespace runner, which cannot run here: {why}"


@contextlib.contextmanager
def _netbed(opts: SwarmOptions):
    """The bed of a scenario with shaping: one namespace per peer, shaped as its [[peer]] table
    says (more --peers than tables: unshaped hosts), firewalls for `advertise = "drop"`, NAT routers for `nat = true`. Beds
    that killed runs left behind are removed first; this one is gone when the block exits,
    however it exits."""
    plan = opts.scenario
    assert plan is not None
    why = netns_refusal(plan)
    if why:
        raise RuntimeError(why)
    cleanup_stale(NETBED_PREFIX)
    specs = [plan.peer_spec(i) for i in range(opts.peers)]
    with NetBed(opts.peers, [s.up_mbit for s in specs], [s.down_mbit for s in specs], prefix=NETBED_PREFIX,
                nat=[s.nat for s in specs]) as bed:
        for i, s in enumerate(specs):
            if s.advertise == "drop":
                bed.drop_inbound(i, NETNS_PEER_PORT)
        log.info("network namespaces: coordinator on %s, peers on %s", bed.root_ip,
                 ", ".join(f"{bed.host_ip(i)} ({_rates(s)}{', behind NAT' if s.nat else ''})"
                           for i, s in enumerate(specs)))
        yield bed


def _rates(spec) -> str:
    def r(v):
        return "-" if v is None else f"{v:g}"
    return f"up {r(spec.up_mbit)} / down {r(spec.down_mbit)} Mbit/s"


def run_swarm(opts: SwarmOptions) -> dict:
    """Run a local swarm to completion; returns the summary (with "ok") and writes it if asked."""
    from shoal.peer.training import baseline_accuracy

    t0 = time.monotonic()
    t0_wall = time.time()
    with contextlib.ExitStack() as stack:
        # SIGTERM (timeout, kill, a supervisor) unwinds like Ctrl-C: every process is stopped.
        previous = signal.signal(signal.SIGTERM, _terminate)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        if opts.workdir:
            wd = pathlib.Path(opts.workdir)
            wd.mkdir(parents=True, exist_ok=True)
        else:
            wd = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shoal-swarm-")))
        warm: dict = {}
        if opts.workload == "lm" and opts.warm_start_steps:
            _say(None, f"warm start: {opts.warm_start_steps} synchronous steps of the model, shared by the swarm"
                       f"{' and the baseline' if opts.baseline else ''}")
            try:
                lm_settings, warm = lm_job.warm_start(opts.lm, world=opts.peers, steps=opts.warm_start_steps,
                                                      workdir=wd, timeout=opts.timeout)
            except RuntimeError as exc:
                log.error("%s", exc)
                return {"ok": False, "error": str(exc).splitlines()[0]}
            opts = dataclasses.replace(opts, lm=lm_settings)
            # Shared by the swarm and the baseline, the warm-up counts in neither (steps, bytes,
            # seconds): the swarm's clocks and its --timeout start after it, as the baseline's do.
            warm["warm_start_seconds"] = round(time.monotonic() - t0, 1)
            t0, t0_wall = time.monotonic(), time.time()
        swarm = Swarm(opts, wd)
        if opts.scenario is not None and opts.scenario.needs_netns:
            swarm.bed = stack.enter_context(_netbed(opts))  # closed after the processes stop (LIFO)
        stack.callback(swarm.stop_all)
        bar = _progress(opts)
        if bar is not None:
            stack.callback(bar.close)
            stack.enter_context(_logs_through(bar))  # chaos and other log lines above the bar
        chaos = Chaos(swarm, opts.seed, opts.chaos_interval, opts.ready_timeout + 2.0) if opts.chaos else None
        driver: ScenarioDriver | None = None
        ok, why = True, ""
        try:
            swarm.start_coordinator()
            if swarm.wants_relay:
                swarm.start_relay()
            if opts.scenario is not None:
                driver = ScenarioDriver(swarm, opts.scenario, time.time())
            for i in range(opts.peers):
                if driver is None or i in driver.early_peers():
                    swarm.start_peer(i)
            if opts.metrics:
                for name, url in swarm.metrics_urls().items():
                    log.info("metrics of %s: %s", name, url)
                log.info("these /metrics URLs answer while the swarm runs; they stop with it")
            shown = 0
            announced = False
            last_t = time.monotonic()
            while True:
                if time.monotonic() - t0 > opts.timeout:
                    raise TimeoutError(f"swarm did not finish within {opts.timeout:.0f}s")
                # A coordinator that exits 0 finished the run (peers told); any other exit is early.
                if not swarm.coordinators_alive() and not swarm.coordinator_finished() \
                        and not all(p.popen.poll() == 0 for p in swarm.peers):
                    raise RuntimeError(f"coordinator exited early:\n{swarm.coordinator.tail()}")
                failed = [p for p in swarm.peers if p.popen is not None and p.popen.poll() not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{failed[0].name} failed (exit {failed[0].popen.returncode}):\n{failed[0].tail()}")
                commits = [e for e in swarm.all_events() if e["event"] == "commit"]
                top = max((e["round"] + 1 for e in commits), default=0)
                if chaos is not None:
                    chaos.tick(top)
                if driver is not None:
                    driver.tick(top)
                if bar is not None and top > shown:
                    last = max((e for e in commits if e["round"] == top - 1), key=lambda e: e["t"])
                    now = time.monotonic()
                    bar.set_postfix(members=last["participants"], loss=f"{last['loss']:.3f}",
                                    acc=f"{last['test_accuracy']:.3f}", sec=f"{(now - last_t) / (top - shown):.2f}")
                    bar.update(top - shown)
                    shown, last_t = top, now
                if top >= opts.rounds and not announced:
                    announced = True
                    _say(bar, f"all {opts.rounds} rounds committed; the peers evaluate the final model and leave")
                skipped = driver.not_started if driver is not None else set()
                if len(swarm.peers) == opts.peers and all(i in skipped or (p.popen is not None and p.popen.poll() == 0)
                                                          for i, p in enumerate(swarm.peers)):
                    break
                time.sleep(0.1)
        except KeyboardInterrupt:
            ok, why = False, "interrupted"
            raise
        except (RuntimeError, TimeoutError) as exc:
            ok, why = False, str(exc)
            log.error("swarm failed: %s", exc)
        finally:
            if chaos is not None:
                chaos.finish()
            if driver is not None:
                driver.finish()
            swarm.stop_all(state_too=False)  # etcd, if any, stays for the summary
        wall = time.monotonic() - t0
        steps = opts.peers * opts.rounds * opts.inner_steps
        if opts.workload == "digits":
            _say(bar, f"baseline: training one process for the same {steps} optimizer steps, to compare accuracy")
        baseline = baseline_accuracy(opts.run_config(), steps) if opts.workload == "digits" else math.nan
        summary = summarize(swarm, wall, baseline, chaos.log if chaos is not None else None)
        summary.update(warm)
        if opts.workload == "lm":
            ok = _lm_summary(swarm, summary, t0_wall, bar) and ok
        summary["ok"] = ok and summary["peers_up_to_date"] >= 1 and summary["rounds_committed"] == opts.rounds
        if why:
            summary["error"] = why.splitlines()[0]
        if opts.metrics:
            summary["metrics"] = swarm.metrics_urls()
        if swarm.relay is not None:
            summary.update(swarm.relay_summary())
        if driver is not None:
            summary["events"] = driver.report()
            summary.update(driver.tables())
        if opts.plot_path:
            from shoal.plots import plot_lm, plot_rounds

            try:
                if opts.workload == "lm":
                    plot_lm(summary, opts.plot_path, title=f"shoal swarm --workload lm: {opts.peers} peers, "
                            f"{opts.rounds} rounds x {opts.inner_steps} inner steps")
                else:
                    plot_rounds(swarm.all_events(), opts.plot_path, title=f"shoal swarm: {opts.peers} peers, "
                                f"{opts.algorithm}, seed {opts.seed}")
                summary["plot"] = opts.plot_path
            except (OSError, ImportError) as exc:
                log.error("plot not written: %s", exc)
                summary["ok"] = False
    if bar is not None:
        bar.close()
    if opts.workload == "lm":
        print(_lm_line(summary), file=sys.stderr)
    else:
        print(f"test accuracy {summary['test_accuracy']:.4f} (baseline, single process, same total steps: "
              f"{summary['baseline_accuracy']:.4f}); rounds committed {summary['rounds_committed']}, "
              f"aborted {summary['rounds_aborted']}; digest mismatches {summary['digest_mismatches']}; "
              f"{summary['wall_seconds']:.1f}s", file=sys.stderr)
    if chaos is not None:
        print(f"chaos: {summary['peers_killed']} peers killed and restarted, {summary['peers_stopped']} stopped, "
              f"{summary['coordinator_restarts']} coordinator restarts, {summary['rounds_retried']} retried attempts, "
              f"{summary['state_syncs']} state syncs; recovery p50 {summary['recovery_seconds_p50']}s, "
              f"max {summary['recovery_seconds_max']}s", file=sys.stderr)
    if opts.summary_path:
        pathlib.Path(opts.summary_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _lm_summary(swarm: Swarm, summary: dict, t0_wall: float, bar) -> bool:
    """Add the LM keys (shoal.lm_job.summary) and, with `--baseline ddp`, run the baseline and add
    its keys. The digits keys `test_accuracy` / `baseline_accuracy` do not apply (None). Returns
    False when the baseline failed (its error is in `baseline_error`)."""
    o = swarm.opts
    paths = [swarm.workdir / f"peer-{i}.jsonl" for i in range(len(swarm.peers))]
    summary.update(lm_job.summary([swarm.events(i) for i in range(len(swarm.peers))], t0_wall,
                                  lm_job.evaluations(paths)))
    summary.update(lm_job.utilization(paths))
    summary.update(lm_job.round_timing([swarm.events(i) for i in range(len(swarm.peers))]))
    summary["test_accuracy"] = summary["baseline_accuracy"] = None
    summary["peer_speed"] = list(o.peer_speed)
    summary["local_work"] = dict(o.run_extra).get("local_work", "steps")
    summary["overlap"] = bool(dict(o.run_extra).get("overlap", False))
    summary.update(target_val_loss=None, seconds_to_target=None, baseline_seconds_to_target=None)
    if o.target_val_loss:
        _to_target(summary, o.target_val_loss)
    if o.baseline != "ddp":
        return True
    steps = o.rounds * o.inner_steps
    _say(bar, f"baseline ddp: {o.peers} ranks, {steps} synchronous steps (gloo all-reduce of gradients every step)")
    try:
        summary.update(lm_job.run_ddp_baseline(o.lm, world=o.peers, steps=steps, eval_every=o.inner_steps,
                                               workdir=swarm.workdir, timeout=o.timeout))
    except (RuntimeError, OSError) as exc:
        log.error("baseline failed: %s", exc)
        summary["baseline_error"] = str(exc).splitlines()[0]
        return False
    if not o.target_val_loss:
        _to_target(summary, TARGET_OVER_BASELINE * summary["baseline_val_loss"])
    return True


TARGET_OVER_BASELINE = 1.05  # seconds_to_target's default: 5 % above the synchronous baseline's final loss


def _to_target(summary: dict, target: float) -> None:
    """`target_val_loss` and the seconds (since the swarm started) at which the swarm's validation
    curve, and the baseline's when it ran, first reached it (None: never)."""
    summary["target_val_loss"] = round(target, 5)
    summary["seconds_to_target"] = lm_job.time_to_target(summary.get("val_curve", []), target)
    if "baseline_curve" in summary:
        summary["baseline_seconds_to_target"] = lm_job.time_to_target(summary["baseline_curve"], target)


def _lm_line(s: dict) -> str:
    line = (f"val_loss {s['val_loss']:.4f} nats/byte ({s['val_bits_per_byte']:.3f} bits/byte), "
            f"{s['bytes_sent_total'] / 1e6:.1f} MB sent, {s['wall_seconds']:.1f}s; rounds committed "
            f"{s['rounds_committed']}, aborted {s['rounds_aborted']}; digest mismatches {s['digest_mismatches']}")
    if "baseline_val_loss" in s:
        line += (f"\nbaseline ddp: val_loss {s['baseline_val_loss']:.4f}, "
                 f"{s['baseline_bytes_sent_total'] / 1e6:.1f} MB sent, {s['baseline_wall_seconds']:.1f}s")
    return line
