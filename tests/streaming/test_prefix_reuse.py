"""Prefix reuse as the APIs report it, through the official clients against a live
Sluice (the toy model, blocks of 16 tokens): a call that resends a prompt's opening
reports the reused tokens (Chat and Completions `prompt_tokens_details.cached_tokens`,
Responses `input_tokens_details.cached_tokens`, Messages `cache_read_input_tokens`
with `input_tokens` the rest, gRPC `Usage.cached_tokens`); another tenant sending the
same opening reuses nothing; `n` choices share their prompt; the audit event counts
the reused tokens."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal

import anthropic
import openai
import pytest
from django.utils import timezone

from governance import cache as policy_cache
from governance import pricing
from governance.models import Price
from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live
from tests.streaming.test_aliases import audited
from tests.streaming.test_grpc import call

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture
def orgs(live: Live) -> tuple[Org, Org]:
    return make_org("alice", [Role.DEVELOPER]), make_org("bob", [Role.DEVELOPER])


def opening() -> str:
    """A system prompt nobody sent before (the runtimes outlive a test)."""
    return f"You are assistant {uuid.uuid4()}. " + "Answer in one short line. " * 12


def oai(live: Live, org: Org) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                         max_retries=0, timeout=60)


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_every_api_reports_the_reused_prompt(live: Live, orgs: tuple[Org, Org], roomy: str,
                                            grpc_target: str) -> None:
    alice, bob = orgs
    client, system = oai(live, alice), opening()
    first = client.chat.completions.create(model=roomy, max_tokens=2,
                                           messages=messages(system, "first?"))
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=roomy, max_tokens=2,
                                           messages=messages(system, "second?"))
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached and cached % BLOCK == 0 and cached >= again.usage.prompt_tokens - 3 * BLOCK
    # Streamed, its usage chunk says the same.
    chunks = list(client.chat.completions.create(
        model=roomy, max_tokens=2, stream=True, stream_options={"include_usage": True},
        messages=messages(system, "third?")))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached
    reply = client.responses.create(model=roomy, max_output_tokens=2, instructions=system,
                                    input="fourth?")
    assert reply.usage is not None
    assert reply.usage.input_tokens_details.cached_tokens == cached
    claude = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"),
                                 api_key=alice.keys[Role.DEVELOPER], max_retries=0, timeout=60)
    fifth: list[anthropic.types.MessageParam] = [{"role": "user", "content": "fifth?"}]
    message = claude.messages.create(model=roomy, max_tokens=2, system=system, messages=fifth)
    assert message.usage.cache_read_input_tokens == cached
    counted = claude.messages.count_tokens(model=roomy, system=system, messages=fifth)
    assert message.usage.input_tokens + cached == counted.input_tokens
    rpc = call(grpc_target, "Chat", pb.ChatRequest(model=roomy, max_tokens=2, messages=[
        pb.ChatMessage(role="system", content=system),
        pb.ChatMessage(role="user", content="sixth?")]), key=alice.keys[Role.DEVELOPER])
    assert rpc.usage.cached_tokens == cached
    # Another tenant's identical opening reuses nothing.
    other = oai(live, bob).chat.completions.create(model=roomy, max_tokens=2,
                                                   messages=messages(system, "second?"))
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens == again.usage.prompt_tokens


def test_reused_tokens_are_priced_as_cached_input(live: Live, orgs: tuple[Org, Org],
                                                 roomy: str) -> None:
    Price.objects.create(model=roomy, input_per_mtok_usd=Decimal("10"),
                         output_per_mtok_usd=Decimal("20"),
                         cached_input_per_mtok_usd=Decimal("1"),
                         valid_from=timezone.now() - timedelta(minutes=1))
    policy_cache.clear()
    client, system = oai(live, orgs[0]), opening()
    client.chat.completions.create(model=roomy, max_tokens=2, messages=messages(system, "a"))
    raw = client.chat.completions.with_raw_response.create(
        model=roomy, max_tokens=2, messages=messages(system, "b"))
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0
    nanos = ((usage.prompt_tokens - cached) * 10_000 + cached * 1_000
             + usage.completion_tokens * 20_000)
    assert Decimal(raw.headers[pricing.COST_HEADER]) == Decimal(nanos) / 10**9


def test_n_choices_share_their_prompt_and_the_audit_counts_it(live: Live,
                                                              orgs: tuple[Org, Org],
                                                              roomy: str) -> None:
    alice, _ = orgs
    reply = oai(live, alice).chat.completions.create(
        model=roomy, max_tokens=3, n=3, temperature=1.0, seed=7,
        messages=messages(opening(), "three ways?"))
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    prompt = reply.usage.prompt_tokens // 3
    # The first choice computes the prompt; each other one reuses at least its full
    # blocks (all of it, when prefilled in the same batch).
    assert reply.usage.prompt_tokens_details.cached_tokens >= 2 * BLOCK * ((prompt - 1) // BLOCK)
    [event] = audited(alice, 1)
    assert int(event.detail["cached_tokens"]) == reply.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_may_narrow_reuse_to_one_key(live: Live, roomy: str) -> None:
    org = make_org("narrow", [Role.TENANT_ADMIN, Role.DEVELOPER])
    admin = org.client(Role.TENANT_ADMIN)
    url = f"/api/v1/tenants/{org.tenant.pk}/privacy"
    assert admin.get(url).body["prefix_cache"] == "tenant"
    changed = admin.patch(url, {"prefix_cache": "key"})
    assert changed.status == 200 and changed.body["prefix_cache"] == "key", changed.body
    assert admin.patch(url, {"prefix_cache": "team"}).status == 422
    keys = {role: openai.OpenAI(base_url=live.base_url, api_key=org.keys[role],
                                max_retries=0, timeout=60)
            for role in (Role.DEVELOPER, Role.TENANT_ADMIN)}
    system = opening()

    def reused(role: Role, question: str) -> int:
        reply = keys[role].chat.completions.create(model=roomy, max_tokens=2,
                                                   messages=messages(system, question))
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    assert reused(Role.DEVELOPER, "one?") == 0
    assert reused(Role.DEVELOPER, "two?") > 0  # the same key reuses
    assert reused(Role.TENANT_ADMIN, "three?") == 0  # the tenant's other key does not
    assert admin.patch(url, {"prefix_cache": None}).body["prefix_cache"] == "tenant"


def test_a_cached_prefix_does_not_stretch_the_context(live: Live, orgs: tuple[Org, Org],
                                                     tiny: str) -> None:
    """A prompt over the model's context is refused though its opening is cached, and the
    cache still serves the prompts that fit."""
    client, system = oai(live, orgs[0]), opening()
    first = client.chat.completions.create(model=tiny, max_tokens=1,
                                           messages=messages(system, "short?"))
    assert first.usage is not None and first.usage.prompt_tokens < 256
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=tiny, max_tokens=1,
                                       messages=messages(system, "long " * 300))
    assert refused.value.code == "context_length_exceeded"
    again = client.chat.completions.create(model=tiny, max_tokens=1,
                                           messages=messages(system, "short!"))
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
