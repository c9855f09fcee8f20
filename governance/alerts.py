"""Budget alerts: a budget's spend reaching one of its `alert_at` percentages fires once
per threshold per window, and reaches people three ways: an audit event, the tenant's
signed webhook, the UI's banner.

Once, across any number of gateways: the script that charges a call (governance/quota.py
SETTLE_LUA) marks the budget's window with the highest threshold its spend has reached,
in the same atomic step, and returns a threshold only when it moves that mark. The
gateway it returns to appends a `budget.alert` audit event with its recorder's next
flush; the audit writer, having stored it, enqueues the webhook delivery (Celery, retried
with backoff), so every stored alert is delivered at least once and carries its event id
for the receiver to drop a repeat. A gateway that dies between the settle and its next
flush (at most governance.recorder.FLUSH_S) loses that alert; the mark stands, so no
other gateway fires it again that window.

The webhook: POST of the alert as JSON with `X-Sluice-Event-Id` and `X-Sluice-Signature:
t=<unix seconds>,v1=<hex HMAC-SHA256 over "<t>.<body>" with the tenant's webhook secret>`
(Stripe's scheme: the receiver checks the MAC and refuses an old `t`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from django.utils import timezone

from governance import pricing
from governance.models import AlertWebhook, AuditEvent, Budget
from inference.upstream.secrets import hint, seal, unseal
from inference.upstream.urls import UpstreamURLError, validate_url
from sluice.errors import Unprocessable

ACTION = "budget.alert"
SIGNATURE_HEADER = "X-Sluice-Signature"
EVENT_HEADER = "X-Sluice-Event-Id"
WEBHOOK_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 8  # backoff 5 s doubling, at most 10 min: about 40 minutes in all
_SIGNATURE = re.compile(r"t=(\d{1,12}),v1=[0-9a-f]{64}")


def alert_thresholds(budget: Budget) -> str:
    """SETTLE_LUA's "pct:nanos,..." for `budget`, ascending: the spend (nano-dollars,
    rounded up) at which each alert percentage is reached. Entries that are not whole
    percentages from 1 to 100 (a row edited in the database) are skipped."""
    limit = int(budget.limit_usd * pricing.NANO_PER_USD)
    pcts = sorted({p for p in budget.alert_at or () if type(p) is int and 0 < p <= 100})
    return ",".join(f"{p}:{(limit * p + 99) // 100}" for p in pcts)


@dataclass(frozen=True)
class Fired:
    budget: Budget
    pct: int
    spent: int  # nano-dollars in the window when it fired
    resets_at: int  # epoch seconds; 0 for a `total` budget


def fired(quotas: Sequence[Any], reply: Any) -> list[Fired]:
    """The thresholds a SETTLE_LUA reply says this settlement crossed."""
    out = []
    for raw in reply or ():
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        index, pct, spent, reset = (int(x) for x in text.split(":"))
        out.append(Fired(quotas[index], pct, spent, reset))
    return out


def event(alert: Fired, tenant_slug: str) -> dict[str, Any]:
    """The alert as an audit event (the recorder appends it to the audit stream)."""
    budget = alert.budget
    detail = {"budget_id": budget.pk, "scope": budget.scope, "member_id": budget.member_id,
              "key_id": budget.api_key_id, "model": budget.model, "window": budget.window,
              "threshold_pct": alert.pct, "limit_usd": str(budget.limit_usd),
              "spent_usd": pricing.usd(alert.spent),
              "resets_at": (datetime.fromtimestamp(alert.resets_at, UTC).isoformat()
                            if alert.resets_at else None)}
    return {"chain": tenant_slug, "at": timezone.now(), "tenant_id": budget.tenant_id,
            "actor": "system", "role": "", "key_prefix": "", "action": ACTION,
            "target": f"budget:{budget.pk}", "model": budget.model, "protocol": "internal",
            "status": 200, "latency_ms": 0.0, "prompt_tokens": 0, "completion_tokens": 0,
            "request_id": "", "trace_id": "", "request_excerpt": "", "response_excerpt": "",
            "detail": detail}


def payload(event_id: int, tenant_slug: str, at: datetime, detail: dict[str, Any]) -> bytes:
    """The webhook's body for a stored alert event."""
    return json.dumps({"type": ACTION, "id": f"evt_{event_id}", "tenant": tenant_slug,
                       "created_at": at.isoformat(), "data": detail},
                      separators=(",", ":"), sort_keys=True).encode()


SECRET_MIN, SECRET_MAX = 16, 200


def signing_secret(given: str | None, *, has_one: bool, param: str
                   ) -> tuple[str, str, str | None] | None:
    """A webhook's signing secret to store: (sealed, hint, made), where `made` is the
    secret Sluice made because none was `given` and there is none yet (shown once);
    None when nothing changes. Unprocessable naming `param` for a `given` outside
    SECRET_MIN..SECRET_MAX characters."""
    made = None
    if given is None and not has_one:
        given = made = "whsec_" + secrets.token_urlsafe(32)
    if given is None:
        return None
    if not SECRET_MIN <= len(given) <= SECRET_MAX:
        raise Unprocessable(f"{param}: {SECRET_MIN} to {SECRET_MAX} characters.", param=param)
    return seal(given), hint(given), made


def sign(secret: str, body: bytes, at: int | None = None) -> str:
    """The signature header's value for `body` at epoch seconds `at` (default now)."""
    stamp = int(time.time()) if at is None else at
    mac = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    return f"t={stamp},v1={mac.hexdigest()}"


def verify(secret: str, body: bytes, header: str, *, tolerance_s: int = 300) -> bool:
    """What a receiver does: the MAC matches and `t` is within `tolerance_s` of now."""
    given = _SIGNATURE.fullmatch(header)
    if given is None:
        return False
    stamp = int(given.group(1))
    if abs(time.time() - stamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, body, stamp), header)


class DeliveryFailed(Exception):
    """The receiver did not take the alert (a connection error or a non-2xx status):
    worth retrying."""


def deliver(source: str) -> str:
    """POST the stored alert event `source` to its tenant's webhook, if it has one:
    "sent", or "no webhook" / "gone" (nothing to do), or DeliveryFailed. The URL passes
    the upstream SSRF guard again at each attempt (a name may resolve elsewhere now)."""
    row = AuditEvent.objects.filter(source=source, action=ACTION).first()
    if row is None or row.tenant_id is None:
        return "gone"
    hook = AlertWebhook.objects.filter(tenant_id=row.tenant_id).first()
    if hook is None:
        return "no webhook"
    try:
        url = validate_url(hook.url)
    except UpstreamURLError as exc:
        raise DeliveryFailed(f"the webhook URL is refused now: {exc}") from None
    body = payload(row.pk, row.chain, row.at, row.detail or {})
    headers = {"Content-Type": "application/json", EVENT_HEADER: f"evt_{row.pk}",
               SIGNATURE_HEADER: sign(unseal(hook.secret_sealed).reveal(), body)}
    try:
        reply = httpx.post(url, content=body, headers=headers, timeout=WEBHOOK_TIMEOUT_S,
                           follow_redirects=False)
    except httpx.HTTPError as exc:
        raise DeliveryFailed(f"{type(exc).__name__} posting the alert") from None
    if not reply.is_success:
        raise DeliveryFailed(f"the webhook answered {reply.status_code}")
    return "sent"


def enqueue(sources: Sequence[str]) -> None:
    """Deliver each stored alert event's webhook through Celery (the audit writer calls
    this once the events are committed)."""
    from governance.tasks import budget_alert_webhook

    for source in sources:
        budget_alert_webhook.delay(source)
