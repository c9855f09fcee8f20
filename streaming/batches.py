"""The OpenAI Batch API: services, selectors and the batch runner (files:
streaming/files.py).

A batch runs in a Celery job (`streaming.tasks.run_batch`): it validates the input
JSONL, then sends every line through the same gateway pipeline as a live call (RBAC,
model access, rate limits, quotas, breakers, audit with protocol "batch"), a few at a
time, and writes OpenAI's output and error files. Results are appended to partial files
as they finish, so a rerun (Celery redelivers a job whose worker died) skips the lines
already done instead of running and billing them twice. Cancelling is noticed between
lines; what finished stays in the output.

A line refused for a passing reason (a rate limit, shedding, an open breaker, a queue
or database outage: a 429 or 503 that says when to come back) waits and is sent again,
as a client would, until the batch expires: a batch larger than the tenant's limits
runs at their pace instead of failing most of its lines. A used-up quota, bad input, a
model fault, or a refusal that says to come back more than RETRY_MAX_WAIT_S later fails
its line at once.

What a batch stores is redacted per the tenant's policy (governance/privacy.py, read
once when the job starts): its metadata when created, every output and error line
(string values; custom_id too) before it is written. Partial and final files are 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
from datetime import timedelta
from pathlib import Path
from secrets import token_hex
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance.privacy import Redactor, redact_json, redactor_now
from sluice.db import async_db
from sluice.errors import ApiError, BadRequest, Conflict, NotFound, QuotaExceeded
from sluice.private_files import open_private
from streaming import bodies
from streaming.call import Call
from streaming.files import TERMINAL, file_get, files_dir, store
from streaming.gateway import Gateway
from streaming.models import Batch, BatchStatus, StoredFile
from streaming.schemas import ChatCompletionRequest, EmbeddingRequest, parse
from tenants.models import ApiKey, Tenant
from tenants.principal import AuthMethod, Principal
from tenants.privacy import policy_of
from tenants.roles import Action, Role
from tenants.selectors import require

logger = logging.getLogger("sluice.batches")
ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
MAX_LINES = 50_000
CONCURRENCY = 8
RETRY_MAX_WAIT_S = 60.0  # a refusal that says to come back later than this fails its line


# -- batches --------------------------------------------------------------------------
def _frozen(principal: Principal) -> dict[str, Any]:
    data = dataclasses.asdict(principal)
    if data["allowed_models"] is not None:
        data["allowed_models"] = sorted(data["allowed_models"])
    return data


def _thawed(data: dict[str, Any]) -> Principal:
    models = data.get("allowed_models")
    return Principal(**{**data, "role": Role(data["role"]), "method": AuthMethod(data["method"]),
                        "allowed_models": frozenset(models) if models is not None else None})


@transaction.atomic
def batch_create(*, actor: Principal, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: dict[str, str] | None) -> Batch:
    require(actor, Action.MODEL_USE)
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    if completion_window != "24h":
        raise BadRequest("completion_window must be '24h'.", param="completion_window")
    source = file_get(actor=actor, file_id=input_file_id)
    if source.purpose != "batch":
        raise BadRequest("The input file's purpose must be 'batch'.", param="input_file_id")
    batch = Batch.objects.create(
        tenant_id=actor.tenant_id, public_id=f"batch_{token_hex(12)}", endpoint=endpoint,
        input_file=source, principal=_frozen(actor),
        metadata=redact_json(metadata, redactor_now(actor.tenant_id), keys=True),
        expires_at=timezone.now() + timedelta(hours=24))
    from sluice.auditlog import admin_action
    from streaming.tasks import run_batch

    admin_action(actor=actor, action="batch.create", target=batch.public_id,
                 detail={"endpoint": endpoint})
    transaction.on_commit(lambda: run_batch.delay(batch.pk))
    return batch


def batch_list(*, actor: Principal) -> QuerySet[Batch]:
    """The batches the caller may read (a tenant admin: the tenant's; anyone else: their
    own, as files), less the finished ones past the retention (or whose input file is:
    the retention task deletes those with it)."""
    require(actor, Action.MODEL_USE)
    cutoff = policy_of(actor.tenant_id).cutoff()
    found = Batch.objects.filter(tenant_id=actor.tenant_id)
    if not actor.can(Action.CONVERSATION_MANAGE_ALL):
        found = found.filter(principal__subject=actor.subject)
    return found.exclude(
        Q(created_at__lt=cutoff) | Q(input_file__created_at__lt=cutoff),
        status__in=TERMINAL).select_related(
        "input_file", "output_file", "error_file").order_by("-id")


def batch_get(*, actor: Principal, batch_id: str) -> Batch:
    row = batch_list(actor=actor).filter(public_id=batch_id).first()
    if row is None:
        raise NotFound(f"No such batch: '{batch_id[:64]}'.", param="batch_id")
    return row


@transaction.atomic
def batch_cancel(*, actor: Principal, batch_id: str) -> Batch:
    batch = batch_get(actor=actor, batch_id=batch_id)
    if batch.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.CANCELLING,
                                                 cancelling_at=timezone.now())
        batch.refresh_from_db()
    elif batch.status != BatchStatus.CANCELLING:
        raise Conflict(f"The batch is {batch.status}; it cannot be cancelled.")
    return batch


# -- the runner -----------------------------------------------------------------------
def _validate(batch: Batch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(requests, errors) of the input file, errors in OpenAI's shape."""
    errors: list[dict[str, Any]] = []
    lines: list[dict[str, Any]] = []
    seen: set[str] = set()
    raw = Path(batch.input_file.path).read_text(encoding="utf-8", errors="replace")
    for number, text in enumerate(raw.splitlines(), start=1):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except ValueError:
            errors.append({"code": "invalid_json_line", "line": number,
                           "message": "This line is not valid JSON."})
            continue
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str) \
                or not isinstance(item.get("body"), dict):
            errors.append({"code": "invalid_request", "line": number,
                           "message": "Each line needs a custom_id and a body object."})
        elif item.get("method", "POST") != "POST" or item.get("url") != batch.endpoint:
            errors.append({"code": "mismatched_endpoint", "line": number,
                           "message": f"url must be {batch.endpoint} and method POST."})
        elif item["custom_id"] in seen:
            errors.append({"code": "duplicate_custom_id", "line": number,
                           "message": "custom_id values must be unique."})
        else:
            seen.add(item["custom_id"])
            lines.append(item)
    if not lines and not errors:
        errors.append({"code": "empty_file", "line": None, "message": "The file is empty."})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "line": None,
                       "message": f"A batch holds at most {MAX_LINES} requests."})
    return lines, errors


def _done_ids(*paths: Path) -> set[str]:
    done = set()
    for path in paths:
        if path.exists():
            for text in path.read_text(encoding="utf-8").splitlines():
                try:
                    done.add(json.loads(text)["custom_id"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash is run again
    return done


def run(batch_id: int) -> str:
    batch = Batch.objects.select_related("input_file").filter(pk=batch_id).first()
    if batch is None or batch.status in TERMINAL:
        return batch.status if batch else "missing"
    principal = _thawed(batch.principal)
    tenant_ok = Tenant.objects.filter(pk=principal.tenant_id, is_active=True).exists()
    key_ok = principal.key_id is None or any(
        k.is_usable() for k in ApiKey.objects.filter(pk=principal.key_id))
    lines, errors = _validate(batch)
    if errors or not tenant_ok or not key_ok:
        if not (tenant_ok and key_ok):
            errors = [{"code": "credential_revoked", "line": None,
                       "message": "The tenant or API key behind this batch was disabled."}]
        Batch.objects.filter(pk=batch.pk).update(
            status=BatchStatus.FAILED, failed_at=timezone.now(),
            errors={"object": "list", "data": errors[:100]})
        return BatchStatus.FAILED
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now(), total=len(lines))
    work = files_dir(batch.tenant_id)
    out_part, err_part = work / f"{batch.public_id}.out.part", work / f"{batch.public_id}.err.part"
    clean = redactor_now(batch.tenant_id)
    done = _done_ids(out_part, err_part)
    # A line's custom_id is stored redacted: either form marks it done.
    todo = [line for line in lines
            if line["custom_id"] not in done and clean(line["custom_id"]) not in done]
    asyncio.run(_process(batch, principal, todo, out_part, err_part, clean))
    return _finish(batch, principal, out_part, err_part)


async def _process(batch: Batch, principal: Principal, todo: list[dict[str, Any]],
                   out_part: Path, err_part: Path, clean: Redactor) -> None:
    gateway = Gateway()
    gate = asyncio.Semaphore(CONCURRENCY)
    cancelled = asyncio.Event()
    completed = failed = 0

    async def watch() -> None:
        while not cancelled.is_set():
            status = await async_db(lambda: Batch.objects.filter(pk=batch.pk).values_list(
                "status", flat=True).first())()
            if status == BatchStatus.CANCELLING:
                cancelled.set()
                return
            await asyncio.sleep(0.5)

    async def one(item: dict[str, Any]) -> None:
        nonlocal completed, failed
        async with gate:
            if cancelled.is_set():
                return
            answer = await _answer(gateway, principal, batch, item["body"], cancelled)
            if answer is None:
                return  # cancelled while waiting to send it again: not done
            status, body, rid = answer
            line = json.dumps({"id": f"batch_req_{token_hex(12)}",
                               "custom_id": clean(item["custom_id"]),
                               "response": {"status_code": status, "request_id": rid,
                                            "body": redact_json(body, clean)},
                               "error": None})
            with open_private(out_part if status == 200 else err_part, "a",
                              encoding="utf-8") as f:
                f.write(line + "\n")
            if status == 200:
                completed += 1
            else:
                failed += 1
            if (completed + failed) % 20 == 0:
                await async_db(lambda: Batch.objects.filter(pk=batch.pk).update(
                    completed=completed, failed=failed))()

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(item) for item in todo))
    finally:
        cancelled.set()
        watcher.cancel()
        await gateway.close()


async def _answer(gateway: Gateway, principal: Principal, batch: Batch,
                  body: dict[str, Any], cancelled: asyncio.Event
                  ) -> tuple[int, dict[str, Any], str] | None:
    """One line's answer: (status, OpenAI body or error body, request id); a passing
    refusal is waited out and the line sent again until the batch expires. None: the
    batch was cancelled while the line waited."""
    while True:
        try:
            return await _call(gateway, principal, batch.endpoint, body)
        except ApiError as exc:
            wait_s = retry_in(exc)
            if wait_s is None or timezone.now() + timedelta(seconds=wait_s) >= batch.expires_at:
                return exc.status, exc.body(), ""
        # A little jitter, so that the lines refused together do not come back together.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cancelled.wait(),
                                   wait_s * random.uniform(1.0, 1.25))  # noqa: S311 - jitter
        if cancelled.is_set():
            return None


def retry_in(exc: ApiError) -> float | None:
    """Seconds to wait before sending a refused line again, or None when the refusal
    is final: not a 429 or 503, a used-up quota (a budget, not a pace), an error marked
    certain to fail again, or one that says to come back after RETRY_MAX_WAIT_S."""
    if exc.status not in (429, 503) or isinstance(exc, QuotaExceeded) \
            or exc.headers.get("x-should-retry") == "false":
        return None
    retry = exc.headers.get("Retry-After", "")
    seconds = float(retry) if retry.isdigit() else 1.0
    return seconds if seconds <= RETRY_MAX_WAIT_S else None


async def _call(gateway: Gateway, principal: Principal, endpoint: str,
                body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    """One line through the pipeline: (200, OpenAI body, request id); a refusal or an
    error raises its ApiError."""
    embedding = endpoint == "/v1/embeddings"
    async with Call(gateway, principal, protocol="batch",
                    action="embeddings" if embedding else "chat.completions") as call:
        if embedding:
            emb = parse(EmbeddingRequest, body)
            sub = await call.embed(emb)
            return 200, await bodies.embeddings(sub, emb), sub.handle.rid
        req = parse(ChatCompletionRequest, body)
        if req.stream:
            raise BadRequest("stream is not supported in a batch.", param="stream")
        sub = await call.chat(req)
        return 200, await bodies.chat_completion(sub, req), sub.handle.rid


def _finish(batch: Batch, principal: Principal, out_part: Path, err_part: Path) -> str:
    Batch.objects.filter(pk=batch.pk).update(finalizing_at=timezone.now())
    outputs: dict[str, StoredFile | None] = {}
    counts = []
    for name, part in (("output", out_part), ("error", err_part)):
        content = part.read_bytes() if part.exists() else b""
        counts.append(content.count(b"\n"))
        outputs[name] = store(
            tenant_id=batch.tenant_id, filename=f"{batch.public_id}_{name}.jsonl",
            purpose="batch_output", content=content, created_by=principal.subject,
        ) if content else None
        part.unlink(missing_ok=True)
    current = Batch.objects.get(pk=batch.pk)
    final = (BatchStatus.CANCELLED if current.status == BatchStatus.CANCELLING
             else BatchStatus.COMPLETED)
    now = timezone.now()
    Batch.objects.filter(pk=batch.pk).update(
        status=final, output_file=outputs["output"], error_file=outputs["error"],
        completed=counts[0], failed=counts[1],
        completed_at=now if final == BatchStatus.COMPLETED else None,
        cancelled_at=now if final == BatchStatus.CANCELLED else None)
    return final
