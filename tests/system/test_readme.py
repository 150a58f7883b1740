"""README, "Running it for real": the commands exactly as written, on one machine.

The bash block is read from README.md (so the README stays true) and run line by line in a fresh
directory, with the two substitutions a reader makes on one machine: `coord.example.org` becomes
127.0.0.1, and the example ports 7070-7073 become free ports (other tests may hold those).
Lines ending in `&` are started in the background as they are; `shoal status` is run (as written)
while the swarm trains. Must show: a coordinator and 3 peers, TLS on both planes (a volunteer's
directory holds only ca.pem; each peer gets its certificate at join), 20 rounds committed, and
`shoal status` answers.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from kits.readme import readme_commands

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN_SECONDS = 600.0  # the whole run, generous for a loaded machine (it takes ~30 s on a quiet one)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_readme_block_is_what_this_test_expects():
    cmds = readme_commands("Running it for real")
    assert len([c for c in cmds if c.endswith("&") and " peer " in c]) == 3, cmds
    assert sum(c.startswith("shoal coordinator") for c in cmds) == 1
    assert any(c.startswith("shoal certs init") for c in cmds)
    assert any(c.startswith("shoal status") for c in cmds)
    assert all("--insecure" not in c for c in cmds)  # TLS on both planes
    assert "--rounds 20" in next(c for c in cmds if c.startswith("shoal coordinator"))


def test_readme_runs_as_written_on_one_machine(procs, tmp_path):
    ports = dict(zip(("7070", "7071", "7072", "7073"), map(str, _free_ports(4))))

    def local(cmd: str) -> str:
        cmd = cmd.replace("coord.example.org", "127.0.0.1")
        return re.sub(r":(707[0-3])\b", lambda m: ":" + ports[m.group(1)], cmd)

    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SHOAL_JOIN_TOKEN", None)
    background: list[subprocess.Popen] = []
    status_cmd = ""
    for i, cmd in enumerate(readme_commands("Running it for real")):
        cmd = local(cmd)
        if cmd.startswith("shoal status"):
            status_cmd = cmd
            continue
        if cmd.endswith("&"):
            name = f"bg-{i}"
            with open(tmp_path / f"{name}.log", "wb") as log:
                p = subprocess.Popen(["bash", "-c", cmd[:-1]], cwd=tmp_path, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            p.name = name  # type: ignore[attr-defined]
            procs.procs.append(p)  # killed at teardown
            background.append(p)
            continue
        done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (cmd, done.stdout, done.stderr)
    assert status_cmd and len(background) == 4
    # What the operator handed out: no shared peer key anywhere; a volunteer's directory holds ca.pem only.
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["ca.key", "ca.pem", "coordinator.key",
                                                                    "coordinator.pem"]
    for v in ("alice", "bob", "carol"):
        assert sorted(p.name for p in (tmp_path / v).iterdir()) == ["ca.pem"]

    # `shoal status` as written, while the swarm trains, until it shows 3 members and 20 commits.
    seen_members = committed = 0
    end = time.monotonic() + RUN_SECONDS
    last = None
    while time.monotonic() < end and committed < 20:
        last = subprocess.run(["bash", "-c", status_cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        if last.returncode == 0:
            m = re.search(r"members \((\d+)\)", last.stdout)
            seen_members = max(seen_members, int(m.group(1)) if m else 0)
            c = re.search(r"committed (\d+)", last.stdout)
            committed = int(c.group(1)) if c else 0
        if any(p.poll() not in (None, 0) for p in background):
            break
        time.sleep(1.0)
    logs = {p.name: procs.log(p.name) for p in background}  # type: ignore[attr-defined]
    assert committed >= 20, (last.stdout if last else "", last.stderr if last else "", logs)
    assert seen_members == 3, (seen_members, logs)
    # Every process ends by itself: the run finished (20 rounds), peers leave, the coordinator exits 0.
    for p in background:
        assert procs.wait_exit(p, 180) == 0, procs.log(p.name)  # type: ignore[attr-defined]
    peer_logs = [procs.log(p.name) for p in background if " peer " in p.args[2]]  # type: ignore[attr-defined]
    assert len(peer_logs) == 3
    for log in peer_logs:
        assert "data-plane certificate issued for" in log, log[-3000:]
        assert '"rounds": 20' in log, log[-3000:]
