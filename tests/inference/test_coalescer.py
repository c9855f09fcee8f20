"""The Coalescer (platform/sluice/redisdirect.py), which sends the gateway's admission and
enqueue scripts: concurrent calls' scripts leave in one write on a connection of the
coalescer's own, a batch in flight does not hold back the next ones (up to a bound),
errors stay with their call, and a dead or stalled connection costs one batch at most.
Against the real Redis, through a counting relay."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from secrets import token_hex
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio as aioredis

from sluice.redisdirect import Coalescer
from tests.conftest import RELAYED
from tests.replycutter import ReplyCutter

pytestmark = RELAYED  # every test puts the relay in front of Redis

ECHO_LUA = "return {KEYS[1], ARGV[1]}"
REFUSE_LUA = "return redis.error_reply('REFUSED ' .. ARGV[1])"
# Holds Redis for ARGV[1] microseconds (a batch Redis is slow to answer).
SLOW_LUA = """local t = redis.call('TIME')
repeat local n = redis.call('TIME')
until (n[1] - t[1]) * 1000000 + (n[2] - t[2]) >= tonumber(ARGV[1])
return ARGV[1]"""
# How long a slow batch holds Redis: long enough that a busy machine's event loop
# (the relay shares it) does not see one finish before the test looks.
HOLD_US = 500_000


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for what the relay has seen (a command sent), not for a guessed time."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.002)


def through_relay(redis_url: str, scenario: Callable[[Coalescer, ReplyCutter],
                                                     Awaitable[Any]],
                  in_flight: int = Coalescer.IN_FLIGHT) -> Any:
    url = urlsplit(redis_url)

    async def main() -> Any:
        cutter = ReplyCutter(url.hostname or "127.0.0.1", url.port or 6379)
        port = await cutter.start()
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/{url.path[1:] or 0}",
                                         socket_timeout=5)
        coalescer = Coalescer(client, in_flight=in_flight)
        try:
            return await scenario(coalescer, cutter)
        finally:
            await coalescer.aclose()
            await client.aclose()
            await cutter.close()

    return asyncio.run(main())


def test_concurrent_scripts_leave_in_one_write_and_an_error_fails_only_its_call(
        redis_url: str, rds: redis.Redis) -> None:
    rds.script_load(ECHO_LUA)
    rds.script_load(REFUSE_LUA)

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        assert await coalescer.script(ECHO_LUA, ["first"], [0]) == [b"first", b"0"]
        writes = cutter.writes  # the connection's set-up and the first call
        calls = [coalescer.script(ECHO_LUA, [f"k{i}"], [i]) for i in range(50)]
        calls.insert(25, coalescer.script(REFUSE_LUA, ["k"], ["this one"]))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        refused = replies.pop(25)
        assert isinstance(refused, redis.ResponseError) and "REFUSED this one" in str(refused)
        assert replies == [[f"k{i}".encode(), str(i).encode()] for i in range(50)]
        assert cutter.commands(b"EVALSHA") == 52 and cutter.commands(b"EVAL") == 0
        assert cutter.writes == writes + 1, "one write for the whole batch"
        # Batches one after another keep to one connection.
        assert await coalescer.script(ECHO_LUA, ["again"], [1]) == [b"again", b"1"]
        assert cutter.connections == 1 and cutter.writes == writes + 2

    through_relay(redis_url, scenario)


def test_a_batch_in_flight_does_not_hold_back_the_next_up_to_the_bound(
        redis_url: str, rds: redis.Redis) -> None:
    """While Redis works on one batch, the next calls leave at once on another
    connection, up to `in_flight` batches; a call that finds every connection busy
    leaves when one comes back."""
    rds.script_load(ECHO_LUA)
    rds.script_load(SLOW_LUA)

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        # Both connections open first (a connection's handshake waits for a busy Redis).
        warm = coalescer.script(SLOW_LUA, ["k"], [HOLD_US])
        await until(lambda: cutter.commands(b"EVALSHA") == 1)
        assert await coalescer.script(ECHO_LUA, ["k"], ["warm"]) == [b"k", b"warm"]
        assert await warm == str(HOLD_US).encode() and cutter.connections == 2
        sent = cutter.commands(b"EVALSHA")
        first = coalescer.script(SLOW_LUA, ["a"], [HOLD_US])
        await until(lambda: cutter.commands(b"EVALSHA") == sent + 1)
        second = coalescer.script(SLOW_LUA, ["b"], [HOLD_US])
        await until(lambda: cutter.commands(b"EVALSHA") == sent + 2)
        third = coalescer.script(ECHO_LUA, ["c"], ["last"])
        await asyncio.sleep(0.05)  # time for the third to leave, were it to
        assert not first.done()
        assert cutter.commands(b"EVALSHA") == sent + 2, \
            "the second batch is out while the first is in flight; the third waits"
        assert cutter.connections == 2
        assert await third == [b"c", b"last"]
        assert first.done() and await first == str(HOLD_US).encode()
        assert await second == str(HOLD_US).encode()
        assert cutter.connections == 2 and cutter.commands(b"EVALSHA") == sent + 3

    through_relay(redis_url, scenario, in_flight=2)


def test_a_script_redis_does_not_know_runs_once_more_with_eval(
        redis_url: str, rds: redis.Redis) -> None:
    # A script no client has loaded (its text, and so its SHA, is this test's own): a
    # SCRIPT FLUSH would empty the cache of every test sharing the server.
    unknown = f"{ECHO_LUA} -- {token_hex(8)}"

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        assert await coalescer.script(unknown, ["k"], ["v"]) == [b"k", b"v"]
        assert cutter.commands(b"EVALSHA") == 1 and cutter.commands(b"EVAL") == 1
        assert await coalescer.script(unknown, ["k"], ["w"]) == [b"k", b"w"]  # cached now
        assert cutter.commands(b"EVALSHA") == 2 and cutter.commands(b"EVAL") == 1

    through_relay(redis_url, scenario)


@pytest.mark.parametrize("idle_check", [True, False])
def test_a_connection_closed_while_idle(redis_url: str, rds: redis.Redis,
                                        idle_check: bool) -> None:
    """Redis closed the coalescer's connection (a restart, an idle timeout) while no
    batch was in flight. Idle long enough to be checked, the next batch reconnects
    first; not checked (busy until just now), that batch fails retriably (RedisError)
    and the one after it reconnects. Nothing is sent twice."""
    rds.script_load(ECHO_LUA)

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        assert await coalescer.script(ECHO_LUA, ["k"], [1]) == [b"k", b"1"]
        for upstream in cutter.upstreams:  # the relay's connections: the coalescer's
            rds.client_kill_filter(addr=upstream)
        await asyncio.sleep(0.2)
        for connection in coalescer.connections:
            connection.IDLE_CHECK_S = 0.1 if idle_check else 60.0
        if idle_check:
            assert await coalescer.script(ECHO_LUA, ["k"], [2]) == [b"k", b"2"]
        else:
            with pytest.raises(redis.ConnectionError):
                await coalescer.script(ECHO_LUA, ["k"], [2])
            assert await coalescer.script(ECHO_LUA, ["k"], [3]) == [b"k", b"3"]
        assert cutter.connections == 2
        # The failed batch is not sent again (it may not have reached the relay).
        assert cutter.commands(b"EVALSHA") in ((2,) if idle_check else (2, 3))

    through_relay(redis_url, scenario)


def test_a_batch_redis_does_not_answer_in_time_fails_retriably_and_the_next_runs(
        redis_url: str, rds: redis.Redis) -> None:
    rds.script_load(ECHO_LUA)

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        assert await coalescer.script(ECHO_LUA, ["k"], ["before"]) == [b"k", b"before"]
        for connection in coalescer.connections:
            connection.timeout_s = 0.2
        rds.client_pause(700, all=True)
        with pytest.raises(redis.TimeoutError):  # a RedisError: the adapters answer 503
            await asyncio.gather(*(coalescer.script(ECHO_LUA, ["k"], [i]) for i in range(3)))
        await asyncio.sleep(0.6)
        assert await coalescer.script(ECHO_LUA, ["k"], ["after"]) == [b"k", b"after"]

    through_relay(redis_url, scenario)


def test_closing_lets_batches_in_flight_finish_then_cancels_what_is_late(
        redis_url: str, rds: redis.Redis) -> None:
    """aclose: a batch in flight that answers within the grace period is delivered; one
    that does not is cancelled (and so are its calls); calls still queued (every
    connection busy) and calls after the close fail with a retriable ConnectionError."""
    rds.script_load(SLOW_LUA)

    async def scenario(coalescer: Coalescer, cutter: ReplyCutter) -> None:
        assert await coalescer.script(SLOW_LUA, ["k"], [1]) == b"1"  # connected
        sent = cutter.commands(b"EVALSHA")
        quick = coalescer.script(SLOW_LUA, ["a"], [HOLD_US])
        await until(lambda: cutter.commands(b"EVALSHA") == sent + 1)
        slow = coalescer.script(SLOW_LUA, ["b"], [3 * HOLD_US])  # the second connection
        await until(lambda: cutter.commands(b"EVALSHA") == sent + 2)
        queued = coalescer.script(SLOW_LUA, ["c"], [1])  # no connection free
        await coalescer.aclose(grace_s=2 * HOLD_US / 1e6)
        assert await quick == str(HOLD_US).encode()
        assert slow.cancelled()
        with pytest.raises(redis.ConnectionError):
            await queued
        with pytest.raises(redis.ConnectionError):
            coalescer.script(SLOW_LUA, ["d"], [1])

    through_relay(redis_url, scenario, in_flight=2)
