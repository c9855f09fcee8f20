"""Budget alerts and fallbacks through live gateways: each threshold fires once per
window across two gateway processes, is audited, and reaches the tenant's signed
webhook through a real Celery worker; a budget's fallback model serves the calls it
refuses; a tenant's time zone and webhook are set through the API."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from governance import alerts, audit, pricing
from governance import cache as policy_cache
from governance.models import AuditEvent, Budget, Price
from inference import selectors as inference_selectors
from inference.models import AliasTarget, Deployment, ModelAlias
from tenants.roles import Role
from tests.conftest import (
    Org,
    assert_openai_error,
    eventually,
    gateway_process,
    process_env,
)
from tests.governance.test_gateway import fire
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow]
TA, DEV = Role.TENANT_ADMIN, Role.DEVELOPER


@pytest.fixture
def private_webhooks(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """The test's receiver is on loopback: allowed here and in the processes it starts,
    which share this process's secret key (the webhook's secret is sealed with it)."""
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    monkeypatch.setenv("SLUICE_UPSTREAM_ALLOW_PRIVATE", "1")
    monkeypatch.setenv("SLUICE_SECRET_KEY", str(settings.SECRET_KEY))


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """An HTTP server that takes POSTs: (its URL, what it received)."""
    got: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/sluice", got
    server.shutdown()


def body(text: str) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}],
            "max_tokens": 16}


def test_thresholds_fire_once_across_two_gateways_to_a_signed_webhook(
        private_webhooks: None, live: Live, payer: Org, celery_worker: None,
        receiver: tuple[str, list[tuple[dict[str, str], bytes]]]) -> None:
    url, got = receiver
    admin = payer.client(TA)
    set_hook = admin.call("PATCH", f"/api/v1/tenants/{payer.tenant.pk}/billing",
                          {"webhook_url": url})
    assert set_hook.status == 200, set_hook.body
    secret = set_hook.body["webhook_secret"]
    assert secret.startswith("whsec_")
    again = admin.get(f"/api/v1/tenants/{payer.tenant.pk}/billing").body
    assert again["webhook_secret"] is None and again["webhook_secret_hint"] == secret[-4:]
    key = payer.keys[DEV]
    probe = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30
                          ).chat.completions.with_raw_response.create(**body("0123456789"))
    made = admin.post("/api/v1/governance/budgets", {
        "scope": "key", "key_id": payer.key_rows[DEV].pk, "window": "day",
        "limit_usd": str((Decimal(probe.headers[pricing.COST_HEADER]) * 10).quantize(
            Decimal("0.000001"))),
        "alert_at": [50, 25]})
    assert made.status == 201 and made.body["alert_at"] == [50, 25], made.body
    with gateway_process(process_env()) as (_proc, second):
        replies = asyncio.run(fire([live.base_url, f"{second}/v1"], key, 30,
                                   body("0123456789"), concurrency=2))
    codes = [r.status_code for r in replies]
    assert 200 in codes and 429 in codes, codes
    budget = Budget.objects.get(pk=made.body["id"])

    def alerted() -> list[AuditEvent]:
        audit.drain()
        return list(AuditEvent.objects.filter(action=alerts.ACTION).order_by("id"))
    events = eventually(lambda: len(alerted()) >= 2 and alerted(), 10,
                        what="two alert events")
    assert sorted(e.detail["threshold_pct"] for e in events) == [25, 50]
    assert all(e.target == f"budget:{budget.pk}" for e in events)
    detail = admin.get(f"/api/v1/governance/budgets/{budget.pk}").body
    assert detail["usage"]["alerted_pct"] == 50
    eventually(lambda: len(got) >= 2, 30, what="the webhook's two deliveries")
    ids = set()
    for headers, raw in got:
        assert alerts.verify(secret, raw, headers[alerts.SIGNATURE_HEADER.lower()])
        sent = json.loads(raw)
        assert sent["type"] == "budget.alert" and sent["tenant"] == "payer"
        assert sent["id"] == headers[alerts.EVENT_HEADER.lower()]
        ids.add(sent["id"])
    assert len(ids) == 2 and not alerts.verify("another secret", got[0][1],
                                               got[0][0][alerts.SIGNATURE_HEADER.lower()])
    assert len(alerted()) == 2, "once per threshold, whichever gateway settled"


def test_a_budgets_fallback_serves_the_calls_it_refuses(live: Live, payer: Org) -> None:
    admin = payer.client(TA)
    refused_model = admin.post("/api/v1/governance/budgets", {
        "scope": "key", "key_id": payer.key_rows[DEV].pk, "window": "total",
        "model": "echo", "limit_usd": "0", "fallback_model": "no-such-model"})
    assert_openai_error(refused_model, 422)
    # An alias as the fallback: its routing picks the deployment (slow-echo).
    alias = ModelAlias.objects.create(name="cheap")
    AliasTarget.objects.create(alias=alias, deployment=Deployment.objects.get(name="slow-echo"))
    inference_selectors.clear_routes()
    made = admin.post("/api/v1/governance/budgets", {
        "scope": "key", "key_id": payer.key_rows[DEV].pk, "window": "total",
        "model": "echo", "limit_usd": "0", "fallback_model": "cheap"})
    assert made.status == 201, made.body
    policy_cache.clear()
    client = openai.OpenAI(base_url=live.base_url, api_key=payer.keys[DEV], max_retries=0,
                           timeout=30)
    raw = client.chat.completions.with_raw_response.create(**body("cheaper, please"))
    assert raw.headers["x-sluice-fallback-model"] == "cheap"
    reply = raw.parse()
    assert reply.choices[0].message.content == "cheaper, please" and reply.model == "echo"
    # The fallback's own budget refusing: refused, no second fallback.
    Price.objects.create(model="slow-echo", input_per_mtok_usd=1, output_per_mtok_usd=1,
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    admin.post("/api/v1/governance/budgets", {
        "scope": "key", "key_id": payer.key_rows[DEV].pk, "window": "total",
        "model": "slow-echo", "limit_usd": "0", "fallback_model": "echo"})
    policy_cache.clear()
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**body("over both"))
    assert caught.value.code == "budget_exceeded" and "slow-echo" in caught.value.message


@pytest.mark.django_db
def test_time_zones_are_set_by_platform_admins_and_checked(ops: Org, alice: Org) -> None:
    path = f"/api/v1/tenants/{alice.tenant.pk}/billing"
    assert alice.client(TA).get(path).body["time_zone"] == "UTC"
    assert_openai_error(alice.client(TA).call("PATCH", path, {"time_zone": "Asia/Tokyo"}), 403)
    moved = ops.client(Role.PLATFORM_ADMIN).call("PATCH", path, {"time_zone": "Asia/Tokyo"})
    assert moved.status == 200 and moved.body["time_zone"] == "Asia/Tokyo", moved.body
    for bad in ("Mars/Olympus", "../etc/passwd", ""):
        error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).call(
            "PATCH", path, {"time_zone": bad}), 422)
        assert error["param"] == "time_zone"
    for bad_hook in ({"webhook_url": "http://169.254.169.254/latest"},
                     {"webhook_url": "ftp://example.com"}, {"webhook_secret": "x" * 20}):
        error = assert_openai_error(alice.client(TA).call("PATCH", path, bad_hook), 422)
        assert error["param"] in ("webhook_url", "webhook_secret")
    other = ops.client(Role.PLATFORM_ADMIN).post("/api/v1/tenants", {"slug": "other",
                                                                    "name": "Other"}).body
    assert_openai_error(alice.client(TA).get(f"/api/v1/tenants/{other['id']}/billing"), 404)
