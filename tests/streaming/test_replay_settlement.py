"""An idempotent retry that meets its first request (streaming/pipeline/replay.py): the request is
charged once whoever settles it, also when the gateway that ran it died; and a retry
never gets a cancelled request's cut reply as if it were whole.

A live Sluice (uvicorn + echo workers, real Redis and PostgreSQL) answers the retries;
the "other gateway" that admitted the first request is a Gateway in the test's own
loop, which then dies (stops without reading, settling or cancelling its call) or
cancels its call as a gateway does when its client leaves."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
from django.conf import settings

from governance import live as live_state
from governance import usage
from governance.models import Quota
from inference import queue as q
from inference.client import InferenceClient
from sluice.redis import sync_client
from streaming.apis import chat_request
from streaming.pipeline.gateway import Gateway
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
SLOW = "slow-echo"  # 50 ms a token: a call of N characters runs N x 50 ms


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("replays", [Role.DEVELOPER])


def body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": SLOW, "messages": [{"role": "user", "content": text}], **kw}


def sdk(live: Live, key: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=timeout)


def wait_for(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def first_attempt(key: str, request: dict[str, Any], idempotency_key: str, *,
                  cancel: bool) -> str:
    """Admit and submit `request` on a gateway of the test's own, which then stops:
    with `cancel`, after cancelling the call on the worker as a gateway does when its
    client leaves, but with the key not yet freed (a retry that came first); else
    dying with the call running (nothing read, settled or cancelled). Its request id."""
    async def run() -> str:
        gateway = Gateway()
        principal = await gateway.authenticate(f"Bearer {key}")
        sub = await gateway.chat(principal, chat_request.call_request(
            chat_request.parsed(request), idempotency_key=idempotency_key))
        if cancel:
            await sub.cancel()
        await gateway.client.close()
        return sub.handle.rid

    return asyncio.run(run())


def charged(org: Org) -> dict[str, int]:
    """The tenant's usage counters today (requests, prompt, completion by field)."""
    day = datetime.now(UTC).date().isoformat()
    raw = sync_client(settings.REDIS_URL).hgetall(usage.usage_key(org.tenant.slug, day))
    return {k.decode().rsplit("|", 1)[1]: int(v) for k, v in raw.items()}


def test_a_call_whose_gateway_died_is_charged_once_by_the_retries_that_replay_it(
        live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, model=SLOW, max_requests=100)
    key = org.keys[Role.DEVELOPER]
    text = "billed though its gateway died"
    rid = first_attempt(key, body(text), "died", cancel=False)
    assert live_state.quota_use(quota).open_reservations == 1  # the dead gateway's

    retry = sdk(live, key).chat.completions.create(**body(text),
                                                   extra_headers={"Idempotency-Key": "died"})
    assert retry.id == f"chatcmpl-{rid}"  # a replay of the first request, not a new run
    assert retry.choices[0].message.content == text
    assert retry.usage is not None
    tokens = retry.usage.total_tokens
    use = wait_for(lambda: (u := live_state.quota_use(quota)).requests and u) or \
        live_state.quota_use(quota)
    assert (use.requests, use.tokens) == (1, tokens)
    assert charged(org) == {"r": 1, "p": retry.usage.prompt_tokens,
                            "c": retry.usage.completion_tokens}

    # Another retry replays it again: nothing more is charged.
    again = sdk(live, key).chat.completions.create(**body(text),
                                                   extra_headers={"Idempotency-Key": "died"})
    assert again.id == retry.id
    # Its own reservation released: only the dead gateway's is left (until it expires).
    assert wait_for(lambda: live_state.quota_use(quota).open_reservations == 1)
    use = live_state.quota_use(quota)
    assert (use.requests, use.tokens) == (1, tokens)
    assert charged(org)["r"] == 1


def test_a_call_and_its_replay_are_charged_once(live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, model=SLOW, max_requests=100)
    client = sdk(live, org.keys[Role.DEVELOPER])
    headers = {"Idempotency-Key": "twice"}
    first = client.chat.completions.create(**body("once"), extra_headers=headers)
    second = client.chat.completions.create(**body("once"), extra_headers=headers)
    assert second.id == first.id
    assert wait_for(lambda: (u := live_state.quota_use(quota)).requests == 1
                    and u.open_reservations == 0)
    assert first.usage is not None
    assert live_state.quota_use(quota).tokens == first.usage.total_tokens
    assert charged(org)["r"] == 1


def test_a_retry_after_a_client_timeout_gets_the_whole_reply(live: Live, org: Org) -> None:
    """The client stops reading a plain call after 0.5 s (of ~3 s) and sends it again
    with the same key: the gateway cancelled the first request when its client left and
    freed the key, so the retry runs afresh and gets the whole reply."""
    key = org.keys[Role.DEVELOPER]
    text = "impatient " * 6
    headers = {"Idempotency-Key": "impatient"}
    with pytest.raises(openai.APITimeoutError):
        sdk(live, key, timeout=0.5).chat.completions.create(**body(text),
                                                            extra_headers=headers)
    reply = sdk(live, key).chat.completions.create(**body(text), extra_headers=headers)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop"


def test_a_plain_retry_that_finds_its_request_cancelled_runs_afresh(
        live: Live, org: Org) -> None:
    """The retry came before the key was freed: it replays a request that ends
    cancelled, and runs the call afresh rather than answer with the cut reply."""
    key = org.keys[Role.DEVELOPER]
    text = "cut short, then whole " * 2
    cut = first_attempt(key, body(text), "cut", cancel=True)
    reply = sdk(live, key).chat.completions.create(**body(text),
                                                   extra_headers={"Idempotency-Key": "cut"})
    assert reply.id != f"chatcmpl-{cut}"
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop"
    # The key now names the run that answered: a further retry replays it.
    again = sdk(live, key).chat.completions.create(**body(text),
                                                   extra_headers={"Idempotency-Key": "cut"})
    assert again.id == reply.id


def test_a_streamed_retry_that_finds_its_request_cancelled_is_told_to_retry(
        live: Live, org: Org) -> None:
    """A stream cannot take back the text it sent: a replay of a cancelled request ends
    with the retriable error `request_cancelled`, never a finish; the key is freed, so
    the next retry runs afresh."""
    key = org.keys[Role.DEVELOPER]
    text = "streamed and cut"
    headers = {"Idempotency-Key": "cut-stream"}
    first_attempt(key, body(text, stream=True), "cut-stream", cancel=True)
    finishes = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in sdk(live, key).chat.completions.create(**body(text, stream=True),
                                                           extra_headers=headers):
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert caught.value.code == "request_cancelled"
    assert finishes == []
    parts = []
    for chunk in sdk(live, key).chat.completions.create(**body(text, stream=True),
                                                       extra_headers=headers):
        parts += [c.delta.content or "" for c in chunk.choices]
        finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert "".join(parts) == text and finishes == ["stop"]


def test_the_idempotency_key_is_freed_only_while_it_names_the_request() -> None:
    from streaming.pipeline.replay import free_key

    rds = sync_client(settings.REDIS_URL)
    key = q.idem_key("replays-t", "k")
    rds.set(key, b'{"rid":"other","fp":"x"}')
    rds.set(q.done_key("replays-t", "ended"), "w")

    async def free(rid: str, *, unended: bool) -> None:
        client = InferenceClient(settings.REDIS_URL)
        try:
            await free_key(client.redis, "replays-t", "k", rid, unended=unended)
        finally:
            await client.close()

    asyncio.run(free("mine", unended=False))
    assert rds.exists(key)
    rds.set(key, b'{"rid":"ended","fp":"x"}')
    asyncio.run(free("ended", unended=True))  # it ended whole: its reply stands
    assert rds.exists(key)
    asyncio.run(free("ended", unended=False))
    assert not rds.exists(key)
    rds.delete(q.done_key("replays-t", "ended"))
    rds.close()
