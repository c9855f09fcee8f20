"""The upstream client's HTTP/1.1 connections (inference/upstream/network.py) against a
small real HTTP server on loopback, on asyncio's loop and on uvloop's (the worker's):
reuse, a request the server dropped, body framings, leaving early, the timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from inference.upstream.network import (
    ConnectFailed,
    Disconnected,
    Pool,
    ReadTimeout,
    Timeouts,
    UpstreamURLError,
)
from sluice.localinfra import free_port

TIMEOUTS = Timeouts(connect=5.0, read=5.0)
HEADERS = [(b"Content-Type", b"application/json")]


@dataclass
class Server:
    """Counts connections and requests; `reply(n, writer)` answers the n-th request of
    a connection (0-based) and says whether the connection stays open."""

    reply: Callable[[int, asyncio.StreamWriter], Awaitable[bool]]
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(await reader.readexactly(length))
                if not await self.reply(n, writer):
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


def ok(body: bytes = b'{"ok": true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


Answer = Callable[[int, asyncio.StreamWriter], Awaitable[bool]]
LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def served(loop: str, reply: Answer, check: Callable[[Server, Pool], Awaitable[None]]) -> None:
    """Run `check` on `loop` against a server answering with `reply`, through a pool."""
    async def main() -> None:
        server, port = Server(reply), free_port()
        async with await asyncio.start_server(server.handle, "127.0.0.1", port):
            pool = Pool(f"http://127.0.0.1:{port}/v1", private_ok=True, max_connections=2)
            try:
                await check(server, pool)
            finally:
                await pool.aclose()
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


async def body_of(pool: Pool, payload: bytes = b"{}") -> tuple[int, bytes]:
    async with pool.request("POST", "/v1/x", headers=HEADERS, body=payload,
                            timeouts=TIMEOUTS) as reply:
        return reply.status, b"".join([part async for part in reply.parts()])


@LOOPS
def test_a_kept_alive_connection_carries_the_next_request(loop: str) -> None:
    async def reply(n: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(ok(b"reply %d" % n))
        return True

    async def check(server: Server, pool: Pool) -> None:
        assert [await body_of(pool, b"%d" % i) for i in range(3)] == [
            (200, b"reply 0"), (200, b"reply 1"), (200, b"reply 2")]
        assert server.connections == 1 and server.requests == [b"0", b"1", b"2"]
    served(loop, reply, check)


@LOOPS
def test_a_request_the_server_drops_is_disconnected_and_not_sent_again(loop: str) -> None:
    async def reply(n: int, writer: asyncio.StreamWriter) -> bool:
        if n == 1:
            return False  # read the second request, then close without a reply
        writer.write(ok(b"reply %d" % n))
        return True

    async def check(server: Server, pool: Pool) -> None:
        assert await body_of(pool) == (200, b"reply 0")
        with pytest.raises(Disconnected):
            await body_of(pool, b"dropped")
        assert await body_of(pool, b"next") == (200, b"reply 0")  # a new connection
        assert server.connections == 2 and server.requests == [b"{}", b"dropped", b"next"]
    served(loop, reply, check)


@LOOPS
def test_chunked_and_close_delimited_bodies_are_read_whole(loop: str) -> None:
    async def reply(n: int, writer: asyncio.StreamWriter) -> bool:
        if n == 0:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for piece in (b"data: one\n\n", b"data: two\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            return True
        writer.write(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\nuntil the close")
        return False

    async def check(server: Server, pool: Pool) -> None:
        assert await body_of(pool) == (200, b"data: one\n\ndata: two\n\n")
        assert await body_of(pool) == (503, b"until the close")
        assert server.connections == 1
    served(loop, reply, check)


@LOOPS
def test_leaving_before_the_reply_ends_closes_the_connection(loop: str) -> None:
    async def reply(n: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        return True  # and never ends it

    async def check(server: Server, pool: Pool) -> None:
        async with pool.request("POST", "/v1/x", headers=HEADERS, body=b"{}",
                                timeouts=TIMEOUTS) as got:
            async for part in got.parts():
                assert part == b"first"
                break
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
    served(loop, reply, check)


@LOOPS
def test_silence_is_a_read_timeout_and_nobody_listening_a_connect_failure(loop: str) -> None:
    async def reply(n: int, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    async def check(server: Server, pool: Pool) -> None:
        with pytest.raises(ReadTimeout):
            async with pool.request("POST", "/v1/x", headers=HEADERS, body=b"{}",
                                    timeouts=Timeouts(connect=5.0, read=0.2)):
                pass
        nobody = Pool(f"http://127.0.0.1:{free_port()}", private_ok=True, max_connections=1)
        with pytest.raises(ConnectFailed):
            await body_of(nobody)
        guarded = Pool(f"http://localhost:{free_port()}", private_ok=False, max_connections=1)
        with pytest.raises(UpstreamURLError):
            await body_of(guarded)
    served(loop, reply, check)
