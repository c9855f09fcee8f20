"""`n` choices of one chat call against a live Sluice: over REST and SSE (the official
openai SDK), gRPC, the WebSocket and batch lines; admitted once, settled with the sum."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
import websockets
from django.conf import settings

from governance import audit
from governance import live as live_state
from governance.models import AuditEvent, Quota
from inference import queue as q
from inference.models import Deployment
from sluice.redis import sync_client
from streaming.batches.services import _call
from streaming.pipeline.gateway import Gateway
from streaming.pipeline.prompting import prompt_bound
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import Org, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

HELLO = [{"role": "user", "content": "hello, three choices"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items"],
         "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                        "items": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "enum": ["tea", "cake"]}}}}


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


def sdk(live: Live, org: Org) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                         max_retries=0, timeout=60)


def usage_of(reply: Any) -> tuple[int, int, int]:
    return (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens)


def wait_for(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


# -- REST and SSE ---------------------------------------------------------------------
def test_n_choices_over_rest_are_seeded_s_to_s_plus_n_and_their_usage_is_summed(
        live: Live, org: Org, tiny: str) -> None:
    # Given the random-weights model, sampled with seed 7
    client = sdk(live, org)
    ask = {"model": tiny, "messages": HELLO, "max_tokens": 6, "temperature": 1.0}
    # When one call asks for 3 choices, and three calls for one each with seeds 7, 8, 9
    reply = client.chat.completions.create(**ask, n=3, seed=7)
    singles = [client.chat.completions.create(**ask, seed=7 + i) for i in range(3)]
    # Then the reply has choices 0, 1 and 2, each a whole message of its own
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert len({c.message.content for c in reply.choices}) > 1, "the seeds differ"
    # and its usage is the sum of the three single calls'
    assert usage_of(reply) == tuple(map(sum, zip(*map(usage_of, singles), strict=True)))
    # and each single call's text is its choice's (choice i is seeded 7 + i)
    assert [c.message.content for c in reply.choices] == \
        [s.choices[0].message.content for s in singles]


def test_n_choices_stream_over_sse_with_their_indexes_and_one_usage_chunk(
        live: Live, org: Org) -> None:
    text = "three streams at once " * 4
    stream = sdk(live, org).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": text}], n=3, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    roles: list[int] = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(roles) == [0, 1, 2]
    assert texts == {0: text, 1: text, 2: text}
    assert finishes == {0: ["stop"], 1: ["stop"], 2: ["stop"]}
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3 * len(text)
    assert chunks[-1].usage.prompt_tokens == 3 * len(text)
    assert len({c.id for c in chunks}) == 1, "one completion, one id"


def test_n_choices_each_make_a_valid_forced_call_or_structured_answer(
        live: Live, org: Org, tiny: str) -> None:
    client = sdk(live, org)
    forced = client.chat.completions.create(
        model=tiny, messages=[{"role": "user", "content": "Weather in Paris?"}], n=3,
        temperature=1.0, seed=3, max_tokens=120, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.index for c in forced.choices] == [0, 1, 2]
    ids = []
    for choice in forced.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [made] = choice.message.tool_calls or []
        assert made.function.name == "get_weather"
        jsonschema.validate(json.loads(made.function.arguments),
                            WEATHER["function"]["parameters"])
        ids.append(made.id)
    assert len(set(ids)) == 3, "every choice's call has its own id"
    formatted = client.chat.completions.create(
        model=tiny, messages=[{"role": "user", "content": "An order, please"}], n=3,
        temperature=1.0, seed=5, max_tokens=120, response_format={
            "type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}})
    for choice in formatted.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), ORDER)


def test_n_out_of_range_or_with_what_it_cannot_have_is_a_400_naming_n(
        live: Live, org: Org) -> None:
    url, auth = f"{live.base_url}/chat/completions", {
        "Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}
    conversation = org.client(Role.DEVELOPER).post("/api/v1/conversations", {"title": "t"})
    body = {"model": "echo", "messages": HELLO}
    cases = [
        ({**body, "n": 9}, {}),
        ({**body, "n": 0}, {}),
        ({**body, "n": 2}, {"Idempotency-Key": "k1"}),
        ({**body, "n": 2, "stream": True}, {"Last-Event-ID": f"{'a' * 24}:3"}),
        ({**body, "n": 2, "conversation_id": conversation.body["id"]}, {}),
    ]
    with httpx.Client(timeout=30) as http:
        for request, headers in cases:
            response = http.post(url, json=request, headers={**auth, **headers})
            assert response.status_code == 400, (request, headers, response.text)
            assert response.json()["error"]["param"] == "n", response.text
    rds = sync_client(settings.REDIS_URL)
    assert not list(rds.scan_iter("sluice:{alice}:out:*")), "nothing reached a worker"


def test_a_client_that_leaves_cancels_every_choice(live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, model="slow-echo", max_tokens=100_000)
    client = sdk(live, org)
    stream = client.chat.completions.create(
        model="slow-echo", messages=[{"role": "user", "content": "x" * 300}], n=3,
        stream=True)
    seen: set[int] = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices if c.delta.content}
        if seen == {0, 1, 2}:
            break
    stream.close()
    worker = live.workers["slow-echo"]
    assert wait_for(lambda: not worker.active), "every generation stopped"
    rds = sync_client(settings.REDIS_URL)
    finals = [f[b"e"] for key in rds.scan_iter("sluice:{alice}:out:*")
              for _i, f in rds.xrange(key) if b'"done"' in f[b"e"]]
    assert len(finals) == 3 and all(b'"cancelled"' in e for e in finals)
    assert int(rds.get(q.depth_key("slow-echo")) or 0) == 0
    # and the call settled once, billed what the three made
    settled = wait_for(lambda: (u := live_state.quota_use(quota)).open_reservations == 0 and u)
    assert settled and settled.requests == 1 and 3 * 300 < settled.tokens < 3 * 600


def test_quota_is_reserved_once_for_every_choice_and_settled_with_their_sum(
        live: Live, org: Org) -> None:
    # Given a token quota on the slow model
    quota = Quota.objects.create(tenant=org.tenant, model="slow-echo", max_tokens=100_000)
    text = "y" * 40  # 40 tokens at 50 ms each: long enough to look at the reservation
    stream = sdk(live, org).chat.completions.create(
        model="slow-echo", messages=[{"role": "user", "content": text}], n=3, max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    # When the call with three choices is running
    chunks = [next(stream)]
    use = live_state.quota_use(quota)
    # Then one reservation holds the bound of all three
    spec = Deployment.objects.get(name="slow-echo").to_spec()
    assert use.open_reservations == 1
    assert use.reserved_tokens == 3 * (prompt_bound([text], spec) + 50)
    chunks += list(stream)
    # and once it ended, the quota is charged the summed usage, as one request
    total = chunks[-1].usage.total_tokens
    assert total == 3 * 2 * len(text)
    settled = wait_for(lambda: (u := live_state.quota_use(quota)).open_reservations == 0 and u)
    assert settled and (settled.tokens, settled.requests) == (total, 1)
    # and the call has one audit event, with the summed usage
    audit.drain()
    [event] = AuditEvent.objects.filter(action="chat.completions", model="slow-echo")
    assert (event.prompt_tokens, event.completion_tokens, event.status) == \
        (3 * len(text), 3 * len(text), 200)


# -- gRPC, the WebSocket, batch lines -------------------------------------------------
def test_n_choices_over_grpc(grpc_target: str, org: Org) -> None:
    request = pb.ChatRequest(model="echo", n=3,
                             messages=[pb.ChatMessage(role="user", content="grpc thrice")])
    auth = (("authorization", f"Bearer {org.keys[Role.DEVELOPER]}"),)

    async def go() -> tuple[Any, list[Any], Any]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            reply = await stub.Chat(request, metadata=auth, timeout=30)
            chunks = [c async for c in stub.ChatStream(request, metadata=auth, timeout=30)]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Chat(pb.ChatRequest(model="echo", n=9, messages=request.messages),
                                metadata=auth, timeout=30)
            return reply, chunks, refused.value

    reply, chunks, refused = asyncio.run(go())
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == "grpc thrice" and c.finish_reason == "stop"
               for c in reply.choices)
    assert reply.message.content == "grpc thrice"  # the first choice, as before n
    assert reply.usage.completion_tokens == 3 * len("grpc thrice")
    texts = {i: "".join(c.delta for c in chunks if c.index == i) for i in range(3)}
    assert texts == {0: "grpc thrice", 1: "grpc thrice", 2: "grpc thrice"}
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert [c for c in chunks if c.HasField("usage")] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 3 * len("grpc thrice")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'n'" in (refused.details() or "")


def test_n_choices_over_the_websocket(live: Live, org: Org) -> None:
    url = live.base_url.replace("http://", "ws://") + "/chat/socket"
    request = {"model": "echo", "n": 3, "messages": [{"role": "user", "content": "ws x3"}]}

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r1", "request": request}))
            frames: list[dict[str, Any]] = []
            while sum(f["type"] == "chat.done" for f in frames) < 3:
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
                assert frames[-1]["type"] != "error", frames[-1]
            return frames

    frames = asyncio.run(go())
    texts = {i: "".join(f["delta"] for f in frames
                        if f["type"] == "chat.delta" and f["index"] == i) for i in range(3)}
    assert texts == {0: "ws x3", 1: "ws x3", 2: "ws x3"}
    done = [f for f in frames if f["type"] == "chat.done"]
    assert sorted(f["index"] for f in done) == [0, 1, 2]
    assert all(f["finish_reason"] == "stop" for f in done)
    assert [f for f in done if "usage" in f] == [frames[-1]]  # the call's last frame
    assert frames[-1]["usage"]["completion_tokens"] == 3 * len("ws x3")


def test_a_batch_line_with_n_gets_every_choice(live: Live, org: Org) -> None:
    principal = principal_for(org.members[Role.DEVELOPER])

    async def go() -> tuple[int, dict[str, Any], str]:
        gateway = Gateway()
        try:
            return await _call(gateway, principal, "/v1/chat/completions", {
                "model": "echo", "n": 2, "messages": [{"role": "user", "content": "batch"}]})
        finally:
            await gateway.close()

    status, body, rid = asyncio.run(go())
    assert status == 200 and body["id"] == f"chatcmpl-{rid}"
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == \
        [(0, "batch"), (1, "batch")]
    assert body["usage"]["completion_tokens"] == 2 * len("batch")
