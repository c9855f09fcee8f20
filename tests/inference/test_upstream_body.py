"""inference/upstream/body.py and the client's error mapping alone: what is sent to an
upstream for a job, how its chunks are read, what its failures mean."""

from __future__ import annotations

from typing import Any

import pytest

from inference.jobs import ChatJob, ResponseFormat, ToolSpec, decode_job, encode_job
from inference.spec import Dialect, UpstreamSpec
from inference.upstream.body import ChunkReader, Continuation, can_continue, path_of, request_body
from inference.upstream.client import exception_failure, status_failure
from inference.upstream.network import BadReply, ConnectFailed, Disconnected, ReadTimeout
from inference.upstream.secrets import cache_salt
from inference.upstream.urls import UpstreamURLError


def _up(dialect: Dialect) -> UpstreamSpec:
    return UpstreamSpec(base_url="http://10.0.0.5:8000/v1", model="served-name", dialect=dialect)


CHAT = ChatJob(history=[{"role": "user", "content": "earlier"}],
               messages=[{"role": "user", "content": "hi", "tool_call_id": "x",
                          "api_base": "http://169.254.169.254/"}],
               max_tokens=50, temperature=0.2, top_p=0.9, seed=7, stop=["END"],
               presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={42: -100.0},
               logprobs=3, ignore_eos=True)


def test_a_chat_job_s_parameters_pass_through_and_nothing_else() -> None:
    body = request_body(CHAT, _up(Dialect.OPENAI), tenant="alice", max_tokens=50)
    assert path_of(CHAT) == "/chat/completions"
    assert body == {
        "model": "served-name", "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 50, "temperature": 0.2, "top_p": 0.9, "seed": 7, "stop": ["END"],
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100.0},
        "messages": [{"role": "user", "content": "earlier"},
                     {"role": "user", "content": "hi", "tool_call_id": "x"}],
        "logprobs": True, "top_logprobs": 3}


def test_a_chat_job_s_instructions_precede_its_history() -> None:
    job = ChatJob(history=[{"role": "user", "content": "earlier"},
                           {"role": "assistant", "content": "said"}],
                  messages=[{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"}])
    body = request_body(job, _up(Dialect.OPENAI), tenant="t", max_tokens=10)
    assert [m["content"] for m in body["messages"]] == ["be brief", "earlier", "said", "hi"]


def test_tool_traffic_and_tool_descriptions_cross_the_queue_and_go_natively() -> None:
    # given a job with an earlier call, its result, and a described tool
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    job = ChatJob(messages=[{"role": "user", "content": "weather?", "name": "ann"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
                            {"role": "assistant", "content": "Checking.", "tool_calls": [call]}],
                  tools=[ToolSpec("get_weather", description="The weather in a city")])
    # when it crosses the queue and becomes the upstream's body
    body = request_body(decode_job(encode_job(job)), _up(Dialect.OPENAI), tenant="t",
                        max_tokens=10)
    # then the messages are the chat API's own (null content for a turn that only calls)
    assert body["messages"] == [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"},
        "description": "The weather in a city"}}]


def test_vllm_gets_the_tenant_s_cache_salt_and_its_extensions() -> None:
    alice = request_body(CHAT, _up(Dialect.VLLM), tenant="alice", max_tokens=50)
    bob = request_body(CHAT, _up(Dialect.VLLM), tenant="bob", max_tokens=50)
    assert alice["cache_salt"] == cache_salt("alice") != bob["cache_salt"]
    assert alice["ignore_eos"] is True
    sglang = request_body(CHAT, _up(Dialect.SGLANG), tenant="alice", max_tokens=50)
    assert "cache_salt" not in sglang and sglang["ignore_eos"] is True
    for dialect in (Dialect.OPENAI, Dialect.SLUICE):
        plain = request_body(CHAT, _up(dialect), tenant="alice", max_tokens=50)
        assert "cache_salt" not in plain and "ignore_eos" not in plain


def test_tools_and_response_formats_in_openai_s_shape() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    job = ChatJob(messages=[{"role": "user", "content": "weather?"}],
                  tools=[ToolSpec("get_weather", params, strict=True), ToolSpec("noop")],
                  tool_choice="get_weather", parallel_tool_calls=False,
                  response_format=ResponseFormat(schema={"type": "object"}, strict=True))
    body = request_body(job, _up(Dialect.OPENAI), tenant="t", max_tokens=10)
    assert body["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": params,
                                          "strict": True}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": {"type": "object"}, "strict": True}}
    auto = ChatJob(messages=job.messages, tools=job.tools, tool_choice="required",
                   response_format=ResponseFormat(type="json_object"))
    body = request_body(auto, _up(Dialect.OPENAI), tenant="t", max_tokens=10)
    assert body["tool_choice"] == "required"
    assert body["response_format"] == {"type": "json_object"}


def test_a_chat_continuation_keeps_the_reply_open_where_the_upstream_can() -> None:
    resumed = Continuation(text="The answer is", seq=4, completion_tokens=4)
    body = request_body(CHAT, _up(Dialect.VLLM), tenant="a", max_tokens=50,
                        continuation=resumed)
    assert body["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 46
    assert can_continue(CHAT, Dialect.VLLM) and can_continue(CHAT, Dialect.SGLANG)
    assert not can_continue(CHAT, Dialect.OPENAI) and not can_continue(CHAT, Dialect.SLUICE)


def test_a_completion_continuation_is_the_prompt_plus_the_text_everywhere() -> None:
    job = ChatJob(prompt="Once upon", logprobs=2)
    assert path_of(job) == "/completions"
    body = request_body(job, _up(Dialect.SLUICE), tenant="a", max_tokens=16,
                        continuation=Continuation(text=" a time", seq=2, completion_tokens=2))
    assert body["prompt"] == "Once upon a time" and body["max_tokens"] == 14
    assert body["logprobs"] == 2 and "messages" not in body
    assert can_continue(job, Dialect.OPENAI)


def test_chunks_give_text_logprobs_tool_calls_finish_and_usage() -> None:
    reader = ChunkReader()
    lp = {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                       "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}]}
    assert reader.read({"choices": [{"delta": {"content": "Hi"}, "logprobs": lp}]}) == (
        "Hi", [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}])
    pieces = []
    for fragment in ({"index": 0, "id": "call_1", "function": {"name": "get_", "arguments": ""}},
                     {"index": 0, "function": {"name": "weather", "arguments": '{"ci'}},
                     {"index": 1, "id": "call_2", "function": {"name": "noop"}},
                     {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}):
        assert reader.read({"choices": [{"delta": {"tool_calls": [fragment]}}]}) == ("", [])
        pieces.append(reader.pieces)
    # each chunk's pieces of the calls (the job's tool deltas): a call once its name is
    # whole (its arguments began), then its arguments; the last call has none yet
    assert pieces == [
        [], [{"index": 0, "id": "call_1", "name": "get_weather", "arguments": '{"ci'}],
        [], [{"index": 0, "arguments": 'ty": "Oslo"}'}]]
    reader.read({"choices": [{"delta": {}, "finish_reason": "tool_calls",
                              "stop_reason": None}]})
    reader.read({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}})
    assert reader.tool_calls() == [
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"id": "call_2", "name": "noop", "arguments": "{}"}]
    assert reader.finish == "tool_calls" and reader.usage == {"prompt_tokens": 11,
                                                               "completion_tokens": 7}


def test_legacy_logprobs_become_chat_entries() -> None:
    reader = ChunkReader()
    text, lp = reader.read({"choices": [{"text": " a", "finish_reason": "stop",
                                         "stop_reason": "END", "logprobs": {
                                             "tokens": [" a"], "token_logprobs": [-0.5],
                                             "top_logprobs": [{" a": -0.5, " b": -1.5}]}}]})
    assert text == " a" and reader.stop_sequence == "END"
    assert lp == [{"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [
        {"token": " a", "logprob": -0.5, "bytes": [32, 97]},
        {"token": " b", "logprob": -1.5, "bytes": [32, 98]}]}]


def test_an_error_inside_the_stream_is_kept() -> None:
    reader = ChunkReader()
    reader.read({"error": {"message": "boom", "code": 500}})
    assert reader.error == {"message": "boom", "code": 500}


@pytest.mark.parametrize(("status", "code", "mapped", "retry"), [
    (429, "upstream_rate_limited", 429, True),
    (500, "upstream_error", 502, True),
    (502, "upstream_error", 502, True),
    (503, "upstream_unavailable", 503, True),
    (504, "upstream_timeout", 504, True),
    (408, "upstream_timeout", 504, True),
    (400, "upstream_bad_request", 400, False),
    (422, "upstream_bad_request", 400, False),
    (401, "upstream_auth_failed", 502, False),
    (403, "upstream_auth_failed", 502, False),
    (404, "upstream_not_found", 502, False),
    (302, "upstream_refused", 502, False),
])
def test_upstream_statuses_are_retriable_or_final(status: int, code: str, mapped: int,
                                                  retry: bool) -> None:
    failure = status_failure(status, "quoted")
    assert (failure.code, failure.status, failure.retry) == (code, mapped, retry)


@pytest.mark.parametrize(("exc", "code", "retry"), [
    (ConnectFailed("refused"), "upstream_unavailable", True),
    (ReadTimeout("silent"), "upstream_timeout", True),
    (BadReply("not HTTP"), "upstream_disconnected", True),
    (Disconnected("reset"), "upstream_disconnected", True),
    (UpstreamURLError("metadata"), "upstream_address_refused", False),
])
def test_transport_failures_are_retriable_or_final(exc: Any, code: str, retry: bool) -> None:
    failure = exception_failure(exc)
    assert (failure.code, failure.retry) == (code, retry)
