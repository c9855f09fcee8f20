"""Anthropic's Messages API through the official anthropic SDK, unchanged, against a
live Sluice: messages create / stream / tools / count_tokens, x-api-key and Bearer, and
every error in Anthropic's envelope as the SDK's typed exceptions."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from governance import audit
from governance import cache as policy_cache
from governance.models import AuditEvent, Quota, RateLimitPolicy
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

WEATHER: Any = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER, Role.AUDITOR])


@pytest.fixture
def keys(org: Org) -> dict[Role, str]:
    return org.keys


def root(live: Live) -> str:
    return live.base_url.removesuffix("/v1")  # the SDK adds /v1/messages itself


def sdk(live: Live, key: str, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root(live), api_key=key, max_retries=0, timeout=60,
                               **kw)


def hello(text: str = "Hello, Claude! ünïcödé") -> list[Any]:
    return [{"role": "user", "content": text}]


def sse_events(live: Live, key: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """(event name, data) of a raw stream, keep-alive comments aside."""
    events = []
    with httpx.stream("POST", f"{live.base_url}/messages", json={**body, "stream": True},
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for frame in response.read().decode().split("\n\n"):
            lines = dict(line.split(": ", 1) for line in frame.splitlines()
                         if not line.startswith(":"))
            if lines:
                events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_create_answers_a_message_with_usage(live: Live, keys: dict[Role, str]) -> None:
    # given a system prompt as text blocks and a user turn
    client = sdk(live, keys[Role.DEVELOPER])
    # when the SDK creates a message
    reply = client.messages.create(
        model="echo", max_tokens=100, messages=hello(),
        extra_body={"temperature": 0.5, "top_p": 0.9},  # older SDKs' parameters
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "user-42"})
    # then it is Anthropic's message, the echo model's reply in one text block
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "echo"
    assert reply.id.startswith("msg_")
    assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [
        ("text", "Hello, Claude! ünïcödé")]
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    size = len("Hello, Claude! ünïcödé".encode())
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (size, size)


def test_max_tokens_and_stop_sequences_say_why_the_reply_ended(
        live: Live, keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    cut = client.messages.create(model="echo", max_tokens=4, messages=hello("abcdefghij"))
    assert cut.content[0].text == "abcd" and cut.stop_reason == "max_tokens"  # type: ignore[union-attr]
    stopped = client.messages.create(model="echo", max_tokens=100, stop_sequences=["##", "%"],
                                     messages=hello("one two ## three % four"))
    assert stopped.content[0].text == "one two "  # type: ignore[union-attr]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "##")


def test_stream_sends_anthropics_events_in_order(live: Live, keys: dict[Role, str]) -> None:
    # given a streamed call
    text = "stream me " * 8
    events = sse_events(live, keys[Role.DEVELOPER],
                        {"model": "echo", "max_tokens": 200, "messages": hello(text)})
    names = [name for name, _ in events]
    # then: message_start, one text block (ping after its start), message_delta, stop
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names[3:-3]) > 5
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and \
        start["stop_reason"] is None
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": len(text), "output_tokens": len(text),
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_sdk_stream_reassembles_text_and_final_message(live: Live,
                                                       keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    text = "streamed through the SDK " * 4
    with client.messages.stream(model="echo", max_tokens=500, messages=hello(text)) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text and len(pieces) > 5
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(text), len(text))


def test_forced_tool_use_input_validates_and_a_tool_result_round_trips(
        live: Live, tiny: str, keys: dict[Role, str]) -> None:
    # given the random-weights model and a tool it is told to use
    client = sdk(live, keys[Role.DEVELOPER])
    ask = hello("Weather in Paris?")
    choice: Any = {"type": "tool", "name": "get_weather"}
    # when it answers (plain and streamed)
    reply = client.messages.create(model=tiny, max_tokens=120, messages=ask, tools=[WEATHER],
                                   tool_choice=choice)
    with client.messages.stream(model=tiny, max_tokens=120, messages=ask, tools=[WEATHER],
                                tool_choice=choice) as stream:
        streamed = stream.get_final_message()
    # then each is one tool_use block whose input is an object valid against the schema
    for message in (reply, streamed):
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
    # and the call with its result goes back to the model as the next turn
    use = next(b for b in reply.content if b.type == "tool_use")
    turn: list[Any] = [*ask, {"role": "assistant", "content": reply.content},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": use.id,
                            "content": [{"type": "text", "text": "18 degrees"}]}]}]
    answer = client.messages.create(model=tiny, max_tokens=5, messages=turn, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # the call and its result are in the prompt, counted alike
    assert answer.usage.input_tokens > client.messages.count_tokens(
        model=tiny, messages=ask).input_tokens
    assert answer.usage.input_tokens == client.messages.count_tokens(
        model=tiny, messages=turn, tools=[WEATHER], tool_choice={"type": "none"}).input_tokens


def test_output_config_format_is_a_structured_output(live: Live, tiny: str,
                                                     keys: dict[Role, str]) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    reply = sdk(live, keys[Role.DEVELOPER]).messages.create(
        model=tiny, max_tokens=40, messages=hello("Two plus two?"),
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)  # type: ignore[union-attr]


def test_count_tokens_is_the_calls_own_count_and_free(live: Live, tiny: str, org: Org,
                                                      keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    messages = hello("How many tokens is this sentence?")
    # given a call's own prompt count (the worker's tokenizer and chat template)
    for tools in ([], [WEATHER]):
        made = client.messages.create(model=tiny, max_tokens=2, messages=messages,
                                      system="Be brief.", tools=tools)
        # when the same request is counted, it is that count exactly
        counted = client.messages.count_tokens(model=tiny, messages=messages,
                                               system="Be brief.", tools=tools)
        assert counted.input_tokens == made.usage.input_tokens
    # a prompt past the model's context (256) is still counted
    long = client.messages.count_tokens(model=tiny, messages=hello("word " * 400))
    assert long.input_tokens > 400
    # counts charge nothing: a 100-token quota still admits a call after many counts
    Quota.objects.create(tenant=org.tenant, model="echo", max_tokens=100)
    policy_cache.clear()
    for _ in range(5):
        assert client.messages.count_tokens(model="echo", messages=hello("x" * 60)) \
            .input_tokens == 60
    assert client.messages.create(model="echo", max_tokens=20, messages=hello("ok")) \
        .content[0].text == "ok"  # type: ignore[union-attr]


def test_x_api_key_and_bearer_both_authenticate(live: Live, keys: dict[Role, str]) -> None:
    key = keys[Role.DEVELOPER]
    by_header = anthropic.Anthropic(base_url=root(live), api_key=None, auth_token=None,
                                    default_headers={"x-api-key": key}, max_retries=0)
    by_token = anthropic.Anthropic(base_url=root(live), auth_token=key, max_retries=0)
    for client in (by_header, by_token, sdk(live, key)):
        assert client.messages.create(model="echo", max_tokens=10, messages=hello("hi")) \
            .content[0].text == "hi"  # type: ignore[union-attr]
    # any anthropic-version is accepted
    raw = httpx.post(f"{live.base_url}/messages", timeout=30, json={
        "model": "echo", "max_tokens": 5, "messages": hello("v")},
        headers={"x-api-key": key, "anthropic-version": "1999-12-31"})
    assert raw.status_code == 200 and raw.json()["content"] == [{"type": "text", "text": "v"}]
    assert raw.headers["request-id"]


def error_of(caught: pytest.ExceptionInfo[anthropic.APIStatusError]) -> dict[str, Any]:
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert isinstance(body["error"], dict)
    return body["error"]


def test_errors_are_anthropics_typed_errors(live: Live, keys: dict[Role, str],
                                           settings: Any) -> None:
    dev = sdk(live, keys[Role.DEVELOPER])
    wrong = "sk-sluice-aaaaaaaaaa-wrong"
    for client in (sdk(live, wrong), anthropic.Anthropic(
            base_url=root(live), api_key=None, default_headers={"x-api-key": wrong},
            max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
            client.messages.create(model="echo", max_tokens=5, messages=hello())
        assert error_of(unauthenticated)["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        dev.messages.create(model="no-such-model", max_tokens=5, messages=hello())
    assert error_of(missing)["type"] == "not_found_error"
    assert missing.value.error_code == "model_not_found"
    with pytest.raises(anthropic.BadRequestError) as no_max:
        dev.post("/v1/messages", cast_to=object,
                 body={"model": "echo", "messages": hello()})
    assert error_of(no_max) == {"type": "invalid_request_error",
                                "message": "max_tokens: Field required",
                                "details": {"error_code": "invalid_request"}}
    with pytest.raises(anthropic.BadRequestError) as top_k:
        dev.messages.create(model="echo", max_tokens=5, messages=hello(),
                            extra_body={"top_k": 5})
    assert error_of(top_k)["message"].startswith("top_k: not supported")
    with pytest.raises(anthropic.BadRequestError) as image:
        dev.messages.create(model="echo", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert error_of(image)["message"].startswith("messages.0.content.0: Input tag 'image'")
    with pytest.raises(anthropic.BadRequestError) as unknown:
        dev.messages.create(model="echo", max_tokens=5, messages=hello(),
                            extra_body={"colour": 1})
    assert error_of(unknown)["message"] == "colour: Extra inputs are not permitted"
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        sdk(live, keys[Role.AUDITOR]).messages.create(model="echo", max_tokens=5,
                                                      messages=hello())
    assert error_of(denied)["type"] == "permission_error"
    settings.SLUICE_MAX_INFERENCE_BODY_BYTES = 1000
    with pytest.raises(anthropic.ContentTooLargeError) as large:
        dev.messages.create(model="echo", max_tokens=5, messages=hello("x" * 2000))
    assert error_of(large)["type"] == "request_too_large"


def test_rate_limit_and_quota_are_rate_limit_errors_with_retry_after(
        live: Live, org: Org, keys: dict[Role, str]) -> None:
    tenant = org.tenant
    client = sdk(live, keys[Role.DEVELOPER])
    RateLimitPolicy.objects.create(scope="model", tenant=tenant, model="echo",
                                   requests_per_minute=60, burst_requests=1)
    policy_cache.clear()
    client.messages.create(model="echo", max_tokens=5, messages=hello())
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="echo", max_tokens=5, messages=hello())
    assert error_of(limited)["type"] == "rate_limit_error"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    Quota.objects.create(tenant=tenant, model="slow-echo", period="minute", max_requests=1)
    policy_cache.clear()
    client.messages.create(model="slow-echo", max_tokens=2, messages=hello("q"))
    with pytest.raises(anthropic.RateLimitError) as exhausted:
        client.messages.create(model="slow-echo", max_tokens=2, messages=hello("q"))
    error = error_of(exhausted)
    assert error["type"] == "rate_limit_error" and exhausted.value.error_code == "quota_exceeded"
    assert error["details"]["quota"]["limit"] == 1
    assert 1 <= int(exhausted.value.response.headers["retry-after"]) <= 60


def test_an_error_mid_stream_is_an_error_event(live: Live, keys: dict[Role, str],
                                               settings: Any) -> None:
    # given a deadline shorter than the slow model's reply (50 ms a token)
    settings.SLUICE_REQUEST_TIMEOUT_S = 1
    client = sdk(live, keys[Role.DEVELOPER])
    received: list[str] = []
    # when it passes mid-stream, the SDK raises the stream's error event
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(
            model="slow-echo", max_tokens=200, messages=hello("y" * 100)) as stream:
        received.extend(stream.text_stream)
    assert received, "the stream had begun"
    assert error_of(caught) == {"type": "timeout_error", "message": caught.value.body[
        "error"]["message"], "details": {"error_code": "deadline_exceeded"}}  # type: ignore[index]


def test_calls_and_counts_are_audited_as_messages(live: Live, org: Org,
                                                  keys: dict[Role, str]) -> None:
    # given a message, a refused one and a count
    client = sdk(live, keys[Role.DEVELOPER])
    client.messages.create(model="echo", max_tokens=5, messages=hello("audited"))
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="echo", max_tokens=5, messages=hello(),
                               extra_body={"top_k": 1})
    client.messages.count_tokens(model="echo", messages=hello("counted"))

    # then each has its audit event, under the API's own actions
    def events() -> list[tuple[str, int, int]]:
        audit.drain()
        rows = AuditEvent.objects.filter(tenant=org.tenant, action__startswith="messages")
        return sorted(rows.values_list("action", "status", "prompt_tokens"))

    deadline = time.monotonic() + 15
    while (found := events()) != [("messages", 200, 7), ("messages", 400, 0),
                                  ("messages.count_tokens", 200, 7)]:
        assert time.monotonic() < deadline, found


# What Claude Code sends (2.1 and later: system and turns as blocks with cache_control,
# its scope too; adaptive thinking by default; context_management, diagnostics and betas
# in the body; a history whose earlier replies thought and called tools, found by tool
# search), for a model that neither caches prompts nor thinks.
CACHED = {"type": "ephemeral", "scope": "global"}
CLAUDE_CODE_BODY: dict[str, Any] = {
    "model": "echo", "max_tokens": 64, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": CACHED}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is here?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look.", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "ZW5j"},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [
                {"type": "tool_reference", "tool_name": "Bash"},
                {"type": "text", "text": "README.md"}]},
            {"type": "text", "text": "list the files", "cache_control": CACHED}]}],
    "thinking": {"type": "adaptive", "budget_tokens": 0},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "diagnostics": {"session": "s1"}, "betas": ["interleaved-thinking-2025-05-14"],
    "metadata": {"user_id": "user_3f2a_account_9b_session_c1"},
    "output_config": {"effort": "high"}, "temperature": 1,
}


def test_claude_codes_request_streams_to_its_end(live: Live, keys: dict[Role, str]) -> None:
    events = sse_events(live, keys[Role.DEVELOPER], CLAUDE_CODE_BODY)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "list the files"
    assert not [d for n, d in events if n == "content_block_start"
                and d["content_block"]["type"] != "text"], "a block other than text"


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024},
                                      {"type": "adaptive"}, {"type": "disabled"},
                                      {"budget_tokens": 1200}])
def test_thinking_is_accepted_without_effect(live: Live, keys: dict[Role, str],
                                             thinking: dict[str, Any]) -> None:
    reply = sdk(live, keys[Role.DEVELOPER]).messages.create(
        model="echo", max_tokens=1500, messages=hello("think"),
        extra_body={"thinking": thinking})
    assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [("text", "think")]


def test_a_thinking_of_another_kind_is_refused_naming_it(live: Live,
                                                        keys: dict[Role, str]) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk(live, keys[Role.DEVELOPER]).messages.create(
            model="echo", max_tokens=5, messages=hello(),
            extra_body={"thinking": {"type": "deep", "budget_tokens": -1}})
    assert error_of(refused)["message"].startswith("thinking.")
