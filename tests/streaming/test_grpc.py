"""The gRPC adapter with a real grpc.aio client against the real grpcio server (its own
event loop, in a thread here), over the same pipeline and workers as REST."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
from django.conf import settings
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from governance import audit, breaker
from governance import cache as policy_cache
from governance.guardrail_models import GuardrailPolicy
from governance.models import AuditEvent, BreakerPolicy, Quota
from inference.models import Deployment
from sluice.localinfra import free_port, start_redis
from sluice.redis import sync_client
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import REPO, Org, eventually, make_org, process_env
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("grpcorg", [Role.DEVELOPER, Role.AUDITOR])


def call(target: str, method: str, request: Any, *, key: str | None = None,
         timeout: float = 30, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    async def go() -> Any:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            auth = (("authorization", f"Bearer {key}"),) if key else ()
            metadata_all = auth + metadata
            rpc = getattr(stub, method)
            if method == "ChatStream":
                return [chunk async for chunk in rpc(request, metadata=metadata_all,
                                                     timeout=timeout)]
            return await rpc(request, metadata=metadata_all, timeout=timeout)
    return asyncio.run(go())


def status_of(target: str, method: str, request: Any, **kw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        call(target, method, request, **kw)
    return caught.value


def chat(text: str, model: str = "echo", **kw: Any) -> pb.ChatRequest:
    return pb.ChatRequest(model=model, messages=[pb.ChatMessage(role="user", content=text)],
                          **kw)


def test_a_post_call_guardrail_masks_and_stops_grpc_streams(grpc_target: str,
                                                           org: Org) -> None:
    GuardrailPolicy.objects.create(tenant=org.tenant, name="mask-out", guard="pii",
                                   phase="post", action="mask", scope="tenant")
    GuardrailPolicy.objects.create(tenant=org.tenant, name="stop-birds", guard="words",
                                   phase="post", action="block", scope="tenant",
                                   config={"deny": ["bluebird"]})
    policy_cache.clear()
    key = org.keys[Role.DEVELOPER]
    chunks = call(grpc_target, "ChatStream", chat("write to jane.doe@example.com now"),
                  key=key)
    assert "".join(c.delta for c in chunks) == "write to [EMAIL] now"
    assert not any("jane" in c.delta or "@" in c.delta for c in chunks)
    stopped = call(grpc_target, "ChatStream", chat("x" * 200 + " a bluebird"), key=key)
    assert stopped[-1].finish_reason == "content_filter"
    assert "blue" not in "".join(c.delta for c in stopped)
    whole = call(grpc_target, "Chat", chat("mail jane.doe@example.com"), key=key)
    assert whole.message.content == "mail [EMAIL]"


def test_every_rpc(grpc_target: str, org: Org) -> None:
    key = org.keys[Role.DEVELOPER]
    reply = call(grpc_target, "Chat", chat("hello grpc"), key=key)
    assert reply.message.content == "hello grpc" and reply.finish_reason == "stop"
    assert reply.usage.completion_tokens == len("hello grpc") and reply.id.startswith("chatcmpl-")
    chunks = call(grpc_target, "ChatStream", chat("stream me please"), key=key)
    assert "".join(c.delta for c in chunks) == "stream me please"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.total_tokens > 0
    emb = call(grpc_target, "Embed", pb.EmbedRequest(model="minilm", input=["a", "b c"]),
               key=key)
    assert [e.index for e in emb.data] == [0, 1] and len(emb.data[0].embedding) == 384
    models = call(grpc_target, "ListModels", pb.ListModelsRequest(), key=key)
    assert {"echo", "minilm"} <= {m.id for m in models.data}
    capped = call(grpc_target, "Chat", chat("abcdefgh", max_tokens=3), key=key)
    assert capped.message.content == "abc" and capped.finish_reason == "length"


def test_status_mapping(grpc_target: str, org: Org, live: Live) -> None:
    key = org.keys[Role.DEVELOPER]
    assert status_of(grpc_target, "Chat", chat("x")).code() == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(grpc_target, "Chat", chat("x"), key="sk-sluice-bad-key").code() == \
        grpc.StatusCode.UNAUTHENTICATED
    denied = status_of(grpc_target, "Chat", chat("x"), key=org.keys[Role.AUDITOR])
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    missing = status_of(grpc_target, "Chat", chat("x", model="nope"), key=key)
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "nope" in (missing.details() or "")
    invalid = status_of(grpc_target, "Chat", chat("x", temperature=5.0), key=key)
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailing = dict(invalid.trailing_metadata() or ())
    assert trailing["error-type"] == "invalid_request_error"
    Quota.objects.create(tenant=org.tenant, model="echo", period="minute", max_requests=1)
    policy_cache.clear()
    call(grpc_target, "Chat", chat("first"), key=key)
    exhausted = status_of(grpc_target, "Chat", chat("second"), key=key)
    assert exhausted.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(exhausted.trailing_metadata() or ())
    assert trailing["error-code"] == "quota_exceeded"
    assert int(trailing["grpc-retry-pushback-ms"]) >= 1000
    # an open circuit breaker: UNAVAILABLE with a retry hint
    policy, _ = BreakerPolicy.objects.update_or_create(
        deployment=Deployment.objects.get(name="minilm"),
        defaults={"min_calls": 1, "window_size": 1, "open_wait_s": 30})
    policy_cache.clear()
    sync_client(settings.REDIS_URL).eval(
        breaker.RECORD_LUA, 4, *breaker.keys("minilm"),
        *breaker.record_args("", [(breaker.Outcome.FAILURE, 5.0)], policy))
    time.sleep(0.25)
    unavailable = status_of(grpc_target, "Embed", pb.EmbedRequest(model="minilm", input=["a"]),
                            key=key)
    assert unavailable.code() == grpc.StatusCode.UNAVAILABLE
    trailing = dict(unavailable.trailing_metadata() or ())
    assert trailing["error-code"] == "circuit_open" and int(trailing["retry-after"]) >= 1


def test_another_tenants_conversation_is_not_found(grpc_target: str, org: Org) -> None:
    other = make_org("grpcother", [Role.DEVELOPER])
    theirs = other.client(Role.DEVELOPER).post("/api/v1/conversations", {"title": "t"})
    err = status_of(grpc_target, "Chat", chat("x", conversation_id=theirs.body["id"]),
                    key=org.keys[Role.DEVELOPER])
    assert err.code() == grpc.StatusCode.NOT_FOUND
    mine = call(grpc_target, "Chat", chat("x", conversation_id=theirs.body["id"]),
                key=other.keys[Role.DEVELOPER])
    assert mine.conversation_id == theirs.body["id"]


def test_deadline_propagates(grpc_target: str, org: Org) -> None:
    err = status_of(grpc_target, "Chat", chat("z" * 200, model="slow-echo"),
                    key=org.keys[Role.DEVELOPER], timeout=0.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancel_mid_stream_reaches_the_worker(grpc_target: str, org: Org, live: Live) -> None:
    async def go() -> int:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            stream = stub.ChatStream(chat("y" * 300, model="slow-echo"), metadata=(
                ("authorization", f"Bearer {org.keys[Role.DEVELOPER]}"),))
            got = 0
            async for _chunk in stream:
                got += 1
                if got == 3:
                    stream.cancel()
                    break
            return got
    assert asyncio.run(go()) == 3
    worker = live.workers["slow-echo"]
    deadline = time.monotonic() + 10
    while worker.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.active, "the generation kept running after the client cancelled"
    audit.drain()
    rows = AuditEvent.objects.filter(tenant=org.tenant, protocol="grpc")
    assert rows.exists()


def test_health_and_reflection(grpc_target: str) -> None:
    async def go() -> tuple[Any, list[str]]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="sluice.v1.Inference"))
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            names: list[str] = []
            async for reply in stub.ServerReflectionInfo(iter([
                    reflection_pb2.ServerReflectionRequest(list_services="")])):
                names += [s.name for s in reply.list_services_response.service]
            return health, names
    health, names = asyncio.run(go())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "sluice.v1.Inference" in names and "grpc.health.v1.Health" in names


def test_tool_calls_over_grpc(grpc_target: str, org: Org, tiny: str) -> None:
    from google.protobuf.struct_pb2 import Struct

    params = Struct()
    params.update({"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]})
    request = chat("weather in Paris?", model=tiny, max_tokens=200, tool_choice="get_weather",
                   tools=[pb.Tool(type="function", function=pb.FunctionDef(
                       name="get_weather", description="Weather", parameters=params))])
    reply = call(grpc_target, "Chat", request, key=org.keys[Role.DEVELOPER])
    assert reply.finish_reason == "tool_calls"
    (tool_call,) = reply.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert "city" in json.loads(tool_call.function.arguments)
    chunks = call(grpc_target, "ChatStream", request, key=org.keys[Role.DEVELOPER])
    assert chunks[-1].finish_reason == "tool_calls"
    assert chunks[-1].tool_calls[0].function.name == "get_weather"


def test_health_follows_redis(transactional_db: None) -> None:
    """The gRPC server's health says what the HTTP gateway's /readyz says: NOT_SERVING
    while Redis does not answer (no call could be queued), SERVING again once it does."""
    redis_port, grpc_port = free_port(), free_port()
    private = start_redis(port=redis_port)
    env = process_env(REDIS_URL=private.url)
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "rungrpc", "--address",
                             f"127.0.0.1:{grpc_port}"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status() -> int | None:
        async def go() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="sluice.v1.Inference"), timeout=2)
                return int(reply.status)
        try:
            return asyncio.run(go())
        except grpc.aio.AioRpcError:
            return None  # not listening yet

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, \
        health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert eventually(lambda: status() == serving, 60, what="SERVING")
        private.stop()
        assert eventually(lambda: status() == not_serving, 10, what="NOT_SERVING")
        private = start_redis(port=redis_port)
        assert eventually(lambda: status() == serving, 10, what="SERVING again")
    finally:
        proc.terminate()
        proc.wait(15)
        private.stop()


def test_parallel_tool_calls_and_strict_over_grpc(grpc_target: str, org: Org,
                                                   tiny: str) -> None:
    """The proto carries parallel_tool_calls (false: exactly one call) and a function's
    strict flag (a schema that breaks OpenAI's strict rules is INVALID_ARGUMENT)."""
    from google.protobuf.struct_pb2 import Struct

    params = Struct()
    params.update({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False})
    tool = pb.Tool(type="function", function=pb.FunctionDef(name="get_time",
                                                             parameters=params, strict=True))
    request = chat("time?", model=tiny, max_tokens=120, tool_choice="required",
                   tools=[tool], parallel_tool_calls=False, temperature=1.0, seed=1)
    reply = call(grpc_target, "Chat", request, key=org.keys[Role.DEVELOPER])
    assert reply.finish_reason == "tool_calls"
    (tool_call,) = reply.message.tool_calls
    assert json.loads(tool_call.function.arguments)["zone"] in ("UTC", "CET")
    loose = Struct()
    loose.update({"type": "object", "properties": {"zone": {"type": "string"}}})
    bad = chat("time?", model=tiny, tool_choice="required", tools=[pb.Tool(
        type="function", function=pb.FunctionDef(name="get_time", parameters=loose,
                                                 strict=True))])
    with pytest.raises(grpc.RpcError) as caught:
        call(grpc_target, "Chat", bad, key=org.keys[Role.DEVELOPER])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "additionalProperties" in (caught.value.details() or "")
