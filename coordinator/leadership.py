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
must stop acting as leader at once, call `step_down`, and may campaign again). While etcd is
unreachable `campaign` retries with exponential backoff (`poll` doubling up to BACKOFF_MAX), logs
one warning when it goes and one line when it is back, and keeps the `store_reachable` metric at
0; only when it has been unreachable for `unreachable_limit` seconds (the setting
`coordinator.store_unreachable_limit`; 0: no limit) does `campaign` raise StoreUnreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from aetcd.rpc import rpc_pb2 as etcd
from aetcd.rpc import rpc_pb2_grpc as etcd_grpc

from shoal.coordinator.etcd_store import EtcdTarget, Failover, token_stale

log = logging.getLogger("shoal.coordinator")

BACKOFF_MAX = 2.0  # seconds between tries of an unreachable etcd, at most


class StoreUnreachable(Exception):
    """etcd did not answer for longer than the stated limit: the process ends with this line."""


class Leadership:
    """This coordinator's candidacy for `target` (see the module docstring)."""

    def __init__(self, target: EtcdTarget, address: str, *, ttl: float = 2.0, poll: float = 0.1,
                 timeout: float = 2.0, unreachable_limit: float = 0.0, metrics=None):
        """unreachable_limit: seconds of etcd not answering after which `campaign` gives up (0:
        never). metrics: a CoordinatorMetrics whose `store_reachable` gauge this keeps."""
        self.target, self.address = target, address
        self.ttl, self.poll, self.timeout = ttl, poll, timeout
        self.unreachable_limit = unreachable_limit
        self.metrics = metrics
        self.lease_id = 0
        self.revision = 0  # create revision of the leader key while this coordinator holds it
        self.leader_address = ""  # the current leader's address as last seen ("" unknown)
        self.unreachable_since: float | None = None  # monotonic time etcd stopped answering
        self._stale_lease = 0  # the lease of a term that ended: revoked once etcd answers
        self._channels = [target.access.channel(e, aio=True) for e in target.endpoints]
        self._failover = Failover([(etcd_grpc.KVStub(c), etcd_grpc.LeaseStub(c), etcd_grpc.AuthStub(c))
                                   for c in self._channels])
        self._token = ""  # etcd's auth token for target.access.user ("" = none yet)

    async def _metadata(self, auth) -> tuple[tuple[str, str], ...] | None:
        access = self.target.access
        if not access.user:
            return None
        if not self._token:
            resp = await auth.Authenticate(etcd.AuthenticateRequest(name=access.user, password=access.password),
                                           timeout=self.timeout)
            self._token = resp.token
        return (("token", self._token),)

    async def _call(self, service: str, method: str, request):
        """One etcd call, trying the endpoints in turn while they are unavailable (Failover);
        authenticated again once when etcd refuses the token."""
        which = 0 if service == "kv" else 1

        async def attempt(stubs):
            try:
                return await getattr(stubs[which], method)(request, timeout=self.timeout,
                                                           metadata=await self._metadata(stubs[2]))
            except grpc.aio.AioRpcError as exc:
                if not (self.target.access.user and token_stale(exc)):
                    raise
                self._token = ""
                return await getattr(stubs[which], method)(request, timeout=self.timeout,
                                                           metadata=await self._metadata(stubs[2]))

        return await self._failover.acall(attempt)

    @property
    def fence(self) -> tuple[bytes, int]:
        """(leader key, create revision): what this leader's writes are conditioned on."""
        return self.target.leader_key, self.revision

    async def campaign(self) -> None:
        """Return once this coordinator leads (`revision` set); until then, stand by.

        Raises:
            StoreUnreachable: etcd did not answer for `unreachable_limit` seconds.
        """
        failures = 0
        while True:
            try:
                if await self._try_to_lead():
                    self._reachable()
                    return
                self._reachable()
                failures = 0
            except grpc.aio.AioRpcError as exc:
                failures += 1
                self._unreachable(exc)
                if "lease not found" in (exc.details() or ""):
                    self.lease_id = 0
            await asyncio.sleep(min(BACKOFF_MAX, self.poll * 2 ** min(failures, 16)) if failures else self.poll)

    async def _try_to_lead(self) -> bool:
        """One try: create the leader key with this coordinator's lease; True when it did."""
        key = self.target.leader_key
        if self._stale_lease:
            await self._revoke(self._stale_lease)  # the last term's key goes with it: no wait for its expiry
            self._stale_lease = 0
        if not self.lease_id:
            self.lease_id = (await self._call("lease", "LeaseGrant",
                                              etcd.LeaseGrantRequest(TTL=max(1, round(self.ttl))))).ID
        absent = etcd.Compare(key=key, target=etcd.Compare.VERSION, result=etcd.Compare.EQUAL, version=0)
        put = etcd.RequestOp(request_put=etcd.PutRequest(key=key, value=self.address.encode(), lease=self.lease_id))
        get = etcd.RequestOp(request_range=etcd.RangeRequest(key=key))
        resp = await self._call("kv", "Txn", etcd.TxnRequest(compare=[absent], success=[put], failure=[get]))
        if resp.succeeded:
            self.revision = resp.header.revision
            self.leader_address = self.address
            log.info("elected leader of %s (fence revision %d)", self.target.prefix, self.revision)
            return True
        kvs = resp.responses[0].response_range.kvs
        leader = kvs[0].value.decode() if kvs else ""
        if leader != self.leader_address:
            log.info("standing by: the leader of %s is %s", self.target.prefix, leader or "unknown")
        self.leader_address = leader
        # Keep this standby's own lease alive while it waits (it attaches it when it runs).
        if not await self._renew():
            log.info("this standby's etcd lease expired; it takes a new one")
        return False

    def _unreachable(self, exc: grpc.aio.AioRpcError) -> None:
        """Count an etcd call that failed; StoreUnreachable past the limit."""
        now = time.monotonic()
        if self.unreachable_since is None:
            self.unreachable_since = now
            log.warning("etcd %s unreachable (%s %s): retrying with backoff up to %.0f s%s",
                        ",".join(self.target.endpoints), exc.code().name, exc.details(), BACKOFF_MAX,
                        f", for at most {self.unreachable_limit:.0f} s (coordinator.store_unreachable_limit)"
                        if self.unreachable_limit > 0 else "")
            if self.metrics is not None:
                self.metrics.on_store(reachable=False)
        elif self.unreachable_limit > 0 and now - self.unreachable_since >= self.unreachable_limit:
            raise StoreUnreachable(f"etcd {','.join(self.target.endpoints)} unreachable for "
                                   f"{now - self.unreachable_since:.0f} s, more than "
                                   f"coordinator.store_unreachable_limit ({self.unreachable_limit:.0f} s)")

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.warning("etcd %s reachable again after %.1f s", ",".join(self.target.endpoints),
                        time.monotonic() - self.unreachable_since)
            self.unreachable_since = None
        if self.metrics is not None:
            self.metrics.on_store(reachable=True)

    def step_down(self) -> None:
        """Stop leading (the lease could not be renewed, or a fenced write failed): forget this
        term's lease and fence; `campaign` revokes the lease once etcd answers, so the leader key
        goes with it at once, and campaigns again."""
        if self.revision:
            log.warning("stepped down as leader of %s; standing by", self.target.prefix)
        self._stale_lease = self.lease_id or self._stale_lease
        self.lease_id = self.revision = 0
        self.leader_address = ""

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease", "LeaseRevoke", etcd.LeaseRevokeRequest(ID=lease_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            # NOT_FOUND: it expired already

    async def _renew(self) -> bool:
        """Renew the lease once; False when etcd no longer knows it (expired)."""
        stubs = self._failover.current
        call = stubs[1].LeaseKeepAlive(timeout=self.timeout, metadata=await self._metadata(stubs[2]))
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
                self._reachable()
                deadline = time.monotonic() + self.ttl
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                if self.unreachable_since is None and isinstance(exc, grpc.aio.AioRpcError):
                    self._unreachable(exc)  # the first failure: a line and the metric, never the limit
                if time.monotonic() >= deadline:
                    log.error("leadership of %s lost: etcd unreachable for the whole lease (%s)",
                              self.target.prefix, type(exc).__name__)
                    return

    async def resign(self) -> None:
        """Give leadership up at once (orderly shutdown): revoke the lease, the key goes with it."""
        for lease in {self.lease_id, self._stale_lease} - {0}:
            try:
                await self._call("lease", "LeaseRevoke", etcd.LeaseRevokeRequest(ID=lease))
            except grpc.aio.AioRpcError:
                pass  # it expires by itself
        self.lease_id = self._stale_lease = 0

    async def close(self) -> None:
        for c in self._channels:
            await c.close()
