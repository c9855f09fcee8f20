"""The Redis batching queue: keys, messages, events, and the producer-side operations.

A deployment's queue is one stream per tenant under the deployment's hash tag, so that
workers can read from every waiting tenant at once (one XREADGROUP over all their
streams returns up to N entries from each): a tenant's flood sits in its own stream and
cannot hide another tenant's single request behind it. The `{...}` hash tags keep a
deployment's queue keys, and a tenant's request keys, each in one Redis Cluster slot:

    sluice:q:{<deployment>}:s:<tenant>:<priority>
                                       a tenant's requests of one priority; group "workers"
    sluice:q:{<deployment>}:s:<tenant>:<priority>:<worker>
                                       the same, placed in a worker's lane: requests whose
                                       prefix that worker likely holds (its prefix cache);
                                       other workers take them after LANE_STEAL_S
    sluice:q:{<deployment>}:streams    hash stream suffix -> requests in that stream
    sluice:q:{<deployment>}:tenants    hash tenant -> requests queued or in flight
    sluice:q:{<deployment>}:depth      requests queued or in flight, all tenants
    sluice:q:{<deployment>}:cancel     set of cancelled request ids
    sluice:q:{<deployment>}:dead       dead-letter stream
    sluice:q:{<deployment>}:workers    hash worker id -> heartbeat JSON
    sluice:q:{<deployment>}:guard      hash: the memory guard's thresholds (governance)
    sluice:{<tenant>}:out:<rid>        the request's event stream (TTL): resume source
    sluice:{<tenant>}:done:<rid>       set once by the worker that finishes the request
    sluice:{<tenant>}:idem:<digest>    a caller's idempotency key (hashed with who sent it)
                                       -> {"rid", "fp": the request's digest}
    sluice:{<tenant>}:owner:<rid>      who may read the request's events again (resume)
    sluice:{<tenant>}:attached:<rid>   a client resumed this stream: do not cancel it
    sluice:{<tenant>}:convlast:<conv>  the request id of a conversation's latest stream
    sluice:gw:<gateway id>             events for the requests one gateway process waits on,
                                       batched: one entry per worker step, [[rid, event]...]

Enqueue and acknowledge are Lua scripts, so the counters (the bound the gateway enforces
before enqueueing, and the set of streams a worker reads from) never drift from the
streams. An emptied stream is kept for a minute (idle workers block on it, so the
tenant's next request wakes them at once), then removed by a worker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from inference.jobs import ChatJob, Job, decode_job, encode_job

GROUP = "workers"
OUT_TTL_S = 600  # how long a finished generation can still be resumed
GATEWAY_STREAM_MAXLEN = 100_000
IDEM_TTL_S = 86_400  # how long an idempotency key keeps answering with its first request


def _base(deployment: str) -> str:
    return f"sluice:q:{{{deployment}}}"


MAX_PRIORITY = 9  # priorities are 0..9: each is its own stream per tenant


def stream_suffix(tenant: str, priority: int, lane: str = "") -> str:
    """A stream's suffix: "<tenant>:<priority>", or in worker `lane`'s lane
    "<tenant>:<priority>:<lane>" (tenant slugs and worker ids hold no colon)."""
    return f"{tenant}:{priority}:{lane}" if lane else f"{tenant}:{priority}"


def suffix_tenant(suffix: str) -> str:
    return suffix.split(":", 1)[0]


def suffix_lane(suffix: str) -> str:
    """The worker whose lane the stream is ("" for a tenant's shared stream)."""
    parts = suffix.split(":", 2)
    return parts[2] if len(parts) == 3 else ""


def stream_key(deployment: str, suffix: str) -> str:
    return f"{_base(deployment)}:s:{suffix}"


def streams_key(deployment: str) -> str:
    return f"{_base(deployment)}:streams"


def tenants_key(deployment: str) -> str:
    return f"{_base(deployment)}:tenants"


def depth_key(deployment: str) -> str:
    return f"{_base(deployment)}:depth"


def cancel_key(deployment: str) -> str:
    return f"{_base(deployment)}:cancel"


def dead_key(deployment: str) -> str:
    return f"{_base(deployment)}:dead"


def workers_key(deployment: str) -> str:
    return f"{_base(deployment)}:workers"


def batch_sizes_key(deployment: str) -> str:
    """Hash: batch size -> how many batches of that size the workers admitted."""
    return f"{_base(deployment)}:batchsizes"


def guard_key(deployment: str) -> str:
    """Hash of the memory guard's thresholds (high, low, hold_s), read by workers."""
    return f"{_base(deployment)}:guard"


def deployment_key(deployment: str, name: str) -> str:
    """Another key in the deployment's slot (governance: breaker state, latencies)."""
    return f"{_base(deployment)}:{name}"


def out_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:out:{rid}"


def done_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:done:{rid}"


def attached_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:attached:{rid}"


def conversation_stream_key(tenant: str, conversation: str) -> str:
    return f"sluice:{{{tenant}}}:convlast:{conversation}"


def idem_key(tenant: str, key: str) -> str:
    return f"sluice:{{{tenant}}}:idem:{key}"


def owner_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:owner:{rid}"


def gateway_key(gateway: str) -> str:
    return f"sluice:gw:{gateway}"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class QueuedRequest:
    """One request as it travels through the stream (all fields are strings there but
    `body`, the encoded job: inference/jobs.py)."""

    rid: str
    tenant: str
    kind: str  # "chat" | "embedding": the job's kind
    body: bytes
    gateway: str
    deadline_ms: int
    priority: int = 0
    traceparent: str = ""
    enqueued_ms: int = field(default_factory=now_ms)

    @classmethod
    def of(cls, job: Job, **fields: Any) -> QueuedRequest:
        return cls(kind="chat" if isinstance(job, ChatJob) else "embedding",
                   body=encode_job(job), **fields)

    def job(self) -> Job:
        """The request's job, decoded (JobError when the body is not one)."""
        return decode_job(self.body)

    def fields(self) -> dict[str, str | bytes]:
        return {"rid": self.rid, "tenant": self.tenant, "kind": self.kind,
                "body": self.body, "gw": self.gateway,
                "deadline": str(self.deadline_ms), "prio": str(self.priority),
                "tp": self.traceparent, "enq": str(self.enqueued_ms)}

    @classmethod
    def from_fields(cls, raw: dict[bytes | str, bytes | str]) -> QueuedRequest:
        f = {_s(k): v for k, v in raw.items()}
        body = f["body"]
        return cls(rid=_s(f["rid"]), tenant=_s(f["tenant"]), kind=_s(f["kind"]),
                   body=body if isinstance(body, bytes) else body.encode(),
                   gateway=_s(f["gw"]), deadline_ms=int(f["deadline"]),
                   priority=int(f["prio"]), traceparent=_s(f.get("tp", "")),
                   enqueued_ms=int(f["enq"]))


def oldest_age_ms(firsts: list[Any], now: int | None = None) -> int:
    """Age of the oldest entry, from `XRANGE <stream> - + COUNT 1` replies (one per
    stream; an entry id starts with its enqueue time in ms). 0 when all are empty."""
    now = now_ms() if now is None else now
    stamps = [int(_s(f[0][0]).split("-")[0]) for f in firsts if f]
    return max(0, now - min(stamps, default=now))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Bounded, fair enqueue in one round trip.
# KEYS: stream, streams hash, tenants hash, depth.
# ARGV: max depth, tenant cap, tenant, stream suffix, stream fields...
# Returns {1, id}, or {-1, depth} when the queue is full, or {-2, count} when this tenant
# already holds its share of it.
ENQUEUE_LUA = """
local depth = tonumber(redis.call('GET', KEYS[4]) or '0')
if depth >= tonumber(ARGV[1]) then return {-1, depth} end
local mine = tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0')
if mine >= tonumber(ARGV[2]) then return {-2, mine} end
if redis.call('HINCRBY', KEYS[2], ARGV[4], 1) == 1 then
  -- the stream's first request: create it and its group (pcall: the group may exist)
  redis.pcall('XGROUP', 'CREATE', KEYS[1], 'workers', '0', 'MKSTREAM')
end
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('INCR', KEYS[4])
return {1, redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))}
"""

# Acknowledge a step's finished entries and release their counts, atomically with
# enqueue; each request leaves the cancel set. An emptied stream stays (at count 0) so
# that idle workers keep blocking on it: a tenant's next request wakes them at once.
# KEYS: streams hash, tenants hash, depth, cancel set, then each entry's stream.
# ARGV: per entry its tenant, stream suffix, entry id, request id. Returns how many
# entries were still pending (an entry acknowledged before is left alone).
ACKS_LUA = """
local acked = 0
for i = 5, #KEYS do
  local a = (i - 5) * 4
  redis.call('SREM', KEYS[4], ARGV[a + 4])
  if redis.call('XACK', KEYS[i], 'workers', ARGV[a + 3]) == 1 then
    redis.call('XDEL', KEYS[i], ARGV[a + 3])
    redis.call('DECR', KEYS[3])
    redis.call('HINCRBY', KEYS[1], ARGV[a + 2], -1)
    if redis.call('HINCRBY', KEYS[2], ARGV[a + 1], -1) <= 0 then
      redis.call('HDEL', KEYS[2], ARGV[a + 1])
    end
    acked = acked + 1
  end
end
return acked
"""

# Requests' last events, written once: the first worker to set a request's `done`
# appends its final event (and the events of the same step before it) to the request's
# stream, in the same script, so a worker killed mid-write never leaves `done` set
# without a final event. One call per tenant and step (a tenant's keys share a slot).
# KEYS: per request its done key and out key. ARGV: worker id, TTL seconds, then per
# request the number of its events and the encoded events (final last).
# Returns per request 1 when this worker wrote them; when the request was already
# finished, the final event that was stored (its worker may have died before telling
# the gateway), or 0.
FINALS_LUA = """
local a, out = 3, {}
for q = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a])
  local result = 0
  if redis.call('SET', KEYS[q], ARGV[1], 'NX', 'EX', ARGV[2]) then
    for j = a + 1, a + n do redis.call('XADD', KEYS[q + 1], '*', 'e', ARGV[j]) end
    redis.call('EXPIRE', KEYS[q + 1], ARGV[2])
    result = 1
  else
    for _, entry in ipairs(redis.call('XREVRANGE', KEYS[q + 1], '+', '-', 'COUNT', 64)) do
      local e = entry[2][2]
      if string.find(e, '"t":"done"', 1, true) or string.find(e, '"t":"error"', 1, true) then
        result = e
        break
      end
    end
  end
  out[#out + 1] = result
  a = a + n + 1
end
return out
"""

# A step's events of one tenant's requests, appended to their streams in one call (a
# pipeline of single XADDs costs the worker more than the writes cost Redis).
# KEYS: each event's request stream (a request may repeat). ARGV: TTL seconds, then per
# key its event and "1" when it is the request's first (its stream gets the TTL).
EVENTS_LUA = """
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, '*', 'e', ARGV[2 * i])
  if ARGV[2 * i + 1] == '1' then redis.call('EXPIRE', key, ARGV[1]) end
end
return #KEYS
"""
# A reply kept past its request (jobs.Keep; the gateway's own saves of a stored response
# too): copied unless a deletion names its keeper or an admin ("*"; the deletion is then
# kept longer), the first copy standing; queued for the stream's writer (on a cluster
# the stream is in another slot: queued apart, KEEP_QUEUE_LUA). The copy and the entry
# hold `by` (the keeper) and the given fields. KEYS: copy, deletions[, stream]. ARGV:
# keeper, copy TTL, deletion TTL, stream maxlen, then field, value, ... Returns 1 when
# kept.
KEEP_LUA = """
if redis.call('SISMEMBER', KEYS[2], '*') == 1
   or redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'by', ARGV[1], unpack(ARGV, 5))
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
if KEYS[3] then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'by', ARGV[1], unpack(ARGV, 5))
end
return 1
"""
# KEYS: the stream. ARGV: keeper, maxlen, then field, value, ...
KEEP_QUEUE_LUA = """
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'by', ARGV[1], unpack(ARGV, 3))
"""


def keep_args(keeper: str, ttl_s: int, forget_s: int, maxlen: int,
              fields: list[str | bytes]) -> list[Any]:
    """KEEP_LUA's ARGV."""
    return [keeper, ttl_s, forget_s, maxlen, *fields]


def keep_queue_args(keeper: str, maxlen: int, fields: list[str | bytes]) -> list[Any]:
    """KEEP_QUEUE_LUA's ARGV."""
    return [keeper, maxlen, *fields]


EVENTS_PER_CALL = 1000  # bounds how long one call holds Redis (events, finals, acks)

# Forget a stream that is still empty (workers call it for streams idle a while).
# KEYS: stream, streams hash. ARGV: suffix.
CLEANUP_LUA = """
if tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') > 0 then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
return 1
"""


def queue_keys(deployment: str, suffix: str) -> list[str]:
    """The KEYS of ENQUEUE_LUA."""
    return [stream_key(deployment, suffix), streams_key(deployment), tenants_key(deployment),
            depth_key(deployment)]


def ack_keys(deployment: str, suffixes: list[str]) -> list[str]:
    """The KEYS of ACKS_LUA for entries of the streams `suffixes` (one per entry)."""
    return [streams_key(deployment), tenants_key(deployment), depth_key(deployment),
            cancel_key(deployment), *(stream_key(deployment, s) for s in suffixes)]


def tenant_cap(max_depth: int, share: float) -> int:
    return max(1, int(max_depth * share))


HEARTBEAT_MAX_AGE_S = 5.0  # a worker silent longer than this is not counted as live


def live_heartbeats(raw: dict[Any, Any], *, max_age_s: float = HEARTBEAT_MAX_AGE_S
                    ) -> dict[str, dict[str, Any]]:
    """The `:workers` hash as read from Redis -> heartbeat JSON by worker id, live ones
    only (younger than max_age_s)."""
    now = time.time()
    beats = {_s(k): json.loads(v) for k, v in raw.items()}
    return {k: v for k, v in beats.items() if now - v["ts"] <= max_age_s}


def gateway_item(rid: str, data: str) -> str:
    """One request's encoded event, as an item of a gateway message."""
    return f'["{rid}",{data}]'


def add_gateway_message(client: Any, gateway: str, items: list[str]) -> None:
    """Append one message carrying `items` to a gateway's event stream (a client or a
    pipeline): the gateway's router reads it as [[rid, event], ...]."""
    key = gateway_key(gateway)
    client.xadd(key, {"b": "[" + ",".join(items) + "]"},
                maxlen=GATEWAY_STREAM_MAXLEN, approximate=True)
    # Reply text must not outlive the resume window, even in the stream of a gateway
    # that is gone (its router trims what it reads; nobody trims a dead one's).
    client.expire(key, OUT_TTL_S)
