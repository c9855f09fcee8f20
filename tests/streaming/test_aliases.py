"""Calls to model aliases through the live gateway (tests/streaming/conftest.py, the
official openai SDK as the caller): the plan's order, fallbacks on a refused admission
and on a worker's retriable failure, open breakers left out, context, allow-lists and
the call's audit event. The deployments here are Sluice's own echo workers and upstream
deployments whose server fails (test_aliases_upstream.py: a working upstream Sluice)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from django.conf import settings
from openai import OpenAI

from governance import audit
from governance import cache as policy_cache
from governance.models import AuditEvent, BreakerPolicy, RateLimitPolicy
from inference.models import Deployment
from inference.selectors import clear_routes
from inference.services import alias_create, deployment_create
from inference.upstream.worker import UpstreamWorker
from inference.worker import Worker
from sluice.localinfra import free_port
from sluice.redis import sync_client
from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import Org, eventually, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


@pytest.fixture
def admin(live: Live) -> Any:
    return principal_for(make_org("ops", [Role.PLATFORM_ADMIN]).members[Role.PLATFORM_ADMIN])


@pytest.fixture
def started() -> Iterator[Callable[[Any], Any]]:
    """Run a worker (model or upstream) in a thread until the test ends."""
    threads: list[tuple[Any, threading.Thread]] = []

    def start(worker: Any) -> Any:
        thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
        thread.start()
        threads.append((worker, thread))
        return worker

    yield start
    for worker, thread in threads:
        worker.stopping.set()
        thread.join(15)


@pytest.fixture
def small(live: Live, started: Callable[[Any], Any]) -> Worker:
    """An echo deployment with a 64-token context, served."""
    spec = Deployment.objects.create(name="echo-small", runtime="echo", max_context=64,
                                     max_batch_size=8).to_spec()
    worker: Worker = started(Worker(spec, sync_client(settings.REDIS_URL),
                                    block_ms=200))
    return worker


@pytest.fixture
def caller(org: Org, live: Live) -> OpenAI:
    clear_routes()
    policy_cache.clear()
    return OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0,
                  timeout=30)


def _ask(client: OpenAI, model: str, text: str, **params: Any) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], **params)
    return reply.choices[0].message.content or ""


def audited(org: Org, count: int) -> list[AuditEvent]:
    """The tenant's last `count` chat call events, oldest first, once they are stored."""
    return audited_as(org, "chat.completions", count)


def audited_as(org: Org, action: str, count: int) -> list[AuditEvent]:
    """The tenant's last `count` call events of `action`, oldest first, once stored."""
    def stored() -> list[AuditEvent]:
        audit.drain(settle_s=0.1)
        rows = list(AuditEvent.objects.filter(tenant=org.tenant, action=action)
                    .order_by("-seq")[:count])
        return rows if len(rows) == count else []
    return list(reversed(eventually(stored, 15, what=f"{count} audit events")))


def test_a_call_too_long_for_a_target_moves_to_the_fallback_with_room(
        live: Live, org: Org, admin: Any, small: Worker, caller: OpenAI) -> None:
    alias_create(actor=admin, name="org/echo", targets=[("echo-small", 1)],
                 fallbacks=["echo"])
    assert _ask(caller, "org/echo", "hi") == "hi"
    long = "x" * 100  # over echo-small's 64 tokens (bound: one token per byte)
    assert _ask(caller, "org/echo", long) == long
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(caller, "org/echo", "y" * 3000)  # over every deployment's context
    assert refused.value.code == "context_length_exceeded"
    first, second, refusal = audited(org, 3)
    assert (first.model, second.model) == ("echo-small", "echo")
    assert first.detail["alias"] == second.detail["alias"] == "org/echo"
    assert second.detail["skipped"] == "echo-small (context_too_small)"
    assert "failed_attempts" not in second.detail
    assert refusal.model == "org/echo" and refusal.status == 400
    assert [len(batch) for batch in small.admitted] == [1]


def test_a_rate_limited_target_falls_back_and_each_attempt_is_its_own(
        live: Live, org: Org, admin: Any, small: Worker, caller: OpenAI) -> None:
    alias_create(actor=admin, name="org/echo", targets=[("echo-small", 1)],
                 fallbacks=["echo"])
    # The tenant's limit on echo-small alone: one call a minute.
    RateLimitPolicy.objects.create(scope="model", tenant=org.tenant, model="echo-small",
                                   requests_per_minute=1, burst_requests=1)
    policy_cache.clear()
    assert _ask(caller, "org/echo", "one") == "one"
    assert _ask(caller, "org/echo", "two") == "two"
    first, second = audited(org, 2)
    assert first.model == "echo-small" and second.model == "echo"
    assert second.detail["failed_attempts"] == "echo-small (429 rate_limit_requests)"
    # Called by name, the limited deployment still refuses: the limit is its own.
    with pytest.raises(openai.RateLimitError):
        _ask(caller, "echo-small", "three")


@pytest.fixture
def down(live: Live, admin: Any, started: Callable[[Any], Any], settings: Any) -> Deployment:
    """An upstream deployment whose server is down (every call a retriable 503
    upstream_unavailable before any text), served, first target of the alias org/ha
    with echo as its fallback."""
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    deployment = deployment_create(actor=admin, name="up-down", runtime="openai_upstream",
                                   upstream_url=f"http://127.0.0.1:{free_port()}/v1",
                                   upstream_model="m", max_context=2048)
    started(UpstreamWorker(deployment.to_spec(), sync_client(settings.REDIS_URL),
                           private_ok=True, block_ms=200))
    alias_create(actor=admin, name="org/ha", targets=[("up-down", 1)], fallbacks=["echo"])
    return deployment


def test_a_retriable_upstream_failure_falls_back_until_the_breaker_opens(
        org: Org, caller: OpenAI, down: Deployment) -> None:
    BreakerPolicy.objects.create(deployment=down, min_calls=2, window_size=4,
                                 failure_rate=0.5, open_wait_s=600)
    policy_cache.clear()
    for i in range(2):
        assert _ask(caller, "org/ha", f"call {i}") == f"call {i}"
    for event in audited(org, 2):
        assert event.model == "echo" and event.status == 200
        assert event.detail["failed_attempts"] == "up-down (503 upstream_unavailable)"

    # Two failures in its window open up-down's breaker: calls skip it, no attempt.
    def skipped() -> bool:
        assert _ask(caller, "org/ha", "later") == "later"
        [event] = audited(org, 1)
        return event.detail.get("skipped") == "up-down (breaker_open)" and \
            "failed_attempts" not in event.detail
    eventually(skipped, 10, what="the open breaker to be skipped")


def test_a_final_failure_is_the_answer(live: Live, org: Org, admin: Any, caller: OpenAI,
                                       started: Callable[[Any], Any], settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    # The upstream refuses Sluice's key: 502 upstream_auth_failed, marked not to retry.
    bad = deployment_create(actor=admin, name="up-bad", runtime="openai_upstream",
                            upstream_url=live.base_url, upstream_model="echo",
                            upstream_api_key="sk-not-a-key-of-that-server", max_context=2048)
    started(UpstreamWorker(bad.to_spec(), sync_client(settings.REDIS_URL),
                           private_ok=True, block_ms=200))
    alias_create(actor=admin, name="org/bad", targets=[("up-bad", 1)], fallbacks=["echo"])
    with pytest.raises(openai.InternalServerError) as failed:
        _ask(caller, "org/bad", "hello")
    assert failed.value.code == "upstream_auth_failed"
    assert failed.value.response.headers["x-should-retry"] == "false"
    [event] = audited(org, 1)
    assert event.model == "up-bad" and event.status == 502
    assert event.detail["alias"] == "org/bad" and "failed_attempts" not in event.detail
    assert not live.workers["echo"].admitted, "no fallback after a final failure"


def test_the_key_s_allow_list_names_the_alias(live: Live, org: Org, admin: Any,
                                              small: Worker, caller: OpenAI) -> None:
    alias_create(actor=admin, name="org/echo", targets=[("echo-small", 1)],
                 fallbacks=["echo"])
    developer = org.members[Role.DEVELOPER]
    to_alias = apikey_create(actor=principal_for(developer), name="alias",
                             allowed_models=["org/echo"]).secret
    to_deployment = apikey_create(actor=principal_for(developer), name="deployment",
                                  allowed_models=["echo-small"]).secret
    narrow = OpenAI(base_url=live.base_url, api_key=to_alias, max_retries=0, timeout=30)
    assert _ask(narrow, "org/echo", "allowed") == "allowed"
    with pytest.raises(openai.NotFoundError):
        _ask(narrow, "echo-small", "not by its own name")
    other = OpenAI(base_url=live.base_url, api_key=to_deployment, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as missing:
        _ask(other, "org/echo", "not through the alias")
    assert missing.value.code == "model_not_found"


def test_aliases_serve_several_choices_and_embeddings(live: Live, org: Org, admin: Any,
                                                      small: Worker, caller: OpenAI) -> None:
    alias_create(actor=admin, name="org/echo", targets=[("echo-small", 1)])
    alias_create(actor=admin, name="org/embed", targets=[("minilm", 1)])
    reply = caller.chat.completions.create(
        model="org/echo", n=2, messages=[{"role": "user", "content": "twice"}])
    assert [c.message.content for c in reply.choices] == ["twice", "twice"]
    vectors = caller.embeddings.create(model="org/embed", input=["a", "b"])
    assert [len(v.embedding) for v in vectors.data] == [384, 384]
    with pytest.raises(openai.BadRequestError) as wrong:
        caller.embeddings.create(model="org/echo", input="a")
    assert wrong.value.code == "wrong_model_kind"


def test_a_stored_response_that_fell_back_is_stored_under_the_id_its_caller_got(
        org: Org, caller: OpenAI, down: Deployment) -> None:
    # Given an alias whose first target fails every call before any event
    # When a plain and a streamed Responses call are answered by the fallback
    plain = caller.responses.create(model="org/ha", input="plain")
    streamed = list(caller.responses.create(model="org/ha", input="streamed",
                                            stream=True))[-1].response
    # Then each is stored under the id its caller got, as it was answered
    for response in (plain, streamed):
        assert caller.responses.retrieve(response.id) == response
    events = audited_as(org, "responses", 2)
    assert [(e.model, e.detail.get("failed_attempts")) for e in events] == [
        ("echo", "up-down (503 upstream_unavailable)")] * 2


def test_a_conversation_stays_on_one_target_and_conversations_spread(
        live: Live, org: Org, admin: Any, started: Callable[[Any], Any],
        caller: OpenAI) -> None:
    """Placement by prefix: the turns of a conversation (its opening resent) go to one
    target, whose own prefix cache holds it; different openings share the targets."""
    twin = Deployment.objects.create(name="echo-twin", runtime="echo", max_batch_size=8)
    started(Worker(twin.to_spec(), sync_client(settings.REDIS_URL), block_ms=200))
    alias_create(actor=admin, name="org/pair", targets=[("echo", 1), ("echo-twin", 1)])
    for opening in range(8):
        history: list[Any] = [{"role": "system", "content": f"persona {opening}"}]
        for turn in range(3):  # each turn resends the conversation so far
            history.append({"role": "user", "content": f"turn {turn}"})
            reply = caller.chat.completions.create(model="org/pair", messages=history)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
    rows = audited(org, 24)
    per_opening = [{row.model for row in rows[i:i + 3]} for i in range(0, 24, 3)]
    assert all(len(models) == 1 for models in per_opening), per_opening
    assert set().union(*per_opening) == {"echo", "echo-twin"}
