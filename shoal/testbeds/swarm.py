"""`shoal swarm`: a whole local swarm — a coordinator and N peers as OS processes on 127.0.0.1.

It trains the default workload, shows a progress bar over committed rounds, compares the final
held-out accuracy with a single-process baseline given the same total number of optimizer steps,
writes a JSON summary, and stops every process it started: on success, on failure of any of
them, and on Ctrl-C (processes run in their own process groups and are killed as groups).
With `metrics` every process serves Prometheus /metrics on a free loopback port (listed in the
log, in `<workdir>/metrics.json` and in the summary); with `plot_path` the loss and accuracy per
round are drawn (shoal.plots) from the peers' event logs.

With a `--scenario` that shapes links (shoal.testbeds.scenario.Scenario.needs_netns), every peer runs in a
network namespace of its own behind tc-shaped links (shoal.testbeds.netbed; root), the coordinator in the
root namespace on the bridge; `ScenarioDriver` carries out the scenario's timed events and builds
the summary's `events`, `per_peer`, `rounds` and `wrongful_exclusions`.
"""

from __future__ import annotations

import collections
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
import sys
import tempfile
import time
from dataclasses import dataclass, field

from shoal.bench import lm_job
from shoal.testbeds import scenario as scenario_mod
from shoal.testbeds.netbed import Latency, NetBed, cleanup_stale
from shoal.processes import Process
from shoal.testbeds.scenario import Event, LatencySpec, Scenario

from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget
from shoal.coordinator.store import MemoryStore, SQLiteStore, recorded_rewinds

log = logging.getLogger("shoal.testbeds.swarm")


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
    scenario: Scenario | None = None  # `--scenario FILE` (shoal.testbeds.scenario), already checked
    workload: str = "digits"  # "lm": the transformer language model (shoal.bench.lm_job), needs torch
    lm: lm_job.LMSettings = lm_job.LMSettings()
    baseline: str = ""  # "ddp" (workload lm): the synchronous data-parallel baseline after the swarm
    peer_speed: tuple[float, ...] = ()  # per peer slot, compute speed (1 = full; workload lm)
    target_val_loss: float = 0.0  # workload lm: seconds_to_target's loss (0 = 1.05 x baseline_val_loss)
    warm_start_steps: int = 0  # workload lm: both the swarm and the baseline start from this many sync steps
    relay: bool = False  # start a relay and the NATed peers (all peers, without NAT) with --relay
    relays: int = 1  # with relay: how many relays; each relayed peer gets all of them, peer i preferring relay i mod N
    checkpoint_every: int = 0  # > 0: each peer checkpoints every N rounds into peer-N.checkpoints in the workdir
    crash_all_after: int = 0  # > 0: kill -9 every process after this many rounds and restart them all (`CrashAll`)
    crash_disk: str = ""  # with crash_all_after: "truncate" the newest checkpoint files, or "lose" the directories
    checkpoint_url: str | None = None  # every peer's --checkpoint-url (the shared checkpoint store)

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
class Swarm:
    """The processes of a local swarm and their files; every method is bounded in time."""

    opts: SwarmOptions
    workdir: pathlib.Path
    coordinator: Process | None = None  # the one that serves (with standbys: the leader, last seen)
    peers: list[Process] = field(default_factory=list)
    standbys: list[Process] = field(default_factory=list)  # every coordinator process, with opts.coordinators > 1
    etcd: Process | None = None
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
    # `shoal relay` processes (docs/nat.md), in the root (public) namespace, and their HOST:PORT.
    relays: list[Process] = field(default_factory=list)
    relay_addresses: list[str] = field(default_factory=list)

    @property
    def relay(self) -> Process | None:
        return self.relays[0] if self.relays else None

    @property
    def relay_address(self) -> str:
        return self.relay_addresses[0] if self.relay_addresses else ""

    def relay_list(self, i: int) -> str:
        """Peer i's --relay: every relay, starting at relay i mod N (the peers spread over them)."""
        n = len(self.relay_addresses)
        return ",".join(self.relay_addresses[(i + k) % n] for k in range(n))

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
        if self.etcd is None:  # it never started: nothing was stored
            return contextlib.nullcontext(MemoryStore())
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
            if isinstance(v, bool):  # a non-default switch: --name, or --no-name for a default-on one
                args += [flag] if v else ["--no-" + k.replace("_", "-")]
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

    def relay_name(self, j: int) -> str:
        return "relay" if j == 0 else f"relay-{j}"

    def start_relay(self, j: int = 0, timeout: float = 30.0) -> str:
        """Start relay j (`shoal relay`) on the coordinator's host (the bed's public side), as an
        operator would on a public host, admitting the coordinator's members only (its ticket key);
        returns its HOST:PORT. A relay started again takes its previous port. Its counters go to
        relay.json (relay-J.json)."""
        name = self.relay_name(j)
        ready = self.workdir / f"{name}.addr"
        ready.unlink(missing_ok=True)
        port = self.relay_addresses[j].rsplit(":", 1)[1] if j < len(self.relay_addresses) else "0"
        key = load_or_create_key(str(self.workdir / "coordinator.key"))  # the coordinators' ticket key
        proc = Process(name, [sys.executable, "-m", "shoal.cli", "relay", "--listen",
                              f"{self.coordinator_host}:{port}", "--stats", str(self.workdir / f"{name}.json"),
                              "--ready-file", str(ready), "--coordinator-key", public_bytes(key).hex(),
                              "--log-level", self.opts.log_level, "--log-format", self.opts.log_format],
                       self.workdir / f"{name}.log")
        proc.start()
        proc.wait_until(ready.exists, timeout, "writing its ready file")
        address = ready.read_text().strip()
        if j < len(self.relays):
            self.relays[j], self.relay_addresses[j] = proc, address
        else:
            self.relays.append(proc)
            self.relay_addresses.append(address)
        return address

    def relay_summary(self) -> dict:
        """relayed_bytes (the relay's count, both directions; relayed_bytes_to_peers: towards the
        relayed peers) and relayed_plan_bytes (chunk bytes the peers sent to relayed participants,
        from their "finished" events), for comparison."""
        stats: dict = {}
        for j in range(len(self.relays)):
            try:
                one = json.loads((self.workdir / f"{self.relay_name(j)}.json").read_text())
            except (OSError, ValueError):
                continue
            for k in ("relayed_bytes", "relayed_bytes_to_peers"):
                stats[k] = stats.get(k, 0) + one.get(k, 0)
        sent = 0
        for i in range(len(self.peers)):
            fin = [e for e in self.events(i) if e["event"] in ("finished", "left")]
            sent += fin[-1].get("relayed_bytes_sent", 0) if fin else 0
        return {"relay": self.relay_address, "relays": list(self.relay_addresses), "relayed_bytes": stats.get("relayed_bytes", 0),
                "relayed_bytes_to_peers": stats.get("relayed_bytes_to_peers", 0), "relayed_plan_bytes": sent}

    def start_coordinator(self, timeout: float = 30.0) -> str:
        if self.replicated:
            return self._start_coordinators(timeout)
        ready = self.workdir / "coordinator.addr"
        self.secure()
        if self.coordinator is None:
            self.coordinator = Process("coordinator", self.coordinator_argv(), self.workdir / "coordinator.log")
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
        self.etcd = Process("etcd", [
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
            self.standbys = [Process(f"coordinator-{i}", self.coordinator_argv(i), self.workdir / f"coordinator-{i}.log")
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

    def leader(self) -> Process | None:
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
                *(["--relay", self.relay_list(i)] if self.relayed(i) else []),
                *(["--no-shared-memory"] if self.bed is not None else []),
                *(["--outbound-only"] if self.opts.scenario is not None
                  and self.opts.scenario.peer_spec(i).outbound_only else []),
                "--key", str(self.workdir / f"peer-{i}.key"), "--data-shard", str(i),
                "--events", str(self.workdir / f"peer-{i}.jsonl"), *self._common_args(f"peer-{i}"),
                *self.checkpoint_args(i), *self.security_args("peer"), *self.opts.extra_peer_args,
                *(self.opts.attack_args if i >= self.opts.peers - self.opts.byzantine else ())]

    def _lm_peer_argv(self, i: int, advertise: str, listen: str) -> list[str]:
        o = self.opts
        speed = o.peer_speed[i] if i < len(o.peer_speed) else 1.0
        return lm_job.peer_argv(o.lm, coordinator=self.address, key=str(self.workdir / f"peer-{i}.key"), data_shard=i,
                                num_data_shards=o.peers, events=str(self.workdir / f"peer-{i}.jsonl"),
                                algorithm=o.algorithm, speed=speed, advertise=advertise, listen=listen,
                                shared_memory=self.bed is None,
                                extra=[*self._common_args(f"peer-{i}"), *self.checkpoint_args(i),
                                       *self.security_args("peer")])

    def checkpoint_dir(self, i: int) -> pathlib.Path:
        """Peer i's checkpoint directory (with checkpoint_every > 0)."""
        return self.workdir / f"peer-{i}.checkpoints"

    def checkpoint_args(self, i: int) -> list[str]:
        n, url = self.opts.checkpoint_every, self.opts.checkpoint_url
        if n <= 0:
            return []
        return ["--checkpoint-dir", str(self.checkpoint_dir(i)), "--checkpoint-every", str(n),
                *(["--checkpoint-url", url] if url else [])]

    def start_peer(self, i: int) -> None:
        while len(self.peers) <= i:
            n = len(self.peers)
            self.peers.append(Process(f"peer-{n}", self.peer_argv(n), self.workdir / f"peer-{n}.log",
                                    env=self.peer_env(n), netns=self.bed.netns(n) if self.bed is not None else None))
        self.peers[i].start()

    def local_work_file(self, i: int) -> pathlib.Path:
        """Where a scenario asks peer i for a long local update (shoal.peer.testing.faults.local_work)."""
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
        for r in self.relays:
            r.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        for p in self.standbys:
            p.stop()
        if self.etcd is not None and state_too:
            self.etcd.stop()
        from shoal.peer.lanes.shm import remove_stale_of_keys

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
        """Joins per peer index from the coordinator logs (shoal.testbeds.scenario.joins_from_log)."""
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
    "no chunk from <peer> within Ns", and before a parenthesis those six words would cut open
    ("<peer> lost before voting", not "... voting (participant <peer>")."""
    text = reason.split("failed: ", 1)[1] if "failed: " in reason else reason
    text = re.sub(r"\b[0-9a-f]{8,32}\b", "<peer>", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    kind = " ".join(text.split()[:6])
    if kind.count("(") > kind.count(")"):  # cut inside a parenthesis: leave the parenthesis out
        kind = kind[:kind.rindex("(")]
    return kind.strip().rstrip(":;,")


def _last_commit_digest(swarm: "Swarm") -> str:
    with swarm.state_reader() as store:
        last = store.last_commit()
    return last.state_digest.hex() if last is not None else ""


def _last_commit_accuracy(commits: list[dict], committed: int) -> float:
    """The accuracy peers recorded when they committed round `committed - 1` (the last durable
    one); 0.0 when no peer recorded it."""
    last = [e["test_accuracy"] for e in commits if e["round"] == committed - 1 and "test_accuracy" in e]
    return max(last, default=0.0)


def _bytes_sent(swarm: Swarm) -> int:
    """Tensor bytes the peers sent: per peer slot, the count its last process reported last (its
    "finished" event, or after an early stop the newest event carrying one). The bytes of a
    process killed -9 before a later process of its slot are not counted."""
    total = 0
    for i in range(len(swarm.peers)):
        counted = [e for e in swarm.events(i) if e["event"] in ("finished", "commit") and "bytes_sent" in e]
        if counted:
            total += counted[-1]["bytes_sent"]
    return total


def _collectives(commits: list[dict], events: list[dict]) -> dict[str, int]:
    """Committed rounds per collective (the plans' `collective` of each committed attempt, e.g.
    {"allgather": 20}; with the sparse codecs the planner chooses between the sparse all-gather,
    the sparse reduce-scatter and a dense all-reduce round by round)."""
    committed = {(e["round"], e.get("attempt", 0)) for e in commits}
    seen: dict[tuple[int, int], str] = {}
    for e in events:
        if e["event"] == "plan" and (e["round"], e.get("attempt", 0)) in committed and "collective" in e:
            seen[(e["round"], e.get("attempt", 0))] = e["collective"]
    return dict(collections.Counter(seen.values()))


def summarize(swarm: Swarm, wall: float, baseline: float | None, chaos: "ChaosLog | None" = None, *,
              stopped_early: bool = False) -> dict:
    """The run summary (see docs/quickstart.md and docs/fault-tolerance.md for the fields).

    `test_accuracy` is the best of the peers that finished up to date; after an early stop
    (`stopped_early`: timed out, failed) with none of them, it is the accuracy the peers recorded
    for the last committed model (`test_accuracy_of` says which: "finished peers", "last commit").

    A digest mismatch is a round for which two peers recorded different committed states, or a
    peer that finished the run holding a state other than the last one the coordinator committed.
    """
    events = swarm.all_events()
    with swarm.state_reader() as store:
        rewinds = recorded_rewinds(store)
    # The commits of rounds a rewind went back over were lost: played again, they are other states.
    events = [e for e in events if not (e["event"] == "commit" and any(
        e["round"] >= rw["to"] and e["t"] < rw["wall"] for rw in rewinds))]
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
    if not committed and up_to_date:  # nothing committed (e.g. an ε budget below one round): they must agree
        last = collections.Counter(e["state_digest"] for e in up_to_date).most_common(1)[0][0]
    mismatches += sum(1 for e in up_to_date if e["state_digest"] != last)
    acc = max((e["test_accuracy"] for e in up_to_date), default=0.0)
    acc_of = "finished peers"
    if stopped_early and not up_to_date and committed:
        acc, acc_of = _last_commit_accuracy(commits, committed), "last commit"
    aborts = {(e["round"], e["attempt"]): e for e in events if e["event"] == "abort"}
    retried = {k for k, e in aborts.items() if e.get("will_retry")}
    reasons: dict[str, int] = {}
    for e in aborts.values():
        kind = abort_kind(e["reason"])
        reasons[kind] = reasons.get(kind, 0) + 1
    summary = {
        "test_accuracy": acc,
        "test_accuracy_of": acc_of,
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
        "bytes_sent_total": _bytes_sent(swarm),
        "state_syncs": sum(1 for e in events if e["event"] == "state_sync"),
        "algorithm": swarm.opts.algorithm,
        "seed": swarm.opts.seed,
        "aggregator": swarm.opts.aggregator,
        "compression": swarm.opts.compression,
        "collectives": _collectives(commits, events),
        "byzantine": swarm.opts.byzantine,
        "attack": swarm.opts.attack_args[1] if swarm.opts.attack_args else "",
        "rounds_with_flagged": len({e["round"] for e in commits if e.get("flagged")}),
        "flagged_peers": sorted({f for e in commits for f in e.get("flagged", [])}),
        "coordinators": swarm.opts.coordinators,
        "cohort_size": swarm.opts.cohort_size,
        "cohort_sizes": swarm.cohort_sizes(),
        "rewinds": rewinds,
        "rounds_lost": sum(rw["lost"] for rw in rewinds),
        "resumed_from_checkpoint": sum(1 for e in events if e["event"] == "resumed"),
        "checkpoints_uploaded": sum(1 for e in events if e["event"] == "checkpoint_uploaded"),
    }
    summary.update(_privacy_summary(swarm, commits))
    summary.update(_secure_summary(swarm, [e for e in events if e["event"] == "collective"]))
    if chaos is not None:
        summary.update(chaos.summary(commits))
    return summary


def _privacy_summary(swarm: Swarm, commits: list[dict]) -> dict:
    """The DP keys (docs/aggregation.md): with dp_sigma > 0, `epsilon` (the coordinator's
    accountant after the last committed round, as the peers received it in the Commit),
    `epsilon_by_round` ({round: epsilon}), `dp_sigma`, `dp_mode`, `dp_delta`, `max_norm`; {} without DP."""
    extra = dict(swarm.opts.run_extra)
    if not extra.get("dp_sigma"):
        return {}
    by_round = {e["round"]: e["epsilon"] for e in commits if "epsilon" in e}
    return {"epsilon": by_round[max(by_round)] if by_round else 0.0,
            "epsilon_by_round": {str(r): by_round[r] for r in sorted(by_round)},
            "dp_sigma": extra["dp_sigma"], "dp_mode": extra.get("dp_mode", "owner"),
            "dp_delta": extra.get("dp_delta", 1e-5), "max_norm": extra.get("max_norm", 0.0)}


def _secure_summary(swarm: Swarm, collectives: list[dict]) -> dict:
    """The secure-aggregation keys (docs/security.md): with secure_aggregation on,
    `secure_aggregation` (true), `secure_bytes_total` (shares and reveals every peer sent through
    the coordinator, all attempts), `secure_seconds_mean` (per peer and attempt: keys, shares,
    masking, relay waits and unmasking, outside the all-reduce); and, with or without it,
    `collective_seconds_mean` (per peer and attempt, plan in hand to result and digest)."""
    out = {"collective_seconds_mean": round(sum(e["ended_at"] - e["started_at"] for e in collectives)
                                            / max(1, len(collectives)), 4)}
    if not dict(swarm.opts.run_extra).get("secure_aggregation"):
        return out
    secure = [e for e in collectives if "secure_seconds" in e]
    return {**out, "secure_aggregation": True, "secure_bytes_total": sum(e["secure_bytes_sent"] for e in secure),
            "secure_seconds_mean": round(sum(e["secure_seconds"] for e in secure) / max(1, len(secure)), 4)}


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
            log.info("scenario: %s%s at %.1fs", ev.action, "" if ev.peer is None else f" peer-{ev.peer}"
                     if ev.relay is None else f" relay-{ev.relay}", now)
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
        if ev.relay is not None:
            if ev.relay >= len(sw.relays):
                raise RuntimeError(f"a {ev.action} event names relay {ev.relay}; the swarm has {len(sw.relays)} "
                                   f"(--relays)")
            if ev.action == "relay-kill":
                sw.relays[ev.relay].signal(signal.SIGKILL)
                if sw.relays[ev.relay].popen is not None:
                    sw.relays[ev.relay].popen.wait(timeout=10)
            else:
                sw.start_relay(ev.relay)
            return
        proc = sw.coordinator if ev.peer is None else sw.peers[ev.peer]
        action = ev.action.removeprefix("coordinator-")
        if action == "local-work":
            sw.local_work_file(ev.peer).write_text(f"{ev.seconds}\n")
        elif action in ("shape", "nat-rebind", "black-hole", "latency"):
            if sw.bed is None:  # Scenario.needs_netns made run_swarm build the bed
                raise RuntimeError(f"a {action} event needs the network-namespace runner")
            if action == "shape":
                sw.bed.shape(ev.peer, ev.up_mbit, ev.down_mbit)
            elif action == "black-hole":
                sw.bed.black_hole(ev.peer)
            elif action == "latency":
                sw.bed.set_latency(ev.peer, _latency(ev.latency))
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
        """The summary's `events`: one entry per event that fired, in order (shoal.testbeds.scenario.event_report)."""
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
        `wrongful_exclusion_list` (shoal.testbeds.scenario: rounds_report, per_peer_report, touch_windows)."""
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


class CrashAll:
    """`shoal swarm --crash-all-after R`: once R rounds are committed, kill -9 every peer and
    every coordinator at once (a power cut; etcd, with standby coordinators, stays: it is the
    durable store), then start them all again: the coordinator on its state file and address,
    each peer with its key and checkpoint directory. Driven by the swarm's monitor loop."""

    def __init__(self, swarm: Swarm, after: int, disk: str = ""):
        self.swarm, self.after, self.disk = swarm, after, disk
        self.truncated: list[str] = []  # the checkpoint files cut short (disk "truncate")
        self.lost: list[str] = []  # the checkpoint directories removed (disk "lose")
        self.killed_at: float | None = None  # unix time of the kill
        self.committed_then = 0  # durable commits at the kill
        self.restarted_at: float | None = None

    def tick(self, committed: int) -> None:
        if self.killed_at is not None or committed < self.after:
            return
        sw = self.swarm
        procs = [p for p in [*sw.peers, *(sw.standbys if sw.replicated else [sw.coordinator])]
                 if p is not None and p.alive()]
        log.info("crash: kill -9 every process (%d peers, the coordinator%s) after %d committed rounds",
                 sum(p in sw.peers for p in procs), "s" if sw.replicated else "", committed)
        for p in procs:  # all signalled first: nobody outlives the others by a round
            p.signal(signal.SIGKILL)
        self.killed_at = time.time()
        for p in procs:
            if p.popen is not None:
                p.popen.wait(timeout=10)
        from shoal.peer.lanes.shm import remove_stale_of_keys

        remove_stale_of_keys(sw.workdir)
        self.committed_then = sw.durable_counts()[0]
        if self.disk == "truncate":
            self._truncate_newest()
        elif self.disk == "lose":
            for i in range(len(sw.peers)):
                if sw.checkpoint_dir(i).exists():
                    shutil.rmtree(sw.checkpoint_dir(i))
                    self.lost.append(str(sw.checkpoint_dir(i)))
            log.info("crash: removed the peers' checkpoint directories %s", self.lost)
        sw.start_coordinator()
        for i in range(len(sw.peers)):
            sw.start_peer(i)
        self.restarted_at = time.time()
        log.info("crash: every process restarted %.1fs after the kill; %d rounds were durable",
                 self.restarted_at - self.killed_at, self.committed_then)

    def _truncate_newest(self) -> None:
        """Cut each peer's newest checkpoint file to half its size (its manifest stays)."""
        from shoal.peer.checkpoints import list_checkpoints

        for i in range(len(self.swarm.peers)):
            found = list_checkpoints(self.swarm.checkpoint_dir(i))
            if found:
                f = found[0].state_file
                with open(f, "r+b") as fh:
                    fh.truncate(f.stat().st_size // 2)
                self.truncated.append(str(f))
                log.info("crash: truncated %s", f)

    def summary(self, commits: list[dict], rewinds: list[dict]) -> dict:
        """The summary's `crash_all`: when, what was committed then, where the run went on from,
        and the seconds from the kill to the first commit after it."""
        after = [e["t"] for e in commits if self.killed_at is not None and e["t"] > self.killed_at]
        return {"after_rounds": self.after, "crashed": self.killed_at is not None,
                "committed_at_crash": self.committed_then,
                "resumed_at_round": rewinds[-1]["to"] if rewinds else self.committed_then,
                "rounds_lost": sum(rw["lost"] for rw in rewinds), "truncated": self.truncated, "lost_directories": self.lost,
                "restart_seconds": round(self.restarted_at - self.killed_at, 3) if self.restarted_at else None,
                "recovery_seconds": round(min(after) - self.killed_at, 3) if after else None}


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


NETBED_PREFIX = "shls"  # namespaces and links of `shoal swarm --scenario` beds (shoal.testbeds.netbed names)


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
                nat=[s.nat for s in specs], latency=[_latency(s.latency) for s in specs],
                pair_latency={(p.a, p.b): _latency(p.latency) for p in plan.paths},
                delay_line=plan.has_latency, delay_seed=opts.seed) as bed:
        for i, s in enumerate(specs):
            if s.advertise == "drop":
                bed.drop_inbound(i, NETNS_PEER_PORT)
        log.info("network namespaces: coordinator on %s, peers on %s", bed.root_ip,
                 ", ".join(f"{bed.host_ip(i)} ({_rates(s)}{', behind NAT' if s.nat else ''})"
                           for i, s in enumerate(specs)))
        yield bed


def _latency(spec: LatencySpec | None) -> Latency | None:
    """The bed's Latency for a scenario's rtt_ms / jitter_ms / loss (None: none)."""
    return None if spec is None else Latency(spec.rtt_ms, spec.jitter_ms, spec.loss)


def _rates(spec) -> str:
    def r(v):
        return "-" if v is None else f"{v:g}"
    return f"up {r(spec.up_mbit)} / down {r(spec.down_mbit)} Mbit/s"


BASELINE_AFTER_TIMEOUT = 0.25  # a timed-out run's baseline may take this share of --timeout (at most 60 s)


@dataclass
class _Run:
    """What the phases of `run_swarm` share: the swarm, its helpers, its clocks, how it ended."""

    opts: SwarmOptions
    swarm: Swarm
    bar: object
    chaos: Chaos | None
    t0: float
    t0_wall: float
    warm: dict
    crash: CrashAll | None = None  # --crash-all-after
    driver: ScenarioDriver | None = None
    ok: bool = True
    why: str = ""
    timed_out: bool = False


def run_swarm(opts: SwarmOptions) -> dict:
    """Run a local swarm to completion; returns the summary (with "ok") and writes it if asked.

    A swarm that reaches `opts.timeout` is stopped and still summarized: `timed_out` true, the
    accuracy of the last committed model, the rounds done, and a baseline for the optimizer steps
    actually done (or `baseline_accuracy` None and `baseline_skipped` saying why); "ok" is false.
    """
    with contextlib.ExitStack() as stack:
        # SIGTERM (timeout, kill, a supervisor) unwinds like Ctrl-C: every process is stopped.
        previous = signal.signal(signal.SIGTERM, _terminate)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        run = _prepare(opts, stack)
        if isinstance(run, dict):
            return run
        try:
            _start(run)
            _watch(run)
        except KeyboardInterrupt:
            run.ok, run.why = False, "interrupted"
            raise
        except TimeoutError as exc:
            run.ok, run.why, run.timed_out = False, str(exc), True
            log.error("swarm stopped: %s", exc)
        except RuntimeError as exc:
            run.ok, run.why = False, str(exc)
            log.error("swarm failed: %s", exc)
        finally:
            if run.chaos is not None:
                run.chaos.finish()
            if run.driver is not None:
                run.driver.finish()
            run.swarm.stop_all(state_too=False)  # etcd, if any, stays for the summary
        summary = _summary(run)
    if run.bar is not None:
        run.bar.close()
    _report(run, summary)
    return summary


def _prepare(opts: SwarmOptions, stack: contextlib.ExitStack) -> _Run | dict:
    """The work directory, the shared warm start (workload lm), the swarm and its helpers; a
    failure summary (dict) when the warm start failed."""
    t0, t0_wall = time.monotonic(), time.time()
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
    crash = CrashAll(swarm, opts.crash_all_after, opts.crash_disk) if opts.crash_all_after > 0 else None
    return _Run(opts, swarm, bar, chaos, t0, t0_wall, warm, crash=crash)


def _start(run: _Run) -> None:
    """The coordinator(s), the relay if wanted, and the peers the scenario starts at once."""
    swarm, opts = run.swarm, run.opts
    swarm.start_coordinator()
    if swarm.wants_relay:
        for j in range(max(1, opts.relays)):
            swarm.start_relay(j)
    if opts.scenario is not None:
        run.driver = ScenarioDriver(swarm, opts.scenario, time.time())
    for i in range(opts.peers):
        if run.driver is None or i in run.driver.early_peers():
            swarm.start_peer(i)
    if opts.metrics:
        for name, url in swarm.metrics_urls().items():
            log.info("metrics of %s: %s", name, url)
        log.info("these /metrics URLs answer while the swarm runs; they stop with it")


def _watch(run: _Run) -> None:
    """Until every peer finished: move the bar, the chaos monkey and the scenario on.

    Raises:
        TimeoutError: `opts.timeout` passed first.
        RuntimeError: the coordinator or a peer exited early (its log's tail in the message).
    """
    swarm, opts, bar = run.swarm, run.opts, run.bar
    shown, announced, last_t = 0, False, time.monotonic()
    while True:
        if time.monotonic() - run.t0 > opts.timeout:
            raise TimeoutError(f"swarm did not finish within {opts.timeout:.0f}s")
        _check_processes(swarm)
        commits = [e for e in swarm.all_events() if e["event"] == "commit"]
        top = max((e["round"] + 1 for e in commits), default=0)
        if run.chaos is not None:
            run.chaos.tick(top)
        if run.crash is not None:
            run.crash.tick(top)
        if run.driver is not None:
            run.driver.tick(top)
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
        skipped = run.driver.not_started if run.driver is not None else set()
        if len(swarm.peers) == opts.peers and all(i in skipped or (p.popen is not None and p.popen.poll() == 0)
                                                  or _meant_to_die(swarm, i)
                                                  for i, p in enumerate(swarm.peers)):
            return
        time.sleep(0.1)


def _meant_to_die(swarm: Swarm, i: int) -> bool:
    """Whether peer i was killed as its scenario asked (a "kill" fault it fires on itself, or a
    "kill" event): the run goes on without it, as it would in the wild."""
    sc = swarm.opts.scenario
    if sc is None or swarm.peers[i].popen is None or swarm.peers[i].popen.returncode != -signal.SIGKILL:
        return False
    return ":kill" in sc.peer_spec(i).fault or any(e.action == "kill" and e.peer == i for e in sc.events)


def _check_processes(swarm: Swarm) -> None:
    """Raise RuntimeError when a coordinator or a peer exited before its time."""
    # A coordinator that exits 0 finished the run (peers told); any other exit is early.
    if not swarm.coordinators_alive() and not swarm.coordinator_finished() \
            and not all(p.popen.poll() == 0 for p in swarm.peers):
        raise RuntimeError(f"coordinator exited early:\n{swarm.coordinator.tail()}")
    failed = [p for i, p in enumerate(swarm.peers) if p.popen is not None and p.popen.poll() not in (None, 0)
              and not _meant_to_die(swarm, i)]
    if failed:
        raise RuntimeError(f"{failed[0].name} failed (exit {failed[0].popen.returncode}):\n{failed[0].tail()}")


def _summary(run: _Run) -> dict:
    """The summary of a run that ended (finished, failed or timed out), with its baseline."""
    swarm, opts = run.swarm, run.opts
    wall = time.monotonic() - run.t0
    baseline: dict = {"baseline_accuracy": math.nan}
    if opts.workload == "digits":
        baseline = _baseline(run)
    summary = summarize(swarm, wall, baseline["baseline_accuracy"], run.chaos.log if run.chaos is not None else None,
                        stopped_early=bool(run.why))
    summary.update(baseline)
    summary["timed_out"] = run.timed_out
    summary.update(run.warm)
    if run.crash is not None:
        summary["crash_all"] = run.crash.summary([e for e in swarm.all_events() if e["event"] == "commit"],
                                                 summary["rewinds"])
    ok = run.ok
    if opts.workload == "lm":
        ok = _lm_summary(swarm, summary, run.t0_wall, run.bar, early=bool(run.why),
                         budget=min(60.0, BASELINE_AFTER_TIMEOUT * opts.timeout) if run.timed_out else None) and ok
    # An epsilon budget that stops the run (dp_on_budget = stop) ends it early, by design.
    extra = dict(opts.run_extra)
    if extra.get("dp_epsilon_budget") and extra.get("dp_on_budget", "stop") == "stop":
        summary["privacy_budget_spent"] = summary["rounds_committed"] < opts.rounds and swarm.coordinator_finished()
    rounds_ok = summary["rounds_committed"] == opts.rounds or summary.get("privacy_budget_spent", False)
    summary["ok"] = ok and summary["peers_up_to_date"] >= 1 and rounds_ok
    if run.why:
        summary["error"] = run.why.splitlines()[0]
    if opts.metrics:
        summary["metrics"] = swarm.metrics_urls()
    if swarm.relay is not None:
        summary.update(swarm.relay_summary())
    if run.driver is not None:
        summary["events"] = run.driver.report()
        summary.update(run.driver.tables())
    if opts.plot_path:
        summary["ok"] = _plot(run, summary) and summary["ok"]
    return summary


def _baseline(run: _Run) -> dict:
    """The single-process baseline's keys: `baseline_accuracy` and `baseline_steps` (the swarm's
    optimizer steps: all planned ones after a full run of every peer, the committed rounds'
    participants times `inner_steps` after an early stop, a privacy budget's stop or with cohorts). A timed-out run's baseline gets BASELINE_AFTER_TIMEOUT of
    the timeout; past it, or with no round committed, `baseline_accuracy` is None and
    `baseline_skipped` says why."""
    from shoal.peer.workloads.digits import baseline_accuracy

    opts = run.opts
    steps = opts.peers * opts.rounds * opts.inner_steps
    committed, _ = run.swarm.durable_counts()
    if run.why or committed < opts.rounds or opts.cohort_size:
        steps = _steps_done(run.swarm)
    if steps == 0:
        return {"baseline_accuracy": None, "baseline_steps": 0,
                "baseline_skipped": "no round committed: no optimizer step to compare with"}
    budget = min(60.0, BASELINE_AFTER_TIMEOUT * opts.timeout) if run.timed_out else None
    _say(run.bar, f"baseline: training one process for the same {steps} optimizer steps, to compare accuracy")
    acc = baseline_accuracy(opts.run_config(), steps, seconds=budget)
    if acc is None:
        return {"baseline_accuracy": None, "baseline_steps": steps,
                "baseline_skipped": f"the baseline's {steps} steps did not fit in {budget:.0f} s after the timeout"}
    return {"baseline_accuracy": acc, "baseline_steps": steps}


def _steps_done(swarm: Swarm) -> int:
    """Optimizer steps of the committed rounds: each participant ran `inner_steps` per round."""
    with swarm.state_reader() as store:
        commits = store.load_commits()
    return sum(len(c.participants) for c in commits) * swarm.opts.inner_steps


def _plot(run: _Run, summary: dict) -> bool:
    """Draw the run (`opts.plot_path`); False when it could not be written."""
    from shoal.plots import plot_lm, plot_rounds

    opts = run.opts
    try:
        if opts.workload == "lm":
            plot_lm(summary, opts.plot_path, title=f"shoal swarm --workload lm: {opts.peers} peers, "
                    f"{opts.rounds} rounds x {opts.inner_steps} inner steps")
        else:
            plot_rounds(run.swarm.all_events(), opts.plot_path, title=f"shoal swarm: {opts.peers} peers, "
                        f"{opts.algorithm}, seed {opts.seed}")
    except (OSError, ImportError) as exc:
        log.error("plot not written: %s", exc)
        return False
    summary["plot"] = opts.plot_path
    return True


def _report(run: _Run, summary: dict) -> None:
    """The closing lines on stderr, and the summary file when asked for."""
    opts = run.opts
    if opts.workload == "lm":
        print(_lm_line(summary), file=sys.stderr)
    else:
        base = summary["baseline_accuracy"]
        base_text = f"{base:.4f}" if base is not None else f"none: {summary['baseline_skipped']}"
        print(f"test accuracy {summary['test_accuracy']:.4f} (baseline, single process, same total steps: "
              f"{base_text}); rounds committed {summary['rounds_committed']}, "
              f"aborted {summary['rounds_aborted']}; digest mismatches {summary['digest_mismatches']}; "
              f"{summary['wall_seconds']:.1f}s{'; timed out' if summary['timed_out'] else ''}", file=sys.stderr)
    if summary.get("privacy_budget_spent"):
        print(f"privacy budget spent: epsilon {summary.get('epsilon', 0.0):.3f} after "
              f"{summary['rounds_committed']} rounds; the next round would exceed the budget", file=sys.stderr)
    if run.chaos is not None:
        print(f"chaos: {summary['peers_killed']} peers killed and restarted, {summary['peers_stopped']} stopped, "
              f"{summary['coordinator_restarts']} coordinator restarts, {summary['rounds_retried']} retried attempts, "
              f"{summary['state_syncs']} state syncs; recovery p50 {summary['recovery_seconds_p50']}s, "
              f"max {summary['recovery_seconds_max']}s", file=sys.stderr)
    if opts.summary_path:
        pathlib.Path(opts.summary_path).write_text(json.dumps(summary, indent=2) + "\n")


def _lm_summary(swarm: Swarm, summary: dict, t0_wall: float, bar, *, early: bool = False,
                budget: float | None = None) -> bool:
    """Add the LM keys (shoal.bench.lm_job.summary) and, with `--baseline ddp`, run the baseline and add
    its keys. The digits keys `test_accuracy` / `baseline_accuracy` do not apply (None). After an
    early stop (`early`) the baseline runs the committed rounds' steps, within `budget` seconds
    when given (else `opts.timeout`). Returns False when the baseline failed (its error is in
    `baseline_error`)."""
    o = swarm.opts
    paths = [swarm.workdir / f"peer-{i}.jsonl" for i in range(len(swarm.peers))]
    summary.update(lm_job.summary([swarm.events(i) for i in range(len(swarm.peers))], t0_wall,
                                  lm_job.evaluations(paths)))
    summary.update(lm_job.utilization(paths))
    summary.update(lm_job.round_timing([swarm.events(i) for i in range(len(swarm.peers))]))
    summary.update(lm_job.traffic([swarm.events(i) for i in range(len(swarm.peers))]))
    summary["test_accuracy"] = summary["baseline_accuracy"] = None
    summary["peer_speed"] = list(o.peer_speed)
    summary["local_work"] = dict(o.run_extra).get("local_work", "steps")
    summary["overlap"] = bool(dict(o.run_extra).get("overlap", False))
    extra = dict(o.run_extra)
    summary.update(fragments=int(extra.get("fragments", 1)), fragment_overlap=int(extra.get("fragment_overlap", 0)),
                   fragment_alpha=float(extra.get("fragment_alpha", 0.5)),
                   fragment_partition=extra.get("fragment_partition", "contiguous"),
                   eager=bool(extra.get("eager", False)), error_feedback=bool(extra.get("error_feedback", True)))
    summary.update(target_val_loss=None, seconds_to_target=None, baseline_seconds_to_target=None)
    if o.target_val_loss:
        _to_target(summary, o.target_val_loss)
    if o.baseline != "ddp":
        return True
    # Each round's local phase is inner_steps / fragments steps (streaming), inner_steps otherwise.
    steps = (summary["rounds_committed"] if early else o.rounds) * (o.inner_steps // summary["fragments"])
    if steps == 0:
        summary["baseline_skipped"] = "no round committed: no optimizer step to compare with"
        return True
    _say(bar, f"baseline ddp: {o.peers} ranks, {steps} synchronous steps (gloo all-reduce of gradients every step)")
    try:
        summary.update(lm_job.run_ddp_baseline(o.lm, world=o.peers, steps=steps, eval_every=o.inner_steps,
                                               workdir=swarm.workdir, timeout=budget or o.timeout))
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
