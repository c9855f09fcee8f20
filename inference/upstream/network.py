"""The upstream client's connections, checked by the SSRF guard when they are opened.

A URL was checked when a platform admin saved it, but a name can resolve elsewhere
later (DNS rebinding, a changed record). `GuardedBackend` is httpcore's network backend
with the guard in front: it resolves the host itself, refuses the connection when any
address is forbidden (inference/upstream/urls.py), and connects to the vetted address,
so what was checked is what is dialled. TLS still verifies the certificate against the
URL's host name (httpcore passes it as the server name).

`pool()` builds httpcore's connection pool over it (the upstream client speaks HTTP
through httpcore directly: httpx's client layer cost a third of a call's CPU here):
proxies from the environment are not used (a proxy would be dialled instead of the
vetted address), redirects are not followed.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING

import httpcore

from inference.upstream.urls import UpstreamURLError, check_addresses

if TYPE_CHECKING:
    from httpcore._backends.base import SOCKET_OPTION as SocketOption


class GuardedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, *, private_ok: bool) -> None:
        self.private_ok = private_ok
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[SocketOption] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        """A connection to one of `host`'s addresses, all of which the guard allows;
        UpstreamURLError (not a network error: never retried) when one is forbidden."""
        try:
            async with asyncio.timeout(timeout):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise httpcore.ConnectError(f"{host} does not resolve") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        check_addresses(host, addresses, private_ok=self.private_ok)
        failure: Exception = httpcore.ConnectError(f"{host} does not resolve")
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address,
                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[SocketOption] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise UpstreamURLError("Upstreams are reached over TCP only.")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def pool(*, private_ok: bool, max_connections: int) -> httpcore.AsyncConnectionPool:
    """httpcore's pool with at most `max_connections` connections, each opened through
    GuardedBackend."""
    return httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(), max_connections=max_connections,
        max_keepalive_connections=max_connections, keepalive_expiry=30.0,
        network_backend=GuardedBackend(private_ok=private_ok))


__all__ = ["GuardedBackend", "UpstreamURLError", "pool"]
