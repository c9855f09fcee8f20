"""The OpenAI Files and Batch APIs with the official SDK, run by a real Celery worker
process through the same pipeline as live calls (quotas apply)."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai
import pytest

from governance import cache as policy_cache
from governance.models import Quota, RateLimitPolicy
from sluice.errors import (
    ApiError,
    BadRequest,
    DeadlineExceeded,
    QuotaExceeded,
    RateLimited,
    ServerError,
    Unavailable,
    audit_unavailable,
    database_unavailable,
)
from streaming.batches import retry_in
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


def jsonl(lines: list[dict[str, Any]]) -> io.BytesIO:
    data = io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())
    data.name = "requests.jsonl"
    return data


def chat_line(custom_id: str, text: str, model: str = "echo") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}]}}


def wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...],
         timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until or time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {row["custom_id"]: row for row in rows}


@pytest.fixture
def client(live: Live) -> openai.OpenAI:
    keys = make_org("batcher", [Role.DEVELOPER]).keys
    return openai.OpenAI(base_url=live.base_url, api_key=keys[Role.DEVELOPER], max_retries=0)


def test_a_batch_runs_every_line_through_the_pipeline(client: openai.OpenAI,
                                                      celery_worker: None) -> None:
    lines = [chat_line(f"ok-{i}", f"hello {i}") for i in range(4)]
    lines.append(chat_line("bad-model", "x", model="nope"))
    lines.append({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "echo", "messages": "not a list"}})
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 4, 2)
    out, err = results(client, done.output_file_id), results(client, done.error_file_id)
    assert set(out) == {f"ok-{i}" for i in range(4)}
    body = out["ok-2"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hello 2"
    assert out["ok-2"]["response"]["status_code"] == 200 and out["ok-2"]["response"]["request_id"]
    assert err["bad-model"]["response"]["status_code"] == 404
    assert err["bad-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert err["bad-body"]["response"]["status_code"] == 400
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]


def test_quotas_apply_to_batch_lines(client: openai.OpenAI, celery_worker: None) -> None:
    Quota.objects.create(tenant_id=make_org_tenant(), model="echo", max_requests=2)
    policy_cache.clear()
    uploaded = client.files.create(file=jsonl([chat_line(f"q-{i}", "hi") for i in range(4)]),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    refused = list(results(client, done.error_file_id).values())
    assert {r["response"]["status_code"] for r in refused} == {429}
    assert refused[0]["response"]["body"]["error"]["type"] == "insufficient_quota"


def test_a_batch_larger_than_the_rate_limit_runs_at_its_pace(client: openai.OpenAI,
                                                              celery_worker: None) -> None:
    """Two requests a second for the tenant, twelve lines sent eight at a time: lines
    refused with a 429 wait out its Retry-After and are sent again; none fails."""
    RateLimitPolicy.objects.create(scope="tenant", tenant_id=make_org_tenant(),
                                   requests_per_minute=120, burst_requests=2)
    policy_cache.clear()
    lines = [chat_line(f"r-{i}", f"paced {i}") for i in range(12)]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"), timeout=120)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0), \
        results(client, done.error_file_id)
    out = results(client, done.output_file_id)
    assert {row["response"]["body"]["choices"][0]["message"]["content"]
            for row in out.values()} == {f"paced {i}" for i in range(12)}
    assert time.monotonic() - started >= 4, "twelve lines at two a second take 5 s"


@pytest.mark.parametrize(("error", "wait_s"), [
    (RateLimited("slow down", retry_after_s=2), 2.0),
    (Unavailable("breaker open", code="circuit_open", headers={"Retry-After": "5"}), 5.0),
    (Unavailable("overloaded"), 1.0),  # no Retry-After: a second
    (database_unavailable(), 1.0),
    (audit_unavailable(), 5.0),
    (QuotaExceeded("used up", retry_after_s=30), None),  # a budget, not a pace
    (RateLimited("come back tomorrow", retry_after_s=3600), None),
    (ServerError("model fault", code="model_error", headers={"x-should-retry": "false"}),
     None),
    (Unavailable("dead", headers={"x-should-retry": "false"}), None),
    (BadRequest("bad"), None),
    (DeadlineExceeded("late"), None),
])
def test_which_refusals_a_batch_line_waits_out(error: ApiError, wait_s: float | None
                                               ) -> None:
    assert retry_in(error) == wait_s


def make_org_tenant() -> int:
    from tenants.models import Tenant
    return Tenant.objects.get(slug="batcher").pk


def test_invalid_files_fail_validation(client: openai.OpenAI, celery_worker: None) -> None:
    data = io.BytesIO(b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\nnot json\n')
    data.name = "bad.jsonl"
    uploaded = client.files.create(file=data, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    assert [e.code for e in done.errors.data] == ["mismatched_endpoint", "invalid_json_line"]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/images",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_cancel_keeps_what_finished(client: openai.OpenAI, celery_worker: None) -> None:
    lines = [chat_line(f"c-{i}", "z" * 40, model="slow-echo") for i in range(24)]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait(client, batch.id, ("in_progress",), timeout=30)
    time.sleep(1.0)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait(client, batch.id, ("cancelled", "completed"))
    assert done.status == "cancelled"
    assert done.request_counts is not None and done.request_counts.completed < 24
