"""What agent clients send as a matter of course, against a live server: Codex CLI's
Responses request as it writes it (`prompt_cache_key` with every call, `store: false`,
`include`, `client_metadata`), and OpenAI's hint parameters through the `openai` SDK
(streaming/pipeline/schemas.py `ClientHints`: prompt caching, service tier, safety identifier,
reasoning effort, verbosity) on Responses and Chat Completions: accepted without effect,
each still range-checked; what would need an effect this engine lacks is refused by
name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tenants.roles import Role
from tests.conftest import Org
from tests.streaming.conftest import Live
from tests.streaming.test_choices import org, sdk  # noqa: F401  (a fixture, a client)

pytestmark = pytest.mark.slow

# The body Codex CLI sends to a `wire_api = "responses"` provider (codex-rs
# ResponsesApiRequest: instructions, input items with input_text parts, function tools,
# tool_choice "auto", store false, stream true, include, prompt_cache_key = the thread's
# id, client_metadata), for a model that neither reasons nor takes a verbosity.
CODEX_BODY: dict[str, Any] = {
    "model": "echo",
    "instructions": "You are a coding agent running in the Codex CLI.",
    "input": [{"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "list the files"}]}],
    "tools": [{"type": "function", "name": "shell", "description": "Runs a command",
               "strict": False, "parameters": {
                   "type": "object", "properties": {
                       "command": {"type": "array", "items": {"type": "string"}},
                       "workdir": {"type": "string"}},
                   "required": ["command"], "additionalProperties": False}}],
    "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "stream": True,
    "include": [], "prompt_cache_key": "0199a7c2-5b1e-7d30-9a5e-3f0c1b2d4e6f",
    "client_metadata": {"x-codex-installation-id": "8f14e45f-ceea-467f-a0e6-2f1c0b4b7a11"},
}


def test_codex_clis_request_streams_to_completion(
        live: Live, org: Org, roomy: str) -> None:  # noqa: F811
    # Given a model that can call tools; When Codex CLI's request comes (its 1,024
    # tokens' default bound cut to keep the toy model's reply short)
    events: list[dict[str, Any]] = []
    body = {**CODEX_BODY, "model": roomy, "max_output_tokens": 24}
    with httpx.stream("POST", f"{live.base_url}/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}",
                               "originator": "codex_cli_rs", "session_id": "s1"}) as reply:
        assert reply.status_code == 200, reply.read()
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ")]
    # Then it streams Responses' events to the end, as Codex reads them
    assert events[0]["type"] == "response.created"
    done = events[-1]
    assert done["type"] in ("response.completed", "response.incomplete"), done
    assert done["response"]["output"] and done["response"]["usage"]["input_tokens"] > 0
    assert done["response"]["prompt_cache_key"] == CODEX_BODY["prompt_cache_key"]
    assert done["response"]["store"] is False


def test_openais_hints_are_accepted_on_responses(
        live: Live, org: Org) -> None:  # noqa: F811
    response = sdk(live, org).responses.create(
        model="echo", input="hello", prompt_cache_key="thread-1", safety_identifier="u-1",
        service_tier="auto", reasoning={"effort": "low", "summary": "auto"},
        text={"verbosity": "low"}, include=["reasoning.encrypted_content"],
        max_tool_calls=4, prompt_cache_retention="24h")
    assert response.output_text == "hello"
    assert response.service_tier == "default"
    assert response.reasoning is not None and response.reasoning.effort == "low"
    assert response.prompt_cache_key == "thread-1" and response.max_tool_calls == 4


def test_openais_hints_are_accepted_on_chat(live: Live, org: Org) -> None:  # noqa: F811
    reply = sdk(live, org).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello"}],
        prompt_cache_key="thread-1", safety_identifier="u-1", service_tier="auto",
        reasoning_effort="low", verbosity="low", store=False)
    assert reply.choices[0].message.content == "hello"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/responses", {"input": "hi", "include": ["message.output_text.logprobs"]},
     "include[0]"),
    ("/responses", {"input": "hi", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ("/responses", {"input": "hi", "service_tier": "cheapest"}, "service_tier"),
    ("/responses", {"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
    ("/responses", {"input": "hi", "prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "store": True},
     "store"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                           "verbosity": "loud"}, "verbosity"),
])
def test_a_hint_out_of_range_or_needing_an_effect_is_refused_by_name(
        live: Live, org: Org, path: str, body: dict[str, Any],  # noqa: F811
        param: str) -> None:
    reply = httpx.post(f"{live.base_url}{path}", json={"model": "echo", **body}, timeout=30,
                       headers={"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
