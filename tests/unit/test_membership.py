"""Memberships: an admitted key rejoins without a token until revoked or unused for
member_retention; one process per identity; connection failures diagnosed. Pure parts, no
sockets (the key files across processes: tests/system/test_key_holding.py; the daemons:
tests/system/test_members_processes.py)."""

from __future__ import annotations


import grpc
import pytest

from shoal.common.errors import AlreadyExists, PermissionDenied, Unauthenticated
from shoal.coordinator.admission import Admission, AllowList, create_token
from shoal.coordinator.admitted_keys import TOUCH_SECONDS, Membership, Memberships
from shoal.peer.diagnosis import OutageLog, diagnose

SECRET = b"s" * 32
KEY_A, KEY_B = b"\x01" * 32, b"\x02" * 32
DAY = 86400.0


def fresh(**kw) -> Memberships:
    return Memberships([], retention=kw.pop("retention", 7 * DAY), live_seconds=5.0, **kw)


def test_an_admitted_key_rejoins_without_its_expired_token_until_unused_for_the_retention():
    ms, adm = fresh(), Admission(SECRET, None)
    token = create_token(SECRET, 60.0, "alice", now=0.0)
    rec = ms.admit(adm, "a" * 32, KEY_A, token, now=10.0)
    assert (rec.label, rec.admitted_at, rec.last_seen) == ("alice", 10.0, 10.0)
    # The token expired long ago: the membership is the credential now.
    again = ms.admit(adm, "a" * 32, KEY_A, token, now=3 * DAY)
    assert (again.admitted_at, again.last_seen, again.label) == (10.0, 3 * DAY, "alice")
    assert ms.admit(adm, "a" * 32, KEY_A, "", now=5 * DAY).last_seen == 5 * DAY
    # Unused for longer than the retention: admission again, and the expired token is refused.
    with pytest.raises(Unauthenticated, match="expired"):
        ms.admit(adm, "a" * 32, KEY_A, token, now=13 * DAY)
    # A key never admitted needs a valid token.
    with pytest.raises(Unauthenticated, match="missing"):
        ms.admit(adm, "b" * 32, KEY_B, "", now=11.0)


def test_a_revoked_key_is_refused_even_with_a_valid_token_and_the_allow_list_still_applies():
    ms, adm = fresh(), Admission(SECRET, None)
    ms.admit(adm, "a" * 32, KEY_A, create_token(SECRET, 60.0, now=0.0), now=1.0)
    rec = ms.revoke("a" * 8, now=2.0)
    assert rec.revoked and rec.status(3.0, ms.retention) == "revoked"
    with pytest.raises(PermissionDenied, match="revoked"):
        ms.admit(adm, "a" * 32, KEY_A, create_token(SECRET, 60.0, now=3.0), now=3.0)
    with pytest.raises(PermissionDenied, match="revoked"):
        ms.check("a" * 32, "")
    # With an allow-list, a member taken off it is refused although its membership is valid.
    listed = Admission(None, AllowList(frozenset({KEY_B})))
    ms.admit(listed, "b" * 32, KEY_B, "", now=1.0)
    with pytest.raises(PermissionDenied, match="allow-list"):
        ms.admit(Admission(None, AllowList(frozenset())), "b" * 32, KEY_B, "", now=2.0)
    with pytest.raises(ValueError, match="no such member"):
        ms.revoke("c" * 8, now=1.0)
    with pytest.raises(ValueError, match="at least 8"):
        ms.revoke("a", now=1.0)


def test_one_process_per_identity_the_live_holder_keeps_it_a_silent_one_is_fenced():
    ms = fresh()
    assert ms.claim("p", "one", live=False) is None
    assert ms.claim("p", "one", live=True) is None  # its own rejoin
    with pytest.raises(AlreadyExists, match="already running"):
        ms.claim("p", "two", live=True)
    ms.check("p", "one")  # the first keeps its identity
    assert ms.claim("p", "two", live=False) == "one"  # the first stopped renewing: taken over
    with pytest.raises(PermissionDenied, match="fenced"):
        ms.check("p", "one")
    ms.check("p", "two")
    # A restarted coordinator knows no holder: the first caller of an admitted key holds it.
    ms2 = Memberships([],
                      retention=DAY, live_seconds=5.0)
    ms2.records["q"] = Membership("q", KEY_A, "open", 0.0, 0.0)
    ms2.check("q", "x")
    with pytest.raises(PermissionDenied):
        ms2.check("q", "y")
    ms2.check("stranger", "x")  # no membership: nothing recorded
    assert "stranger" not in ms2.instances


def test_last_use_is_written_at_most_hourly_and_unused_memberships_are_pruned_but_not_revoked_ones():
    ms, adm = fresh(retention=DAY), Admission(None, None)
    ms.admit(adm, "a" * 32, KEY_A, "", now=0.0)
    ms.admit(adm, "b" * 32, KEY_B, "", now=0.0)
    assert ms.records["a" * 32].label == "open"
    assert ms.touch("a" * 32, TOUCH_SECONDS - 1) is None
    assert ms.touch("a" * 32, TOUCH_SECONDS + 1).last_seen == TOUCH_SECONDS + 1
    ms.revoke("b" * 32, now=1.0)
    assert ms.prune(DAY + TOUCH_SECONDS + 2) == ["a" * 32]
    assert [r.peer_id for r in ms.listing()] == ["b" * 32]
    with pytest.raises(ValueError):
        Memberships([], retention=0, live_seconds=1)


# ------------------------------------------------------------------------------ diagnosis


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, "")


# The details grpcio 1.6x gives for each failure (recorded on this machine).
DETAILS = {
    "connection refused": (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused"),
    "DNS lookup": (grpc.StatusCode.UNAVAILABLE, "errors resolving nosuch.invalid:7070: [field:hostname lookup error:address "
            "lookup failed for nosuch.invalid:7070: Domain name not found]"),
    "unknown CA": (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                   "ipv4:127.0.0.1:36007: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
                   "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local "
                   "issuer certificate: OK"),
    "not valid for '127.0.0.1' (it holds coord.example.org)": (
        grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:36007: "
        "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."),
    "expired": (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:"
                "1: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
                "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired: OK"),
    "timed out": (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
    "join_token: expired 5 s ago": (grpc.StatusCode.UNAUTHENTICATED, "join_token: expired 5 s ago"),
    "already running": (grpc.StatusCode.ALREADY_EXISTS, "peer abc is already running: another process ..."),
    "took over": (grpc.StatusCode.PERMISSION_DENIED, "peer abc: another process with this key took over the identity; "
                  "this one is fenced"),
    "revoked by the operator": (grpc.StatusCode.PERMISSION_DENIED, "peer abc: membership revoked by the operator"),
}


@pytest.mark.parametrize("says", list(DETAILS))
def test_each_failure_kind_has_its_own_line_and_fix(says):
    d = diagnose(rpc_error(*DETAILS[says]), "127.0.0.1:7070", names=lambda t: ["coord.example.org"])
    assert says in d.reason and d.fix, d
    others = [diagnose(rpc_error(*v), "127.0.0.1:7070", names=lambda t: ["coord.example.org"]).line()
              for k, v in DETAILS.items() if k != says]
    assert d.line() not in others  # distinct


async def test_an_outage_logs_at_once_then_every_10_s_and_gives_up_with_the_most_useful_error(caplog):
    t = [0.0]
    out = OutageLog("coord:7070", clock=lambda: t[0])
    caplog.set_level("INFO", logger="shoal.peer.control")
    await out.failed(rpc_error(*DETAILS["unknown CA"]))
    for step in range(1, 25):
        t[0] = step
        await out.failed(rpc_error(*DETAILS["timed out"]))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "unknown CA" in lines[0] and all("timed out" in x for x in lines[1:]), lines
    gave_up = str(out.gave_up(24))
    assert gave_up.startswith("coordinator coord:7070 unreachable (gave up after --connect-timeout 24s)")
    assert "unknown CA" in gave_up and "fix: use the ca.pem" in gave_up
    out.recovered()
    assert "reachable again" in caplog.records[-1].getMessage()
