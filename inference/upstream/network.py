"""The upstream client's HTTP/1.1 connections: asyncio-native, kept alive, each opened
through the SSRF guard.

`Pool(base_url, private_ok=..., max_connections=...)` holds the connections to one
upstream; `pool.request(method, path, headers=..., body=..., timeouts=...)` is an async
context manager whose `Reply` has the `status` and yields the body's parts as they
arrive (`async for part in reply.parts()`). A connection is a protocol on the event
loop's own transport with httptools' parser (llhttp, what uvicorn parses with): no
task, lock or cancel scope of its own per request (httpcore's pool over anyio cost
about a third of an upstream worker's CPU per call).

- The guard: a URL was checked when a platform admin saved it, but a name can resolve
  elsewhere later (DNS rebinding, a changed record). Each new connection resolves the
  host itself, is refused (UpstreamURLError, never retried) when any address is
  forbidden (inference/upstream/urls.py), and dials a vetted address, so what was
  checked is what is dialled. TLS still verifies the certificate against the URL's host
  name. No proxy from the environment is used; redirects are not followed.
- Reuse: a connection goes back to the pool only after a whole reply that lets it be
  kept alive, and is dropped when the server closes it or after `keepalive_s` idle. A
  request is never sent twice: one that meets a connection the server closes (an
  upstream that died, or one closing an idle connection just as it was reused) fails
  with `Disconnected`, which the caller may retry.
- Leaving the context before the reply ended (cancellation, an error) closes the
  connection: the upstream sees its client go.
- Timeouts (`Timeouts`): `connect` bounds resolving and connecting; `read` each wait for
  the reply's next bytes, and a send stalled by a full socket buffer.
- Failures are `NetworkError`s: `ConnectFailed`, `ReadTimeout`, `Disconnected`,
  `BadReply`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from inference.upstream.urls import UpstreamURLError, check_addresses

_PAUSE_AT = 1024 * 1024  # of reply bytes received and not yet read: stop reading
_RESUME_AT = 256 * 1024


class NetworkError(Exception):
    """The connection to the upstream failed (not the upstream's answer)."""


class ConnectFailed(NetworkError):
    """No connection could be made: the name does not resolve, the connect was refused
    or timed out."""


class ReadTimeout(NetworkError):
    """The upstream was silent (or did not take what was sent) past the read timeout."""


class Disconnected(NetworkError):
    """The connection closed before the reply ended."""


class BadReply(NetworkError):
    """The reply is not HTTP/1.1 this client reads."""


@dataclass(frozen=True)
class Timeouts:
    connect: float
    read: float


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its reply parsed as it comes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.lost = False
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.received = False  # a byte of the current reply came
        self.headers_done = self.complete = self.keep_alive = False
        self._until_close = True  # no Content-Length, not chunked: the body ends at close
        self._parts: deque[bytes] = deque()
        self._size = 0
        self._failure: NetworkError | None = None

    # -- the loop's callbacks ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            self._fail(BadReply("The upstream sent bytes no request asked for."))
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadReply(f"The upstream's reply is not HTTP/1.1: {exc}"))
            return
        if self._size > _PAUSE_AT and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.headers_done and not self.complete and self._until_close:
            self.complete = True  # a body delimited by the close has ended
        elif not self.complete and self._failure is None:
            self._failure = Disconnected("The upstream closed the connection.")
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # -- the parser's callbacks ----------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding"
                                         and b"chunked" in value.lower()):
            self._until_close = False

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # noqa: S101
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200:  # an interim reply: the real one follows
            self.status = 0
            return
        self.headers_done = True
        if self.status in (204, 304):
            self._until_close = False

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)
        self._size += len(body)

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return  # the interim reply's end
        assert self._parser is not None  # noqa: S101
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # -- the request's side ------------------------------------------------------------
    def _fail(self, failure: NetworkError) -> None:
        if self._failure is None:
            self._failure = failure
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, timeout: float) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._waiter
        except TimeoutError:
            raise ReadTimeout("The upstream stopped answering.") from None
        finally:
            self._waiter = None

    async def send(self, data: bytes, timeouts: Timeouts) -> None:
        """Send a request and wait for its reply's head (`status`)."""
        assert self.transport is not None  # noqa: S101
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        self.transport.write(data)
        if self._writable is not None:
            try:
                async with asyncio.timeout(timeouts.read):
                    await self._writable
            except TimeoutError:
                raise ReadTimeout("The upstream does not take the request.") from None
        while not self.headers_done:
            if self._failure is not None:
                raise self._failure
            await self._wait(timeouts.read)

    async def parts(self, timeouts: Timeouts) -> AsyncIterator[bytes]:
        """The reply's body, part by part, as it arrives."""
        while True:
            while self._parts:
                part = self._parts.popleft()
                self._size -= len(part)
                if self._size < _RESUME_AT and self.transport is not None \
                        and not self.lost:
                    self.transport.resume_reading()
                yield part
            if self.complete:
                return
            if self._failure is not None:
                raise self._failure
            await self._wait(timeouts.read)

    def reusable(self) -> bool:
        return (self.complete and self.keep_alive and not self._parts and not self.lost
                and self._failure is None and self.transport is not None
                and not self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Reply:
    """An upstream's reply: its status, then its body's parts."""

    def __init__(self, connection: _Connection, timeouts: Timeouts) -> None:
        self.status = connection.status
        self._connection, self._timeouts = connection, timeouts

    def parts(self) -> AsyncIterator[bytes]:
        return self._connection.parts(self._timeouts)


class Pool:
    """The connections to one upstream (`base_url`'s scheme, host and port): at most
    `max_connections` kept alive. Build and use it inside one event loop."""

    def __init__(self, base_url: str, *, private_ok: bool, max_connections: int,
                 keepalive_s: float = 30.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UpstreamURLError("Upstreams are reached over http or https.")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        named = f"[{self.host}]" if ":" in self.host else self.host
        default = self.port == (443 if self._ssl else 80)
        self._host_header = (named if default else f"{named}:{self.port}").encode()
        self.private_ok = private_ok
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    def _head(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
              length: int) -> bytes:
        lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: " + self._host_header,
                 b"Content-Length: " + str(length).encode()]
        lines += [name + b": " + value for name, value in headers]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    @asynccontextmanager
    async def request(self, method: str, target: str, *, headers: list[tuple[bytes, bytes]],
                      body: bytes, timeouts: Timeouts) -> AsyncIterator[Reply]:
        """`target`: the path (and query) on the upstream."""
        data = self._head(method, target, headers, len(body)) + body
        connection = self._reused()
        try:
            if connection is None:
                connection = await self._connect(timeouts.connect)
            await connection.send(data, timeouts)
            yield Reply(connection, timeouts)
        except OSError as exc:
            raise Disconnected(f"The connection to the upstream failed: {exc}") from exc
        finally:
            if connection is not None:
                if connection.reusable() and len(self._idle) < self.max_connections:
                    connection.idle_since = time.monotonic()
                    self._idle.append(connection)
                else:
                    connection.close()

    def _reused(self) -> _Connection | None:
        """The most recently used live idle connection, if any (the others age out)."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable() and now - connection.idle_since < self.keepalive_s:
                return connection
            connection.close()
        return None

    async def _connect(self, timeout: float) -> _Connection:
        """A new connection to one of the host's addresses, all of which the guard
        allows."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise ConnectFailed(f"{self.host} does not resolve") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        check_addresses(self.host, addresses, private_ok=self.private_ok)
        failure: Exception = ConnectFailed(f"{self.host} does not resolve")
        for address in addresses:
            try:
                async with asyncio.timeout(timeout):
                    _transport, connection = await loop.create_connection(
                        _Connection, address, self.port, ssl=self._ssl,
                        server_hostname=self.host if self._ssl else None)
                return connection
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                failure = ConnectFailed(f"{self.host}:{self.port} cannot be reached: "
                                        f"{type(exc).__name__}")
        raise failure


__all__ = [
    "BadReply",
    "ConnectFailed",
    "Disconnected",
    "NetworkError",
    "Pool",
    "ReadTimeout",
    "Reply",
    "Timeouts",
    "UpstreamURLError",
]
