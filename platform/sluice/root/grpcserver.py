"""The gRPC server bootstrap: grpcio's asyncio server in its own process
(`manage.py rungrpc`, which the run command starts), serving `sluice.v1.Inference`,
standard health checking and server reflection (so grpcurl works).

Health follows what the HTTP gateway's `/readyz` says: SERVING while Redis (queue,
limits, breakers) answers, NOT_SERVING while it does not (checked every
READINESS_EVERY_S), so a gRPC readiness probe takes the server out of rotation only
when no call could be served. A database outage leaves it SERVING: cached callers are
served and the rest get a retriable UNAVAILABLE.

Connection settings follow the platform's seed: connections idle for 5 minutes are
closed, keepalive pings every 30 s, at most 1000 concurrent streams per connection, and
bounded message sizes.

TLS (docs/TLS.md): with SLUICE_GRPC_TLS_CERT_FILE and _KEY_FILE (by default the HTTP
server's SLUICE_TLS_* pair) the port takes only TLS (1.2 or 1.3, ALPN h2); without them
it is plaintext HTTP/2, for a proxy in front or loopback. The files are read once, at
start: a renewed certificate takes a restart.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from django.conf import settings
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice import gctuning
from sluice.aio import finish_or_cancel
from sluice.observability import telemetry
from sluice.redis import async_redis
from streaming.protos import inference_pb2, inference_pb2_grpc
from streaming.transports.grpc_service import SERVICE, InferenceServicer, ObservingInterceptor

logger = logging.getLogger("sluice.grpc")
READINESS_EVERY_S = 2.0
_watchers: set[asyncio.Task[None]] = set()

OPTIONS = [
    ("grpc.max_connection_idle_ms", 5 * 60 * 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_concurrent_streams", 1000),
]


def message_options() -> list[tuple[str, int]]:
    size = int(settings.SLUICE_MAX_INFERENCE_BODY_BYTES)
    return [("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", max(size, 16 * 1024 * 1024))]


def credentials() -> grpc.ServerCredentials | None:
    """The port's TLS credentials from the settings, None for plaintext."""
    cert, key = settings.SLUICE_GRPC_TLS_CERT_FILE, settings.SLUICE_GRPC_TLS_KEY_FILE
    if not cert:
        return None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


async def build(address: str) -> tuple[grpc.aio.Server, InferenceServicer, int]:
    """A started server on `address` ("host:port"; port 0 picks one), with TLS when
    the settings give it a certificate."""
    telemetry.setup("sluice-grpc")
    server = grpc.aio.server(options=OPTIONS + message_options(),
                             interceptors=[ObservingInterceptor()])
    servicer = InferenceServicer()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    names = (inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    tls = credentials()
    port = (server.add_secure_port(address, tls) if tls is not None
            else server.add_insecure_port(address))
    await server.start()
    await _set_health(checker, serving=True)
    watcher = asyncio.create_task(_watch_readiness(checker), name="sluice-grpc-readiness")
    _watchers.add(watcher)
    watcher.add_done_callback(_watchers.discard)
    return server, servicer, port


async def _set_health(checker: health.aio.HealthServicer, *, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE):
        await checker.set(name, status)


async def _watch_readiness(checker: health.aio.HealthServicer) -> None:
    """Ping Redis every READINESS_EVERY_S and say in the health service whether calls
    can be served; a change is logged once."""
    client, serving = async_redis(), True
    try:
        while True:
            try:
                ready = bool(await client.ping())
            except Exception as exc:  # any failure to answer is "not ready"
                ready = False
                reason = type(exc).__name__
            if ready != serving:
                serving = ready
                await _set_health(checker, serving=ready)
                if ready:
                    logger.warning("Redis answers again: gRPC health SERVING")
                else:
                    logger.warning("Redis does not answer (%s): gRPC health NOT_SERVING",
                                   reason)
            await asyncio.sleep(READINESS_EVERY_S)
    finally:
        await client.aclose()


async def serve(address: str) -> None:
    server, servicer, port = await build(address)
    gctuning.tune()  # what start-up made lives as long as the process
    logger.info("gRPC serving %s on port %d (%s)", SERVICE, port,
                "TLS" if settings.SLUICE_GRPC_TLS_CERT_FILE else "plaintext")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    await finish_or_cancel(_watchers, 0)
    await servicer.close()
