"""What the upstream worker asks for a job nobody reads token by token, and how the one
JSON reply is read (inference/upstream/body.py alone, no I/O): the shapes are OpenAI's
non-streamed chat and completion replies."""

from __future__ import annotations

from inference.jobs import ChatJob
from inference.spec import Dialect, UpstreamSpec
from inference.upstream.body import ChunkReader, request_body
from inference.upstream.client import UpstreamClient

UP = UpstreamSpec(base_url="http://10.0.0.5:8000/v1", model="served", dialect=Dialect.VLLM)


def test_a_job_not_streamed_asks_for_one_reply_and_a_streamed_one_for_chunks() -> None:
    job = ChatJob(messages=[{"role": "user", "content": "hi"}])
    streamed = request_body(job, UP, tenant="alice", max_tokens=10)
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    whole = request_body(ChatJob(messages=job.messages, stream=False), UP, tenant="alice",
                         max_tokens=10)
    assert whole["stream"] is False and "stream_options" not in whole
    assert {k: v for k, v in whole.items() if k not in ("stream",)} == \
        {k: v for k, v in streamed.items() if k not in ("stream", "stream_options")}


def test_a_whole_chat_reply_reads_like_its_chunks() -> None:
    reader = ChunkReader()
    text, lp = reader.read({
        "id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None,
                     "message": {"role": "assistant", "content": "Checking.", "tool_calls": [
                         {"id": "call_a", "type": "function",
                          "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                         {"id": "call_b", "type": "function",
                          "function": {"name": "time", "arguments": "{}"}}]},
                     "logprobs": {"content": [{"token": "Checking", "logprob": -0.5,
                                               "bytes": [67], "top_logprobs": []}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}})
    assert text == "Checking." and [e["token"] for e in lp] == ["Checking"]
    assert reader.finish == "tool_calls"
    assert reader.usage == {"prompt_tokens": 12, "completion_tokens": 7}
    # A whole reply's calls have no index: their order is theirs.
    assert reader.tool_calls() == [
        {"id": "call_a", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"id": "call_b", "name": "time", "arguments": "{}"}]


def test_a_whole_completion_reply_and_an_error_reply() -> None:
    reader = ChunkReader()
    text, lp = reader.read({"object": "text_completion", "choices": [
        {"index": 0, "text": " world", "finish_reason": "stop", "stop_reason": "!",
         "logprobs": {"tokens": [" world"], "token_logprobs": [-0.25],
                      "top_logprobs": [{" world": -0.25}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    assert text == " world" and lp[0]["logprob"] == -0.25
    assert reader.finish == "stop" and reader.stop_sequence == "!"
    failed = ChunkReader()
    assert failed.read({"error": {"message": "overloaded", "code": 503}}) == ("", [])
    assert failed.error == {"message": "overloaded", "code": 503}


def test_a_call_the_upstream_cut_at_max_tokens_ends_length_with_its_arguments_so_far() -> None:
    # given an upstream's reply whose call max_tokens cut (OpenAI's shape)
    reader = ChunkReader()
    reader.read({"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "edit_file", "arguments": '{"path": "ma'}}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 20}})
    # then the worker's final event keeps the finish and the call as it was cut
    done = UpstreamClient._done(reader, 0, 0, 0)
    assert done["finish"] == "length"
    assert done.get("tool_calls") == [
        {"id": "call_a", "name": "edit_file", "arguments": '{"path": "ma'}]


def test_an_upstreams_cached_tokens_are_kept_within_the_prompt() -> None:
    """vLLM, SGLang and OpenAI report their own prefix cache's reuse: it becomes the
    reply's cached_tokens (priced as cached input), never more than the prompt."""
    for details, cached in (({"cached_tokens": 64}, 64), ({"cached_tokens": 10**9}, 100),
                            ({"cached_tokens": -5}, 0), (None, 0), ("junk", 0)):
        reader = ChunkReader()
        reader.read({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                                              "prompt_tokens_details": details}})
        assert reader.usage is not None
        assert reader.usage.get("cached_tokens", 0) == cached, details
