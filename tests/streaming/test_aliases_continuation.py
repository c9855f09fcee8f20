"""A model alias's call continued on its next deployment after the first one's upstream
died mid-reply (streaming/pipeline/routed.py, streaming/pipeline/submitted.py): Sluice in
front of second
Sluice gateway processes (tests/streaming/test_aliases_upstream.py's `Front`), one of
them SIGKILLed while the caller's official openai SDK stream is mid-reply. The upstream
models are the live fixture's slow echo (50 ms a token), which answers with its prompt:
a continuation sent prompt + S (S: what was already streamed) answers with prompt + S,
so a continued reply is S + prompt + S, each character once, in order."""

from __future__ import annotations

import signal
import threading
from typing import Any

import openai
import pytest

from governance import audit
from governance.models import AuditEvent
from inference.jobs import Continuation
from inference.services import alias_create
from inference.spec import DeploymentSpec, Dialect, Kind, RuntimeName, UpstreamSpec
from streaming.pipeline.routed import Routed
from tests.conftest import eventually
from tests.streaming.conftest import Live
from tests.streaming.test_aliases_upstream import Front, front  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 tokens: ~2.2 s


def _spec(dialect: Dialect | None) -> DeploymentSpec:
    upstream = UpstreamSpec(base_url="http://10.0.0.5/v1", model="m", dialect=dialect) \
        if dialect is not None else None
    return DeploymentSpec(name="d", runtime=RuntimeName.OPENAI_UPSTREAM if upstream
                          else RuntimeName.ECHO, upstream=upstream)


@pytest.mark.parametrize(("dialect", "prompt_only", "continues"), [
    (Dialect.VLLM, False, True), (Dialect.SGLANG, False, True),
    (Dialect.OPENAI, False, False), (Dialect.SLUICE, False, False),
    (Dialect.OPENAI, True, True), (Dialect.SLUICE, True, True),
    (None, True, False), (None, False, False)])
def test_which_deployments_may_continue_a_cut_reply(
        dialect: Dialect | None, prompt_only: bool, continues: bool) -> None:
    async def attempt(_spec: DeploymentSpec, _routed: Routed) -> Any:
        raise AssertionError("not called")

    routed = Routed("org/a", Kind.CHAT, [], 0.0, attempt, prompt_only=prompt_only)
    assert routed.resumable(_spec(dialect))  # afresh: any deployment
    routed.resume = Continuation(text="The answer", seq=2, completion_tokens=2)
    assert routed.resumable(_spec(dialect)) is continues


def _two_upstreams(front: Front) -> Any:  # noqa: F811
    """Deployments up-a and up-b on two upstream Sluice processes, alias org/ha over
    them (up-b the fallback); up-a's process."""
    upstream_a, base_a = front.upstream_server()
    _proc_b, base_b = front.upstream_server()
    front.deployment("up-a", base_a, "slow-echo")
    front.deployment("up-b", base_b, "slow-echo")
    alias_create(actor=front.admin, name="org/ha", targets=[("up-a", 1)], fallbacks=["up-b"])
    return upstream_a


def _last_event(front: Front) -> AuditEvent:  # noqa: F811
    def stored() -> AuditEvent | None:
        audit.drain(settle_s=0.1)
        return AuditEvent.objects.filter(tenant=front.org.tenant, action__in=(
            "chat.completions", "completions")).order_by("-seq").first()
    event = eventually(stored, 20, what="the call's audit event")
    assert event is not None
    return event


def test_a_streamed_reply_cut_by_its_upstreams_death_goes_on_from_the_next_deployment(
        front: Front) -> None:  # noqa: F811
    upstream_a = _two_upstreams(front)
    stream = front.caller().completions.create(
        model="org/ha", prompt=PROMPT, max_tokens=500, stream=True,
        stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        if len(pieces) == 3 and upstream_a.poll() is None:
            upstream_a.send_signal(signal.SIGKILL)  # mid-reply: 41 tokens still to come
            upstream_a.wait()
    text = "".join(pieces)
    size, odd = divmod(len(text) - len(PROMPT), 2)
    streamed = text[:size]
    assert not odd and size >= 3 and PROMPT.startswith(streamed), text
    assert text == streamed + PROMPT + streamed  # continued, nothing repeated or lost
    assert finishes == ["stop"]  # one final event
    # Billed once: S as completion tokens (not as the continuation's prompt too).
    assert usage is not None and usage.completion_tokens == len(text)
    assert usage.prompt_tokens == len(PROMPT)
    event = _last_event(front)
    assert event.status == 200 and event.model == "up-b"
    assert event.detail["fallback_from"] == "up-a"
    assert event.detail["failed_attempts"].startswith("up-a (502 upstream_disconnected")
    assert (event.prompt_tokens, event.completion_tokens) == (len(PROMPT), len(text))


def test_a_chat_reply_a_sluice_upstream_cannot_continue_ends_retriable_as_before(
        front: Front) -> None:  # noqa: F811
    upstream_a = _two_upstreams(front)
    stream = front.caller().chat.completions.create(
        model="org/ha", stream=True, messages=[{"role": "user", "content": PROMPT}])
    text = ""
    with pytest.raises(openai.APIError) as cut:
        for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if len(text) >= 3 and upstream_a.poll() is None:
                upstream_a.send_signal(signal.SIGKILL)
                upstream_a.wait()
    assert PROMPT.startswith(text) and 3 <= len(text) < len(PROMPT)
    assert "upstream" in str(cut.value)
    event = _last_event(front)
    assert event.model == "up-a" and event.status == 502, event.detail
    assert "fallback_from" not in event.detail
    assert event.detail["skipped"] == "up-b (cannot_continue)"
    assert not any(front.workers["up-b"].admitted)  # never sent to up-b


def test_a_non_streamed_call_whose_upstream_dies_mid_generation_is_answered_whole(
        front: Front, live: Live) -> None:  # noqa: F811
    upstream_a = _two_upstreams(front)
    primary, model = front.workers["up-a"], live.workers["slow-echo"]
    replies: list[Any] = []
    call = threading.Thread(target=lambda: replies.append(front.caller().chat.completions.create(
        model="org/ha", messages=[{"role": "user", "content": PROMPT}])))
    call.start()
    # Generating on the upstream behind up-a (its reply comes whole, at the end).
    eventually(lambda: primary.active and model.active, 30, what="the call generating on up-a")
    upstream_a.send_signal(signal.SIGKILL)
    call.join(60)
    [reply] = replies
    assert reply.choices[0].message.content == PROMPT
    assert reply.choices[0].finish_reason == "stop"
    event = _last_event(front)
    assert event.status == 200 and event.model == "up-b"
    assert event.detail["failed_attempts"].startswith("up-a (50")
    assert "fallback_from" not in event.detail  # nothing had been sent: run afresh
