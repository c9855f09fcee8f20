"""The OpenAI Files and Batch APIs with the official SDK, run by a real Celery worker
process through the same pipeline as live calls (quotas apply)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from governance import cache as policy_cache
from governance.guardrail_models import GuardrailPolicy
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
from streaming.batches.lines import retry_in
from tenants.roles import Role
from tenants.services import apikey_revoke
from tests.conftest import REPO, eventually, make_org, process_env
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


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


CHUNK_LINES = 4


@pytest.fixture
def celery_worker(transactional_db: None, tmp_path: Path) -> Iterator[None]:
    """A real Celery worker process (solo pool, as tests/conftest.py's) running batches
    in chunks of CHUNK_LINES; its log is printed when the test ends (shown on failure)."""
    log = tmp_path / "worker.log"
    env = process_env(SLUICE_STATE_DIR=str(tmp_path),
                      SLUICE_BATCH_CHUNK_LINES=str(CHUNK_LINES))
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sluice.celery",
                                 "worker", "--pool", "solo", "--loglevel", "WARNING",
                                 "--without-gossip", "--without-mingle"], cwd=REPO, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
    yield
    proc.terminate()
    proc.wait(20)
    print(log.read_text(errors="replace")[-6000:])


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


def test_guardrails_apply_to_batch_lines(client: openai.OpenAI, celery_worker: None) -> None:
    tenant = make_org_tenant()
    GuardrailPolicy.objects.create(tenant_id=tenant, name="no-birds", guard="words",
                                   phase="pre", action="block", scope="tenant",
                                   config={"deny": ["bluebird"]})
    GuardrailPolicy.objects.create(tenant_id=tenant, name="mask-out", guard="pii",
                                   phase="post", action="mask", scope="tenant")
    policy_cache.clear()
    uploaded = client.files.create(file=jsonl([
        chat_line("fine", "write to jane.doe@example.com"),
        chat_line("blocked", "a bluebird sings")]), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"))
    out, err = results(client, done.output_file_id), results(client, done.error_file_id)
    assert out["fine"]["response"]["body"]["choices"][0]["message"]["content"] == \
        "write to [EMAIL]"
    refused = err["blocked"]["response"]
    assert refused["status_code"] == 400
    assert refused["body"]["error"]["code"] == "content_blocked"
    assert "bluebird" not in json.dumps(refused)


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


# -- chunks, revocation, the worker never held ----------------------------------------
def batch_row(batch_id: str) -> Any:
    from streaming.models import Batch
    return Batch.objects.select_related("output_file", "error_file").get(public_id=batch_id)


def rows_of(stored: Any) -> list[dict[str, Any]]:
    if stored is None:
        return []
    return [json.loads(line) for line in Path(stored.path).read_text().splitlines()]


def paced_batch(base_url: str, org: Any, count: int, *,
                requests_per_minute: int) -> tuple[openai.OpenAI, str]:
    """A batch of `count` echo lines by `org`'s developer, under a tenant rate limit of
    `requests_per_minute` with a burst of one."""
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant,
                                   requests_per_minute=requests_per_minute, burst_requests=1)
    policy_cache.clear()
    sdk = openai.OpenAI(base_url=base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    uploaded = sdk.files.create(
        file=jsonl([chat_line(f"p-{i}", f"paced {i}") for i in range(count)]), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    return sdk, batch.id


def ended(batch_id: str) -> Any:
    row = batch_row(batch_id)
    return row if row.status in ("failed", "completed", "cancelled") else None


@pytest.mark.parametrize("revoke", ["key", "member"])
def test_a_revoked_identity_ends_the_batch_before_its_next_chunk(
        live: Live, celery_worker: None, revoke: str) -> None:
    """Given a batch paced at a line a second (a chunk each), when the creator's key is
    revoked (or the member deactivated) after the first line ran, then the batch ends
    `failed` with credential_revoked and the remaining lines never run."""
    from tenants.services import member_update
    from tests.conftest import principal_for

    org = make_org(f"revoked-{revoke}", [Role.TENANT_ADMIN, Role.DEVELOPER])
    _, batch_id = paced_batch(live.base_url, org, 12, requests_per_minute=60)
    eventually(lambda: batch_row(batch_id).completed >= 1, 60, what="the first line")
    admin = principal_for(org.members[Role.TENANT_ADMIN])
    if revoke == "key":
        apikey_revoke(actor=admin, key_id=org.key_rows[Role.DEVELOPER].pk)
    else:
        member_update(actor=admin, member_id=org.members[Role.DEVELOPER].pk, is_active=False)
    done = eventually(lambda: ended(batch_id), 60, what="the batch to end")
    assert done.status == "failed"
    assert [e["code"] for e in done.errors["data"]] == ["credential_revoked"]
    ran = rows_of(done.output_file) + rows_of(done.error_file)
    assert 1 <= len(ran) < 12 and done.completed == len(rows_of(done.output_file))


def test_a_rate_limited_chunk_is_rescheduled_and_frees_the_worker(
        live: Live, celery_worker: None) -> None:
    """Given one tenant's batch under 2 requests a minute (its second line is told to
    come back in ~30 s), then its next chunk waits as a scheduled task, not in the
    worker: another tenant's batch completes meanwhile on the same solo worker; and a
    cancel ends the waiting batch at once."""
    from sluice.celery import app

    slow = make_org("slowpoke", [Role.DEVELOPER])
    sdk, batch_id = paced_batch(live.base_url, slow, 3, requests_per_minute=2)
    eventually(lambda: batch_row(batch_id).completed >= 1, 60, what="the first line")

    def scheduled() -> list[dict[str, Any]]:
        replies = app.control.inspect(timeout=2).scheduled() or {}
        return [entry for entries in replies.values() for entry in entries
                if entry["request"]["name"] == "streaming.tasks.run_batch"]

    [entry] = eventually(scheduled, 30, what="the rescheduled chunk")
    assert str(batch_row(batch_id).pk) in str(entry["request"]["args"])

    other = make_org("quick", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    quick = openai.OpenAI(base_url=live.base_url, api_key=other, max_retries=0)
    uploaded = quick.files.create(file=jsonl([chat_line(f"q-{i}", "hi") for i in range(6)]),
                                  purpose="batch")
    theirs = quick.batches.create(input_file_id=uploaded.id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = wait(quick, theirs.id, ("completed", "failed"), timeout=25)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 6
    assert batch_row(batch_id).status == "in_progress", "still waiting for its rate limit"

    assert sdk.batches.cancel(batch_id).status == "cancelled"
    assert batch_row(batch_id).completed < 3


def test_a_line_nested_thousands_deep_fails_alone(client: openai.OpenAI,
                                                  celery_worker: None) -> None:
    deep = ('{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", '
            '"body": {"model": "echo", "messages": ' + "[" * 5000 + "]" * 5000 + "}}")
    nested = {"custom_id": "nested", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "echo", "messages": [], "metadata": {}}}
    inner: Any = nested["body"]
    for _ in range(100):  # readable JSON, past what a request may nest
        inner["x"] = {}
        inner = inner["x"]
    data = io.BytesIO("\n".join([json.dumps(chat_line("ok-0", "a")), deep, json.dumps(nested),
                                 json.dumps(chat_line("ok-1", "b"))]).encode())
    data.name = "deep.jsonl"
    uploaded = client.files.create(file=data, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (4, 2, 2)
    assert set(results(client, done.output_file_id)) == {"ok-0", "ok-1"}
    errors = [json.loads(line) for line in
              client.files.content(done.error_file_id or "").text.splitlines()]
    assert sorted((e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors) \
        == [(None, "json_too_deep", 2), (None, "json_too_deep", 3)]


@pytest.mark.parametrize("stuck", ["validating", "cancelling"])
def test_cancel_ends_a_batch_that_no_chunk_runs(client: openai.OpenAI, stuck: str) -> None:
    """No worker runs here: a batch left `validating` (or `cancelling`, as a runner that
    died leaves it) ends `cancelled` on cancel, and its input file can then be deleted."""
    from streaming.models import Batch

    uploaded = client.files.create(file=jsonl([chat_line("a", "x")]), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    Batch.objects.filter(public_id=batch.id).update(status=stuck)
    assert client.batches.cancel(batch.id).status == "cancelled"
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
