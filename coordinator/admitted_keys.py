"""Memberships: the keys the coordinator has admitted, and the one process that may speak for each.

Admission (`coordinator.admission`: a join token and/or the allow-list) happens once per key. The
admitted key is then a *membership*: a credential that joins again without a token (after a
restart, a crash, a coordinator restart) until the operator revokes it or it goes unused for
`retention` seconds (the coordinator's `member_retention`). A revoked key stays refused, with or
without a token (a join token is a bearer token: forgetting the key would let it back in).

One process per identity: each peer process sends a random *instance* id (metadata
`x-shoal-instance`) on every call. The instance that joined last holds the identity. A Join from
another instance is refused while the holder is live (its round-event stream open and its lease
renewed within `live_seconds`); once the holder stopped renewing, the newcomer takes over and the
old instance is *fenced*: every call it makes from then on is refused.

Everything here is pure (no I/O, no clock): `Memberships` decides and returns the records to
persist; coordinator.server carries the decisions out (store writes, closing streams).
"""

from __future__ import annotations

import dataclasses

from shoal.common.errors import AlreadyExists, PermissionDenied
from shoal.coordinator.admission import Admission

# A membership's last use is written at most this often while its peer stays connected (seconds):
# one write per member per hour, not one per heartbeat.
TOUCH_SECONDS = 3600.0


class AlreadyLive(AlreadyExists):
    """A second process joined with a key whose first process is live (ALREADY_EXISTS)."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """An admitted key. Times are unix seconds; `revoked_at` 0.0 = not revoked; `label` is the
    admitting token's label (or "allow-list", "open")."""

    peer_id: str
    public_key: bytes
    label: str
    admitted_at: float
    last_seen: float
    revoked_at: float = 0.0

    @property
    def revoked(self) -> bool:
        return self.revoked_at > 0.0

    def expired(self, now: float, retention: float) -> bool:
        """True when unused for longer than `retention` seconds (it then needs admission again)."""
        return now - self.last_seen > retention

    def status(self, now: float, retention: float) -> str:
        """"revoked", "expired" or "admitted"."""
        return "revoked" if self.revoked else "expired" if self.expired(now, retention) else "admitted"


class Memberships:
    """Admitted keys (from the store) and the live instance of each identity.

    retention: seconds a membership stays valid unused. live_seconds: a holder that renewed its
    lease within this long (and keeps its stream open) cannot be displaced.
    """

    def __init__(self, records: list[Membership], *, retention: float, live_seconds: float):
        if not retention > 0:
            raise ValueError(f"member_retention: must be > 0 seconds, got {retention}")
        self.records = {r.peer_id: r for r in records}
        self.retention = retention
        self.live_seconds = live_seconds
        self.instances: dict[str, str] = {}  # peer id -> the instance that holds it
        self._touched: dict[str, float] = {}  # peer id -> last_seen as last persisted

    def admit(self, admission: Admission, peer_id: str, public_key: bytes, join_token: str,
              now: float) -> Membership:
        """The membership of a joining key: its current one (no token needed) or a new one from
        `admission` (token and/or allow-list). The caller persists the returned record.

        Raises:
            PermissionDenied: the key's membership was revoked (token or not), or an allow-list is
                configured and the key is no longer on it.
            Unauthenticated: no valid membership and the token is missing, bad or expired.
        """
        rec = self.records.get(peer_id)
        if rec is not None and rec.revoked:
            raise PermissionDenied(f"peer {peer_id}: membership revoked by the operator "
                                   f"{now - rec.revoked_at:.0f} s ago; this key can no longer join")
        if rec is not None and not rec.expired(now, self.retention):
            if admission.allow_list is not None:
                admission.allow_list.check(public_key)
            rec = dataclasses.replace(rec, last_seen=now)
        else:
            claims = admission.admit(public_key, join_token, now)
            label = (claims.label or f"token {claims.token_id[:8]}") if claims else \
                "allow-list" if admission.allow_list is not None else "open"
            rec = Membership(peer_id, public_key, label, now, now)
        self.records[peer_id] = rec
        self._touched[peer_id] = now
        return rec

    def claim(self, peer_id: str, instance: str, live: bool) -> str | None:
        """Give the identity to `instance` at its Join; returns the fenced instance, if any.

        `live`: the current holder's stream is open and it renewed within `live_seconds`.

        Raises:
            AlreadyLive: another instance holds the identity and is live.
        """
        holder = self.instances.get(peer_id)
        if holder is None or holder == instance:
            self.instances[peer_id] = instance
            return None
        if live:
            raise AlreadyLive(f"peer {peer_id} is already running: another process with this key is live and "
                              f"renews its lease")
        self.instances[peer_id] = instance
        return holder

    def holds(self, peer_id: str, instance: str) -> bool:
        """Whether `instance` still holds the identity `peer_id` (a Join re-checks after each await:
        another process of the key may have taken it over meanwhile)."""
        return self.instances.get(peer_id) == instance

    def check(self, peer_id: str, instance: str) -> None:
        """Refuse a call of a revoked membership or of a fenced instance (any call but Join).

        An admitted identity whose holder is unknown (a restarted coordinator) is held by its first
        caller; a key without a membership is not recorded (any signer could fill the table).

        Raises:
            PermissionDenied: naming the peer and why.
        """
        rec = self.records.get(peer_id)
        if rec is not None and rec.revoked:
            raise PermissionDenied(f"peer {peer_id}: membership revoked by the operator")
        holder = self.instances.setdefault(peer_id, instance) if rec is not None else self.instances.get(peer_id)
        if holder is not None and holder != instance:
            raise PermissionDenied(f"peer {peer_id}: another process with this key took over the identity; "
                                   f"this one is fenced")

    def touch(self, peer_id: str, now: float) -> Membership | None:
        """Note a call of `peer_id`; returns the record to persist when its last use on disk is
        older than TOUCH_SECONDS (else None)."""
        rec = self.records.get(peer_id)
        if rec is None or rec.revoked or now - self._touched.get(peer_id, rec.last_seen) < TOUCH_SECONDS:
            return None
        rec = dataclasses.replace(rec, last_seen=now)
        self.records[peer_id] = rec
        self._touched[peer_id] = now
        return rec

    def revoke(self, peer_id: str, now: float) -> Membership:
        """Revoke `peer_id` (a full id or a unique prefix of at least 8 hex chars); returns the
        record to persist.

        Raises:
            ValueError: no membership, or an ambiguous prefix (the message says which).
        """
        rec = self.find(peer_id)
        if not rec.revoked:
            rec = dataclasses.replace(rec, revoked_at=now)
            self.records[rec.peer_id] = rec
        self.instances.pop(rec.peer_id, None)
        return rec

    def find(self, prefix: str) -> Membership:
        """The membership whose id is `prefix` or starts with it (at least 8 chars).

        Raises:
            ValueError: none, or several match.
        """
        if prefix in self.records:
            return self.records[prefix]
        if len(prefix) < 8:
            raise ValueError(f"peer id {prefix!r}: give at least 8 hex characters")
        found = [r for p, r in self.records.items() if p.startswith(prefix)]
        if len(found) != 1:
            raise ValueError(f"peer id {prefix!r}: " + ("no such member" if not found else
                                                         f"{len(found)} members match; give more characters"))
        return found[0]

    def listing(self) -> list[Membership]:
        """Every membership, by peer id."""
        return sorted(self.records.values(), key=lambda r: r.peer_id)

    def prune(self, now: float) -> list[str]:
        """Drop memberships unused beyond retention (not revoked ones: they stay refused);
        returns their ids for the store to forget."""
        gone = [p for p, r in self.records.items() if not r.revoked and r.expired(now, self.retention)]
        for p in gone:
            del self.records[p]
            self.instances.pop(p, None)
            self._touched.pop(p, None)
        return gone
