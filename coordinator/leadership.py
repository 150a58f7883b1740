"""Leader election among coordinators that share one etcd prefix (`--state etcd://...`).

Each coordinator grants itself an etcd lease of `ttl` seconds and keeps it alive; the leader is
the one that created `PREFIX/leader` (value: its gRPC address) with its lease attached. Creating
is one transaction that succeeds only while the key does not exist, so at most one coordinator
holds it; the key's create revision is the leader's *fence*: every write of its store compares
it (`coordinator.etcd_store`), so once its lease has expired (its process stalled, its network
was cut) it can write nothing, even if it still believes it leads.

A standby polls the key every `poll` seconds and campaigns as soon as it is gone (the old
leader's lease expired: within `ttl` seconds of its death, or at once when it resigned). etcd
grants leases of at least 2 s (its minimum with the default election timeout) and expires them
within ~0.5 s after that, so a standby leads ~2.1-2.6 s after the leader died; peers then
reconnect (their backoff: up to 2 s) and the first round waits for them (docs/fault-tolerance.md,
"Standby coordinators").

Failure semantics: `campaign` waits (for ever, until cancelled) for leadership and answers the
current leader's address meanwhile (`leader_address`). `keep` renews the lease every `ttl / 3`
seconds and returns when it could not renew it before it expired (leadership lost: the caller
must stop acting as leader at once). etcd calls that fail (etcd unreachable) are retried until
the lease would have expired.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from aetcd.rpc import rpc_pb2 as etcd
from aetcd.rpc import rpc_pb2_grpc as etcd_grpc

from shoal.coordinator.etcd_store import EtcdTarget

log = logging.getLogger("shoal.coordinator")


class Leadership:
    """This coordinator's candidacy for `target` (see the module docstring)."""

    def __init__(self, target: EtcdTarget, address: str, *, ttl: float = 2.0, poll: float = 0.1,
                 timeout: float = 2.0):
        self.target, self.address = target, address
        self.ttl, self.poll, self.timeout = ttl, poll, timeout
        self.lease_id = 0
        self.revision = 0  # create revision of the leader key while this coordinator holds it
        self.leader_address = ""  # the current leader's address as last seen ("" unknown)
        self._channels = [grpc.aio.insecure_channel(e) for e in target.endpoints]
        self._at = 0

    async def _call(self, service: str, method: str, request):
        """One etcd call, trying the endpoints in turn while they are unavailable."""
        last: grpc.aio.AioRpcError | None = None
        for i in range(len(self._channels)):
            k = (self._at + i) % len(self._channels)
            stub = (etcd_grpc.KVStub if service == "kv" else etcd_grpc.LeaseStub)(self._channels[k])
            try:
                resp = await getattr(stub, method)(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = exc
                continue
            self._at = k
            return resp
        assert last is not None
        raise last

    @property
    def fence(self) -> tuple[bytes, int]:
        """(leader key, create revision): what this leader's writes are conditioned on."""
        return self.target.leader_key, self.revision

    async def campaign(self) -> None:
        """Return once this coordinator leads (`revision` set); until then, stand by."""
        key = self.target.leader_key
        while True:
            try:
                if not self.lease_id:
                    self.lease_id = (await self._call("lease", "LeaseGrant",
                                                      etcd.LeaseGrantRequest(TTL=max(1, round(self.ttl))))).ID
                absent = etcd.Compare(key=key, target=etcd.Compare.VERSION, result=etcd.Compare.EQUAL, version=0)
                put = etcd.RequestOp(request_put=etcd.PutRequest(key=key, value=self.address.encode(),
                                                                  lease=self.lease_id))
                get = etcd.RequestOp(request_range=etcd.RangeRequest(key=key))
                resp = await self._call("kv", "Txn", etcd.TxnRequest(compare=[absent], success=[put], failure=[get]))
                if resp.succeeded:
                    self.revision = resp.header.revision
                    self.leader_address = self.address
                    log.info("elected leader of %s (fence revision %d)", self.target.prefix, self.revision)
                    return
                kvs = resp.responses[0].response_range.kvs
                leader = kvs[0].value.decode() if kvs else ""
                if leader != self.leader_address:
                    log.info("standing by: the leader of %s is %s", self.target.prefix, leader or "unknown")
                self.leader_address = leader
                # Keep this standby's own lease alive while it waits (it attaches it when it runs).
                await self._renew()
            except grpc.aio.AioRpcError as exc:
                log.warning("etcd %s: %s %s; retrying", ",".join(self.target.endpoints), exc.code().name,
                            exc.details())
                if "lease not found" in (exc.details() or ""):
                    self.lease_id = 0
            await asyncio.sleep(self.poll)

    async def _renew(self) -> bool:
        """Renew the lease once; False when etcd no longer knows it (expired)."""
        stub = etcd_grpc.LeaseStub(self._channels[self._at])
        call = stub.LeaseKeepAlive(timeout=self.timeout)
        try:
            await call.write(etcd.LeaseKeepAliveRequest(ID=self.lease_id))
            resp = await call.read()
        finally:
            call.cancel()
        if resp is grpc.aio.EOF or resp.TTL <= 0:
            self.lease_id = 0
            return False
        return True

    async def keep(self) -> None:
        """Renew the lease every ttl/3 s; return when leadership is lost (the lease expired or
        could not be renewed before it would)."""
        deadline = time.monotonic() + self.ttl
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                if not await self._renew():
                    log.error("leadership of %s lost: the lease expired", self.target.prefix)
                    return
                deadline = time.monotonic() + self.ttl
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    log.error("leadership of %s lost: etcd unreachable for the whole lease (%s)",
                              self.target.prefix, type(exc).__name__)
                    return

    async def resign(self) -> None:
        """Give leadership up at once (orderly shutdown): revoke the lease, the key goes with it."""
        if self.lease_id:
            try:
                await self._call("lease", "LeaseRevoke", etcd.LeaseRevokeRequest(ID=self.lease_id))
            except grpc.aio.AioRpcError:
                pass  # it expires by itself
            self.lease_id = 0

    async def close(self) -> None:
        for c in self._channels:
            await c.close()
