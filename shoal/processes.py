"""OS processes of a local run (the swarm, the benchmarks, the tests): each in a process group
of its own, its output in a log file, always stopped.

`Process` is one named process that can be started again (the swarm restarts peers and
coordinators on the same argv); `ProcessGroup` holds the processes of one run and `close` kills
every group (SIGCONT first, so a stopped process dies too) and reaps them. A process group is
the unit of signalling: `ip netns exec`, `python -m` and their children stop together.

Failure semantics: starting raises OSError when the program cannot be executed; waiting helpers
raise RuntimeError (the process exited first, its log's tail in the message) or TimeoutError;
`stop`, `kill` and `close` never raise for a process that is already gone.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group of `p` (its own: started with start_new_session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


def tail(path: pathlib.Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def spawn(argv: list[str], log_path: pathlib.Path, *, env: dict[str, str] | None = None, cwd: str | None = None,
          nice: int = 0, popen: Callable[..., subprocess.Popen] = subprocess.Popen, mode: str = "ab") -> subprocess.Popen:
    """Start `argv` in a new session (its own process group), stdin closed, stdout and stderr
    appended to `log_path` (`mode` "wb": truncated first). `env`: the whole environment (None:
    this process's). `popen`: how to start it (a network bed's `popen` runs it in a namespace)."""
    out = open(log_path, mode)
    try:
        return popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                     start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    finally:
        out.close()


@dataclass
class Process:
    """One named process that may be started several times on the same argv (a restart)."""

    name: str
    argv: list[str]
    log_path: pathlib.Path
    popen: subprocess.Popen | None = None
    starts: int = 0

    env: dict[str, str] | None = None  # extra environment (scenario faults and hooks)
    netns: str | None = None  # run inside this network namespace (`ip netns exec` execs the command)
    first_started: float | None = None  # wall time (time.time) of the first start

    def start(self) -> None:
        env = {**os.environ, **self.env} if self.env else None
        argv = ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv
        self.popen = spawn(argv, self.log_path, env=env)
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
            signal_group(self.popen, sig)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM (after SIGCONT), SIGKILL after `grace` seconds; reaped."""
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
        return tail(self.log_path, n)


class ProcessGroup:
    """The processes of one run, each in its own process group with its log `<workdir>/<name>.log`;
    `close()` kills every one of them (SIGKILL to the group) and reaps them.

    cwd / env: the working directory and extra environment of every process (None: this
    process's). clean_slabs: `close` also removes the shared-memory slabs of peers it killed
    (their identity keys are under the workdir)."""

    def __init__(self, workdir: pathlib.Path, *, cwd: str | pathlib.Path | None = None,
                 env: dict[str, str] | None = None, clean_slabs: bool = False):
        self.workdir = pathlib.Path(workdir)
        self.cwd, self.env, self.clean_slabs = cwd, env, clean_slabs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, nice: int = 0,
              popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> subprocess.Popen:
        """Start `argv` as `name` (`p.name`); `env` adds to the group's environment."""
        extra = {**(self.env or {}), **(env or {})}
        p = spawn(argv, self.workdir / f"{name}.log", env={**os.environ, **extra} if extra else None,
                  cwd=None if self.cwd is None else str(self.cwd), nice=nice, popen=popen)
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def log(self, name: str, chars: int | None = None) -> str:
        """The log of `name` (its last `chars` characters when given; "" when it has none)."""
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-chars:] if chars else text

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        signal_group(p, sig)

    def wait_ok(self, p: subprocess.Popen, deadline: float) -> None:
        """Wait for `p` until `deadline` (time.monotonic); RuntimeError when it is still running
        then or exits non-zero (its log's tail in the message)."""
        name = getattr(p, "name", str(p.pid))
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} still running at the deadline:\n{self.log(name, 3000)}") from None
        if rc != 0:
            raise RuntimeError(f"{name} exited {rc}:\n{self.log(name, 3000)}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.kill(p, signal.SIGCONT)
                self.kill(p)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        if self.clean_slabs:
            from shoal.peer.lanes.shm import remove_stale_of_keys

            remove_stale_of_keys(self.workdir, recursive=True)
