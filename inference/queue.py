"""The Redis batching queue: keys, messages, events, and the producer-side operations.

Layout (the `{...}` hash tags keep a deployment's queue keys, and a tenant's request
keys, each in one Redis Cluster slot):

    sluice:q:{<deployment>}            stream of requests; consumer group "workers"
    sluice:q:{<deployment>}:tenants    hash tenant -> requests queued or in flight
    sluice:q:{<deployment>}:cancel     set of cancelled request ids
    sluice:q:{<deployment>}:dead       dead-letter stream
    sluice:q:{<deployment>}:workers    hash worker id -> heartbeat JSON
    sluice:{<tenant>}:out:<rid>        the request's event stream (TTL): resume source
    sluice:{<tenant>}:done:<rid>       set once by the worker that finishes the request
    sluice:{<tenant>}:idem:<key>       idempotency key -> request id
    sluice:gw:<gateway id>             events for the requests one gateway process waits on

Workers XACK *and* XDEL finished entries, so XLEN of the stream is exactly the number of
requests queued or in flight: the bound the gateway enforces before enqueueing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

GROUP = "workers"
OUT_TTL_S = 600  # how long a finished generation can still be resumed
GATEWAY_STREAM_MAXLEN = 100_000


def stream_key(deployment: str) -> str:
    return f"sluice:q:{{{deployment}}}"


def tenants_key(deployment: str) -> str:
    return f"{stream_key(deployment)}:tenants"


def cancel_key(deployment: str) -> str:
    return f"{stream_key(deployment)}:cancel"


def dead_key(deployment: str) -> str:
    return f"{stream_key(deployment)}:dead"


def workers_key(deployment: str) -> str:
    return f"{stream_key(deployment)}:workers"


def out_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:out:{rid}"


def done_key(tenant: str, rid: str) -> str:
    return f"sluice:{{{tenant}}}:done:{rid}"


def idem_key(tenant: str, key: str) -> str:
    return f"sluice:{{{tenant}}}:idem:{key}"


def gateway_key(gateway: str) -> str:
    return f"sluice:gw:{gateway}"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class QueuedRequest:
    """One request as it travels through the stream (all fields are strings there)."""

    rid: str
    tenant: str
    kind: str  # "chat" | "embedding"
    body: dict[str, Any]  # chat: messages + params; embedding: inputs
    gateway: str
    deadline_ms: int
    priority: int = 0
    traceparent: str = ""
    enqueued_ms: int = field(default_factory=now_ms)

    def fields(self) -> dict[str, str]:
        return {"rid": self.rid, "tenant": self.tenant, "kind": self.kind,
                "body": json.dumps(self.body), "gw": self.gateway,
                "deadline": str(self.deadline_ms), "prio": str(self.priority),
                "tp": self.traceparent, "enq": str(self.enqueued_ms)}

    @classmethod
    def from_fields(cls, raw: dict[bytes | str, bytes | str]) -> QueuedRequest:
        f = {_s(k): _s(v) for k, v in raw.items()}
        return cls(rid=f["rid"], tenant=f["tenant"], kind=f["kind"], body=json.loads(f["body"]),
                   gateway=f["gw"], deadline_ms=int(f["deadline"]), priority=int(f["prio"]),
                   traceparent=f.get("tp", ""), enqueued_ms=int(f["enq"]))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Bounded, fair enqueue in one round trip. Returns {1, id}, or {-1, depth} when the queue
# is full, or {-2, count} when this tenant already holds its share of it.
ENQUEUE_LUA = """
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[1]) then return {-1, depth} end
local mine = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0')
if mine >= tonumber(ARGV[2]) then return {-2, mine} end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return {1, redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))}
"""


def tenant_cap(max_depth: int, share: float) -> int:
    return max(1, int(max_depth * share))


def encode_event(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))
