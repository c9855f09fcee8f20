"""End-to-end traces: a REST call, a gRPC call and a WebSocket request, each a single
trace from the adapter's server span through the pipeline stages to the enqueue, joined
by the worker's batch span through a span link (the traceparent travels inside the
queue message)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
from anthropic import Anthropic
from openai import AuthenticationError, OpenAI
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from governance.models import RateLimitPolicy, RateLimitScope
from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import eventually, make_org
from tests.streaming.conftest import Live
from tests.streaming.test_anthropic import root
from tests.streaming.test_grpc import call
from tests.streaming.test_websocket import frames_until, in_loop, socket

pytestmark = pytest.mark.slow

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PII = "jane.doe@example.com"
STAGES = frozenset({"sluice.auth", "sluice.limits", "sluice.breaker", "sluice.enqueue",
                    "sluice.wait"})


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _wait_for(spans: InMemorySpanExporter, name: str, trace_id: str,
              stages: frozenset[str] = frozenset()) -> list[ReadableSpan]:
    """The finished spans, once `name` and every one of `stages` have ended in that trace
    (the server span ends just after the client has its response; the wait span when
    the call settles, a loop turn later, which a busy machine can put after it)."""
    deadline = time.monotonic() + 10
    ended: set[str] = set()
    while time.monotonic() < deadline:
        finished = list(spans.get_finished_spans())
        ended = {s.name for s in finished if _hex(s.context.trace_id, 32) == trace_id}
        if name in ended and ended >= stages:
            return finished
        time.sleep(0.02)
    raise AssertionError(f"no finished span {name!r} (and {sorted(stages)}) in trace "
                         f"{trace_id}; it has {sorted(ended)}")


def _assert_one_trace(finished: Sequence[ReadableSpan], server_name: str, secret: str,
                      stages: frozenset[str] = STAGES
                      ) -> tuple[ReadableSpan, dict[str, ReadableSpan]]:
    in_trace = [s for s in finished if _hex(s.context.trace_id, 32) == CALLER_TRACE]
    by_name = {s.name: s for s in in_trace}
    server = by_name[server_name]
    assert server.kind == SpanKind.SERVER
    assert server.parent is not None and _hex(server.parent.span_id, 16) == CALLER_SPAN
    assert set(by_name) >= stages, f"missing stages: {stages - set(by_name)}"
    for name in stages:  # every stage is a child of the server span
        assert by_name[name].parent is not None
        assert by_name[name].parent.span_id == server.context.span_id, name
    enqueue = by_name["sluice.enqueue"]
    batches = [s for s in finished if s.name == "inference.batch"
               and any(link.context.span_id == enqueue.context.span_id
                       and link.context.trace_id == enqueue.context.trace_id
                       for link in s.links)]
    assert len(batches) == 1, "the worker's batch span links to the request's enqueue span"
    batch = batches[0]
    assert batch.kind == SpanKind.CONSUMER
    assert batch.attributes is not None
    assert batch.attributes["sluice.deployment"] == "echo"
    assert int(str(batch.attributes["sluice.batch.size"])) >= 1
    # Nothing personal or secret in any attribute of the trace.
    for span in [*in_trace, batch]:
        for value in (span.attributes or {}).values():
            assert PII not in str(value) and secret not in str(value), span.name
    return server, by_name


@pytest.fixture
def org(live: Live) -> Any:
    org = make_org("traced", [Role.DEVELOPER])
    RateLimitPolicy.objects.create(tenant=org.tenant, scope=RateLimitScope.TENANT,
                                   requests_per_minute=10_000)  # so `sluice.limits` runs
    return org


def test_a_rest_call_is_one_trace_from_adapter_to_batch(live: Live, org: Any,
                                                         spans: InMemorySpanExporter) -> None:
    key = org.keys[Role.DEVELOPER]
    client = OpenAI(base_url=live.base_url, api_key=key)
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": f"mail {PII} please"}],
        max_tokens=4, extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    finished = _wait_for(spans, "POST /v1/chat/completions", CALLER_TRACE, STAGES)
    server, stages = _assert_one_trace(finished, "POST /v1/chat/completions", key)
    attrs = dict(server.attributes or {})
    assert attrs["http.route"] == "/v1/chat/completions"
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200
    assert attrs["sluice.protocol"] == "rest"
    assert attrs["sluice.tenant"] == org.tenant.slug
    assert attrs["gen_ai.request.model"] == "echo"
    assert reply.id == f"chatcmpl-{attrs['sluice.request_id']}"
    wait = dict(stages["sluice.wait"].attributes or {})
    assert wait["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert float(str(wait["sluice.time_to_first_token_ms"])) > 0


def test_a_grpc_call_is_one_trace_from_adapter_to_batch(live: Live, grpc_target: str,
                                                         org: Any,
                                                         spans: InMemorySpanExporter) -> None:
    key = org.keys[Role.DEVELOPER]
    request = pb.ChatRequest(model="echo", max_tokens=4, messages=[
        pb.ChatMessage(role="user", content=f"mail {PII} please")])
    reply = call(grpc_target, "Chat", request, key=key,
                 metadata=(("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),))
    name = "sluice.v1.Inference/Chat"
    finished = _wait_for(spans, name, CALLER_TRACE, STAGES)
    server, _ = _assert_one_trace(finished, name, key)
    attrs = dict(server.attributes or {})
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.method"] == "/sluice.v1.Inference/Chat"
    assert attrs["http.response.status_code"] == 200
    assert attrs["sluice.protocol"] == "grpc"
    assert attrs["gen_ai.request.model"] == "echo"
    assert reply.id == f"chatcmpl-{attrs['sluice.request_id']}"


def test_a_websocket_request_is_one_trace_from_frame_to_batch(
        live: Live, org: Any, spans: InMemorySpanExporter) -> None:
    key = org.keys[Role.DEVELOPER]

    async def go() -> list[dict[str, Any]]:
        ws = socket(key)
        await ws.connect()
        await ws.send_to(text_data=json.dumps({
            "type": "chat.request", "id": "r1",
            "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
            "request": {"model": "echo", "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"mail {PII}"}]}}))
        frames = await frames_until(ws, {"r1"})
        await ws.disconnect()
        return frames

    frames = in_loop(go)
    assert frames[-1]["type"] == "chat.done"
    name = "chat.request /v1/realtime"
    # The socket authenticated once, at connect: a frame's trace has no auth stage.
    stages = STAGES - {"sluice.auth"}
    server, _ = _assert_one_trace(_wait_for(spans, name, CALLER_TRACE, stages), name, key,
                                  stages)
    attrs = dict(server.attributes or {})
    assert attrs["sluice.protocol"] == "websocket"
    assert attrs["http.response.status_code"] == 200
    assert attrs["sluice.tenant"] == org.tenant.slug
    assert attrs["gen_ai.request.model"] == "echo"


def test_a_refused_call_marks_its_stage_and_status(live: Live, org: Any,
                                                   spans: InMemorySpanExporter) -> None:
    client = OpenAI(base_url=live.base_url, api_key="sk-sluice-not-a-real-key",
                    max_retries=0)
    with pytest.raises(AuthenticationError):
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    finished = _wait_for(spans, "POST /v1/chat/completions", CALLER_TRACE)
    auth = next(s for s in finished if s.name == "sluice.auth")
    assert auth.status.is_ok is False
    assert (auth.attributes or {})["error.type"] == "invalid_api_key"
    server = next(s for s in finished if s.name == "POST /v1/chat/completions")
    assert (server.attributes or {})["http.response.status_code"] == 401
    assert not [s for s in finished if s.name == "sluice.enqueue"]


@pytest.mark.parametrize("api", ["responses", "messages", "count_tokens"])
def test_an_agent_apis_plain_call_ends_its_wait_span_as_it_ended(
        live: Live, org: Any, spans: InMemorySpanExporter, api: str) -> None:
    """A call answered in one piece reads its events to their end: its wait span carries
    the usage and no error (leaving at the final event had marked every such call's
    span failed, GeneratorExit)."""
    key = org.keys[Role.DEVELOPER]
    hello = [{"role": "user", "content": "hello there"}]
    # (The test process's instrumented SDKs start a trace of their own: the call's trace
    # is found by its server span.)
    if api == "responses":
        reply = OpenAI(base_url=live.base_url, api_key=key).responses.create(
            model="echo", input="hello there")
        name, output_tokens = "POST /v1/responses", reply.usage.output_tokens  # type: ignore[union-attr]
    elif api == "messages":
        message = Anthropic(base_url=root(live), api_key=key, max_retries=0).messages.create(
            model="echo", max_tokens=8, messages=hello)  # type: ignore[arg-type]
        name, output_tokens = "POST /v1/messages", message.usage.output_tokens
    else:
        Anthropic(base_url=root(live), api_key=key, max_retries=0).messages.count_tokens(
            model="echo", messages=hello)  # type: ignore[arg-type]
        name, output_tokens = "POST /v1/messages/count_tokens", 0
    def beside_server() -> ReadableSpan | None:
        finished = list(spans.get_finished_spans())
        server = next((s for s in finished if s.name == name), None)
        return next((s for s in finished if s.name == "sluice.wait" and server is not None
                     and s.context.trace_id == server.context.trace_id), None)

    wait = eventually(beside_server, 10, what=f"a wait span beside {name!r}")
    assert wait.status.status_code != StatusCode.ERROR, wait.attributes
    assert "error.type" not in (wait.attributes or {})
    assert (wait.attributes or {})["gen_ai.usage.output_tokens"] == output_tokens
