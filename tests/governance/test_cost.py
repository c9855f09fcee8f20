"""What a call cost, on every answered-in-one-piece reply: `x-sluice-cost-usd` on REST
(OpenAI's and Anthropic's official clients), the usage that ends a stream, gRPC's
trailing metadata, the call's audit event and the usage rows, all the same exact
figure from the price valid when the call was admitted; an unpriced model's replies
carry none."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import anthropic
import grpc
import openai
import pytest

from governance import audit, pricing, usage
from governance import cache as policy_cache
from governance.models import AuditEvent, Budget, BudgetScope, Price, UsageRecord
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import Org, eventually, make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

INPUT, OUTPUT = Decimal("0.15"), Decimal("0.6")  # dollars per million tokens


@pytest.fixture
def org(live: Live) -> Org:
    Price.objects.create(model="echo", input_per_mtok_usd=INPUT, output_per_mtok_usd=OUTPUT,
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    # A later version that no call here is admitted under.
    Price.objects.create(model="echo", input_per_mtok_usd=100, output_per_mtok_usd=100,
                         valid_from=datetime.now(UTC) + timedelta(days=30))
    policy_cache.clear()
    return make_org("payer", [Role.TENANT_ADMIN, Role.DEVELOPER])


def expected(prompt: int, completion: int) -> str:
    pico = prompt * pricing.micros(INPUT) + completion * pricing.micros(OUTPUT)
    return pricing.usd(-(-pico // 1000))


def test_each_api_reports_the_cost_of_its_reply(live: Live, org: Org) -> None:
    key = org.keys[Role.DEVELOPER]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "what does this cost?"}])
    reply = raw.parse()
    assert reply.usage is not None
    assert raw.headers[pricing.COST_HEADER] == expected(reply.usage.prompt_tokens,
                                                        reply.usage.completion_tokens)
    raw = client.completions.with_raw_response.create(model="echo", prompt="priced",
                                                      max_tokens=4)
    done = raw.parse()
    assert done.usage is not None and done.usage.completion_tokens == 4
    assert raw.headers[pricing.COST_HEADER] == expected(done.usage.prompt_tokens, 4)
    raw = client.responses.with_raw_response.create(model="echo", input="a response",
                                                    store=False)
    answer = raw.parse()
    assert answer.usage is not None
    assert raw.headers[pricing.COST_HEADER] == expected(answer.usage.input_tokens,
                                                        answer.usage.output_tokens)
    an = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=key,
                             max_retries=0, timeout=30)
    raw_msg = an.messages.with_raw_response.create(
        model="echo", max_tokens=64, messages=[{"role": "user", "content": "a message"}])
    message = raw_msg.parse()
    assert raw_msg.headers[pricing.COST_HEADER] == expected(message.usage.input_tokens,
                                                            message.usage.output_tokens)
    # Not priced: no figure rather than a made-up zero.
    plain = client.embeddings.with_raw_response.create(model="minilm", input=["free"])
    assert pricing.COST_HEADER not in plain.headers


def test_each_apis_stream_ends_with_its_cost_in_its_usage(live: Live, org: Org) -> None:
    """A stream's headers leave before its cost is known: the usage that ends it carries
    `cost_usd` (an extra field each official client keeps)."""
    key = org.keys[Role.DEVELOPER]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(
        model="echo", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "a streamed cost"}]))
    used = chunks[-1].usage
    assert used is not None and used.model_extra is not None
    assert used.model_extra["cost_usd"] == expected(used.prompt_tokens, used.completion_tokens)
    legacy = list(client.completions.create(model="echo", prompt="streamed", max_tokens=4,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    counted = legacy[-1].usage
    assert counted is not None and counted.model_extra is not None
    assert counted.model_extra["cost_usd"] == expected(counted.prompt_tokens, 4)
    events = list(client.responses.create(model="echo", input="a streamed response",
                                          store=False, stream=True))
    done = events[-1]
    assert done.type == "response.completed" and done.response.usage is not None
    assert done.response.usage.model_extra is not None
    assert done.response.usage.model_extra["cost_usd"] == expected(
        done.response.usage.input_tokens, done.response.usage.output_tokens)
    an = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=key,
                             max_retries=0, timeout=30)
    with an.messages.stream(model="echo", max_tokens=64,
                            messages=[{"role": "user", "content": "a message"}]) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
        final = stream.get_final_message()
    assert deltas and deltas[-1].usage.model_extra is not None
    assert deltas[-1].usage.model_extra["cost_usd"] == expected(final.usage.input_tokens,
                                                               final.usage.output_tokens)


def test_a_gpu_second_price_charges_the_calls_share_of_the_steps(live: Live, tiny: str,
                                                                 org: Org) -> None:
    """A self-hosted model priced by device time: the worker reports each request's
    share of its steps' time (a CPU's wall time here), the reply costs exactly that at
    the price, and a budget holds the deadline's worth of the whole device."""
    Price.objects.create(model=tiny, input_per_mtok_usd=0, output_per_mtok_usd=0,
                         gpu_second_usd=Decimal("0.5"),
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    policy_cache.clear()
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0, timeout=60)
    began = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=tiny, max_tokens=8, messages=[{"role": "user", "content": "time me"}])
    took_us = (time.monotonic() - began) * 1e6
    cost = raw.headers[pricing.COST_HEADER]
    audit.drain()
    event = eventually(lambda: AuditEvent.objects.filter(model=tiny).order_by("-id").first())
    device_us = event.detail["device_us"]
    assert 0 < device_us < took_us
    assert cost == event.detail["cost_usd"] == pricing.usd(-(-device_us * 500_000_000
                                                             // 10**6))
    # The hold: the whole device for the deadline ($0.5 a second), more than $1.
    Budget.objects.create(tenant=org.tenant, scope=BudgetScope.TENANT, window="day",
                          limit_usd=Decimal("1"))
    policy_cache.clear()
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=tiny, max_tokens=8,
                                       messages=[{"role": "user", "content": "again"}])
    assert caught.value.code == "budget_exceeded"


def test_grpc_carries_the_cost_in_its_trailing_metadata(grpc_target: str, org: Org) -> None:
    async def go() -> tuple[pb.ChatResponse, dict[str, str]]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            rpc = pb_grpc.InferenceStub(channel).Chat(
                pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user",
                                                                      content="over grpc")]),
                metadata=(("authorization", f"Bearer {org.keys[Role.DEVELOPER]}"),),
                timeout=30)
            reply = await rpc
            return reply, dict(await rpc.trailing_metadata() or ())
    reply, trailing = asyncio.run(go())
    assert trailing[pricing.COST_HEADER] == expected(reply.usage.prompt_tokens,
                                                     reply.usage.completion_tokens)


def test_the_audit_event_and_the_usage_rows_hold_the_same_cost(live: Live, org: Org) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                           max_retries=0, timeout=30)
    costs = []
    for text in ("one call", "and another, a little longer"):
        raw = client.chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": text}])
        costs.append(raw.headers[pricing.COST_HEADER])
    audit.drain()
    events = AuditEvent.objects.filter(tenant=org.tenant, action="chat.completions")
    assert sorted(e.detail["cost_usd"] for e in events) == sorted(costs)

    total = sum(Decimal(c) for c in costs)

    def rolled_up() -> bool:  # the gateway writes its usage counters every 0.1 s
        usage.rollup()
        row = UsageRecord.objects.filter(tenant=org.tenant, model="echo").first()
        return row is not None and row.requests == 2
    eventually(rolled_up, 10, what="the gateway's usage counters")
    row = UsageRecord.objects.get(tenant=org.tenant, model="echo")
    assert Decimal(row.cost_nanousd) / pricing.NANO_PER_USD == total
    listed = openai.OpenAI(base_url=live.base_url.removesuffix("/v1") + "/api/v1",
                           api_key=org.keys[Role.TENANT_ADMIN], max_retries=0, timeout=30
                           ).get("/governance/usage", cast_to=object)
    assert isinstance(listed, dict)
    assert [r["cost_usd"] for r in listed["items"] if r["model"] == "echo"] == [
        pricing.usd(row.cost_nanousd)]
