"""Who may read a request's events again, and whose idempotency key is whose.

A stream's events stay in Redis for a while after it ends so that its client can resume
it (`Last-Event-ID`, or `conversation_id` + `last_offset`), and an idempotent retry is
fed the first request's events. Both hand out a stored reply, so both are authorized as
reading the original is:

- resume: the caller's role must allow calling models, its key's allow-list the
  request's model, the body must name that model, and the caller must be the request's
  own subject (the member or external identity behind any of its keys) or be able to
  read the conversation the request belongs to (its owner; a tenant admin). Anything
  else is NotFound, word for word the answer for an unknown request id. Each resume is
  audited (a refused one as any refused call is).
- idempotency: a key is scoped to the caller (subject and key), kept only as a hash, and
  bound to a digest of the request: another caller's identical key is another key, and
  the same key with another body is a 422 (`idempotency_key_reused`).

Only requests submitted with an ownership record (streams) can be resumed.

A key answers with its first request's reply only if that request ran to its end: when
the gateway cancels a call because its client left (Call), or a replay finds the request
was cancelled, the key is freed (`free_key`, only while it still names that request), so
the client's retry runs afresh instead of being handed a cut reply.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import orjson

from governance import audit
from inference import queue as q
from sluice.db import async_db
from sluice.errors import BadRequest, NotFound, PermissionDenied
from sluice.observability import telemetry
from tenants.conversations import conversation_get
from tenants.principal import Principal
from tenants.roles import Action

if TYPE_CHECKING:
    from streaming.pipeline.callrequest import CallRequest

MAX_IDEMPOTENCY_KEY = 255  # characters (Stripe's limit)
MAX_SEQ = 10**9  # no stream has more events than this
_EVENT_ID = re.compile(r"([0-9a-f]{1,64}):(start|[0-9]{1,10})")


@dataclass(frozen=True, slots=True)
class Ownership:
    """Stored beside a resumable request: whose it is, for which model and conversation."""

    subject: str
    model: str
    conversation: str = ""

    def dumps(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def loads(cls, raw: str | None) -> Ownership | None:
        try:
            data = orjson.loads(raw) if raw else None
            return cls(**data) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, TypeError):
            return None


def parse_event_id(value: str | None) -> tuple[str, int] | None:
    """`<request id>:<seq>` or `<request id>:start` (what every SSE event's `id:` carries)
    -> (rid, seq; -1 for start). None when absent; BadRequest when malformed."""
    if value is None or not value.strip():
        return None
    found = _EVENT_ID.fullmatch(value.strip())
    if found is None or (found[2] != "start" and int(found[2]) > MAX_SEQ):
        raise BadRequest("Last-Event-ID must be '<request id>:<sequence number>' as sent in "
                         "an event's id.", param="Last-Event-ID", code="invalid_last_event_id")
    return found[1], -1 if found[2] == "start" else int(found[2])


def idempotency(principal: Principal, request: CallRequest) -> tuple[str | None, str]:
    """(the request's idempotency key as the queue stores it, the request's fingerprint:
    CallRequest.fingerprint); (None, "") without a key. The stored key is a hash of the
    caller's identity and its key text, so the client's text (which may be anything,
    personal data included) never reaches Redis."""
    key = request.idempotency_key
    if key is None:
        return None, ""
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise BadRequest(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable "
                         "characters.", param="Idempotency-Key",
                         code="invalid_idempotency_key")
    who = f"{principal.subject}\0{principal.key_id or ''}\0{key}"
    return (hashlib.sha256(who.encode()).hexdigest(),
            hashlib.sha256(request.fingerprint()).hexdigest())


# KEYS: the idempotency record (inference.queue.idem_key), optionally the request's done
# key. ARGV: the request id. Deletes the record only while it names that request (another
# may have taken the key since) and, given the done key, the request has not ended (its
# reply is whole: a retry may have been answered with it already).
FREE_LUA = """
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, record = pcall(cjson.decode, raw)
if ok and type(record) == 'table' and record['rid'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


async def free_key(redis: Any, tenant: str, key: str, rid: str, *, unended: bool) -> None:
    """Free the idempotency key `key` (as `idempotency` stores it) while it names the
    request `rid` (and, when `unended`, that request has not ended): the next request
    with it runs afresh."""
    keys = [q.idem_key(tenant, key)]
    if unended:
        keys.append(q.done_key(tenant, rid))
    await redis.eval(FREE_LUA, len(keys), *keys, rid)


def ownership(principal: Principal, model: str, conversation: str | None) -> str:
    return Ownership(principal.subject, model, conversation or "").dumps()


async def authorize_resume(principal: Principal, stored: str | None, *, model: str,
                           conversation: str | None = None) -> Ownership:
    """Pass if `principal` may read the request whose ownership record is `stored`
    (None: expired, unknown, or never resumable) under the rules above; `conversation`:
    the conversation the caller named, which the request must belong to."""
    if not principal.can(Action.MODEL_USE):
        raise PermissionDenied(f"Your role ({principal.role}) may not call models.")
    owner = Ownership.loads(stored)
    missing = NotFound("No resumable stream with that Last-Event-ID.", code="stream_not_found")
    if (owner is None or owner.model != model or not principal.may_use_model(owner.model)
            or (conversation is not None and owner.conversation != conversation)):
        raise missing
    if owner.subject != principal.subject:
        if not owner.conversation:
            raise missing
        try:
            await async_db(conversation_get)(actor=principal, public_id=owner.conversation)
        except NotFound:
            raise missing from None
    return owner


def resume_event(principal: Principal, rid: str, *, model: str, after: int,
                 protocol: str, began: float) -> dict[str, object]:
    """The audit event of an authorized resume (`began`: time.monotonic() at arrival)."""
    return audit.call_event(
        principal=principal, action="chat.completions.resume", model=model,
        protocol=protocol, status=200, latency_ms=(time.monotonic() - began) * 1000,
        request_id=rid, trace_id=telemetry.ids()[0], detail={"after_seq": after})
