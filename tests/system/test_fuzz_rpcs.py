"""Fuzzing every RPC of both services of real processes with random and mutated messages.

A coordinator (join tokens required) and one joined peer run as processes; hypothesis throws at
every method, a fixed number of derandomized examples each, raw random bytes, well-formed messages with random
fields (unsigned, signed, or with garbage signature metadata) and bit-flipped valid messages.
Every call must end with a status code (never UNKNOWN/INTERNAL, which would mean an unhandled
exception, nor a hang), the servers stay up, and an honest round afterwards commits the exact sum.
"""

from __future__ import annotations

import sys
import time

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shoal.coordinator.admission import create_secret, create_token
from shoal.common.identity import peer_id_of, public_bytes, sign_metadata
from kits.procs import read_json
from shoal.bench.collective_job import make_input
from shoal.v1 import shoal_pb2 as pb

# Starts a coordinator and a collective job as processes: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration

EXAMPLES_PER_METHOD = 25
SIZE = 500
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}

COORDINATOR = {
    "Join": (pb.JoinRequest, "unary"), "Heartbeat": (pb.HeartbeatRequest, "unary"),
    "Leave": (pb.LeaveRequest, "unary"), "Ready": (pb.ReadyRequest, "unary"),
    "WatchRounds": (pb.WatchRequest, "server_stream"), "Vote": (pb.VoteRequest, "unary"),
    "ReportLinks": (pb.LinkReport, "unary"), "GetStatus": (pb.StatusRequest, "unary"),
}
PEER = {
    "PushChunks": (pb.Chunk, "client_stream"), "FetchState": (pb.StateRequest, "server_stream"),
    "Probe": (pb.ProbeRequest, "unary"),
}

_INT_RANGES = {
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
}


def _value(data, f: FieldDescriptor, depth: int):
    t = f.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        return data.draw(st.one_of(st.integers(lo, hi), st.integers(0, 70)))
    if t == FieldDescriptor.TYPE_ENUM:
        return data.draw(st.sampled_from([v.number for v in f.enum_type.values]))
    if t == FieldDescriptor.TYPE_BOOL:
        return data.draw(st.booleans())
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64))
    if t == FieldDescriptor.TYPE_STRING:
        return data.draw(st.text(max_size=40))
    if t == FieldDescriptor.TYPE_BYTES:
        return data.draw(st.binary(max_size=96))
    return None


def _message(data, cls, depth: int = 0):
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if not data.draw(st.booleans()):
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 2:
                continue
            sub_cls = getattr(pb, f.message_type.name)
            if f.is_repeated:
                for _ in range(data.draw(st.integers(0, 3))):
                    getattr(msg, f.name).add().CopyFrom(_message(data, sub_cls, depth + 1))
            else:
                getattr(msg, f.name).CopyFrom(_message(data, sub_cls, depth + 1))
        elif f.is_repeated:
            getattr(msg, f.name).extend(_value(data, f, depth) for _ in range(data.draw(st.integers(0, 4))))
        else:
            setattr(msg, f.name, _value(data, f, depth))
    return msg


def _call(channel: grpc.Channel, path: str, kind: str, bodies: list[bytes], md) -> grpc.StatusCode:
    try:
        if kind == "unary":
            channel.unary_unary(path)(bodies[0], metadata=md, timeout=5)
        elif kind == "server_stream":
            it = channel.unary_stream(path)(bodies[0], metadata=md, timeout=5)
            try:
                next(it)
            finally:
                it.cancel()
        else:
            channel.stream_unary(path)(iter(bodies), metadata=md, timeout=5)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and kind == "server_stream":
            return grpc.StatusCode.OK  # a stream we cut after its first message
        return exc.code()
    return grpc.StatusCode.OK


def _fuzz(address: str, service: str, methods: dict, examples: int) -> dict[str, set]:
    """Every method gets exactly `examples` generated calls (derandomized: the same inputs each run)."""
    seen: dict[str, set] = {m: set() for m in methods}
    key = Ed25519PrivateKey.generate()
    me = peer_id_of(public_bytes(key))
    with grpc.insecure_channel(address) as ch:
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(name, data):
            cls, kind = methods[name]
            path = f"/shoal.v1.{service}/{name}"
            how = data.draw(st.sampled_from(["raw", "message", "signed", "mutated", "bad-sig"]))
            msgs = [_message(data, cls) for _ in range(data.draw(st.integers(1, 3)) if kind == "client_stream" else 1)]
            if data.draw(st.booleans()):  # claim the fuzzer's own identity, to get past the signature check
                for m in msgs:
                    for f in ("peer_id", "sender"):
                        if f in cls.DESCRIPTOR.fields_by_name:
                            setattr(m, f, me)
            md = None
            if how == "raw":
                bodies = [data.draw(st.binary(max_size=300)) for _ in msgs]
            elif how == "mutated":
                bodies = []
                for m in msgs:
                    b = bytearray(m.SerializeToString())
                    for _ in range(data.draw(st.integers(1, 4))):
                        if b:
                            b[data.draw(st.integers(0, len(b) - 1))] ^= 1 << data.draw(st.integers(0, 7))
                        else:
                            b.extend(data.draw(st.binary(min_size=1, max_size=8)))
                    bodies.append(bytes(b))
                try:  # sign what the server will parse, so the mutation reaches the handler
                    md = sign_metadata(key, path, cls.FromString(bodies[0]))
                except (DecodeError, ValueError):
                    md = None
            else:
                bodies = [m.SerializeToString() for m in msgs]
                if how == "signed":
                    md = sign_metadata(key, path, msgs[0])
                elif how == "bad-sig":
                    md = tuple((k, data.draw(st.sampled_from([v, v[::-1], v[:-2], "zz" + v[2:], ""])))
                               for k, v in sign_metadata(key, path, msgs[0]))
            code = _call(ch, path, kind, bodies, md)
            seen[name].add(code)
            assert code not in BAD_CODES, f"{path} ({how}) answered {code}"

        for name in sorted(methods):  # bounded: each call has a 5 s deadline
            one(name)
    return seen


def test_fuzz_every_rpc_then_an_honest_round_commits(procs):
    wd = procs.workdir
    secret = create_secret(wd / "join.secret")
    token = create_token(secret, 600)
    coord, addr = procs.coordinator("--join-token-secret", str(wd / "join.secret"), "--rounds", "1",
                                    "--min-peers", "2", "--initial-peers", "2")
    jobs = []

    def job(rank: int):
        out = wd / f"job-{rank}.json"
        p = procs.start(f"job-{rank}", [sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr,
                                        "--rank", str(rank), "--size", str(SIZE), "--key", str(wd / f"k{rank}.key"),
                                        "--out", str(out), "--timeout", "90", "--insecure", "--join-token", token])
        jobs.append((p, out))

    job(0)  # joined and waiting for a second peer: its data plane is up for fuzzing
    with grpc.insecure_channel(addr) as ch:
        status = ch.unary_unary("/shoal.v1.Coordinator/GetStatus", request_serializer=pb.StatusRequest.SerializeToString,
                                response_deserializer=pb.StatusResponse.FromString)
        end = time.monotonic() + 30
        while not (members := status(pb.StatusRequest(), timeout=5).members):
            assert time.monotonic() < end, procs.log("job-0")
            time.sleep(0.1)
    peer_addr = members[0].address

    seen = _fuzz(addr, "Coordinator", COORDINATOR, EXAMPLES_PER_METHOD)
    seen.update(_fuzz(peer_addr, "Peer", PEER, EXAMPLES_PER_METHOD))
    assert all(seen.values()), f"some RPC was never fuzzed: {seen}"
    assert coord.poll() is None and jobs[0][0].poll() is None, "a server died under fuzzing"

    job(1)
    for p, _ in jobs:
        assert procs.wait_exit(p, 90) == 0, procs.log(p.name)
    expected = sum(make_input(0, r, 0, SIZE, "float32").astype(np.float64) for r in range(2))
    for _, out in jobs:
        assert read_json(out)["committed"] == 1
        np.testing.assert_allclose(np.load(str(out) + ".npy"), expected, rtol=1e-5, atol=1e-5)
