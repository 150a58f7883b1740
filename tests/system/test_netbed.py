"""NetBed: namespaces joined by a bridge, tbf-shaped links measured with real TCP, clean exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kits.requires import needs_iptables

from shoal.testbeds.netbed import NetBed, cleanup_stale

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

PREFIX = "shlt"

# Receiver: accepts one connection, ignores the first `warmup` seconds (slow start, the token
# bucket's initial burst), then reports the goodput until the sender closes.
RECEIVER = r"""
import json, socket, sys, time
host, port, warmup = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(10)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(10)
start = time.monotonic(); t0 = None; n = 0
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    now = time.monotonic()
    if now - start >= warmup:
        if t0 is None:
            t0 = now
        else:
            n += len(data)
t1 = time.monotonic()
print(json.dumps({"bytes": n, "seconds": t1 - t0, "mbit": n * 8 / (t1 - t0) / 1e6}), flush=True)
"""

SENDER = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf = b"x" * 65536
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(buf)
conn.close()
"""


def _measure(bed: NetBed, src: int, dst: int, seconds: float = 2.5, port: int = 5201) -> float:
    """Goodput in Mbit/s of one TCP stream from host `src` to host `dst`."""
    recv = bed.popen(dst, [sys.executable, "-c", RECEIVER, bed.host_ip(dst), str(port), "0.5"],
                     stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    assert recv.stdout.readline().strip() == "ready"
    send = bed.popen(src, [sys.executable, "-c", SENDER, bed.host_ip(dst), str(port), str(seconds)])
    out, _ = recv.communicate(timeout=seconds + 15)
    assert send.wait(timeout=10) == 0
    return json.loads(out)["mbit"]


def _leftovers(prefix: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    found = [l.split()[0] for l in ns.splitlines() if l.startswith(f"{prefix}-")]
    found += [l.split(":")[1].strip().split("@")[0] for l in links.splitlines()
              if l.split(":")[1].strip().startswith(prefix)]
    return found


@pytest.fixture(autouse=True)
def _no_leftovers():
    cleanup_stale(PREFIX)
    yield
    assert _leftovers(PREFIX) == []


def test_shaped_rate_and_cleanup() -> None:
    with NetBed(2, [20, 20], [20, 20], prefix=PREFIX) as bed:
        assert bed.host_ip(0) != bed.host_ip(1)
        assert bed.root_ip.endswith(".254")
        mbit = _measure(bed, 0, 1)
        assert 0.7 * 20 <= mbit <= 1.15 * 20, mbit
        names = [bed.netns(0), bed.netns(1), bed.bridge]
        assert all(n in _leftovers(PREFIX) for n in names)
    assert _leftovers(PREFIX) == []


def test_upload_and_download_shaped_separately() -> None:
    # host 0 uploads at 10, host 2 downloads at 30: 0→1 is limited by the upload, 1→2 by the
    # download, and 2→0 by nothing we set.
    with NetBed(3, [10, None, None], [None, None, 30], prefix=PREFIX) as bed:
        assert 7 <= _measure(bed, 0, 1, seconds=2.0) <= 11.5
        assert 21 <= _measure(bed, 1, 2, seconds=2.0, port=5202) <= 34.5
        assert _measure(bed, 2, 0, seconds=1.5, port=5203) > 60


def _root_qdisc(bed: NetBed, i: int) -> tuple[str, str]:
    """(handle, rate) of host i's upload and download root qdiscs, e.g. ("1:", "10Mbit")."""
    up = subprocess.run(["ip", "netns", "exec", bed.netns(i), "tc", "qdisc", "show", "dev", "eth0"],
                        capture_output=True, text=True, check=True).stdout.split()
    down = subprocess.run(["tc", "qdisc", "show", "dev", bed.veth_bridge_side(i)],
                          capture_output=True, text=True, check=True).stdout.split()
    return (up[2], up[up.index("rate") + 1]) if "rate" in up else (up[2], ""), \
        (down[2], down[down.index("rate") + 1]) if "rate" in down else (down[2], "")


def test_a_new_rate_is_a_new_qdisc_and_the_link_keeps_its_new_rate() -> None:
    # Changing a busy tbf in place stalled it for good on this machine's kernel (NetBed.shape):
    # every shape is a fresh qdisc under another handle, and the link carries the new rate.
    with NetBed(2, [50, None], [50, None], prefix=PREFIX) as bed:
        (h0, _), _ = _root_qdisc(bed, 0)
        bed.shape(0, 10, 10)
        (h1, up), (d1, down) = _root_qdisc(bed, 0)
        assert h1 != h0 and up == down == "10Mbit" and d1 == h1
        assert 7 <= _measure(bed, 0, 1, seconds=2.0, port=5205) <= 11.5
        bed.shape(0, 20, None)
        (h2, up), (_, down) = _root_qdisc(bed, 0)
        assert h2 != h1 and up == "20Mbit" and down == ""


def test_root_namespace_reaches_hosts() -> None:
    with NetBed(1, prefix=PREFIX) as bed:
        srv = bed.popen(0, [sys.executable, "-c", RECEIVER, bed.host_ip(0), "5204", "0"],
                        stdout=subprocess.PIPE, text=True)
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        send = subprocess.run([sys.executable, "-c", SENDER, bed.host_ip(0), "5204", "0.3"], timeout=15)
        assert send.returncode == 0
        out, _ = srv.communicate(timeout=15)
        assert json.loads(out)["bytes"] > 0


def test_cleanup_on_exception_and_killed_processes() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetBed(2, [5, None], [None, 5], prefix=PREFIX) as bed:
            sleeper = bed.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None  # killed by the bed
    assert _leftovers(PREFIX) == []


def test_cleanup_stale_removes_dead_runs_only() -> None:
    live = NetBed(1, prefix=PREFIX).__enter__()
    try:
        # Pretend a killed run (pid that cannot exist) left a namespace and a bridge behind.
        ghost_ns = f"{PREFIX}-999999999-dead-0"
        subprocess.run(["ip", "netns", "add", ghost_ns], check=True, timeout=10)
        subprocess.run(["ip", "link", "add", f"{PREFIX}deadbr", "type", "bridge"], check=True, timeout=10)
        subprocess.run(["ip", "link", "set", f"{PREFIX}deadbr", "alias", f"shoal-netbed:{PREFIX}:999999999"],
                       check=True, timeout=10)
        removed = cleanup_stale(PREFIX)
        assert sorted(removed) == sorted([ghost_ns, f"{PREFIX}deadbr"])
        assert live.netns(0) in _leftovers(PREFIX)  # the live bed is untouched
    finally:
        live.close()


# Dials HOST:PORT once: prints "ok" (connected and exchanged a line) or the error's name.
DIAL = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.sendall(b"hi\n"); c.settimeout(5); print("ok" if c.recv(16) == b"hi\n" else "bad", flush=True)
except OSError as exc:
    print(type(exc).__name__, flush=True)
"""

# Echoes one line per connection for every connection it accepts, until killed.
ECHO = r"""
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(8)
print("ready", flush=True)
def serve(c):
    with c:
        while (line := c.recv(64)):
            c.sendall(line)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


def _echo(bed: NetBed, host: int | None, port: int) -> subprocess.Popen:
    """An echo server on host `host` (None: the root namespace, on bed.root_ip)."""
    argv = [sys.executable, "-c", ECHO, bed.root_ip if host is None else bed.host_ip(host), str(port)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) if host is None else \
        bed.popen(host, argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _dial(bed: NetBed, src: int | None, addr: str, port: int, timeout: float = 3.0) -> str:
    argv = [sys.executable, "-c", DIAL, addr, str(port), str(timeout)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=30) if src is None else \
        bed.run(src, argv, capture_output=True, text=True, timeout=30)
    return run.stdout.strip()


@needs_iptables
def test_a_nat_host_dials_out_and_nobody_dials_it() -> None:
    root_echo = None
    with NetBed(3, nat=[False, True, True], prefix=PREFIX) as bed:
        try:
            root_echo = _echo(bed, None, 5210)
            _echo(bed, 0, 5211)
            _echo(bed, 1, 5212)
            _echo(bed, 2, 5213)
            assert bed.public_ip(1) != bed.host_ip(1)
            # Out: to the coordinator's namespace, to a public host and to another NAT host's
            # router (whose port is closed to inbound connections).
            assert _dial(bed, 1, bed.root_ip, 5210) == "ok"
            assert _dial(bed, 1, bed.host_ip(0), 5211) == "ok"
            # In: neither its private address (no route) nor its router's public one (dropped).
            assert _dial(bed, None, bed.host_ip(1), 5212) != "ok"
            assert _dial(bed, 0, bed.host_ip(1), 5212) != "ok"
            assert _dial(bed, 0, bed.public_ip(1), 5212, timeout=1.5) == "TimeoutError"
            assert _dial(bed, 2, bed.public_ip(1), 5212, timeout=1.5) == "TimeoutError"
            assert _dial(bed, 0, bed.host_ip(2), 5213) != "ok"
        finally:
            if root_echo is not None:
                root_echo.kill()
                root_echo.wait(timeout=10)


# Holds one connection open: prints "up" once a line came back, then, each time it is told
# (a line on stdin), sends another and prints "ok" or the error's name.
HOLD = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.sendall(b"a\n"); c.recv(16); print("up", flush=True)
for _ in sys.stdin:
    try:
        c.settimeout(3); c.sendall(b"b\n"); print("ok" if c.recv(16) else "closed", flush=True)
    except OSError as exc:
        print(type(exc).__name__, flush=True)
"""


@needs_iptables
def test_nat_rebind_breaks_open_connections_and_new_dials_work() -> None:
    with NetBed(2, nat=[False, True], prefix=PREFIX) as bed:
        _echo(bed, 0, 5220)
        hold = bed.popen(1, [sys.executable, "-c", HOLD, bed.host_ip(0), "5220"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        assert hold.stdin is not None and hold.stdout is not None
        assert hold.stdout.readline().strip() == "up"
        hold.stdin.write("\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == "ok"
        before = bed.public_ip(1)
        assert bed.nat_rebind(1) != before
        hold.stdin.write("\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() != "ok"  # the old mapping is gone
        assert _dial(bed, 1, bed.host_ip(0), 5220) == "ok"  # a new connection goes out


@needs_iptables
def test_a_nat_host_is_shaped_like_any_other() -> None:
    with NetBed(2, [None, 20], [None, None], nat=[False, True], prefix=PREFIX) as bed:
        assert 0.7 * 20 <= _measure(bed, 1, 0, seconds=2.0, port=5230) <= 1.15 * 20
        bed.shape(1, 10, None)  # a shape event on a NATed peer, while the bed runs
        assert 0.7 * 10 <= _measure(bed, 1, 0, seconds=2.0, port=5231) <= 1.15 * 10


def test_hosts_take_the_congestion_control_asked_for() -> None:
    """Every host's new connections use the bed's `tcp_congestion` (checked on a live socket in
    the namespace); a name the kernel lacks is refused before anything is left behind."""
    probe = ("import socket; s = socket.socket(); "
             "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b'\\0').decode())")
    for cc in ("reno", "cubic"):
        with NetBed(2, [100, None], [100, None], prefix=PREFIX, tcp_congestion=cc) as bed:
            assert [bed.run(i, [sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() for i in range(2)] == [cc, cc]
    with pytest.raises(Exception, match="tcp_congestion: the kernel has no 'nosuch'"):
        with NetBed(1, prefix=PREFIX, tcp_congestion="nosuch"):
            pass
    with pytest.raises(ValueError, match="tcp_congestion"):
        NetBed(1, prefix=PREFIX, tcp_congestion="cubic; reboot")
    assert _leftovers(PREFIX) == []
