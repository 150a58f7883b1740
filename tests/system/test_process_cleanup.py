"""A run killed -9 takes its processes with it: `shoal.processes.spawn` children get SIGKILL
from the kernel when their parent dies (PR_SET_PDEATHSIG), so a test whose `shoal swarm` hit its
timeout leaves no coordinator or peer running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import pathlib, sys, time
from shoal.processes import spawn
child = spawn([sys.executable, "-c", "import time; time.sleep(120)"], pathlib.Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_spawned_child_dies_with_its_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE,
                              text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
