"""A network test bed of Linux network namespaces with kernel-shaped links (docs/concepts.md, "Test beds").

`NetBed` builds, in the root namespace, one Linux bridge and, per host, a network namespace joined
to the bridge by a veth pair. Host *i* gets ``10.<x>.0.<i+1>/24`` on its ``eth0`` (``x`` is picked
among 10.200–10.254 so it does not clash with a subnet already routed here); the root namespace gets
``10.<x>.0.254`` on the bridge, so a coordinator can run unconfined while peers run "elsewhere".
Each host's upload is shaped by a token-bucket filter (``tc qdisc tbf``) on its own ``eth0`` and
its download by one on the bridge-side veth, so every byte a host sends or receives, to another
host or to the root namespace, crosses both the sender's upload and the receiver's download
shaper, like home links meeting in the internet core.

Round-trip time, jitter, loss and reordering come from a packet-level delay line
(shoal.testbeds.delayline), built when the bed is given any `Latency` (``latency``,
``pair_latency`` or ``delay_line=True``; the kernel's ``netem`` qdisc is not available on every
machine, so the bed does not use it): a "core" namespace on the bridge (``10.<x>.0.253``) with a
TUN device and the forwarder process behind it. Every host and the root namespace route the
other hosts' addresses (``/32`` each) via the core, whose policy routing (``ip rule iif eth0``)
hands each arriving packet to the TUN device; the forwarder holds it for its direction's one-way
delay (or drops it) and writes it back, and the core sends it on to its destination over the
bridge. So a packet from host i to host j crosses i's upload shaper, the delay line, then j's
download shaper, and both kernels' TCP sees the path's RTT and loss end to end. `set_latency`
and `set_pair_latency` change a path while processes run. The delay line does not combine with
NAT hosts (ValueError).

A host may sit behind a NAT router of its own (``nat[i]``), as a volunteer behind a home router
does: the router is a namespace joined to the bridge on ``10.<x>.0.<i+1>`` (the host's public
address, `public_ip`) and to the host on a private LAN ``10.<x>.<i+1>.0/24`` (router ``.1``, host
``.2``, `host_ip`); it masquerades (``iptables -t nat ... MASQUERADE``) what the host sends out and
drops every new inbound connection, so only replies to the host's own outbound connections come
back. Nobody can dial such a host: the root namespace gets an ``unreachable`` route for the LAN
(a dial fails at once instead of leaving for the default route), and the other hosts have no
route there. `nat_rebind` changes the router's public address, as home routers do when their
lease changes: the kernel drops the masqueraded connections, and the host must dial again.

The bed owns everything it creates: leaving the ``with`` block (normally or by an exception) kills
the processes started with `NetBed.popen` and deletes the namespaces, veths and the bridge. Names
carry the creating process id (namespaces ``<prefix>-<pid>-<tag>-<i>``, links carry the alias
``shoal-netbed:<prefix>:<pid>``), so `cleanup_stale` can remove what a killed run left behind
without touching a live bed. Needs root and iproute2; `NetBed.available` says why not otherwise.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shoal.testbeds.delayline import Path

__all__ = ["ROOT", "Latency", "NetBed", "NetBedError", "cleanup_stale", "is_congestion_name", "machine_congestion",
           "tbf_params"]

log = logging.getLogger(__name__)

_ALIAS = "shoal-netbed"
_CMD_TIMEOUT_S = 10.0  # one ip/tc invocation; they take milliseconds
_KILL_GRACE_S = 2.0  # SIGTERM → SIGKILL for processes started in the bed


_CORE_TABLE = "100"  # the core namespace's routing table that sends every arriving packet to the TUN device
_CORE_OCTET = 253  # the core namespace's last address octet
_DELAY_READY_S = 10.0  # how long the forwarder may take to open its device and say "ready"
ROOT = -1  # the root namespace as an end of a path (`NetBed.set_pair_latency`)
ROOT_CORE = -2  # `NetBed.popen`'s index for the delay line's core namespace


class NetBedError(RuntimeError):
    """An ip/tc command failed while building the bed (the message holds its stderr)."""


@dataclass(frozen=True)
class Latency:
    """What a path adds besides rate: rtt_ms (round-trip time in milliseconds, half of it each
    way), jitter_ms (each packet's one-way delay varies uniformly by ± this, ≤ rtt_ms / 2), loss
    (probability that a packet is lost, in each direction independently), reorder (probability
    that a packet is held back so that later ones overtake it). Raises ValueError outside
    [0, 60 s) for times and [0, 1) for probabilities, or for jitter above half the RTT."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    reorder: float = 0.0

    def __post_init__(self) -> None:
        self.one_way()  # validates

    def one_way(self) -> Path:
        """The delay line's behaviour for each direction of this path."""
        return Path(self.rtt_ms / 2, self.jitter_ms, self.loss, self.reorder)

    @staticmethod
    def combine(a: Latency | None, b: Latency | None) -> Latency | None:
        """The path between two hosts each with a latency of its own: the larger of each field
        (None when both are None)."""
        if a is None or b is None:
            return a or b
        return Latency(max(a.rtt_ms, b.rtt_ms), max(a.jitter_ms, b.jitter_ms), max(a.loss, b.loss),
                       max(a.reorder, b.reorder))


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise NetBedError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tbf_params(rate_mbit: float) -> dict[str, int]:
    """Token-bucket settings for an accurate long-run rate of ``rate_mbit`` (10^6 bit/s).

    ``burst`` is 10 ms of traffic but at least 64 KiB + one frame: veth hands tbf GSO super-packets
    of up to 64 KiB, and a bucket smaller than a packet would make tbf split every one of them.
    ``limit`` (the queue) holds 100 ms of traffic but at least two buckets: TCP then loses few
    packets at the shaper and keeps the link full, instead of losing throughput to backoff.
    """
    if not rate_mbit > 0:
        raise ValueError(f"rate must be > 0 Mbit/s, got {rate_mbit}")
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(int(rate_bps * 0.010), 64 * 1024 + 1514)
    limit = max(int(rate_bps * 0.100), 2 * burst)
    return {"rate_bit": int(rate_mbit * 1e6), "burst": burst, "limit": limit}


_IPV4_SYSCTL = pathlib.Path("/proc/sys/net/ipv4")


def is_congestion_name(name: str) -> bool:
    """Whether `name` can be a TCP congestion control's name (ASCII letters, digits, "_"): what
    NetBed passes to sysctl and modprobe."""
    return bool(name) and name.isascii() and name.replace("_", "").isalnum()


def machine_congestion() -> str:
    """The TCP congestion control of the namespace this process runs in, which a new namespace
    inherits on most machines ("?" when /proc cannot be read)."""
    try:
        return (_IPV4_SYSCTL / "tcp_congestion_control").read_text().strip()
    except OSError:
        return "?"


class NetBed:
    """Hosts in network namespaces behind shaped links; a context manager.

    ``up_mbit[i]`` / ``down_mbit[i]``: host i's upload / download in Mbit/s (10^6 bit/s), ``None``
    for unshaped. ``prefix`` (≤ 5 characters) starts every name this bed creates.
    ``tcp_congestion``: the TCP congestion control every host's connections use (e.g. "cubic",
    "bbr"; ``net.ipv4.tcp_congestion_control`` in its namespace), or ``None`` for the machine's
    default, which a new namespace inherits.

    Failure semantics: `__enter__` either returns a complete bed or, after deleting whatever it
    had built, raises `NetBedError` (or `OSError` when a tool is missing; a `tcp_congestion` the
    kernel lacks is refused before anything is built). `__init__` raises ValueError for bad
    arguments. `__exit__` never raises; it logs what it could not delete (use `cleanup_stale`
    afterwards). A `tcp_congestion` missing from the machine's allowed list is added to it, and
    stays.
    """

    def __init__(
        self,
        n_hosts: int,
        up_mbit: Sequence[float | None] | None = None,
        down_mbit: Sequence[float | None] | None = None,
        prefix: str = "shl",
        *,
        subnet_octet: int | None = None,
        nat: Sequence[bool] | None = None,
        tcp_congestion: str | None = None,
        latency: Sequence[Latency | None] | None = None,
        pair_latency: Mapping[tuple[int, int], Latency | None] | None = None,
        delay_line: bool = False,
        delay_seed: int = 0,
    ) -> None:
        if n_hosts < 1 or n_hosts > 250:
            raise ValueError("n_hosts must be in 1..250")
        if not prefix or len(prefix) > 5 or not prefix.isalnum():
            raise ValueError("prefix must be 1-5 alphanumeric characters (interface names ≤ 15)")
        self.n_hosts = n_hosts
        self.up_mbit = list(up_mbit) if up_mbit is not None else [None] * n_hosts
        self.down_mbit = list(down_mbit) if down_mbit is not None else [None] * n_hosts
        if len(self.up_mbit) != n_hosts or len(self.down_mbit) != n_hosts:
            raise ValueError("up_mbit and down_mbit need one entry per host")
        self.nat = [bool(v) for v in nat] if nat is not None else [False] * n_hosts
        if len(self.nat) != n_hosts:
            raise ValueError("nat needs one entry per host")
        if any(self.nat) and n_hosts > 120:
            raise ValueError("a bed with NAT hosts holds at most 120 hosts (rebind addresses sit above .128)")
        if tcp_congestion is not None and not is_congestion_name(tcp_congestion):
            raise ValueError(f"tcp_congestion: not a congestion control name: {tcp_congestion!r}")
        self.tcp_congestion = tcp_congestion
        self.latency: list[Latency | None] = list(latency) if latency is not None else [None] * n_hosts
        if len(self.latency) != n_hosts:
            raise ValueError("latency needs one entry per host")
        self.pair_latency: dict[tuple[int, int], Latency | None] = {}
        for (a, b), lat in (pair_latency or {}).items():
            self._check_pair(a, b)
            self.pair_latency[(min(a, b), max(a, b))] = lat
        self.delay_line = bool(delay_line or any(self.latency) or any(self.pair_latency.values()))
        if self.delay_line and any(self.nat):
            raise ValueError("latency: the delay line does not combine with NAT hosts (nat)")
        self.delay_seed = int(delay_seed)
        self._delay_proc: subprocess.Popen[bytes] | None = None
        self._delay_buf = b""
        self.prefix = prefix
        self._subnet_octet = subnet_octet
        self._tag = secrets.token_hex(2)
        self._pid = os.getpid()
        self._alias = f"{_ALIAS}:{prefix}:{self._pid}"
        self.bridge = f"{prefix}{self._tag}br"
        self._procs: list[subprocess.Popen[Any]] = []
        self._namespaces: list[str] = []
        self._bridge_made = False
        self._routes: list[str] = []  # root-namespace routes this bed added (unreachable NAT LANs)
        self._core_routes: list[str] = []  # root-namespace /32 routes via the delay line's core
        self._rebinds = [0] * n_hosts  # how often each NAT router's public address changed
        self._shapes = [0] * n_hosts  # shapes applied per host (each gets a fresh qdisc handle: `shape`)
        self.octet: int | None = None

    # --- names and addresses -----------------------------------------------------------------

    def netns(self, i: int) -> str:
        """The name of host i's network namespace (for ``ip netns exec``)."""
        self._check_host(i)
        return f"{self.prefix}-{self._pid}-{self._tag}-{i}"

    def veth_bridge_side(self, i: int) -> str:
        """Host i's veth end in the root namespace (its download shaper sits here)."""
        return f"{self.prefix}{self._tag}b{i}"

    @property
    def core_netns(self) -> str:
        """The name of the delay line's core namespace (only with `delay_line`)."""
        return f"{self.prefix}-{self._pid}-{self._tag}-core"

    @property
    def core_ip(self) -> str:
        """The core namespace's address on the bridge, ``10.<x>.0.253``."""
        return f"10.{self._octet()}.0.{_CORE_OCTET}"

    def _check_pair(self, a: int, b: int) -> None:
        if a == b:
            raise ValueError(f"pair_latency: ({a}, {b}) is not a pair of two ends")
        for end in (a, b):
            if end != ROOT:
                self._check_host(end)

    def router_netns(self, i: int) -> str:
        """The name of the NAT router namespace in front of host i (only for ``nat[i]``)."""
        self._check_host(i)
        return f"{self.prefix}-{self._pid}-{self._tag}-r{i}"

    def host_ip(self, i: int) -> str:
        """The address on host i's own ``eth0`` (what it binds): ``10.<x>.0.<i+1>``, or behind
        NAT its private ``10.<x>.<i+1>.2``."""
        self._check_host(i)
        return f"10.{self._octet()}.{i + 1}.2" if self.nat[i] else f"10.{self._octet()}.0.{i + 1}"

    def public_ip(self, i: int) -> str:
        """The address host i's connections come from as others see them: `host_ip`, or behind
        NAT its router's current public address (it changes with `nat_rebind`)."""
        self._check_host(i)
        if not self.nat[i]:
            return self.host_ip(i)
        return f"10.{self._octet()}.0.{i + 1 + (128 if self._rebinds[i] % 2 else 0)}"

    @property
    def root_ip(self) -> str:
        """The root namespace's address on the bridge, ``10.<x>.0.254``."""
        return f"10.{self._octet()}.0.254"

    def _octet(self) -> int:
        if self.octet is None:
            raise RuntimeError("the bed is not started")
        return self.octet

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host {i} not in 0..{self.n_hosts - 1}")

    # --- availability ------------------------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether this process can build a bed, and if not, why (for ``pytest.skip``).

        Checks root, ``ip``/``tc`` on PATH, and actually creates and deletes a probe namespace.
        """
        if os.geteuid() != 0:
            return False, "NetBed needs root (network namespaces, veth, tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"NetBed needs iproute2: {tool!r} not on PATH"
        probe = f"shlprobe-{os.getpid()}-{secrets.token_hex(2)}"
        try:
            made = _run(["ip", "netns", "add", probe], check=False)
            if made.returncode != 0:
                return False, f"ip netns unsupported here: {made.stderr.strip()}"
        finally:
            _run(["ip", "netns", "del", probe], check=False)
        return True, "ok"

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> NetBed:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pick_octet(self) -> int:
        if self._subnet_octet is not None:
            return self._subnet_octet
        used: set[int] = set()
        for fam in ("-4",):
            out = _run(["ip", "-j", fam, "addr", "show"], check=False).stdout or "[]"
            for link in json.loads(out):
                for a in link.get("addr_info", []):
                    parts = a.get("local", "").split(".")
                    if len(parts) == 4 and parts[0] == "10":
                        used.add(int(parts[1]))
            out = _run(["ip", "-j", fam, "route", "show"], check=False).stdout or "[]"
            for r in json.loads(out):
                parts = r.get("dst", "").split("/")[0].split(".")
                if len(parts) == 4 and parts[0] == "10":
                    used.add(int(parts[1]))
                elif r.get("dst") == "default":
                    continue
        for octet in range(200, 255):
            if octet not in used:
                return octet
        raise NetBedError("no free 10.x.0.0/24 subnet in 10.200-10.254")

    def _build(self) -> None:
        if self.tcp_congestion is not None:
            self._allow_congestion()
        self.octet = self._pick_octet()
        br = self.bridge
        _run(["ip", "link", "add", br, "type", "bridge"])
        self._bridge_made = True
        _run(["ip", "link", "set", br, "alias", self._alias])
        _run(["ip", "addr", "add", f"{self.root_ip}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        for i in range(self.n_hosts):
            self._add_host(i)
        if self.delay_line:
            self._add_core()
        log.info(
            "netbed up: %d hosts on 10.%d.0.0/24 via %s (up %s, down %s Mbit/s)",
            self.n_hosts, self.octet, br, self.up_mbit, self.down_mbit,
        )

    def _add_host(self, i: int) -> None:
        """Host i: its namespace, its veth to the bridge (or to its NAT router), its address,
        its shapers."""
        ns, vb = self.netns(i), self.veth_bridge_side(i)
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.tcp_congestion is not None:
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                  f"net.ipv4.tcp_congestion_control={self.tcp_congestion}"])
        if self.nat[i]:
            self._add_nat_host(i)
            self.shape(i, self.up_mbit[i], self.down_mbit[i])
            return
        self._bridge_port(vb, ns, self.host_ip(i))
        self.shape(i, self.up_mbit[i], self.down_mbit[i])

    @staticmethod
    def congestion_available(name: str) -> tuple[bool, str]:
        """Whether the kernel has TCP congestion control `name`, loading its module first when it
        is one (``modprobe tcp_<name>`` where modprobe exists; a failure there is only "no");
        also the algorithms it has, space-separated. Raises OSError when /proc is unreadable."""
        have = _IPV4_SYSCTL / "tcp_available_congestion_control"
        avail = have.read_text().split()
        if name not in avail and shutil.which("modprobe"):
            _run(["modprobe", f"tcp_{name}"], check=False)
            avail = have.read_text().split()
        return name in avail, " ".join(avail)

    def _allow_congestion(self) -> None:
        """Make `tcp_congestion` one a namespace may take, before anything is built: check the
        kernel has it (`congestion_available`) and add it to the machine's allowed list
        (``net.ipv4.tcp_allowed_congestion_control``, which only the init namespace sets; the
        addition stays: it only lets processes choose it). Raises NetBedError: the kernel has no
        such algorithm, or the allowed list cannot be written; OSError: /proc unreadable."""
        cc = self.tcp_congestion
        ok, avail = self.congestion_available(cc)
        if not ok:
            raise NetBedError(f"tcp_congestion: the kernel has no {cc!r} (available: {avail})")
        allowed = (_IPV4_SYSCTL / "tcp_allowed_congestion_control").read_text().split()
        if cc not in allowed:
            _run(["sysctl", "-q", "-w", f"net.ipv4.tcp_allowed_congestion_control={' '.join([*allowed, cc])}"])
            log.info("netbed: added %s to net.ipv4.tcp_allowed_congestion_control", cc)

    def _bridge_port(self, vb: str, ns: str, ip: str) -> None:
        """A veth pair from the bridge (`vb`, tagged with this bed's alias) to `eth0` in namespace
        `ns`, which gets `ip`/24; both ends up."""
        _run(["ip", "link", "add", vb, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", vb, "alias", self._alias])
        _run(["ip", "link", "set", vb, "master", self.bridge])
        _run(["ip", "link", "set", vb, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def _add_nat_host(self, i: int) -> None:
        """Host i behind its own router namespace (see the module docstring). The host's upload
        shaper sits on its own eth0, its download shaper on the router's bridge-side veth, as for
        any host; the router itself is unshaped."""
        ns, rns, vb = self.netns(i), self.router_netns(i), self.veth_bridge_side(i)
        x = self._octet()
        _run(["ip", "netns", "add", rns])
        self._namespaces.append(rns)
        _run(["ip", "-n", rns, "link", "set", "lo", "up"])
        self._bridge_port(vb, rns, self.public_ip(i))
        _run(["ip", "-n", rns, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "-n", rns, "addr", "add", f"10.{x}.{i + 1}.1/24", "dev", "lan0"])
        _run(["ip", "-n", rns, "link", "set", "lan0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"10.{x}.{i + 1}.1"])
        _run(["ip", "netns", "exec", rns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        ipt = ["ip", "netns", "exec", rns, "iptables", "-w"]
        _run([*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"])
        _run([*ipt, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
              "ESTABLISHED,RELATED", "-j", "ACCEPT"])
        _run([*ipt, "-A", "FORWARD", "-i", "eth0", "-j", "DROP"])
        _run([*ipt, "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"])
        lan = f"10.{x}.{i + 1}.0/24"
        _run(["ip", "route", "replace", "unreachable", lan])
        self._routes.append(lan)

    # --- the delay line ------------------------------------------------------------------------

    def _add_core(self) -> None:
        """The core namespace, its TUN device and policy routing, the forwarder, and the /32 routes
        that send every host's and the root namespace's traffic to another host through it (the
        module docstring)."""
        ns, vb, core = self.core_netns, f"{self.prefix}{self._tag}bc", self.core_ip
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._bridge_port(vb, ns, core)
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
                    "net.ipv4.conf.eth0.send_redirects=0", "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.eth0.rp_filter=0"):
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", key])
        _run(["ip", "netns", "exec", ns, "ip", "tuntap", "add", "dev", "dl0", "mode", "tun"])
        _run(["ip", "-n", ns, "link", "set", "dl0", "txqueuelen", "10000", "up"])
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.dl0.rp_filter=0"])
        # A plain FIFO in front of the forwarder: a queue that drops on its own (fq_codel) would add
        # losses no path asked for; this one only drops past 10,000 packets (counted by tc -s).
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", "dl0", "root", "pfifo", "limit", "10000"])
        _run(["ip", "-n", ns, "rule", "add", "iif", "eth0", "lookup", _CORE_TABLE, "pref", "100"])
        _run(["ip", "-n", ns, "route", "add", "default", "dev", "dl0", "table", _CORE_TABLE])
        self._delay_proc = self.popen(ROOT_CORE, [sys.executable, "-m", "shoal.testbeds.delayline", "--tun", "dl0"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        ready = self._delay_line_read(_DELAY_READY_S)
        if not ready.get("ready"):
            raise NetBedError(f"the delay line's forwarder did not start: {ready}")
        self._push_paths()
        hosts = [self.host_ip(i) for i in range(self.n_hosts)]
        for i in range(self.n_hosts):
            hns = self.netns(i)
            for key in ("net.ipv4.conf.all.accept_redirects=0", "net.ipv4.conf.eth0.accept_redirects=0"):
                _run(["ip", "netns", "exec", hns, "sysctl", "-q", "-w", key])
            for dst in [*hosts, self.root_ip]:
                if dst != hosts[i]:
                    _run(["ip", "-n", hns, "route", "replace", f"{dst}/32", "via", core])
        for dst in hosts:
            _run(["ip", "route", "replace", f"{dst}/32", "via", core])
            self._core_routes.append(dst)

    def _path_table(self) -> list[list[Any]]:
        """Every direction the delay line delays: [[src, dst, delay_ms, jitter_ms, loss, reorder]]."""
        ends = [*range(self.n_hosts), ROOT]
        ip = {i: (self.root_ip if i == ROOT else self.host_ip(i)) for i in ends}
        rows = []
        for a, b in itertools.combinations(ends, 2):
            lat = self.path_latency(a, b)
            if lat is None:
                continue
            p = lat.one_way()
            for src, dst in ((a, b), (b, a)):
                rows.append([ip[src], ip[dst], p.delay_ms, p.jitter_ms, p.loss, p.reorder])
        return rows

    def path_latency(self, a: int, b: int) -> Latency | None:
        """The latency of the path between ends a and b (host indices or ROOT): the pair's own
        (`set_pair_latency`) or else the larger of the two hosts' (`Latency.combine`; the root
        namespace has none of its own)."""
        self._check_pair(a, b)
        key = (min(a, b), max(a, b))
        if key in self.pair_latency:
            return self.pair_latency[key]
        return Latency.combine(*(None if e == ROOT else self.latency[e] for e in (a, b)))

    def _push_paths(self) -> None:
        proc = self._delay_proc
        if proc is None or proc.stdin is None:
            raise NetBedError("the bed was built without a delay line (give it a latency or delay_line=True)")
        line = json.dumps({"paths": self._path_table(), "seed": self.delay_seed, "stats": True}) + "\n"
        try:
            proc.stdin.write(line.encode())
        except OSError as exc:
            raise NetBedError(f"the delay line's forwarder is gone ({exc})") from None
        reply = self._delay_line_read(_DELAY_READY_S)
        if "error" in reply or "in" not in reply:
            raise NetBedError(f"the delay line refused its path table: {reply}")

    def _delay_line_read(self, timeout: float) -> dict:
        """The forwarder's next JSON line (stdout), within `timeout` seconds. Raises NetBedError."""
        proc = self._delay_proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._delay_buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise NetBedError(f"the delay line's forwarder did not answer within {timeout:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise NetBedError(f"the delay line's forwarder exited ({proc.poll()})")
            self._delay_buf += chunk
        line, self._delay_buf = self._delay_buf.split(b"\n", 1)
        return json.loads(line)

    def set_latency(self, i: int, latency: Latency | None) -> None:
        """Set host i's own latency (every path it is on, unless a pair's own applies) now, also
        while processes run; held packets keep their release time. Raises NetBedError for a bed
        without a delay line."""
        self._check_host(i)
        old, self.latency[i] = self.latency[i], latency
        try:
            self._push_paths()
        except NetBedError:
            self.latency[i] = old
            raise

    def set_pair_latency(self, a: int, b: int, latency: Latency | None) -> None:
        """Set the path between ends a and b (host indices or ROOT), both directions, now; None
        makes it follow the hosts' own latencies again. Raises NetBedError as `set_latency`."""
        self._check_pair(a, b)
        key = (min(a, b), max(a, b))
        old = self.pair_latency.pop(key, "absent")
        if latency is not None:
            self.pair_latency[key] = latency
        try:
            self._push_paths()
        except NetBedError:
            self.pair_latency.pop(key, None)
            if old != "absent":
                self.pair_latency[key] = old  # type: ignore[assignment]
            raise

    def delay_stats(self) -> dict:
        """The forwarder's counters: packets in/out, lost (drawn), reordered, overflow (past its
        hold limit), held now and at most, its CPU seconds and wall seconds. Raises NetBedError."""
        proc = self._delay_proc
        if proc is None or proc.stdin is None:
            raise NetBedError("the bed was built without a delay line")
        proc.stdin.write(b'{"stats": true}\n')
        return self._delay_line_read(_DELAY_READY_S)

    def nat_rebind(self, i: int) -> str:
        """Give host i's NAT router a new public address now (alternating between two), as a
        home router does when its lease changes; returns the new address. The kernel forgets the
        masqueraded connections: the host's open connections break and it must dial again.
        Raises ValueError for a host without NAT, NetBedError when ip fails."""
        if not self.nat[i]:
            raise ValueError(f"host {i} is not behind NAT")
        rns, old = self.router_netns(i), self.public_ip(i)
        self._rebinds[i] += 1
        new = self.public_ip(i)
        # Old one first: deleting a primary address would delete a secondary in its subnet too.
        _run(["ip", "-n", rns, "addr", "del", f"{old}/24", "dev", "eth0"])
        _run(["ip", "-n", rns, "addr", "add", f"{new}/24", "dev", "eth0"])
        # Deleting the address drops its masqueraded conntrack entries (nf_nat's address notifier);
        # flush the rest too where the conntrack tool is installed.
        if shutil.which("conntrack") is not None:
            _run(["ip", "netns", "exec", rns, "conntrack", "-F"], check=False)
        log.info("netbed: host %d's NAT router moved from %s to %s", i, old, new)
        return new

    def shape(self, i: int, up_mbit: float | None, down_mbit: float | None) -> None:
        """Set host i's upload / download rate (Mbit/s; None = unshaped) now, also while
        processes run: a new tbf qdisc takes the old one's place (connections stay up; the
        packets queued in the old one are dropped and TCP resends them, as when a real link
        degrades). Raises NetBedError when tc fails.

        A new qdisc (another handle), not the running one changed in place: changing a busy tbf's
        rate (`tc qdisc replace` with the same handle) left it stalled for good on this machine's
        kernel (6.18): backlog full, nothing sent, every new packet dropped, the host cut off (a
        peer of the link-drop scenario lost its lease and gave up after 120 s, twice in two runs)."""
        self._check_host(i)
        self._shapes[i] += 1
        handle = f"{1 + self._shapes[i] % 2}:"  # 1: and 2: in turn, never the one in place
        self._set_rate(["-n", self.netns(i)], "eth0", up_mbit, handle)
        self._set_rate([], self.veth_bridge_side(i), down_mbit, handle)
        self.up_mbit[i], self.down_mbit[i] = up_mbit, down_mbit

    @staticmethod
    def _set_rate(ns_args: list[str], dev: str, rate_mbit: float | None, handle: str) -> None:
        if rate_mbit is None:
            r = _run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"], check=False)
            # No qdisc of ours there: nothing to remove (the kernel's default is unshaped).
            if r.returncode != 0 and "No such file" not in r.stderr and "Cannot find" not in r.stderr \
                    and "handle of zero" not in r.stderr:
                raise NetBedError(f"tc del on {dev} failed: {r.stderr.strip()}")
            return
        t = tbf_params(float(rate_mbit))
        _run(
            ["tc", *ns_args, "qdisc", "replace", "dev", dev, "root", "handle", handle, "tbf",
             "rate", f"{t['rate_bit']}bit", "burst", str(t["burst"]), "limit", str(t["limit"])]
        )

    def drop_inbound(self, i: int, port: int | None = None) -> None:
        """Make host i drop (silently, like a firewall) new inbound TCP connections, to `port`
        only or to any port; replies to its own outbound connections still pass. Needs iptables
        (raises NetBedError, or OSError when it is missing). Gone with the namespace."""
        rule = ["-p", "tcp", "-m", "conntrack", "--ctstate", "NEW", *(["--dport", str(port)] if port else []),
                "-j", "DROP"]
        _run(["ip", "netns", "exec", self.netns(i), "iptables", "-w", "-A", "INPUT", *rule])

    def black_hole(self, i: int) -> list[int]:
        """Make host i drop (silently) every inbound TCP packet to the ports it listens on now
        (`ss -ltn` in its namespace), on connections already established too: its listening
        ports become a black hole mid-run, while its own outbound connections (ephemeral ports)
        keep working. Returns the ports. Needs iptables and ss (NetBedError or OSError)."""
        out = subprocess.run(["ip", "netns", "exec", self.netns(i), "ss", "-ltnH"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        ports = sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.split()})
        for port in ports:
            _run(["ip", "netns", "exec", self.netns(i), "iptables", "-w", "-A", "INPUT", "-p", "tcp", "--dport",
                  str(port), "-j", "DROP"])
        return ports

    def close(self) -> None:
        """Kill the bed's processes, delete its namespaces, veths and bridge. Idempotent."""
        for proc in self._procs:
            _terminate(proc)
        self._procs.clear()
        for ns in reversed(self._namespaces):
            _kill_netns_pids(ns)
            r = _run(["ip", "netns", "del", ns], check=False)  # also deletes the veth pair
            if r.returncode != 0:
                log.warning("netbed: could not delete netns %s: %s", ns, r.stderr.strip())
        self._namespaces.clear()
        for lan in self._routes:
            _run(["ip", "route", "del", "unreachable", lan], check=False)
        self._routes.clear()
        for dst in self._core_routes:  # normally gone with the bridge
            _run(["ip", "route", "del", f"{dst}/32"], check=False)
        self._core_routes.clear()
        self._delay_proc, self._delay_buf = None, b""
        for i in range(self.n_hosts):  # normally gone with their namespace; be thorough
            vb = self.veth_bridge_side(i)
            if _run(["ip", "link", "show", vb], check=False).returncode == 0:
                _run(["ip", "link", "del", vb], check=False)
        if self._bridge_made:
            r = _run(["ip", "link", "del", self.bridge], check=False)
            if r.returncode != 0 and "Cannot find device" not in r.stderr:
                log.warning("netbed: could not delete bridge %s: %s", self.bridge, r.stderr.strip())
            self._bridge_made = False

    # --- processes ---------------------------------------------------------------------------

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host i's namespace (``ip netns exec``); keyword arguments go to
        `subprocess.Popen`. The bed owns the process: it is killed (SIGTERM, then SIGKILL after
        2 s) when the bed closes, if it is still running."""
        ns = self.core_netns if i == ROOT_CORE else self.netns(i)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], *, timeout: float = 30.0, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in host i's namespace to completion (`subprocess.run`, with a timeout)."""
        return subprocess.run(["ip", "netns", "exec", self.netns(i), *argv], timeout=timeout, **kw)


def _terminate(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=_KILL_GRACE_S)


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs in a namespace this module created."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for tok in out.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass
    deadline = time.monotonic() + _KILL_GRACE_S
    while time.monotonic() < deadline and _run(["ip", "netns", "pids", ns], check=False).stdout.strip():
        time.sleep(0.05)


def cleanup_stale(prefix: str = "shl", *, include_live: bool = False) -> list[str]:
    """Delete namespaces and links that beds with ``prefix`` left behind; return their names.

    Only objects whose creating process is gone are touched, unless ``include_live`` (then every
    bed with this prefix, including running ones, is torn down). Never raises for a missing object.
    """
    removed: list[str] = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if not include_live and _pid_alive(int(parts[1])):
            continue
        _kill_netns_pids(name)
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    out = _run(["ip", "-j", "link", "show"], check=False).stdout or "[]"
    links = json.loads(out)
    # Veths before bridges (deleting a veth removes its peer; the bridge goes last).
    links.sort(key=lambda l: (l.get("linkinfo", {}).get("info_kind") == "bridge", l.get("ifname", "")))
    for link in links:
        alias = link.get("ifalias", "")
        fields = alias.split(":")
        if len(fields) != 3 or fields[0] != _ALIAS or fields[1] != prefix or not fields[2].isdigit():
            continue
        if not include_live and _pid_alive(int(fields[2])):
            continue
        if _run(["ip", "link", "del", link["ifname"]], check=False).returncode == 0:
            removed.append(link["ifname"])
    if removed:
        log.info("netbed: removed stale %s", ", ".join(removed))
    return removed
