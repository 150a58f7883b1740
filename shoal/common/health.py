"""Standard gRPC health checking (grpc.health.v1) and server reflection on a grpc.aio server.

Both the coordinator and a peer's data-plane server carry them, so that `grpc_health_probe`,
Kubernetes gRPC probes, load balancers and `grpcurl` work without Shoal-specific tooling.
The overall status ("") and each named service are SERVING from `attach` until `shutdown`,
which flips them to NOT_SERVING before the server drains (clients stop routing to it first).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from shoal.v1 import shoal_pb2 as pb


class HealthReporter:
    """The health servicer of one server and the services it reports on."""

    def __init__(self, services: tuple[str, ...]):
        self.services = services
        self.servicer = health_aio.HealthServicer()

    async def serving(self) -> None:
        for name in ("", *self.services):
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING everywhere; call before stopping the server."""
        await self.servicer.enter_graceful_shutdown()


def attach(server: grpc.aio.Server, services: tuple[str, ...]) -> HealthReporter:
    """Add health checking and reflection for `services` (full names, e.g. "shoal.v1.Coordinator")
    to `server` (before it starts). Call `await reporter.serving()` once it serves."""
    reporter = HealthReporter(services)
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    names = (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return reporter


COORDINATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
PEER_SERVICE = pb.DESCRIPTOR.services_by_name["Peer"].full_name
