"""Certificates issued at join, with real processes: `shoal certs init` writes no shared peer key,
a real coordinator issues certificates at Join and renews them for members only, and a TLS swarm
runs on certificates issued and renewed at join (the handshakes in process:
tests/component/test_peer_certificates.py)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from shoal.common.certs import (PeerTLS, certificate_peer_id)
from shoal.common.identity import public_bytes
from shoal.common.security import Security, open_channel, signing_interceptors
from shoal.coordinator.ca import CertificateAuthority
from shoal.peer.dataplane import channel_options
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

from kits.certs import ca, identity as _identity, tls_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ issuing (pure)


def test_certs_init_writes_no_shared_peer_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "certs", "init", "--out", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["ca.key", "ca.pem", "coordinator.key",
                                                                 "coordinator.pem"]
    assert "peer.key" not in out.stdout


# ------------------------------------------------------------------ the data plane, real handshakes


def ca_dir(ca: CertificateAuthority, tmp_path) -> str:
    # The server needs a TLS directory to be in TLS mode; a peer's holds ca.pem only.
    d = tmp_path / "volunteer"
    d.mkdir(exist_ok=True)
    (d / "ca.pem").write_bytes(ca.ca_pem)
    return str(d)


# ------------------------------------------------------------------ over the control plane, a real coordinator


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_join_issues_and_renew_reissues_for_members_only(procs, tls_dir, tmp_path):
    _, addr = procs.coordinator("--tls-dir", str(tls_dir), "--cert-lifetime", "600", "--rounds", "1")
    sec = Security(tls_dir=ca_dir(CertificateAuthority.from_dir(tls_dir), tmp_path))
    key, pid = _identity(tmp_path, "m")
    stranger, stranger_id = _identity(tmp_path, "s")
    tls = PeerTLS(pid)
    async with open_channel(addr, sec, channel_options(), signing_interceptors(key)) as ch, \
            open_channel(addr, sec, channel_options(), signing_interceptors(stranger)) as sch:
        stub = pb_grpc.CoordinatorStub(ch)
        resp = await stub.Join(pb.JoinRequest(public_key=public_bytes(key), data_address="127.0.0.1:9",
                                              num_samples=1, tls_csr=tls.csr()), timeout=10)
        tls.install(resp.tls_certificate, resp.tls_ca)
        first = x509.load_pem_x509_certificate(resp.tls_certificate)
        assert certificate_peer_id(first) == pid
        assert 590 <= resp.tls_not_after - first.not_valid_before_utc.timestamp() - 300 <= 610
        renewed = await stub.RenewCertificate(pb.RenewCertificateRequest(peer_id=pid, tls_csr=tls.csr()), timeout=10)
        second = x509.load_pem_x509_certificate(renewed.tls_certificate)
        assert certificate_peer_id(second) == pid and second.serial_number != first.serial_number
        tls.install(renewed.tls_certificate, renewed.tls_ca)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a bad request
            await stub.RenewCertificate(pb.RenewCertificateRequest(peer_id=pid, tls_csr=b"junk"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a Join with a bad CSR is refused before it counts
            await pb_grpc.CoordinatorStub(sch).Join(pb.JoinRequest(
                public_key=public_bytes(stranger), data_address="127.0.0.1:9", num_samples=1, tls_csr=b"junk"),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:  # not a member (that join did not count): no certificate
            await pb_grpc.CoordinatorStub(sch).RenewCertificate(
                pb.RenewCertificateRequest(peer_id=stranger_id, tls_csr=PeerTLS(stranger_id).csr()), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nor for a member's id, signed by another key
            await pb_grpc.CoordinatorStub(sch).RenewCertificate(
                pb.RenewCertificateRequest(peer_id=pid, tls_csr=tls.csr()), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.integration
@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run; the outbound-only TLS swarm keeps issued certificates in the default run
@pytest.mark.timeout(660)
def test_swarm_tls_with_certificates_issued_and_renewed_at_join(tmp_path):
    """`shoal swarm --tls`: the volunteers' directory holds ca.pem only, every peer gets its
    certificate at join; with 10 s certificates they are renewed while the rounds go on."""
    import json
    import os
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    env = {**os.environ, "SHOAL_COORDINATOR_CERT_LIFETIME": "10"}
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--tls", "--peers", "3", "--rounds", "150", "--summary",
         str(summary), "--no-progress", "--workdir", str(wd)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 150 and s["digest_mismatches"] == 0 and s["peers"] == 3
    assert sorted(p.name for p in (wd / "tls-peer").iterdir()) == ["ca.pem"]
    assert not (wd / "tls" / "peer.key").exists()
    for i in range(3):
        log = (wd / f"peer-{i}.log").read_text()
        assert "data-plane certificate issued for" in log, log[-2000:]
        assert "data-plane certificate renewed" in log, log[-2000:]
