"""Real OS processes for tests: start, wait for readiness, always kill (process groups)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

from shoal.processes import ProcessGroup


class Procs(ProcessGroup):
    """Processes started by one test (shoal.processes.ProcessGroup: each in its own process group,
    logs `<workdir>/<name>.log`, run in the workdir); `close()` kills every one of them (SIGKILL
    to the group) and removes the shared-memory slabs of peers it killed."""

    def __init__(self, workdir: pathlib.Path):
        super().__init__(workdir, cwd=workdir, clean_slabs=True)

    def wait_file(self, path: pathlib.Path, timeout: float, proc: subprocess.Popen | None = None) -> str:
        end = time.monotonic() + timeout
        while not path.exists() or not path.read_text().strip():
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited {proc.returncode}:\n{self.log(proc.name)[-3000:]}")  # type: ignore[attr-defined]
            if time.monotonic() > end:
                raise TimeoutError(f"{path} did not appear within {timeout}s")
            time.sleep(0.05)
        return path.read_text().strip()

    def wait_for(self, what: str, check, timeout: float, *, every: float = 0.1, tail: int = 2000):
        """Poll `check()` every `every` seconds until it returns something true (returned); after
        `timeout` seconds raise AssertionError naming `what`, with the last `tail` characters of
        every process's log."""
        end = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not within {timeout}s\n" + "\n".join(
                    f"--- {p.name}\n{self.log(p.name)[-tail:]}" for p in self.procs))  # type: ignore[attr-defined]
            time.sleep(every)

    def wait_exit(self, p: subprocess.Popen, timeout: float) -> int:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{p.name} still running after {timeout}s:\n{self.log(p.name)[-3000:]}") from None  # type: ignore[attr-defined]

    async def wait_exit_async(self, p: subprocess.Popen, timeout: float) -> int:
        """`wait_exit` for async tests, on a worker thread: the test's event loop keeps serving
        what runs on it (an in-process peer's data plane the processes still talk to)."""
        return await asyncio.to_thread(self.wait_exit, p, timeout)

    def coordinator(self, *flags: str, name: str = "coordinator", state: str = "coordinator.db",
                    listen: str = "127.0.0.1:0") -> tuple[subprocess.Popen, str]:
        ready = self.workdir / f"{name}.addr"
        ready.unlink(missing_ok=True)
        if "--tls-dir" not in flags and "--insecure" not in flags:
            flags = ("--insecure", *flags)  # plaintext must be asked for explicitly
        if "--finish-linger" not in flags:
            flags = ("--finish-linger", "600", *flags)  # tests look at a finished run: it stays to answer
        p = self.start(name, [sys.executable, "-m", "shoal.cli", "coordinator", "--listen", listen,
                              "--state", str(self.workdir / state), "--ready-file", str(ready), *flags])
        return p, self.wait_file(ready, 30, p)


TERM_GRACE_S = 30.0  # SIGTERM -> SIGKILL for a command past its timeout (`run_to_end`)


def run_to_end(argv: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw) for a command
    that starts processes of its own (`shoal swarm`, `shoal bench`, an example): past `timeout`
    it gets SIGTERM first, as a supervisor sends it, so that it stops what it started (each in
    its own process group, out of reach of a kill of the command alone), then SIGKILL after
    TERM_GRACE_S seconds; subprocess.TimeoutExpired is raised either way. Keywords go to
    subprocess.Popen (cwd, env)."""
    kw.pop("capture_output", None)
    kw.pop("text", None)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """`proc`'s output once it exited within `timeout` seconds; killed (and reaped) otherwise, or
    when waiting fails, and the error raised."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return out


def scenario_swarm(tmp_path: pathlib.Path, scenario: pathlib.Path, *args: str) -> tuple[dict, pathlib.Path]:
    """Run `shoal swarm --scenario scenario *args` in a subprocess (killed on a timeout or a
    failure), assert it exited 0 and left no network namespace behind; returns (summary, workdir)."""
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "swarm", "--scenario", str(scenario), "--summary", str(summary),
         "--workdir", str(wd), "--no-progress", "--timeout", "400", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = finish(proc, 540)
    assert proc.returncode == 0, out[-3000:]
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert f"shls-{proc.pid}-" not in leftovers
    return json.loads(summary.read_text()), wd
