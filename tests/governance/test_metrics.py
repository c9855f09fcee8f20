"""Prometheus /metrics on the live server: the listed series exist, they move after
requests, and only loopback (or the scrape token) may read them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI, RateLimitError
from prometheus_client.parser import text_string_to_metric_families

from governance import audit
from governance.models import Quota, RateLimitPolicy, RateLimitScope
from sluice.observability import metrics
from tenants.roles import Role
from tests.conftest import eventually, make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.cluster

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(live: Live, **headers: str) -> Samples:
    response = httpx.get(live.base_url.removesuffix("/v1") + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples: Samples, name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for (n, ls) in samples)


def test_series_exist_and_move_after_requests(live: Live) -> None:
    org = make_org("metered", [Role.DEVELOPER])
    Quota.objects.create(tenant=org.tenant, model="echo", period="day", max_tokens=100_000)
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    before = scrape(live)
    chat = dict(route="/v1/chat/completions", model="echo", status="200")
    for _ in range(3):
        client.chat.completions.create(model="echo", max_tokens=5,
                                       messages=[{"role": "user", "content": "one two three"}])
    stream = client.chat.completions.create(model="echo", max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": "a b c d"}])
    assert len([c for c in stream]) > 2
    client.embeddings.create(model="minilm", input=["hello"])

    def moved() -> Samples | None:
        after = scrape(live)  # the batch-size histogram arrives with a worker heartbeat
        ok = value(after, "sluice_batch_size_count", deployment="echo") >= \
            value(before, "sluice_batch_size_count", deployment="echo") + 1
        return after if ok else None

    after = eventually(moved, timeout=6)
    assert after is not None, "the batch-size histogram did not move"
    assert value(after, "sluice_requests_total", **chat, protocol="rest") == \
        value(before, "sluice_requests_total", **chat, protocol="rest") + 3
    assert value(after, "sluice_requests_total", **{**chat, "protocol": "sse"}) == \
        value(before, "sluice_requests_total", **{**chat, "protocol": "sse"}) + 1
    assert value(after, "sluice_request_duration_seconds_count", model="echo") >= 4
    assert value(after, "sluice_time_to_first_token_seconds_count", model="echo") >= 4
    assert value(after, "sluice_output_tokens_per_second_count", model="echo") >= 1
    assert value(after, "sluice_tokens_total", model="echo", kind="completion") >= \
        value(before, "sluice_tokens_total", model="echo", kind="completion") + 4
    assert value(after, "sluice_tokens_total", model="minilm", kind="prompt") >= 1
    for deployment in ("echo", "minilm"):
        assert has(after, "sluice_queue_depth", deployment=deployment)
        assert has(after, "sluice_queue_oldest_age_seconds", deployment=deployment)
        assert value(after, "sluice_workers", deployment=deployment) == 1
        assert value(after, "sluice_breaker_state", deployment=deployment) == 0
        assert value(after, "sluice_worker_device_memory_bytes", deployment=deployment,
                     kind="used") > 0
    assert has(after, "sluice_batch_size_bucket", deployment="echo", le="8.0")
    assert has(after, "sluice_breaker_opens_total", deployment="echo")
    quota = dict(tenant=org.tenant.slug, model="echo", metric="tokens")
    assert value(after, "sluice_quota_used", **quota) > 0
    assert value(after, "sluice_quota_limit", **quota) == 100_000


def test_rate_limit_rejections_are_counted(live: Live) -> None:
    org = make_org("limited", [Role.DEVELOPER])
    RateLimitPolicy.objects.create(tenant=org.tenant, scope=RateLimitScope.TENANT,
                                   requests_per_minute=1, burst_requests=1)
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    before = scrape(live)
    client.chat.completions.create(model="echo", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RateLimitError):
        client.chat.completions.create(model="echo", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    after = scrape(live)
    key = dict(model="echo", limit="requests")
    assert value(after, "sluice_ratelimit_rejections_total", **key) == \
        value(before, "sluice_ratelimit_rejections_total", **key) + 1
    assert value(after, "sluice_requests_total", route="/v1/chat/completions",
                 status="429") >= 1


def test_unknown_models_never_become_labels(live: Live) -> None:
    org = make_org("scanner", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    for i in range(3):
        with pytest.raises(Exception, match="does not exist"):
            client.chat.completions.create(model=f"probe-{i}", messages=[
                {"role": "user", "content": "hi"}])
    after = scrape(live)
    assert not [ls for (n, ls) in after if n == "sluice_requests_total"
                and any(v.startswith("probe-") for _, v in ls)]
    assert value(after, "sluice_requests_total", route="/v1/chat/completions", model="",
                 status="404") >= 3


def test_metrics_are_for_loopback_or_the_scrape_token(live: Live,
                                                     settings: Any) -> None:
    assert metrics.allowed("127.0.0.1", None) and metrics.allowed("::1", None)
    assert not metrics.allowed("10.0.0.8", None)
    assert not metrics.allowed(None, None)
    settings.SLUICE_METRICS_TOKEN = "scrape-secret"
    assert not metrics.allowed("127.0.0.1", None)
    assert not metrics.allowed("127.0.0.1", "Bearer wrong")
    assert metrics.allowed("10.0.0.8", "Bearer scrape-secret")
    url = live.base_url.removesuffix("/v1") + "/metrics"
    refused = httpx.get(url)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "forbidden"
    assert scrape(live, authorization="Bearer scrape-secret")


@pytest.mark.parametrize("writer", ["audit", "responses"])
def test_a_writers_backlog_shows_until_the_writer_stores_it(live: Live, writer: str) -> None:
    """The live fixture runs no writer process: a call's audit event (and its stored
    response) waits in Redis, and the backlog's size and age say so until written."""
    from streaming.apis.responses import writer as responses_writer

    drain = {"audit": audit.drain, "responses": responses_writer.drain}[writer]
    drain()
    org = make_org("backlogged", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    for _ in range(3):
        client.responses.create(model="echo", input="audited and stored")
    metric = f"sluice_{writer}_backlog"

    def backlogged() -> Samples | None:
        samples = scrape(live)
        return samples if value(samples, metric) >= 3 else None

    samples = eventually(backlogged, 5, what="the backlog to show three entries")
    assert 0 < value(samples, f"{metric}_oldest_age_seconds") < 60
    drain()
    eventually(lambda: value(scrape(live), metric) == 0, 5,
               what="the backlog to empty once written")
    assert value(scrape(live), f"{metric}_oldest_age_seconds") == 0
