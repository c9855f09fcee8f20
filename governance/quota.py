"""Tenant x model quotas and budgets: reserve before the call, settle with real usage
after.

A budget (governance.models.Budget) is metered like a quota of one metric, its spend in
nano-dollars (governance/pricing.py) where a quota counts tokens: a call reserves its
worst-case cost and settles its real cost, in the same scripts and round trips as the
quotas (`Metered`: either one).

One Redis script reserves against every quota that applies to a call, all or nothing,
with Redis' clock. A reservation holds the call's token bound (prompt bound + max_tokens)
and one request until it is settled (real usage replaces it) or released (cancelled
before any work, or refused further down the pipeline); a reservation nobody settles
(a gateway that died) expires after the request's deadline. So concurrent calls see each
other's reservations and cannot overshoot a limit.

A call is charged once per request id, to its quotas and the usage counters together
(SETTLE_LUA), by whichever gateway settles it first: the one that ran it, or one that
replayed it to an idempotent retry (the first gateway may have died with the call
running on its worker).

Per quota (budget: `bg:<id>`, its "tokens" nano-dollars), three keys under the
tenant's hash tag:
    sluice:{t}:qt:<id>:u   usage: fields r:<slot> and t:<slot> (requests and tokens)
    sluice:{t}:qt:<id>:r   open reservations: rid -> reserved tokens; #n, #t their totals
    sluice:{t}:qt:<id>:x   reservation expiries: rid scored by its deadline
and per charged request (SETTLED_TTL_S):
    sluice:{t}:settled:<request id>
Calendar windows use one slot per period (UTC minute, day, week from Monday or month;
a budget's `total` one slot forever); rolling windows sixty slots of a sixtieth of the
period, so "the last day" moves in 24-minute steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from governance import usage
from governance.alerts import alert_thresholds
from governance.models import Budget, BudgetWindow, Quota, QuotaPeriod, QuotaWindow
from governance.pricing import NANO_PER_USD

PERIOD_S: dict[str, int] = {QuotaPeriod.MINUTE: 60, QuotaPeriod.DAY: 86_400, QuotaPeriod.MONTH: 0}
ROLLING_MONTH_S = 30 * 86_400
# Period codes past seconds: a calendar week from Monday, and no window at all.
WEEK, TOTAL = -7, -1
BUDGET_PERIOD: dict[str, int] = {BudgetWindow.DAY: 86_400, BudgetWindow.WEEK: WEEK,
                                 BudgetWindow.MONTH: 0, BudgetWindow.TOTAL: TOTAL}
Metered = Quota | Budget
# How long a charged request's mark (`settled_key`) is kept: longer than its events can be
# replayed to an idempotent retry after it ended (inference.queue.OUT_TTL_S, 600 s) and
# than a failed flush is retried (recorder.RETRY_FOR_S, 60 s).
SETTLED_TTL_S = 900
_ROLLING_SLOTS = 60

# How many values `shape_args` gives per quota.
SHAPE = 5

_PRELUDE = f"local SHAPE = {SHAPE}\n" + """
-- ARGV[1]: "" (Redis' clock, what the gateway always sends) or seconds (tests)
local now = tonumber(ARGV[1])
if not now then now = tonumber(redis.call('TIME')[1]) end
local function month_bounds(s)
  -- days since the epoch -> civil date (H. Hinnant's algorithm), UTC
  local days = math.floor(s / 86400)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  local lengths = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31}
  local len = lengths[m]
  if m == 2 and ((y % 4 == 0 and y % 100 ~= 0) or y % 400 == 0) then len = 29 end
  local start = (days - d + 1) * 86400
  return start, start + len * 86400
end
-- -> current slot, first slot in the window, reset time (s). A calendar window's
-- slot is its start in local seconds (UTC + off, the time zone's offset now).
local function window(len, rolling, off)
  if rolling == 1 then
    local slot_len = len / 60
    local slot = math.floor(now / slot_len)
    return slot, slot - 59, (slot + 1) * slot_len
  end
  local t = now + off
  if len == 0 then
    local start, stop = month_bounds(t)
    return start, start, stop - off
  end
  if len == -1 then return 0, 0, 0 end  -- total: one slot, no reset
  if len == -7 then  -- a week from Monday 00:00 (1970-01-05 was a Monday)
    local start = math.floor((t - 345600) / 604800) * 604800 + 345600
    return start, start, start + 604800 - off
  end
  local start = math.floor(t / len) * len
  return start, start, start + len - off
end
-- -> requests and tokens used in the window; drops fields that left it (a budget's
-- alert marks, a:<slot>, too)
local function used(key, first)
  local r, tk = 0, 0
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local f = fields[i]
    local slot = tonumber(string.sub(f, 3))
    local kind = string.sub(f, 1, 1)
    if slot < first then
      redis.call('HDEL', key, f)
    elseif kind == 'r' then
      r = r + tonumber(fields[i + 1])
    elseif kind == 't' then
      tk = tk + tonumber(fields[i + 1])
    end
  end
  return r, tk
end
-- drop one open reservation; the running totals (#n, #t) follow. -> whether it was open
local function unhold(rkey, rid)
  local v = redis.call('HGET', rkey, rid)
  if v then
    redis.call('HDEL', rkey, rid)
    redis.call('HINCRBY', rkey, '#n', -1)
    redis.call('HINCRBY', rkey, '#t', 0 - tonumber(v))
    return true
  end
  return false
end
-- -> open reservations (count, tokens), after dropping expired ones
local function held(rkey, xkey)
  local dead = redis.call('ZRANGEBYSCORE', xkey, '-inf', now)
  for _, rid in ipairs(dead) do unhold(rkey, rid) end
  if #dead > 0 then redis.call('ZREMRANGEBYSCORE', xkey, '-inf', now) end
  local h = redis.call('HMGET', rkey, '#n', '#t')
  return tonumber(h[1] or '0'), tonumber(h[2] or '0')
end
"""

# KEYS: 3 per quota. ARGV: clock, rid, hold seconds, then per quota 8 values: period length
# (0 = calendar month, WEEK, TOTAL), rolling (0/1), max requests, max tokens, max concurrent (-1 =
# none), shadow (0/1), reserved tokens, the time zone's offset now (s).
# Returns {1, shadow hits as "i:metric"...} or {0, quota index, metric, limit, used, reset}.
RESERVE_LUA = _PRELUDE + """
local rid, hold = ARGV[2], tonumber(ARGV[3])
local shadows = {}
for q = 0, #KEYS / 3 - 1 do
  local a = 4 + q * 8
  local len, rolling = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local max_r, max_t, max_c = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local shadow, want = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local slot, first, reset = window(len, rolling, tonumber(ARGV[a + 7]))
  local r, tk = used(KEYS[3 * q + 1], first)
  local n, held_t = held(KEYS[3 * q + 2], KEYS[3 * q + 3])
  local metric, limit, have = nil, 0, 0
  if max_c >= 0 and n + 1 > max_c then metric, limit, have = 'concurrent', max_c, n
  elseif max_r >= 0 and r + n + 1 > max_r then metric, limit, have = 'requests', max_r, r + n
  elseif max_t >= 0 and tk + held_t + want > max_t then
    metric, limit, have = 'tokens', max_t, tk + held_t
  end
  if metric then
    if shadow == 0 then return {0, q, metric, limit, have, math.ceil(reset)} end
    shadows[#shadows + 1] = q .. ':' .. metric
  end
end
for q = 0, #KEYS / 3 - 1 do
  local want = ARGV[4 + q * 8 + 6]
  if redis.call('HSETNX', KEYS[3 * q + 2], rid, want) == 1 then
    redis.call('HINCRBY', KEYS[3 * q + 2], '#n', 1)
    redis.call('HINCRBY', KEYS[3 * q + 2], '#t', want)
  end
  redis.call('ZADD', KEYS[3 * q + 3], now + hold, rid)
  redis.call('EXPIRE', KEYS[3 * q + 2], math.ceil(hold) + 60)
  redis.call('EXPIRE', KEYS[3 * q + 3], math.ceil(hold) + 60)
end
return {1, unpack(shadows)}
"""

# KEYS: 3 per quota, the tenant's usage counters (governance/usage.py), then the settled
# mark (`settled_key`) of each settlement that charges, in order. ARGV: clock, the number
# of quotas, the marks' TTL, the counters' TTL, per quota its `shape_args` (period
# length, rolling flag, metric: 1 a budget's cost, 0 tokens; offset; alert thresholds
# "pct:nanos,..."), then per settled call (`Settlement`)
# its reservation id, the requests (0/1), prompt and completion tokens to charge, its
# usage counters' field prefix and its cost (nano-dollars, governance/pricing.py): the
# calls of one flush that had the same quotas, in one call. Drops each reservation (one
# no longer open, settled already or expired, is no matter) and charges each request
# once, to the quotas and the usage counters both, whoever settles it first: the
# gateway that ran it, or another that replayed it to a retry (SET NX of its mark). A
# retried flush, or a second settlement of the same request, charges nothing.
# A budget's spend reaching an alert threshold marks its window (field a:<slot>, the
# highest threshold reached) in the same script, so each threshold is returned once per
# window whichever gateway settles: {"<quota index>:<pct>:<spent>:<reset>", ...}.
SETTLE_LUA = _PRELUDE + """
local quotas, mark_ttl, usage_ttl = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local counters = KEYS[3 * quotas + 1]
local reqs, toks, fields = {}, {}, {}
for q = 0, quotas - 1 do reqs[q], toks[q] = 0, 0 end
local mark = 3 * quotas + 1
for s = 5 + SHAPE * quotas, #ARGV, 6 do
  local rid, req = ARGV[s], tonumber(ARGV[s + 1])
  for q = 0, quotas - 1 do
    unhold(KEYS[3 * q + 2], rid)
    redis.call('ZREM', KEYS[3 * q + 3], rid)
  end
  if req > 0 then
    mark = mark + 1
    if redis.call('SET', KEYS[mark], 1, 'NX', 'EX', mark_ttl) then
      local prompt, completion = tonumber(ARGV[s + 2]), tonumber(ARGV[s + 3])
      local cost = tonumber(ARGV[s + 5])
      for q = 0, quotas - 1 do
        local spent = prompt + completion
        if ARGV[7 + q * SHAPE] == '1' then spent = cost end
        reqs[q], toks[q] = reqs[q] + req, toks[q] + spent
      end
      local row = fields[ARGV[s + 4]]
      if not row then
        row = {0, 0, 0, 0}
        fields[ARGV[s + 4]] = row
      end
      row[1], row[2], row[3] = row[1] + req, row[2] + prompt, row[3] + completion
      row[4] = row[4] + cost
    end
  end
end
local fired = {}
for q = 0, quotas - 1 do
  if reqs[q] > 0 or toks[q] > 0 then
    local a = 5 + q * SHAPE
    local len, rolling = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    local slot, first, reset = window(len, rolling, tonumber(ARGV[a + 3]))
    redis.call('HINCRBY', KEYS[3 * q + 1], 'r:' .. slot, reqs[q])
    redis.call('HINCRBY', KEYS[3 * q + 1], 't:' .. slot, toks[q])
    if ARGV[a + 4] ~= '' then
      local _, spent = used(KEYS[3 * q + 1], first)
      local high = tonumber(redis.call('HGET', KEYS[3 * q + 1], 'a:' .. slot)) or 0
      local top = high
      for pct, at in string.gmatch(ARGV[a + 4], '(%d+):(%d+)') do
        pct = tonumber(pct)
        if pct > high and spent >= tonumber(at) then
          fired[#fired + 1] = q .. ':' .. pct .. ':' .. spent .. ':' .. math.ceil(reset)
          if pct > top then top = pct end
        end
      end
      if top > high then redis.call('HSET', KEYS[3 * q + 1], 'a:' .. slot, top) end
    end
    if len == -1 then
      redis.call('PERSIST', KEYS[3 * q + 1])  -- a total is kept while its budget is
    else
      local keep = ((len == 0 and 32 * 86400) or (len == -7 and 604800) or len) * 2 + 3600
      redis.call('EXPIRE', KEYS[3 * q + 1], keep)
    end
  end
end
if next(fields) then
  for prefix, row in pairs(fields) do
    redis.call('HINCRBY', counters, prefix .. 'r', row[1])
    redis.call('HINCRBY', counters, prefix .. 'p', row[2])
    redis.call('HINCRBY', counters, prefix .. 'c', row[3])
    if row[4] > 0 then redis.call('HINCRBY', counters, prefix .. 'n', row[4]) end
  end
  redis.call('EXPIRE', counters, usage_ttl)
end
return fired
"""

# KEYS: 3 per quota. ARGV: clock, then per quota its `shape_args`.
# Returns per quota {requests used, tokens used, open reservations, reserved tokens, reset,
# the highest alert threshold reached in the window}.
PEEK_LUA = _PRELUDE + """
local out = {}
for q = 0, #KEYS / 3 - 1 do
  local a = 2 + q * SHAPE
  local len, rolling = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local slot, first, reset = window(len, rolling, tonumber(ARGV[a + 3]))
  local r, tk = used(KEYS[3 * q + 1], first)
  local n, held_t = held(KEYS[3 * q + 2], KEYS[3 * q + 3])
  local alerted = tonumber(redis.call('HGET', KEYS[3 * q + 1], 'a:' .. slot)) or 0
  out[#out + 1] = {r, tk, n, held_t, math.ceil(reset), alerted}
end
return out
"""


def period_len(quota: Metered) -> int:
    """The period in seconds (0: a calendar month; WEEK, TOTAL: a budget's). A period
    that is none of the choices (a row edited in the database; the hot path's are
    repaired on load, governance.ranges.sane) is read as a day, the default."""
    if isinstance(quota, Budget):
        return BUDGET_PERIOD.get(quota.window, BUDGET_PERIOD[BudgetWindow.MONTH])
    seconds = PERIOD_S.get(quota.period, PERIOD_S[QuotaPeriod.DAY])
    if quota.window == QuotaWindow.ROLLING:
        return seconds or ROLLING_MONTH_S
    return seconds


def _rolling(quota: Metered) -> int:
    return int(isinstance(quota, Quota) and quota.window == QuotaWindow.ROLLING)


def keys_for(tenant: str, quotas: Sequence[Metered]) -> list[str]:
    out = []
    for quota in quotas:
        kind = "bg" if isinstance(quota, Budget) else "qt"
        base = f"sluice:{{{tenant}}}:{kind}:{quota.pk}"
        out += [f"{base}:u", f"{base}:r", f"{base}:x"]
    return out


def shape_args(quotas: Sequence[Metered], clock: float | None = None) -> list[Any]:
    """Each quota's SHAPE values for settle and peek: period length, rolling flag,
    metric (1: a budget's cost), the time zone's offset at `clock` (a budget's tenant's;
    a quota's windows are UTC) and its alert thresholds ("pct:nanos,...", "" for none)."""
    at = time.time() if clock is None else clock
    out: list[Any] = []
    for quota in quotas:
        if isinstance(quota, Budget):
            out += [period_len(quota), 0, 1, utc_offset(quota.tenant.time_zone, at),
                    alert_thresholds(quota)]
        else:
            out += [period_len(quota), _rolling(quota), 0, 0, ""]
    return out


def utc_offset(zone: str, at: float) -> int:
    """`zone`'s offset from UTC at epoch seconds `at`, in seconds (UTC for a name that is
    no zone: a row edited in the database; the API checks the name)."""
    if zone == "UTC":
        return 0
    try:
        tz = ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        return 0
    offset = datetime.fromtimestamp(at, tz).utcoffset()
    return int(offset.total_seconds()) if offset is not None else 0


def clock_arg(clock: float | None) -> str:
    return "" if clock is None else repr(float(clock))


def reserve_args(rid: str, hold_s: float, quotas: Sequence[Metered], tokens: int,
                 clock: float | None = None, cost: int = 0) -> list[Any]:
    """RESERVE_LUA's args: `tokens` reserved against each quota, `cost` (nano-dollars,
    the call's worst case) against each budget."""
    out: list[Any] = [clock_arg(clock), rid, repr(float(hold_s))]
    for quota in quotas:
        if isinstance(quota, Budget):
            out += [period_len(quota), 0, -1, limit_nanos(quota), -1, 0, cost,
                    utc_offset(quota.tenant.time_zone, time.time() if clock is None else clock)]
        else:
            out += [period_len(quota), _rolling(quota), _limit(quota.max_requests),
                    _limit(quota.max_tokens), _limit(quota.max_concurrent),
                    int(quota.shadow), tokens, 0]
    return out


def limit_nanos(budget: Budget) -> int:
    return int(budget.limit_usd * NANO_PER_USD)


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class Settlement(NamedTuple):
    """A call's settlement: its reservation (an admission's id; released whatever
    else happens), and what to charge (requests 0: nothing) under its request id, once
    however many gateways settle that request (`settled_key`)."""

    reservation: str
    request: str  # the request id ("" when it charges nothing)
    requests: int
    prompt: int
    completion: int
    usage: str  # its usage counters' field prefix, "<model>|<key prefix>|"
    cost: int = 0  # nano-dollars (governance/pricing.py), charged with the tokens


def settled_key(tenant: str, request: str) -> str:
    """Set when the request is charged: a later settlement of it charges nothing."""
    return f"sluice:{{{tenant}}}:settled:{request}"


def settle_call(tenant: str, quotas: Sequence[Metered], settlements: Sequence[Settlement],
                clock: float | None = None) -> tuple[list[str], list[Any]]:
    """SETTLE_LUA's keys and args: `settlements` (of calls with `quotas`, possibly none)
    charged to the quotas and to the tenant's usage counters of today (UTC)."""
    day = datetime.fromtimestamp(time.time() if clock is None else clock, UTC).date()
    keys = [*keys_for(tenant, quotas), usage.usage_key(tenant, day.isoformat()),
            *(settled_key(tenant, s.request) for s in settlements if s.requests)]
    args: list[Any] = [clock_arg(clock), len(quotas), SETTLED_TTL_S, usage.USAGE_TTL_S,
                       *shape_args(quotas, clock)]
    for s in settlements:
        args += [s.reservation, s.requests, s.prompt, s.completion, s.usage, s.cost]
    return keys, args


def peek_args(quotas: Sequence[Metered], clock: float | None = None) -> list[Any]:
    return [clock_arg(clock), *shape_args(quotas, clock)]


@dataclass(frozen=True)
class QuotaUse:
    requests: int
    tokens: int
    open_reservations: int
    reserved_tokens: int
    resets_at: int
    alerted: int = 0  # a budget's highest alert threshold reached in the window (%)

    @classmethod
    def from_reply(cls, row: list[Any]) -> QuotaUse:
        return cls(*(int(x) for x in row))
