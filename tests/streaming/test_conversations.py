"""Server-side conversations over the OpenAI SDK: history is kept per tenant, fed back
as context, and trimmed to the model's window by the stated policy."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletion

from tenants.models import Conversation
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_conversation_keeps_history_and_trims_it(live: Live, tiny: str) -> None:
    import httpx

    org = make_org("alice", [Role.DEVELOPER])
    key = org.keys[Role.DEVELOPER]
    with httpx.Client(timeout=10) as http:
        created = http.post(live.base_url.replace("/v1", "/api/v1") + "/conversations",
                            json={"title": "demo"}, headers={"Authorization": f"Bearer {key}"})
    conversation = created.json()["id"]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)

    def ask(text: str, conversation_id: str = conversation) -> ChatCompletion:
        return client.chat.completions.create(
            model=tiny, messages=[{"role": "user", "content": text}], max_tokens=8,
            temperature=0, extra_body={"conversation_id": conversation_id})

    first = ask("My name is Ada.")
    second = ask("What is my name?")
    assert first.usage and second.usage
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 8, "history was included"
    stored = Conversation.objects.get(public_id=conversation).messages.order_by("id")
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[0].content == "My name is Ada."
    assert stored[1].content == first.choices[0].message.content
    # Far more history than the 256-token window: the oldest turns are dropped, the
    # request still fits and answers.
    for i in range(12):
        reply = ask(f"Turn {i}: " + "words " * 20)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens <= 256 - 8
    # Another tenant cannot use (or see) it.
    bob = make_org("bob", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=live.base_url, api_key=bob, max_retries=0).chat.completions.create(
            model=tiny, messages=[{"role": "user", "content": "hi"}],
            extra_body={"conversation_id": conversation})
    with pytest.raises(openai.BadRequestError):
        ask("x", conversation_id="not-a-conversation")


def test_conversation_stream_resumes_from_last_offset(live: Live) -> None:
    import httpx

    key = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=30) as http:
        conversation = http.post(live.base_url.replace("/v1", "/api/v1") + "/conversations",
                                 json={}, headers=auth).json()["id"]
        body = {"model": "slow-echo", "stream": True, "conversation_id": conversation,
                "messages": [{"role": "user", "content": "pick up where I left " * 2}]}
        url = f"{live.base_url}/chat/completions"
        with http.stream("POST", url, json=body, headers=auth) as response:
            ids, text = [], ""
            for line in response.iter_lines():
                if line.startswith("id: "):
                    ids.append(line[4:])
                elif line.startswith("data: "):
                    if '"content"' in line:
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if len(ids) >= 5:  # drop the connection after an event's data
                        break
        last_offset = int(ids[-1].split(":")[1])
        rest = http.post(url, json={**body, "last_offset": last_offset}, headers=auth)
        for line in rest.text.splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
        bad = http.post(url, json={**body, "stream": False, "last_offset": 2}, headers=auth)
    assert text == "pick up where I left " * 2
    assert bad.status_code == 400


def test_a_nul_in_a_message_is_stored_not_a_500(live: Live) -> None:
    """PostgreSQL text cannot hold NUL: the turn is kept with U+FFFD in its place."""
    key = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    import httpx

    conversation = httpx.post(live.base_url.replace("/v1", "/api/v1") + "/conversations",
                              json={}, headers={"Authorization": f"Bearer {key}"}).json()
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a\x00b"}],
        extra_body={"conversation_id": conversation["id"]})
    assert reply.choices[0].message.content == "a\x00b"
    stored = Conversation.objects.get(public_id=conversation["id"])
    assert [m.content for m in stored.messages.order_by("id")] == ["a\ufffdb", "a\ufffdb"]
