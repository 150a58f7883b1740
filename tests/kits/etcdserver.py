"""A real etcd server for tests: the `etcd` binary on free loopback ports, its data in a temporary
directory, killed at the end. Tests that use it skip with the reason when etcd is not installed
(Debian: apt-get install etcd-server; .ci/run installs it)."""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
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


def _client_certificate(tls: pathlib.Path) -> tuple[str, str]:
    """A client certificate (clientAuth) for the coordinators, signed by the CA in `tls`: (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from shoal.common import certs

    ca_key = serialization.load_pem_private_key((tls / certs.CA_KEY).read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((tls / certs.CA_CERT).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = certs._leaf_builder(ca_cert.subject, ca_key, key.public_key(), "shoal-coordinator-etcd-client",
                               x509.SubjectAlternativeName([x509.DNSName("shoal-coordinator")]),
                               [ExtendedKeyUsageOID.CLIENT_AUTH], now - datetime.timedelta(hours=1),
                               now + datetime.timedelta(days=1)).sign(ca_key, hashes.SHA256())
    (tls / "etcd-client.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tls / "etcd-client.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    return str(tls / "etcd-client.pem"), str(tls / "etcd-client.key")


class EtcdServer:
    """One etcd member on 127.0.0.1; `endpoint` is HOST:PORT of its client API.

    secured: its client API is TLS only (a server certificate of a fresh `shoal certs init` CA,
    client certificates required: etcd's --client-cert-auth) and authentication is on (user
    `shoal` with password `PASSWORD`, allowed every key; the root user exists to enable it):
    `access` is what a coordinator needs to reach it."""

    PASSWORD = "correct horse battery staple"

    def __init__(self, secured: bool = False) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not installed (apt-get install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="shoal-etcd-")
        client, peer = _port(), _port()
        self.endpoint = f"127.0.0.1:{client}"
        self.log = open(os.path.join(self.dir, "etcd.log"), "ab")
        scheme, tls_flags = "http", []
        self.access = None
        if secured:
            from shoal.common.certs import init_certs
            from shoal.coordinator.etcd_store import EtcdAccess

            paths = init_certs(pathlib.Path(self.dir) / "tls")
            cert, key = _client_certificate(paths.dir)
            scheme = "https"
            tls_flags = ["--cert-file", str(paths.coordinator_cert), "--key-file", str(paths.coordinator_key),
                         "--trusted-ca-file", str(paths.ca_cert), "--client-cert-auth"]
            self.access = EtcdAccess(str(paths.ca_cert), cert, key, "shoal", self.PASSWORD)
        self.proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", f"{scheme}://{self.endpoint}", "--advertise-client-urls",
             f"{scheme}://{self.endpoint}", *tls_flags,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait()
        if secured:
            self._enable_auth()

    def _enable_auth(self) -> None:
        """Users root (etcd needs it to turn authentication on) and shoal (every key), then auth on."""
        import grpc
        from aetcd.rpc import auth_pb2
        from aetcd.rpc import rpc_pb2 as etcd
        from aetcd.rpc import rpc_pb2_grpc as etcd_grpc

        with self.access.channel(self.endpoint) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            auth = etcd_grpc.AuthStub(channel)
            auth.UserAdd(etcd.AuthUserAddRequest(name="root", password=self.PASSWORD), timeout=10)
            auth.UserGrantRole(etcd.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
            auth.RoleAdd(etcd.AuthRoleAddRequest(name="shoal"), timeout=10)
            auth.RoleGrantPermission(etcd.AuthRoleGrantPermissionRequest(
                name="shoal", perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=b"\0",
                                                       range_end=b"\0")), timeout=10)
            auth.UserAdd(etcd.AuthUserAddRequest(name="shoal", password=self.PASSWORD), timeout=10)
            auth.UserGrantRole(etcd.AuthUserGrantRoleRequest(user="shoal", role="shoal"), timeout=10)
            auth.AuthEnable(etcd.AuthEnableRequest(), timeout=10)

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


@pytest.fixture(scope="session")
def secured_etcd_server():
    """An etcd with TLS (client certificates) and authentication on (`EtcdServer(secured=True)`)."""
    server = EtcdServer(secured=True)
    try:
        yield server
    finally:
        server.close()
