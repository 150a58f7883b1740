"""The coordinator's durable state in etcd: the `Store` contract, every write fenced by leadership.

`shoal coordinator --state etcd://HOST:PORT[,HOST:PORT...]/PREFIX` keeps members, the epoch, the
commit and abort history and the run's metadata under PREFIX in an etcd v3 cluster, so that
several coordinators can share them: one leads (`coordinator.leadership`), the others stand by and
take over from the same state when it dies. SQLite stays the default for one machine.

Keys (values are JSON, byte strings in hex):

    PREFIX/leader                   the leader's address, bound to its etcd lease
    PREFIX/meta/KEY                 run_config, epoch, incarnation, untrusted, ...
    PREFIX/members/PEER_ID          {public_key, address, num_samples, state}
    PREFIX/memberships/PEER_ID      {public_key, label, admitted_at, last_seen, revoked_at}
    PREFIX/commits/ROUND            {round, attempt, result_digest, ...}, ROUND zero-padded to 12 digits
    PREFIX/aborts/ROUND/ATTEMPT     {round, attempt, reason, excluded, will_retry, at}

Fencing: a store made with `fence=(leader key, create revision)` writes only in transactions
that compare the leader key's create revision with the one this coordinator was elected with. A
coordinator that lost its lease (and so the key) while it still believes it leads can therefore
write nothing; its writes raise `NotLeader`, and it stops.

Access (`EtcdAccess`, the [coordinator] settings etcd_ca, etcd_cert, etcd_key, etcd_user,
etcd_password): with a CA the channels are TLS (server certificate checked against it; with a
client certificate and key, mutual TLS as etcd's --client-cert-auth asks); with a user, every
call carries the token etcd's Auth.Authenticate gives for the user and password (taken again
when etcd says it is no longer valid). Without either, plaintext and no authentication: anyone
who reaches etcd reads and writes the run's state (a warning at start).

Failure semantics: every call is a synchronous gRPC call to etcd (the project's grpcio and the
etcd v3 API stubs of the `aetcd` package) with `timeout` seconds; an endpoint that does not
answer is skipped for the next one; when none answers, grpc.RpcError is raised and nothing was
written (etcd transactions are atomic). A write returns once etcd has committed it (a quorum of
the etcd cluster has it on disk). More than `MAX_OPS` writes in one batch go in several
transactions, each atomic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from aetcd.rpc import rpc_pb2 as etcd
from aetcd.rpc import rpc_pb2_grpc as etcd_grpc

from shoal.coordinator.admitted_keys import Membership
from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member, MemberState

log = logging.getLogger("shoal.coordinator")

T = TypeVar("T")

SCHEME = "etcd://"
MAX_OPS = 100  # operations per transaction (etcd's --max-txn-ops defaults to 128)


class NotLeader(Exception):
    """A fenced write was refused: the leader key is gone or belongs to another coordinator."""


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd: TLS files (PEM paths; `ca` turns TLS on, `cert` + `key` present a client
    certificate) and a user and password for etcd's authentication ("" = none)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)

    @property
    def secured(self) -> bool:
        return self.ca is not None or bool(self.user)

    def credentials(self) -> grpc.ChannelCredentials:
        """The TLS credentials of the channels. Raises OSError (a file that cannot be read)."""
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca), private_key=read(self.key),
                                            certificate_chain=read(self.cert))

    def channel(self, endpoint: str, aio: bool = False):
        """A channel to `endpoint`: TLS with a CA, plaintext without."""
        if self.ca is None:
            return grpc.aio.insecure_channel(endpoint) if aio else grpc.insecure_channel(endpoint)
        creds = self.credentials()
        return grpc.aio.secure_channel(endpoint, creds) if aio else grpc.secure_channel(endpoint, creds)


def token_stale(exc: grpc.RpcError) -> bool:
    """etcd refused a call for its auth token (expired, or taken before a restart)."""
    details = (exc.details() or "") if hasattr(exc, "details") else ""
    return exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) and "token" in details


@dataclasses.dataclass(frozen=True)
class EtcdTarget:
    """Where the state lives: etcd endpoints (HOST:PORT), the key prefix (no trailing slash), and
    how to reach them (`access`)."""

    endpoints: tuple[str, ...]
    prefix: str
    access: EtcdAccess = EtcdAccess()

    @staticmethod
    def parse(url: str) -> EtcdTarget:
        """`etcd://HOST:PORT[,HOST:PORT...]/PREFIX`. Raises ValueError naming what is wrong."""
        if not url.startswith(SCHEME):
            raise ValueError(f"{url!r}: not an etcd:// URL")
        hosts, _, prefix = url[len(SCHEME):].partition("/")
        endpoints = tuple(h for h in hosts.split(",") if h)
        if not endpoints or any(":" not in h or not h.rsplit(":", 1)[1].isdigit() for h in endpoints):
            raise ValueError(f"{url!r}: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        prefix = prefix.strip("/")
        if not prefix:
            raise ValueError(f"{url!r}: a key prefix is needed after the endpoints (etcd://HOST:PORT/PREFIX)")
        return EtcdTarget(endpoints, "/" + prefix)

    def key(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    @property
    def leader_key(self) -> bytes:
        return self.key("leader")


def is_etcd(state: str) -> bool:
    return state.startswith(SCHEME)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # try the next endpoint


class Failover:
    """The endpoint failover of every etcd client here (the store's, the leadership's): one item
    per endpoint (its stubs), tried in turn from the one that answered last while they are
    unavailable (RETRYABLE); any other error is raised at once. When none answers, the last
    endpoint's error is raised. `call` is for synchronous stubs, `acall` for grpc.aio ones."""

    def __init__(self, items: Sequence):
        self.items = list(items)
        self._at = 0

    def _order(self) -> list[int]:
        n = len(self.items)
        return [(self._at + i) % n for i in range(n)]

    @property
    def current(self):
        """The item of the endpoint that answered last."""
        return self.items[self._at]

    def call(self, attempt: Callable[[object], T]) -> T:
        """`attempt(item)` on each endpoint in turn until one answers."""
        last: grpc.RpcError | None = None
        for k in self._order():
            try:
                resp = attempt(self.items[k])
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                last = exc
                continue
            self._at = k
            return resp
        assert last is not None
        raise last

    async def acall(self, attempt: Callable[[object], Awaitable[T]]) -> T:
        """`await attempt(item)` on each endpoint in turn until one answers."""
        last: grpc.RpcError | None = None
        for k in self._order():
            try:
                resp = await attempt(self.items[k])
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                last = exc
                continue
            self._at = k
            return resp
        assert last is not None
        raise last


class EtcdClient:
    """Synchronous etcd KV calls over one channel per endpoint (`Failover`), with `access`'s TLS
    and authentication."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0, access: EtcdAccess = EtcdAccess()):
        self.timeout, self.access = timeout, access
        self._channels = [access.channel(e) for e in endpoints]
        self._failover = Failover([(etcd_grpc.KVStub(c), etcd_grpc.AuthStub(c)) for c in self._channels])
        self._token = ""

    def _metadata(self, auth) -> tuple[tuple[str, str], ...] | None:
        if not self.access.user:
            return None
        if not self._token:
            self._token = auth.Authenticate(etcd.AuthenticateRequest(name=self.access.user,
                                                                     password=self.access.password),
                                            timeout=self.timeout).token
        return (("token", self._token),)

    def call(self, method: str, request):
        """`KV.<method>(request)` on the current endpoint, the others in turn when it is unavailable
        (authenticated again once when etcd refuses the token)."""
        def attempt(stubs):
            try:
                return getattr(stubs[0], method)(request, timeout=self.timeout, metadata=self._metadata(stubs[1]))
            except grpc.RpcError as exc:
                if not (self.access.user and token_stale(exc)):
                    raise
                self._token = ""
                return getattr(stubs[0], method)(request, timeout=self.timeout, metadata=self._metadata(stubs[1]))

        return self._failover.call(attempt)

    def range(self, key: bytes, end: bytes = b"", **kw) -> etcd.RangeResponse:
        return self.call("Range", etcd.RangeRequest(key=key, range_end=end, **kw))

    def close(self) -> None:
        for c in self._channels:
            c.close()


def _put(key: bytes, value: dict | str) -> etcd.RequestOp:
    data = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return etcd.RequestOp(request_put=etcd.PutRequest(key=key, value=data.encode()))


def _delete(key: bytes) -> etcd.RequestOp:
    return etcd.RequestOp(request_delete_range=etcd.DeleteRangeRequest(key=key))


class EtcdStore:
    """`Store` on etcd (see the module docstring). `fence`: (leader key, create revision) every
    write is conditioned on; None (tools, tests) writes unconditionally."""

    def __init__(self, target: EtcdTarget, *, fence: tuple[bytes, int] | None = None, timeout: float = 5.0):
        self.target = target
        self.fence = fence
        self.client = EtcdClient(target.endpoints, timeout, target.access)
        self._batch: list[etcd.RequestOp] | None = None

    # ------------------------------------------------------------ writes

    def _write(self, ops: list[etcd.RequestOp]) -> None:
        """`ops` now, in one fenced transaction, or at the end of the batch in progress."""
        if self._batch is not None:
            self._batch.extend(ops)
        else:
            self._txn(ops)

    def _txn(self, ops: list[etcd.RequestOp], compare: Sequence[etcd.Compare] = ()) -> etcd.TxnResponse:
        """`ops` in transactions of at most MAX_OPS, each fenced; `compare` guards the first."""
        fence: list[etcd.Compare] = []
        if self.fence is not None:
            key, rev = self.fence
            fence.append(etcd.Compare(key=key, target=etcd.Compare.CREATE, result=etcd.Compare.EQUAL,
                                      create_revision=rev))
        resp = etcd.TxnResponse(succeeded=True)
        for i in range(0, max(1, len(ops)), MAX_OPS):
            guard = [*compare, *fence] if i == 0 else fence
            resp = self.client.call("Txn", etcd.TxnRequest(compare=guard, success=ops[i:i + MAX_OPS]))
            if not resp.succeeded:
                if self.fence is not None and not self._holds_fence():
                    raise NotLeader(f"{self.target.prefix}: this coordinator no longer leads (the leader key "
                                    f"changed); its write was refused")
                return resp
        return resp

    def _holds_fence(self) -> bool:
        key, rev = self.fence
        kvs = self.client.range(key).kvs
        return bool(kvs) and kvs[0].create_revision == rev

    @contextlib.contextmanager
    def batch(self, durable: bool = True) -> Iterator[None]:
        """Every write inside goes in one transaction at the end (nested batches join the outer
        one); nothing is written when the block raises. etcd commits durably either way."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
            ops, self._batch = self._batch, None
            if ops:
                self._txn(ops)
        finally:
            self._batch = None

    # ------------------------------------------------------------ members

    def load_members(self) -> list[Member]:
        prefix = self.target.key("members", "")
        out = []
        for kv in self.client.range(prefix, prefix_end(prefix)).kvs:
            d = json.loads(kv.value)
            out.append(Member(kv.key.decode().rsplit("/", 1)[1], bytes.fromhex(d["public_key"]), d["address"],
                              d["num_samples"], 0.0, MemberState.from_label(d["state"])))
        return out

    def save_member(self, m: Member) -> None:
        self._write([_put(self.target.key("members", m.peer_id), {
            "public_key": m.public_key.hex(), "address": m.address, "num_samples": m.num_samples,
            "state": m.state.label})])

    def forget_member(self, peer_id: str) -> None:
        self._write([_delete(self.target.key("members", peer_id))])

    def load_memberships(self) -> list[Membership]:
        prefix = self.target.key("memberships", "")
        out = []
        for kv in self.client.range(prefix, prefix_end(prefix)).kvs:
            d = json.loads(kv.value)
            out.append(Membership(kv.key.decode().rsplit("/", 1)[1], bytes.fromhex(d["public_key"]), d["label"],
                                  d["admitted_at"], d["last_seen"], d["revoked_at"]))
        return out

    def save_membership(self, m: Membership) -> None:
        self._write([_put(self.target.key("memberships", m.peer_id), {
            "public_key": m.public_key.hex(), "label": m.label, "admitted_at": m.admitted_at,
            "last_seen": m.last_seen, "revoked_at": m.revoked_at})])

    def forget_membership(self, peer_id: str) -> None:
        self._write([_delete(self.target.key("memberships", peer_id))])

    def load_epoch(self) -> int:
        v = self.get_meta("epoch")
        return int(v) if v is not None else 0

    def save_epoch(self, epoch: int) -> None:
        self.set_meta("epoch", str(epoch))

    # ------------------------------------------------------------ commits and aborts

    @staticmethod
    def _commit(raw: bytes) -> CommitRecord:
        d = json.loads(raw)
        return CommitRecord(d["round"], d["attempt"], bytes.fromhex(d["result_digest"]),
                            bytes.fromhex(d["state_digest"]), tuple(d["participants"]), d["train_loss"],
                            d["seconds"], tuple(d["flagged"]), d["at"])

    def _commits(self, *, limit: int = 0, newest_first: bool = False) -> list[CommitRecord]:
        prefix = self.target.key("commits", "")
        order = etcd.RangeRequest.DESCEND if newest_first else etcd.RangeRequest.ASCEND
        kvs = self.client.range(prefix, prefix_end(prefix), limit=limit, sort_order=order,
                                sort_target=etcd.RangeRequest.KEY).kvs
        return [self._commit(kv.value) for kv in kvs]

    def load_commits(self) -> list[CommitRecord]:
        return self._commits()

    def recent_commits(self, n: int) -> list[CommitRecord]:
        return self._commits(limit=n, newest_first=True)[::-1] if n > 0 else []

    def save_commit(self, rec: CommitRecord) -> None:
        key = self.target.key("commits", f"{rec.round:012d}")
        value = {"round": rec.round, "attempt": rec.attempt, "result_digest": rec.result_digest.hex(),
                 "state_digest": rec.state_digest.hex(), "participants": list(rec.participants),
                 "train_loss": rec.train_loss, "seconds": rec.seconds, "flagged": list(rec.flagged), "at": rec.at}
        absent = etcd.Compare(key=key, target=etcd.Compare.VERSION, result=etcd.Compare.EQUAL, version=0)
        ops = [_put(key, value)]
        if self._batch is not None:
            ops += self._batch
            self._batch.clear()
        if not self._txn(ops, [absent]).succeeded:
            raise ValueError(f"round {rec.round} already committed")

    def rewind(self, rounds: int) -> int:
        """Drop every commit of a round >= `rounds` (one fenced delete of that key range);
        returns how many were dropped."""
        prefix = self.target.key("commits", "")
        start = self.target.key("commits", f"{max(0, rounds):012d}")
        n = int(self.client.range(start, prefix_end(prefix), count_only=True).count)
        self._write([etcd.RequestOp(request_delete_range=etcd.DeleteRangeRequest(key=start,
                                                                                range_end=prefix_end(prefix)))])
        return n

    def count_commits(self) -> int:
        prefix = self.target.key("commits", "")
        return int(self.client.range(prefix, prefix_end(prefix), count_only=True).count)

    def last_commit(self) -> CommitRecord | None:
        got = self._commits(limit=1, newest_first=True)
        return got[0] if got else None

    def count_aborts(self) -> int:
        prefix = self.target.key("aborts", "")
        return int(self.client.range(prefix, prefix_end(prefix), count_only=True).count)

    def save_abort(self, rec: AbortRecord) -> None:
        self._write([_put(self.target.key("aborts", f"{rec.round:012d}", f"{rec.attempt:010d}"), {
            "round": rec.round, "attempt": rec.attempt, "reason": rec.reason, "excluded": list(rec.excluded),
            "will_retry": rec.will_retry, "at": rec.at})])

    def recent_aborts(self, n: int) -> list[AbortRecord]:
        if n <= 0:
            return []
        prefix = self.target.key("aborts", "")
        kvs = self.client.range(prefix, prefix_end(prefix), limit=n, sort_order=etcd.RangeRequest.DESCEND,
                                sort_target=etcd.RangeRequest.KEY).kvs
        out = []
        for kv in reversed(kvs):
            d = json.loads(kv.value)
            out.append(AbortRecord(d["round"], d["attempt"], d["reason"], tuple(d["excluded"]), d["will_retry"],
                                   d["at"]))
        return out

    # ------------------------------------------------------------ metadata

    def get_meta(self, key: str) -> str | None:
        kvs = self.client.range(self.target.key("meta", key)).kvs
        return kvs[0].value.decode() if kvs else None

    def set_meta(self, key: str, value: str) -> None:
        self._write([_put(self.target.key("meta", key), value)])

    def close(self) -> None:
        self.client.close()
