"""The quota scripts: reserve / settle / release, calendar and rolling windows (UTC days
and months, leap years), concurrency, shadow quotas, expiry of abandoned reservations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from governance.models import Quota
from governance.quota import (
    PEEK_LUA,
    RESERVE_LUA,
    SETTLE_LUA,
    QuotaUse,
    Settlement,
    keys_for,
    peek_args,
    reserve_args,
    settle_call,
)
from governance.refusals import refusal, shadow_hits

pytestmark = pytest.mark.cluster


def q(pk: int, **kw: Any) -> Quota:
    row = Quota(**kw)
    row.pk = pk
    return row


def ts(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()


def reserve(rds: redis.Redis, quotas: list[Quota], rid: str, tokens: int, clock: float,
            hold: float = 60.0) -> list[Any]:
    keys = keys_for("t", quotas)
    return rds.eval(RESERVE_LUA, len(keys), *keys,
                    *reserve_args(rid, hold, quotas, tokens, clock=clock))


def settle(rds: redis.Redis, quotas: list[Quota], rid: str, tokens: int, clock: float,
           requests: int = 1) -> None:
    keys, args = settle_call("t", quotas, [Settlement(rid, rid, requests, tokens, 0, "m|k|")],
                             clock=clock)
    rds.eval(SETTLE_LUA, len(keys), *keys, *args)


def peek(rds: redis.Redis, quotas: list[Quota], clock: float) -> list[QuotaUse]:
    keys = keys_for("t", quotas)
    return [QuotaUse.from_reply(row)
            for row in rds.eval(PEEK_LUA, len(keys), *keys, *peek_args(quotas, clock))]


def test_reservations_stop_overspend_then_settle_frees_the_difference(rds: redis.Redis
                                                                     ) -> None:
    day = [q(1, period="day", max_tokens=100)]
    now = ts(2026, 12, 3, 12)
    assert reserve(rds, day, "a", 60, now)[0] == 1
    refused = reserve(rds, day, "b", 60, now)
    assert refused[0] == 0
    r = refusal(day, refused)
    assert (r.metric, r.limit, r.used) == ("tokens", 100, 60)
    assert r.resets_at == ts(2026, 12, 4)
    assert "tokens per day" in r.message("m") and "2026-12-04T00:00:00+00:00" in r.message("m")
    settle(rds, day, "a", 25, now)  # it really used 25
    assert reserve(rds, day, "b", 60, now)[0] == 1
    use = peek(rds, day, now)[0]
    assert (use.tokens, use.open_reservations, use.reserved_tokens) == (25, 1, 60)


def test_requests_and_concurrency(rds: redis.Redis) -> None:
    quotas = [q(2, period="minute", max_requests=3), q(3, period="day", max_concurrent=2)]
    now = ts(2026, 12, 3, 12, 0, 10)
    assert reserve(rds, quotas, "a", 1, now)[0] == 1
    assert reserve(rds, quotas, "b", 1, now)[0] == 1
    refused = reserve(rds, quotas, "c", 1, now)
    assert refusal(quotas, refused).metric == "concurrent"
    settle(rds, quotas, "a", 1, now)
    assert reserve(rds, quotas, "c", 1, now)[0] == 1
    settle(rds, quotas, "b", 1, now)
    refused = reserve(rds, quotas, "d", 1, now)  # 2 used + 1 open = 3 of 3 this minute
    assert refusal(quotas, refused).metric == "requests"
    assert reserve(rds, quotas, "d", 1, ts(2026, 12, 3, 12, 1, 0))[0] == 1  # next minute


def test_release_books_nothing(rds: redis.Redis) -> None:
    quotas = [q(4, period="day", max_tokens=10, max_requests=1)]
    now = ts(2026, 12, 3)
    assert reserve(rds, quotas, "a", 10, now)[0] == 1
    settle(rds, quotas, "a", 0, now, requests=0)
    use = peek(rds, quotas, now)[0]
    assert (use.requests, use.tokens, use.open_reservations) == (0, 0, 0)


def test_abandoned_reservations_expire(rds: redis.Redis) -> None:
    quotas = [q(5, period="day", max_concurrent=1)]
    now = ts(2026, 12, 3)
    assert reserve(rds, quotas, "lost", 1, now, hold=30)[0] == 1
    assert reserve(rds, quotas, "next", 1, now + 29)[0] == 0
    assert reserve(rds, quotas, "next", 1, now + 31)[0] == 1


@pytest.mark.parametrize(("moment", "reset"), [
    ((2026, 12, 31, 23, 59), (2027, 1, 1)),
    ((2028, 2, 10), (2028, 3, 1)),  # leap year: February has 29 days
    ((2027, 2, 28, 23), (2027, 3, 1)),
    ((2026, 4, 30, 5), (2026, 5, 1)),
    ((2000, 2, 29), (2000, 3, 1)),
])
def test_calendar_month_bounds(rds: redis.Redis, moment: tuple[int, ...],
                               reset: tuple[int, ...]) -> None:
    month = [q(6, period="month", max_tokens=5)]
    assert peek(rds, month, ts(*moment))[0].resets_at == ts(*reset)


def test_calendar_month_resets_usage(rds: redis.Redis) -> None:
    month = [q(7, period="month", max_tokens=5)]
    assert reserve(rds, month, "a", 5, ts(2028, 2, 29, 23))[0] == 1
    settle(rds, month, "a", 5, ts(2028, 2, 29, 23))
    assert reserve(rds, month, "b", 1, ts(2028, 2, 29, 23, 59))[0] == 0
    assert reserve(rds, month, "b", 1, ts(2028, 3, 1))[0] == 1


def test_rolling_window_slides(rds: redis.Redis) -> None:
    rolling = [q(8, period="minute", window="rolling", max_requests=2)]
    t0 = ts(2026, 12, 3, 12, 0, 30)
    for rid, at in (("a", t0), ("b", t0 + 20)):
        assert reserve(rds, rolling, rid, 0, at)[0] == 1
        settle(rds, rolling, rid, 0, at)
    # a calendar minute would have reset at 12:01:00; the rolling one has not
    assert reserve(rds, rolling, "c", 0, t0 + 40)[0] == 0
    assert reserve(rds, rolling, "c", 0, t0 + 61)[0] == 1  # "a" left the window


def test_shadow_quota_reports_and_admits(rds: redis.Redis) -> None:
    quotas = [q(9, period="day", max_requests=1, shadow=True)]
    now = ts(2026, 12, 3)
    assert reserve(rds, quotas, "a", 0, now) == [1]
    settle(rds, quotas, "a", 0, now)
    reply = reserve(rds, quotas, "b", 0, now)
    assert reply[0] == 1
    assert [(hit.pk, metric) for hit, metric in shadow_hits(quotas, reply)] == [(9, "requests")]


def test_all_or_nothing_across_quotas(rds: redis.Redis) -> None:
    quotas = [q(10, period="day", max_tokens=1000), q(11, period="minute", max_tokens=10)]
    now = ts(2026, 12, 3)
    assert reserve(rds, quotas, "big", 50, now)[0] == 0
    assert peek(rds, quotas, now)[0].open_reservations == 0  # the day quota took nothing


def test_one_call_settles_many_reservations_each_once(rds: redis.Redis) -> None:
    """A flush's settlements of calls with the same quotas go in one call: each open
    reservation is charged what its call used (a release charges nothing), and one
    settled before (a retried flush) is not charged again."""
    quotas = [q(4, period="day", max_tokens=1000), q(5, period="minute", max_requests=10)]
    now = ts(2026, 12, 3, 12, 0, 10)
    for rid in "abcd":
        assert reserve(rds, quotas, rid, 100, now)[0] == 1
    settle(rds, quotas, "a", 30, now)
    keys, args = settle_call("t", quotas, [
        Settlement(rid, rid, requests, tokens, 0, "m|k|")
        for rid, requests, tokens in [("a", 1, 30), ("b", 1, 20), ("c", 0, 0), ("d", 1, 5)]],
        clock=now)
    rds.eval(SETTLE_LUA, len(keys), *keys, *args)
    day, minute = peek(rds, quotas, now)
    assert (day.tokens, day.requests, day.open_reservations, day.reserved_tokens) == \
        (55, 3, 0, 0)
    assert (minute.tokens, minute.requests, minute.open_reservations) == (55, 3, 0)
