"""A TCP relay to Redis that loses replies on purpose: what a Redis restart or a network
failure after a write was applied looks like to a client (redis-py then retries the
command). For the tests of what a retried write must not do twice, and, since it sees
every byte, for the tests that count the commands a client sends."""

from __future__ import annotations

import asyncio
import contextlib


class ReplyCutter:
    """A loopback relay to Redis. While `cut` is set, the next request (with `match`,
    the next that contains it) is relayed, its reply read from Redis in full, and the
    client's connection closed unanswered. `commands(name)`: how many of a command
    the clients sent through it."""

    def __init__(self, host: str, port: int, match: bytes | None = None) -> None:
        self.target = (host, port)
        self.match = match
        self.cut = False
        self.cuts = 0
        self.sent = bytearray()  # every byte the clients sent, to count commands in
        self.connections = 0  # client connections relayed
        self.writes = 0  # reads of client data (one per client write, when not split)
        self.upstreams: list[str] = []  # host:port of each relayed connection to Redis
        self.server: asyncio.Server | None = None

    def commands(self, name: bytes) -> int:
        return self.sent.count(b"\r\n" + name + b"\r\n")

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.connections += 1
        host, port = up_writer.get_extra_info("sockname")[:2]
        self.upstreams.append(f"{host}:{port}")
        cutting = False

        async def upward() -> None:
            nonlocal cutting
            while data := await reader.read(65536):
                self.sent += data
                self.writes += 1
                cutting = cutting or (self.cut and (self.match is None or self.match in data))
                up_writer.write(data)
                await up_writer.drain()

        async def downward() -> None:
            while data := await up_reader.read(65536):
                if cutting:
                    # Let Redis finish answering (every command of the request runs),
                    # then close the client's connection with the reply unsent.
                    with contextlib.suppress(TimeoutError):
                        while await asyncio.wait_for(up_reader.read(65536), 0.3):
                            pass
                    self.cut = False
                    self.cuts += 1
                    return
                writer.write(data)
                await writer.drain()

        pumps = [asyncio.create_task(upward()), asyncio.create_task(downward())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            writer.close()
            up_writer.close()
