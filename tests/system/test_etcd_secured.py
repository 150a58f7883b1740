"""etcd with TLS and authentication (coordinator.etcd_store.EtcdAccess; docs/security.md,
"The store"): a real etcd (TLS only, client certificates required, authentication on; skipped when
etcd is not installed). The coordinators' store and leadership work through it with the CA, a
client certificate and a user; without TLS, without a client certificate, without a user or with
a wrong password nothing is read or written. Under -m soak a real `shoal coordinator` leads on it
and a peer trains two rounds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import grpc
import pytest

from shoal.coordinator.etcd_store import EtcdAccess, EtcdStore, EtcdTarget
from shoal.coordinator.leadership import Leadership
from shoal.coordinator.rounds import CommitRecord

from kits.etcdserver import secured_etcd_server  # noqa: F401 - the fixture
from kits.procs import finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _target(server, access) -> EtcdTarget:
    return dataclasses.replace(EtcdTarget.parse(server.url()), access=access)


async def test_the_store_and_leadership_need_tls_a_client_certificate_and_the_user(secured_etcd_server):
    server = secured_etcd_server
    target = _target(server, server.access)
    lead = Leadership(target, "127.0.0.1:7001", ttl=2.0, poll=0.05, timeout=5.0)
    try:
        await asyncio.wait_for(lead.campaign(), 20)
        store = EtcdStore(target, fence=lead.fence)
        store.save_commit(CommitRecord(0, 0, b"r", b"s0", ("p",), 0.1, 0.1))
        assert store.last_commit().state_digest == b"s0"
        store.close()
    finally:
        await lead.resign()
        await lead.close()
    a = server.access
    for why, access in (("plaintext", EtcdAccess(user=a.user, password=a.password)),
                        ("no client certificate", EtcdAccess(a.ca, user=a.user, password=a.password)),
                        ("no user", EtcdAccess(a.ca, a.cert, a.key)),
                        ("a wrong password", EtcdAccess(a.ca, a.cert, a.key, a.user, "guess"))):
        store = EtcdStore(_target(server, access), timeout=2.0)
        try:
            with pytest.raises(grpc.RpcError):
                store.last_commit()
        finally:
            store.close()


@pytest.mark.soak  # half a minute of processes; the default run keeps the store and leadership test above
def test_a_coordinator_leads_on_a_secured_etcd_and_a_peer_trains(secured_etcd_server, procs):
    server = secured_etcd_server
    a = server.access
    p, address = procs.coordinator("--state", server.url(), "--key", str(procs.workdir / "c.key"), "--rounds", "2",
                                   "--min-peers", "1", "--initial-peers", "1", "--finish-linger", "0",
                                   "--etcd-ca", a.ca, "--etcd-cert", a.cert, "--etcd-key", a.key,
                                   "--etcd-user", a.user, "--etcd-password", a.password, state="unused.db")
    peer = subprocess.Popen([sys.executable, "-m", "shoal.cli", "peer", "--coordinator", address, "--insecure",
                             "--listen", "127.0.0.1:0", "--key", str(procs.workdir / "p.key")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=procs.workdir)
    out = finish(peer, 150)
    assert peer.returncode == 0, out[-3000:] + procs.log("coordinator")[-3000:]
    done = json.loads(out.rsplit("finished: ", 1)[1].splitlines()[0])
    assert done["rounds"] == 2
    log = procs.log("coordinator")
    assert "plaintext and no authentication" not in log
