"""A stored response's row: the response object and the call's input items, redacted.

Two ways a response becomes a row (streaming/responses_copy.Row):
- `row`: from the response object the gateway made (a reply it stores itself);
- `kept_row`: from a reply a worker kept with its final event (inference/jobs.Keep):
  the gateway's draft (`draft`: the response object's fields the request decides and
  the input items, as `keep_draft` writes it) completed by the reply's events, through
  the same encoder a streamed call's events go through (EventStream), so the row is
  the response object the caller got, plain or streamed.

Either way every text of the caller's or the model's (item text, function arguments
and outputs, instructions, identifiers, metadata) goes through the tenant's redaction
(governance/privacy.py) and a NUL becomes U+FFFD (PostgreSQL's jsonb cannot hold one);
ids, types, roles and statuses, which the gateway makes or checks against fixed sets,
are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from django.utils import timezone

from governance.privacy import Redactor, redact_json
from inference.jobs import Event
from streaming.apis.responses.copy import Kept, Row
from streaming.apis.responses.wire import EventStream, finished, output
from streaming.pipeline.fold import Delta, Final, stored

# The response object's fields that have columns of their own; the rest is `details`.
_COLUMNS = frozenset({"id", "object", "created_at", "status", "model", "output", "usage",
                      "previous_response_id", "store"})


def keep_draft(tenant_id: int, head: dict[str, Any], input_items: list[dict[str, Any]]
               ) -> str:
    """What a worker keeps for `kept_row` to complete: the tenant, the response object's
    fields the request decides (`head`; its id is the request's) and the input items."""
    return orjson.dumps({"tenant": tenant_id, "head": head, "input": input_items}).decode()


class _Unsent:
    """Where a kept reply's events go when it is made into a row: nowhere."""

    def add(self, body: bytes) -> None:
        pass


def kept_body(draft: dict[str, Any], rid: str, events: list[Event]) -> dict[str, Any]:
    """The response object of a kept reply, as its caller got it (streaming/apis/
    responses.py encodes the same events the same way). ValueError when the events do
    not end with a `done` event."""
    head = {**draft["head"], "id": f"resp_{rid}"}
    pieces = stored(events)
    final = pieces[-1] if pieces else None
    if not isinstance(final, Final):
        raise ValueError(f"the reply kept for {rid} has no done event")
    deltas = [piece for piece in pieces if isinstance(piece, Delta)]
    if all(d.tools is None for d in deltas):  # the items as a plain call makes them
        return finished(head, output(rid, "".join(d.text for d in deltas), final.event),
                        final.event)
    # Calls written piece by piece: a call cut short is an item of its own.
    stream = EventStream(_Unsent(), head, rid)
    for delta in deltas:
        if delta.text:
            stream.text(delta.text)
        if delta.tools is not None:
            stream.calls(delta.tools)
    return stream.end(final.event)


def kept_row(kept: Kept, redactor_of: Callable[[int], Redactor]) -> Row:
    """The row of a reply a worker kept, redacted with its tenant's `redactor_of(tenant
    id)`. ValueError (or TypeError, KeyError) when what was kept is not a draft and a
    reply."""
    draft = orjson.loads(kept.draft)
    body = kept_body(draft, kept.rid, orjson.loads(kept.reply))
    return row(draft["tenant"], kept.by, body, draft["input"], redactor_of(draft["tenant"]))


def _no_nul(text: str) -> str:
    return text.replace("\x00", "\ufffd")


def _stored(clean: Redactor) -> Redactor:
    return lambda text: _no_nul(clean(text))


_OURS = frozenset({"id", "type", "role", "status"})  # an item's and a content part's
# The response object's free text of the caller's besides its items and metadata (an
# identifier may be an e-mail address).
_CALLERS_TEXT = ("instructions", "user", "prompt_cache_key", "safety_identifier")


def _clean_fields(value: Any, clean: Redactor) -> Any:
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, list):
        return [_clean_fields(v, clean) for v in value]
    if isinstance(value, dict):
        return {k: v if k in _OURS and isinstance(v, str) else _clean_fields(v, clean)
                for k, v in value.items()}
    return value


def _clean_item(item: dict[str, Any], clean: Redactor) -> dict[str, Any]:
    """An item's strings through `clean` but its own ids, types, roles and statuses; a
    function call's arguments as JSON when they parse (redacting the serialized text
    could leave an unquoted placeholder), as they were written when nothing in them is
    redacted."""
    cleaned = _clean_fields(item, clean)
    if item.get("type") == "function_call":
        try:
            arguments = json.loads(item.get("arguments") or "")
        except ValueError:
            return cleaned
        redacted = redact_json(arguments, clean, keys=True)
        cleaned["arguments"] = item["arguments"] if redacted == arguments \
            else json.dumps(redacted, ensure_ascii=False)
    return cleaned


def row(tenant_id: int, created_by: str, body: dict[str, Any],
        input_items: list[dict[str, Any]], clean: Redactor) -> Row:
    """The response object `body` and the call's own `input_items` as a row, redacted
    with `clean`."""
    clean = _stored(clean)
    details = {k: v for k, v in body.items() if k not in _COLUMNS}
    if b"\\u0000" in orjson.dumps(details):  # rare: not walked string by string
        details = redact_json(details, _no_nul, keys=True)
    for key in _CALLERS_TEXT:
        if isinstance(details.get(key), str):
            details[key] = clean(details[key])
    details["metadata"] = redact_json(details.get("metadata") or {}, clean, keys=True)
    created = body.get("created_at")
    return Row(
        tenant_id=tenant_id, public_id=body["id"], created_by=created_by,
        model=body["model"], status=body["status"],
        previous_response_id=body.get("previous_response_id") or "",
        input_items=[_clean_item(i, clean) for i in input_items],
        output_items=[_clean_item(i, clean) for i in body.get("output") or []],
        usage=body.get("usage"), details=details,
        created_at=(datetime.fromtimestamp(created, tz=UTC)
                    if isinstance(created, int | float) else timezone.now()))
