"""`shoal member list|revoke`: the operator's view and control of the admitted keys (memberships).

The operator proves who they are by signing the calls with the coordinator's own key file (the
one `shoal coordinator --key` uses, by default the state file with `.key`): whoever can read that
file already controls the coordinator. The calls go to the running coordinator, so a revocation
takes effect at the peer's next call (coordinator.admitted_keys); with standby coordinators on etcd
it is stored there and the next leader keeps it.
"""

from __future__ import annotations

import time

from shoal.common.identity import load_key
from shoal.common.security import Security, open_channel, signing_interceptors
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc


def _info(m: pb.MembershipInfo) -> dict:
    return {"member": m.member, "label": m.label, "status": m.status, "live": m.live, "address": m.address,
            "admitted_at": m.admitted_at, "last_seen": m.last_seen, "revoked_at": m.revoked_at}


async def list_members(target: str, admin_key: str, security: Security, timeout: float = 10.0) -> dict:
    """{"retention_seconds": float, "members": [ {member, label, status, live, address, admitted_at,
    last_seen, revoked_at} ]} from the coordinator at `target`.

    Raises:
        grpc.aio.AioRpcError: UNAVAILABLE (unreachable), PERMISSION_DENIED (not the coordinator's key).
        OSError, ValueError: `admin_key` cannot be read.
    """
    key = load_key(admin_key)
    async with open_channel(target, security, [], signing_interceptors(key)) as channel:
        resp = await pb_grpc.CoordinatorStub(channel).ListMembers(pb.ListMembersRequest(), timeout=timeout)
    return {"retention_seconds": resp.retention_seconds, "members": [_info(m) for m in resp.members]}


async def revoke_member(target: str, admin_key: str, member: str, security: Security,
                        timeout: float = 10.0) -> dict:
    """Revoke `member` (a peer id or a unique prefix of 8+ hex chars); returns its record.

    Raises:
        grpc.aio.AioRpcError: NOT_FOUND (no such member, ambiguous prefix), PERMISSION_DENIED,
            UNAVAILABLE.
        OSError, ValueError: `admin_key` cannot be read.
    """
    key = load_key(admin_key)
    async with open_channel(target, security, [], signing_interceptors(key)) as channel:
        resp = await pb_grpc.CoordinatorStub(channel).RevokeMember(pb.RevokeMemberRequest(member=member),
                                                                   timeout=timeout)
    return _info(resp.member)


def _ago(t: float, now: float) -> str:
    if not t:
        return "-"
    s = max(0.0, now - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def render_members(listing: dict, now: float | None = None) -> str:
    """A table: one line per membership (id, status, live address, label, admitted, last seen)."""
    now = time.time() if now is None else now
    rows = [("MEMBER", "STATUS", "LIVE", "LABEL", "ADMITTED", "LAST SEEN")]
    for m in listing["members"]:
        rows.append((m["member"], m["status"], m["address"] if m["live"] else "-", m["label"],
                     _ago(m["admitted_at"], now), "now" if m["live"] else _ago(m["last_seen"], now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    days = listing["retention_seconds"] / 86400
    lines.append(f"{len(listing['members'])} members; an unused membership expires after {days:g} days "
                 f"(member_retention)")
    return "\n".join(lines)
