"""Per-deployment circuit breaker, its state shared by every gateway through Redis.

    closed --(window holds >= min_calls and failure rate >= threshold,
              or slow-call rate >= slow threshold)--> open
    open --(open_wait_s passed, on the next call)--> half_open
    half_open: admits at most `half_open_probes` probe calls; each must report within
               probe_timeout_s. All succeed -> closed (window cleared); one fails, is
               slow or times out -> open again.

Outcomes: a worker error of 5xx or a deadline is a failure; a call slower than
slow_call_ms is slow; the tenant's own 4xx and client cancellations never count.
Windows: the last N calls (a capped list) or the last N seconds (per-second counters).

Keys, in the deployment's slot:  sluice:q:{<dep>}:br (state), :brw (count window),
:brt (time window), :brp (open probes: id scored by deadline).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from governance.models import BreakerPolicy
from inference.queue import deployment_key


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(StrEnum):
    SUCCESS = "ok"
    FAILURE = "fail"
    IGNORED = "ignore"  # the caller's 4xx, a client cancel: a probe slot is freed only


# Calls, failures and slow calls of a time window (KEYS[3]: per-second counters "c:<s>",
# "f:<s>", "s:<s>") at second `sec`; `purge` drops the counters that left the window.
_TIME_WINDOW = """
local function time_totals(sec, size, purge)
  local calls, fails, slows = 0, 0, 0
  local fields = redis.call('HGETALL', KEYS[3])
  for j = 1, #fields, 2 do
    local f = fields[j]
    if tonumber(string.sub(f, 3)) <= sec - size then
      if purge then redis.call('HDEL', KEYS[3], f) end
    else
      local n, p = tonumber(fields[j + 1]), string.sub(f, 1, 1)
      if p == 'c' then calls = calls + n elseif p == 'f' then fails = fails + n
      else slows = slows + n end
    end
  end
  return calls, fails, slows
end
"""

_PRELUDE = _TIME_WINDOW + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function reset_window()
  redis.call('HSET', KEYS[1], 'c', 0, 'f', 0, 's', 0)
  redis.call('DEL', KEYS[2], KEYS[3])
end
local function open(reason)
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', tostring(now), 'ok', 0,
             'reason', reason)
  redis.call('HINCRBY', KEYS[1], 'opened', 1)
  reset_window()
  redis.call('DEL', KEYS[4])
end
"""

# KEYS: br, brw, brt, brp. ARGV: probe id, open_wait_s, probes, probe_timeout_s.
# Returns {verdict, retry_ms}: verdict 1 = admitted, 2 = admitted as a probe, 0 = refused.
ADMIT_LUA = _PRELUDE + """
local id, wait, probes, ptimeout = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local s = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'ok')
local state = s[1] or 'closed'
if state == 'closed' then return {1, 0} end
if state == 'open' then
  local left = tonumber(s[2]) + wait - now
  if left > 0 then return {0, math.ceil(left * 1000)} end
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'ok', 0)
  redis.call('DEL', KEYS[4])
  s[3] = '0'
end
-- half open: a probe that never reported is a failure
if redis.call('ZCOUNT', KEYS[4], '-inf', now) > 0 then
  open('probe timed out')
  return {0, math.ceil(wait * 1000)}
end
if redis.call('ZCARD', KEYS[4]) + tonumber(s[3] or '0') >= probes then
  return {0, math.ceil(ptimeout * 1000)}
end
redis.call('ZADD', KEYS[4], now + ptimeout, id)
redis.call('PEXPIRE', KEYS[4], math.ceil((ptimeout + wait) * 1000) + 60000)
return {2, 0}
"""

# KEYS: br, brw, brt, brp. ARGV: probe id ("" = not probes), slow_call_ms, window kind
# (count/time), window size, min calls, failure rate, slow-call rate, probes, then
# outcome (ok/fail/ignore) and latency ms for each call: gateways send the outcomes of
# many calls at once; a probe's alone. Count windows keep running totals (O(1) a call).
# Returns the state after recording.
RECORD_LUA = _PRELUDE + """
local id, slow_ms, kind, size = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local min_calls, fail_rate, slow_rate = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local probes = tonumber(ARGV[8])
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
if id ~= '' then
  local outcome, ms = ARGV[9], tonumber(ARGV[10])
  if state ~= 'half_open' or redis.call('ZREM', KEYS[4], id) == 0 then return state end
  if outcome == 'ignore' then return state end
  if outcome == 'fail' or ms >= slow_ms then
    open(outcome == 'fail' and 'probe failed' or 'probe slow')
    return 'open'
  end
  if redis.call('HINCRBY', KEYS[1], 'ok', 1) >= probes then
    redis.call('HSET', KEYS[1], 'state', 'closed', 'ok', 0)
    reset_window()
    redis.call('DEL', KEYS[4])
    return 'closed'
  end
  return state
end
if state ~= 'closed' then return state end
local sec = math.floor(now)
local tc, tf, ts = 0, 0, 0  -- a time window's totals: read once, then kept per call
if kind ~= 'count' then tc, tf, ts = time_totals(sec, size, true) end
for i = 9, #ARGV, 2 do
  local outcome, ms = ARGV[i], tonumber(ARGV[i + 1])
  if outcome ~= 'ignore' then
    local bad, slow = outcome == 'fail', ms >= slow_ms
    local calls, fails, slows
    if kind == 'count' then
      redis.call('LPUSH', KEYS[2], (bad and 'f' or 'o') .. (slow and 's' or '-'))
      calls = redis.call('HINCRBY', KEYS[1], 'c', 1)
      fails = redis.call('HINCRBY', KEYS[1], 'f', bad and 1 or 0)
      slows = redis.call('HINCRBY', KEYS[1], 's', slow and 1 or 0)
      if calls > size then
        local old = redis.call('RPOP', KEYS[2])
        calls = redis.call('HINCRBY', KEYS[1], 'c', -1)
        if string.sub(old, 1, 1) == 'f' then fails = redis.call('HINCRBY', KEYS[1], 'f', -1) end
        if string.sub(old, 2, 2) == 's' then slows = redis.call('HINCRBY', KEYS[1], 's', -1) end
      end
    else
      redis.call('HINCRBY', KEYS[3], 'c:' .. sec, 1)
      if bad then redis.call('HINCRBY', KEYS[3], 'f:' .. sec, 1) end
      if slow then redis.call('HINCRBY', KEYS[3], 's:' .. sec, 1) end
      tc, tf, ts = tc + 1, tf + (bad and 1 or 0), ts + (slow and 1 or 0)
      calls, fails, slows = tc, tf, ts
    end
    if calls >= min_calls then
      if fails / calls >= fail_rate then open('failure rate'); return 'open' end
      if slows / calls >= slow_rate then open('slow-call rate'); return 'open' end
    end
  end
end
redis.call('EXPIRE', KEYS[1], 86400 * 7)
redis.call('EXPIRE', KEYS[2], 86400)
redis.call('EXPIRE', KEYS[3], size + 60)
return 'closed'
"""

# KEYS: br, brw, brt, brp. ARGV: window kind, window size.
# Returns {state, calls, failures, slow, opened_at, reason, times opened}.
PEEK_LUA = _TIME_WINDOW + """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local s = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'reason', 'opened', 'c', 'f', 's')
local calls, fails, slows = tonumber(s[5] or '0'), tonumber(s[6] or '0'), tonumber(s[7] or '0')
if ARGV[1] ~= 'count' then
  calls, fails, slows = time_totals(sec, tonumber(ARGV[2]), false)
end
return {s[1] or 'closed', calls, fails, slows, s[2] or '', s[3] or '', s[4] or '0'}
"""


def keys(deployment: str) -> list[str]:
    return [deployment_key(deployment, name) for name in ("br", "brw", "brt", "brp")]


async def is_closed(redis: Any, deployment: str) -> bool:
    """The shared state alone, read without taking a probe slot (gateways keep it for a
    moment; only a breaker not closed needs ADMIT_LUA's per-call verdict)."""
    state = await redis.hget(keys(deployment)[0], "state")
    return state is None or (state.decode() if isinstance(state, bytes) else state) == State.CLOSED


def admit_args(probe_id: str, policy: BreakerPolicy) -> list[Any]:
    return [probe_id, repr(policy.open_wait_s), policy.half_open_probes,
            repr(policy.probe_timeout_s)]


def record_args(probe_id: str, calls: list[tuple[Outcome, float]],
                policy: BreakerPolicy) -> list[Any]:
    """ARGV for RECORD_LUA: a probe's one call, or a batch of ordinary calls."""
    args: list[Any] = [probe_id, policy.slow_call_ms, policy.window_kind, policy.window_size,
                       policy.min_calls, repr(policy.failure_rate),
                       repr(policy.slow_call_rate), policy.half_open_probes]
    for outcome, latency_ms in calls:
        args += [outcome.value, repr(float(latency_ms))]
    return args


def peek_args(policy: BreakerPolicy) -> list[Any]:
    return [policy.window_kind, policy.window_size]


@dataclass(frozen=True)
class Snapshot:
    state: State
    calls: int
    failures: int
    slow: int
    opened_at: float | None
    reason: str
    times_opened: int

    @classmethod
    def from_reply(cls, reply: list[Any]) -> Snapshot:
        s = [x.decode() if isinstance(x, bytes) else x for x in reply]
        return cls(state=State(s[0]), calls=int(s[1]), failures=int(s[2]), slow=int(s[3]),
                   opened_at=float(s[4]) if s[4] else None, reason=str(s[5]),
                   times_opened=int(s[6]))


def default_policy(deployment_id: int) -> BreakerPolicy:
    """The thresholds a deployment without its own row uses (the model's defaults)."""
    return BreakerPolicy(deployment_id=deployment_id)

