"""A real etcd server for tests: the `etcd` binary on free loopback ports, its data in a temporary
directory, killed at the end. Tests that use it skip with the reason when etcd is not installed
(Debian: apt-get install etcd-server; .ci/run installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

import pytest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member on 127.0.0.1; `endpoint` is HOST:PORT of its client API."""

    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not installed (apt-get install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="shoal-etcd-")
        client, peer = _port(), _port()
        self.endpoint = f"127.0.0.1:{client}"
        self.log = open(os.path.join(self.dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait()

    def _wait(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        host, port = self.endpoint.split(":")
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.2):
                return
            time.sleep(0.05)
        raise TimeoutError("etcd did not start")

    def url(self, prefix: str | None = None) -> str:
        """An etcd:// state URL with a fresh prefix (one per test, so tests never share state)."""
        return f"etcd://{self.endpoint}/{prefix or 'shoal-test-' + uuid.uuid4().hex[:8]}"

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server():
    server = EtcdServer()
    try:
        yield server
    finally:
        server.close()
