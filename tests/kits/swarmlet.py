"""An in-process swarm of data planes for collective tests: real gRPC on loopback, real
identities and tickets, no coordinator (the test builds the plan)."""

from __future__ import annotations

import asyncio

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.plan import Plan
from shoal.peer.collectives import all_reduce
from shoal.peer.dataplane import Inbox, PeerService, Session, Transport
from shoal.peer.lanes.bulk import BulkServer
from shoal.common.identity import peer_id_of, public_bytes
from shoal.common.tickets import issue_ticket, verify_ticket
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc


class Swarmlet:
    """p peers' data planes on loopback in this event loop, secured as in production: each peer
    has an Ed25519 identity and signs its streams, and a coordinator key signs round tickets.
    `shared[i]`: whether peer i takes the shared-memory lane (default: all do); `tcp[i]`: whether
    it listens on and sends through the bulk lane (peer.lanes.bulk; default: none does)."""

    def __init__(self, p: int, shared: list[bool] | None = None, tcp: list[bool] | None = None):
        self.p = p
        self.shared = shared if shared is not None else [True] * p
        self.tcp = tcp if tcp is not None else [False] * p
        self.coordinator_key = Ed25519PrivateKey.generate()
        self.keys = [Ed25519PrivateKey.generate() for _ in range(p)]
        self.ids = [peer_id_of(public_bytes(k)) for k in self.keys]

    def session(self, attempt: int, outbound_only=(), collective: str = "") -> Session:
        pub = public_bytes(self.coordinator_key)

        def check(ticket: bytes, sender: str) -> None:
            verify_ticket(pub, ticket, round=0, attempt=attempt, sender=sender)

        return Session(0, attempt, frozenset(self.ids), pb.FLOAT32, check,
                       outbound_only=frozenset(self.ids[i] for i in outbound_only), collective=collective)

    async def __aenter__(self):
        self.servers, self.services, self.inboxes, self.addresses, self.transports = [], [], [], [], []
        for i in range(self.p):
            inbox = Inbox()
            server = grpc.aio.server()
            service = PeerService(inbox, coordinator_public_key=public_bytes(self.coordinator_key),
                                  shared_memory=self.shared[i], key=self.keys[i])
            pb_grpc.add_PeerServicer_to_server(service, server)
            port = server.add_insecure_port("127.0.0.1:0")
            if self.tcp[i]:
                service.bulk = BulkServer(service)
                await service.bulk.start("127.0.0.1")
            await server.start()
            self.servers.append(server)
            self.services.append(service)
            self.inboxes.append(inbox)
            self.addresses.append(f"127.0.0.1:{port}")
            self.transports.append(Transport(key=self.keys[i], shared_memory=self.shared[i], tcp_lane=self.tcp[i]))
        return self

    async def __aexit__(self, *exc):
        for t in self.transports:
            await t.close()
        for s in self.servers:
            await s.stop(grace=None)
        for s in self.services:
            s.close()

    async def run(self, xs, *, attempt: int, algorithm: str = "butterfly", compression: str = "none",
                  reducers=None, feedback=None, chunk_bytes: int = 64, return_exceptions: bool = False,
                  chunk_timeout: float = 5.0, audit: bool = False, tampers=None, shard_owner=None, silent=(),
                  outbound_only=(), sparse=None, shard_bounds=None):
        """One all-reduce attempt of every peer (results in peer order). Peers in `silent` take no
        part (their data planes still accept chunks) and get None. `outbound_only`: positions the
        plan marks so (give them no shard in `shard_owner`). `sparse`: per peer, its
        `SparseRound` (sparse collectives); `shard_bounds`: in place of equal shards."""
        n = xs[0].size
        shard_owner = tuple(range(self.p)) if shard_owner is None else tuple(shard_owner)
        shards = len(shard_owner)
        plan = Plan(round=0, attempt=attempt, participants=tuple(self.ids), addresses=tuple(self.addresses),
                    shard_bounds=tuple(n * i // shards for i in range(shards + 1)) if shard_bounds is None
                    else tuple(shard_bounds),
                    shard_owner=shard_owner, collective=algorithm, chunk_bytes=chunk_bytes,
                    chunk_timeout_seconds=chunk_timeout, deadline_seconds=30.0, compression=compression,
                    audit_owners=audit, outbound_only=tuple(outbound_only),
                    ticket=issue_ticket(self.coordinator_key, 0, attempt, self.ids, bytes(32), 60.0))
        for inbox in self.inboxes:
            inbox.start(self.session(attempt, outbound_only, algorithm))
        reducers = reducers or [None] * self.p
        feedback = feedback or [None] * self.p
        live = [i for i in range(self.p) if i not in silent]
        try:
            out = await asyncio.gather(*[
                all_reduce(xs[i], plan, me=self.ids[i], transport=self.transports[i], inbox=self.inboxes[i],
                           reducer=reducers[i], feedback=feedback[i], tamper=(tampers or {}).get(i),
                           sparse=sparse[i] if sparse else None)
                for i in live],
                return_exceptions=return_exceptions)
            results = dict(zip(live, out))
            return [results.get(i) for i in range(self.p)]
        finally:
            for inbox in self.inboxes:
                inbox.finish(0, attempt)
