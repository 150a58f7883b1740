"""Request signing: good requests pass; forged identity, replay, staleness and tampering fail."""

from __future__ import annotations


import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal.common.errors import grpc_errors
from shoal.common.identity import (
    RequestVerifier,
    public_bytes,
    sign_metadata,
)


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


class VerifyingHealth(health.aio.HealthServicer):
    """Health servicer that demands a signed request, as the coordinator's servicers will."""

    METHOD = "/grpc.health.v1.Health/Check"

    def __init__(self) -> None:
        super().__init__()
        self.verifier = RequestVerifier()
        self.callers: list[bytes] = []

    async def Check(self, request, context):
        async with grpc_errors(context):
            md = context.invocation_metadata()
            self.callers.append(self.verifier.verify(md, self.METHOD, request))
        return await super().Check(request, context)


@pytest.mark.timeout(30)
async def test_signed_call_over_grpc(key):
    servicer = VerifyingHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest()
            md = sign_metadata(key, VerifyingHealth.METHOD, req)
            resp = await stub.Check(req, metadata=md, timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert servicer.callers == [public_bytes(key)]
            for metadata in (md, ()):  # replay, then unsigned
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(req, metadata=metadata, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replayed" in (await _details(stub, req, md))
    finally:
        await server.stop(grace=None)


async def _details(stub, req, md) -> str:
    try:
        await stub.Check(req, metadata=md, timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.details() or ""
    return ""
