"""Per-deployment circuit breaker, its state shared by every gateway through Redis.

    closed --(window holds >= min_calls and failure rate >= threshold,
              or slow-call rate >= slow threshold)--> open
    open --(open_wait_s passed, on the next call)--> half_open
    half_open: admits at most `half_open_probes` probe calls; each must report within
               probe_timeout_s. All succeed -> closed (window cleared); one fails, is
               slow or times out -> open again.

Outcomes: a worker error of 5xx or a platform deadline is a failure; a call slower than
slow_call_ms is slow; the tenant's own 4xx, a deadline the caller chose and client
cancellations never count (governance/admission.py decides). Windows: the last N calls
(a capped list) or the last N seconds (per-second counters).

One tenant alone never opens the breaker for everyone. Each outcome names its tenant;
when a window reaches a threshold, the tenant with the most bad calls (`top`) is set
against the rest of the window's calls:
  - other tenants' calls are bad at the threshold rate too: open (an outage, opened
    exactly as fast as without tenants);
  - other tenants' calls are not: only `top` is refused for open_wait_s ("scoped": field
    `t:<tenant>` = opened_at), and the window starts again;
  - no other tenant called: open, "by" `top`: `top` waits open_wait_s, while another
    tenant's calls probe it at once (half-open rules); their probes succeeding close it
    and leave `top` scoped for the rest of its wait, one failing opens it for everyone.
Outcomes with no tenant (tenant "") count as before: the breaker opens for everyone.

Keys, in the deployment's slot:  sluice:q:{<dep>}:br (state, scoped tenants), :brw (count
window: one entry per call; time window: one per tenant per recorded batch, for the
per-tenant counts), :brt (time window totals), :brp (open probes: id scored by deadline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from governance.models import BreakerPolicy
from inference.jobs import FinalEvent, is_done, is_error
from inference.queue import deployment_key
from sluice.errors import DeadlineExceeded


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(StrEnum):
    SUCCESS = "ok"
    FAILURE = "fail"
    IGNORED = "ignore"  # the caller's 4xx, a client cancel: a probe slot is freed only


def outcome_of(final: FinalEvent | None, status: int, *, error: BaseException | None,
               caller_deadline: bool) -> Outcome:
    """What a call that ended with `final` (None: never seen to end, `error` why) and
    `status` says of its deployment. The platform's deadline and a 5xx are failures;
    the caller's own deadline (`caller_deadline`: shorter than the platform's), its
    4xx, a cancellation and a call we never saw end are not."""
    if final is None:
        return (Outcome.FAILURE if isinstance(error, DeadlineExceeded) and not caller_deadline
                else Outcome.IGNORED)
    if caller_deadline and is_error(final) and final["code"] == "deadline_exceeded":
        return Outcome.IGNORED
    if status >= 500:
        return Outcome.FAILURE
    if status >= 400 or (is_done(final) and final["finish"] == "cancelled"):
        return Outcome.IGNORED
    return Outcome.SUCCESS


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
-- `by`: the tenant whose calls alone opened it ("" when more than one, or unnamed)
local function open(reason, by)
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', tostring(now), 'ok', 0,
             'reason', reason, 'by', by)
  redis.call('HINCRBY', KEYS[1], 'opened', 1)
  reset_window()
  redis.call('DEL', KEYS[4])
end
"""

# KEYS: br, brw, brt, brp. ARGV: probe id, open_wait_s, probes, probe_timeout_s, tenant.
# Returns {verdict, retry_ms}: verdict 1 = admitted, 2 = admitted as a probe, 0 = refused.
ADMIT_LUA = _PRELUDE + """
local id, wait, probes, ptimeout = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tenant = ARGV[5] or ''
local s = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'ok', 'by', 't:' .. tenant)
local state = s[1] or 'closed'
if s[5] then  -- the caller's own scope: refused alone for open_wait_s
  local left = tonumber(s[5]) + wait - now
  if left > 0 then return {0, math.ceil(left * 1000)} end
  redis.call('HDEL', KEYS[1], 't:' .. tenant)
end
if state == 'closed' then return {1, 0} end
if state == 'open' then
  local left = tonumber(s[2]) + wait - now
  if left <= 0 then
    redis.call('HSET', KEYS[1], 'state', 'half_open', 'ok', 0)
    redis.call('DEL', KEYS[4])
    s[3] = '0'
  elseif (s[4] or '') == '' or s[4] == tenant then
    return {0, math.ceil(left * 1000)}
  end
  -- else opened by one other tenant's calls alone: this call may probe it now
end
-- probing: a probe that never reported is a failure
if redis.call('ZCOUNT', KEYS[4], '-inf', now) > 0 then
  open('probe timed out', '')
  return {0, math.ceil(wait * 1000)}
end
if redis.call('ZCARD', KEYS[4]) + tonumber(s[3] or '0') >= probes then
  return {0, math.ceil(ptimeout * 1000)}
end
redis.call('ZADD', KEYS[4], now + ptimeout, id)
redis.call('PEXPIRE', KEYS[4], math.ceil((ptimeout + wait) * 1000) + 60000)
return {2, 0}
"""

# The tenant to refuse alone when a window reached a threshold (ARGV `which`: 2 failures,
# 3 slow calls; `bad` of the window's `calls` were), or nil and the tenant that opens it
# for everyone "by" itself (see the module docstring). Per-tenant counts are read from
# KEYS[2] (and `batch`, a time window's calls of this script call not yet pushed) only
# here, when the breaker is about to open: recording stays O(1) a call.
_CULPRIT = """
local function culprit(kind, sec, size, batch, which, rate, calls, bad)
  local per = {}
  local function add(t, c, f, s)
    local v = per[t]
    if not v then v = {0, 0, 0}; per[t] = v end
    v[1], v[2], v[3] = v[1] + c, v[2] + f, v[3] + s
  end
  for _, e in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    if kind == 'count' then
      add(string.sub(e, 3), 1, string.sub(e, 1, 1) == 'f' and 1 or 0,
          string.sub(e, 2, 2) == 's' and 1 or 0)
    else
      local es, c, f, s, t = string.match(e, '^(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
      if tonumber(es) > sec - size then add(t, tonumber(c), tonumber(f), tonumber(s)) end
    end
  end
  for t, v in pairs(batch) do add(t, v[1], v[2], v[3]) end
  local top, most = nil, -1
  for t, v in pairs(per) do  -- ties: the least name, so that replicas agree
    if v[which] > most or (v[which] == most and t < top) then top, most = t, v[which] end
  end
  if top == nil or top == '' then return nil, '' end
  local others = calls - per[top][1]
  if others <= 0 then return nil, top end
  if (bad - most) / others >= rate then return nil, '' end
  return top, ''
end
"""

# KEYS: br, brw, brt, brp. ARGV: probe id ("" = not probes), slow_call_ms, window kind
# (count/time), window size, min calls, failure rate, slow-call rate, probes, then
# outcome (ok/fail/ignore), latency ms and tenant for each call: gateways send the
# outcomes of many calls at once; a probe's alone. Count windows keep running totals
# (O(1) a call). Returns the state after recording (a tenant refused alone leaves it
# closed).
RECORD_LUA = _PRELUDE + _CULPRIT + """
local id, slow_ms, kind, size = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local min_calls, fail_rate, slow_rate = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local probes = tonumber(ARGV[8])
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
if id ~= '' then
  local outcome, ms = ARGV[9], tonumber(ARGV[10])
  if state == 'closed' or redis.call('ZREM', KEYS[4], id) == 0 then return state end
  if outcome == 'ignore' then return state end
  if outcome == 'fail' or ms >= slow_ms then
    open(outcome == 'fail' and 'probe failed' or 'probe slow', '')
    return 'open'
  end
  if redis.call('HINCRBY', KEYS[1], 'ok', 1) >= probes then
    local s = redis.call('HMGET', KEYS[1], 'opened_at', 'by')
    if state == 'open' and (s[2] or '') ~= '' then
      -- other tenants' probes closed what one tenant's calls opened: it waits alone
      redis.call('HSET', KEYS[1], 't:' .. s[2], s[1])
    end
    redis.call('HSET', KEYS[1], 'state', 'closed', 'ok', 0, 'by', '')
    reset_window()
    redis.call('DEL', KEYS[4])
    return 'closed'
  end
  return state
end
if state ~= 'closed' then return state end
local sec = math.floor(now)
local tc, tf, ts = 0, 0, 0  -- a time window's totals: read once, then kept per call
local batch = {}  -- a time window's calls per tenant, pushed to KEYS[2] at the end
if kind ~= 'count' then
  tc, tf, ts = time_totals(sec, size, true)
  while true do  -- the per-tenant log, oldest at the tail: drop what left the window
    local last = redis.call('LINDEX', KEYS[2], -1)
    if not last or tonumber(string.match(last, '^(%d+)')) > sec - size then break end
    redis.call('RPOP', KEYS[2])
  end
end
for i = 9, #ARGV, 3 do
  local outcome, ms, tenant = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2] or ''
  if outcome ~= 'ignore' then
    local bad, slow = outcome == 'fail', ms >= slow_ms
    local calls, fails, slows
    if kind == 'count' then
      redis.call('LPUSH', KEYS[2], (bad and 'f' or 'o') .. (slow and 's' or '-') .. tenant)
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
      local b = batch[tenant]
      if not b then b = {0, 0, 0}; batch[tenant] = b end
      b[1], b[2], b[3] = b[1] + 1, b[2] + (bad and 1 or 0), b[3] + (slow and 1 or 0)
    end
    if calls >= min_calls then
      local which, rate, reason, n = nil, 0, '', 0
      if fails / calls >= fail_rate then
        which, rate, reason, n = 2, fail_rate, 'failure rate', fails
      elseif slows / calls >= slow_rate then
        which, rate, reason, n = 3, slow_rate, 'slow-call rate', slows
      end
      if which then
        local alone, by = culprit(kind, sec, size, batch, which, rate, calls, n)
        if not alone then open(reason, by); return 'open' end
        redis.call('HSET', KEYS[1], 't:' .. alone, tostring(now))
        redis.call('HINCRBY', KEYS[1], 'scoped', 1)
        reset_window()
        tc, tf, ts, batch = 0, 0, 0, {}
      end
    end
  end
end
for t, b in pairs(batch) do
  redis.call('LPUSH', KEYS[2], sec .. '|' .. b[1] .. '|' .. b[2] .. '|' .. b[3] .. '|' .. t)
end
redis.call('EXPIRE', KEYS[1], 86400 * 7)
redis.call('EXPIRE', KEYS[2], 86400)
redis.call('EXPIRE', KEYS[3], size + 60)
return 'closed'
"""

# KEYS: br, brw, brt, brp. ARGV: window kind, window size, open_wait_s (0: none given).
# Returns {state, calls, failures, slow, opened_at, reason, times opened, opened by,
# {tenants refused alone now}, times a tenant was refused alone}.
PEEK_LUA = _TIME_WINDOW + """
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'reason', 'opened', 'c', 'f', 's',
                     'by', 'scoped')
local calls, fails, slows = tonumber(s[5] or '0'), tonumber(s[6] or '0'), tonumber(s[7] or '0')
if ARGV[1] ~= 'count' then
  calls, fails, slows = time_totals(sec, tonumber(ARGV[2]), false)
end
local wait, scoped = tonumber(ARGV[3] or '0'), {}
local fields = redis.call('HGETALL', KEYS[1])
for j = 1, #fields, 2 do
  if string.sub(fields[j], 1, 2) == 't:' and tonumber(fields[j + 1]) + wait > now then
    scoped[#scoped + 1] = string.sub(fields[j], 3)
  end
end
return {s[1] or 'closed', calls, fails, slows, s[2] or '', s[3] or '', s[4] or '0',
        s[8] or '', scoped, s[9] or '0'}
"""


def keys(deployment: str) -> list[str]:
    return [deployment_key(deployment, name) for name in ("br", "brw", "brt", "brp")]


# A call's outcome for RECORD_LUA: (outcome, latency ms) or (outcome, latency ms, tenant);
# without a tenant it counts as no one tenant's (the breaker opens for everyone).
Call = tuple[Outcome, float] | tuple[Outcome, float, str]


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


async def is_closed(redis: Any, deployment: str, tenant: str = "") -> bool:
    """Whether the breaker is closed to `tenant` (shared state closed and the tenant not
    refused alone), read without taking a probe slot (gateways keep it for a moment;
    only a breaker not closed needs ADMIT_LUA's per-call verdict)."""
    state, scoped = await redis.hmget(keys(deployment)[0], "state", f"t:{tenant}")
    return scoped is None and (state is None or _s(state) == State.CLOSED)


def admit_args(probe_id: str, policy: BreakerPolicy, tenant: str = "") -> list[Any]:
    return [probe_id, repr(policy.open_wait_s), policy.half_open_probes,
            repr(policy.probe_timeout_s), tenant]


def record_args(probe_id: str, calls: Sequence[Call], policy: BreakerPolicy) -> list[Any]:
    """ARGV for RECORD_LUA: a probe's one call, or a batch of ordinary calls."""
    args: list[Any] = [probe_id, policy.slow_call_ms, policy.window_kind, policy.window_size,
                       policy.min_calls, repr(policy.failure_rate),
                       repr(policy.slow_call_rate), policy.half_open_probes]
    for call in calls:
        args += [call[0].value, repr(float(call[1])), call[2] if len(call) == 3 else ""]
    return args


def peek_args(policy: BreakerPolicy) -> list[Any]:
    return [policy.window_kind, policy.window_size, repr(policy.open_wait_s)]


@dataclass(frozen=True)
class Snapshot:
    state: State
    calls: int
    failures: int
    slow: int
    opened_at: float | None
    reason: str
    times_opened: int
    opened_by: str = ""  # the tenant whose calls alone opened it (others probe it)
    tenants_open: tuple[str, ...] = field(default_factory=tuple)  # refused alone now
    times_tenant_opened: int = 0

    @classmethod
    def from_reply(cls, reply: list[Any]) -> Snapshot:
        s: list[Any] = [x if isinstance(x, list) else _s(x) for x in reply]
        s += ["", [], "0"][len(s) - 7:] if len(s) < 10 else []
        return cls(state=State(s[0]), calls=int(s[1]), failures=int(s[2]), slow=int(s[3]),
                   opened_at=float(s[4]) if s[4] else None, reason=str(s[5]),
                   times_opened=int(s[6]), opened_by=str(s[7]),
                   tenants_open=tuple(sorted(str(_s(t)) for t in s[8])),
                   times_tenant_opened=int(s[9]))


def default_policy(deployment_id: int) -> BreakerPolicy:
    """The thresholds a deployment without its own row uses (the model's defaults)."""
    return BreakerPolicy(deployment_id=deployment_id)

