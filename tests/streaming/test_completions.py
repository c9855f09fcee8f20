"""Legacy Completions (`POST /v1/completions`) with the official openai SDK against the
live server: string and list prompts, OpenAI's defaults, `n`, `echo`, legacy
`logprobs`, streaming, cancellation when the client leaves, the refusals naming their
field, and every error path in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings

from governance import audit
from governance.models import AuditEvent, Quota, RateLimitPolicy
from inference.client import InferenceClient
from inference.jobs import ChatJob
from inference.models import Deployment
from inference.weights import smollm2_tokenizer_dir
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live, assert_quota_exhausted, assert_rate_limited

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("compl", [Role.DEVELOPER])


@pytest.fixture
def client(live: Live, org: Org) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                         max_retries=0, timeout=30)


def tokens_of(text: str) -> int:
    """What SmolLM2's tokenizer (the tiny model's) makes of `text`, as is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    return len(tokenizer.encode(text, add_special_tokens=False))


# -- prompts and OpenAI's defaults ----------------------------------------------------------
def test_the_echo_models_completion_of_a_prompt_is_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt="Hello there", max_tokens=50)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, "Hello there", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens == len("Hello there")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 11


def test_max_tokens_defaults_to_openais_16(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt="a prompt longer than sixteen")
    assert reply.choices[0].text == "a prompt longer "
    assert reply.choices[0].finish_reason == "length"


def test_a_completion_from_a_language_model(client: openai.OpenAI, tiny: str) -> None:
    reply = client.completions.create(model=tiny, prompt="Once upon a time", max_tokens=5,
                                      temperature=0, seed=1, stop=["\n\n"],
                                      presence_penalty=0.5, frequency_penalty=0.5,
                                      logit_bias={"0": -100}, top_p=0.9, user="u1")
    [choice] = reply.choices
    assert isinstance(choice.text, str) and choice.finish_reason in ("length", "stop")
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 5


def test_the_prompt_reaches_a_model_as_is_without_the_worker_chat_template(
        live: Live, tiny: str) -> None:
    # given a queued body with a raw `prompt` (what a completion sends the worker)
    spec = Deployment.objects.get(name=tiny).to_spec()
    prompt = "The capital of France is"

    async def run() -> dict[str, Any]:
        client = InferenceClient(settings.REDIS_URL)
        try:
            handle = await client.submit(spec, tenant="compl", job=ChatJob(
                prompt=prompt, max_tokens=2, temperature=0.0, stream=False),
                timeout_s=30)
            return [e async for e in handle.events()][-1]
        finally:
            await client.close()

    final = asyncio.run(run())
    # then the model's prompt is the text's own tokens: no template, no history
    assert final["t"] == "done", final
    assert final["usage"]["prompt_tokens"] == tokens_of(prompt)


def test_a_completion_prompt_is_not_wrapped_in_the_chat_template(
        client: openai.OpenAI, tiny: str) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model=tiny, prompt=prompt, max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == tokens_of(prompt)


def test_each_prompt_of_a_list_has_its_own_choices(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt=["alpha", "beta gamma"],
                                      max_tokens=20)
    assert [(c.index, c.text) for c in reply.choices] == [(0, "alpha"), (1, "beta gamma")]
    assert reply.usage is not None and reply.usage.completion_tokens == 5 + 10


def test_n_choices_of_each_prompt_are_numbered_as_openai_does(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt=["ab", "cde"], n=2, max_tokens=9)
    # prompt p's choice j is choice p * n + j
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, "ab"), (1, "ab"), (2, "cde"), (3, "cde")]
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * 2 + 2 * 3


def test_n_choices_from_a_language_model_differ_by_seed(client: openai.OpenAI,
                                                        tiny: str) -> None:
    reply = client.completions.create(model=tiny, prompt="Hi", n=2, max_tokens=6, seed=3,
                                      temperature=1.5)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.completion_tokens <= 12


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI,
                                                    tiny: str) -> None:
    reply = client.completions.create(model="echo", prompt="ping", echo=True, max_tokens=9)
    assert reply.choices[0].text == "pingping"
    reply = client.completions.create(model=tiny, prompt="Once", echo=True, max_tokens=3)
    assert reply.choices[0].text.startswith("Once")


# -- logprobs -------------------------------------------------------------------------------
def test_logprobs_in_the_legacy_shape(client: openai.OpenAI, tiny: str) -> None:
    reply = client.completions.create(model=tiny, prompt="Tell me about rivers.",
                                      max_tokens=8, temperature=0, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert reply.usage is not None
    count = reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset) == count
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                   strict=True):
        assert logprob <= 0 and math.isfinite(logprob)
        # the 2 likeliest, the sampled one among them (greedy: it is the likeliest)
        assert 1 <= len(top) <= 3 and token in top
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(choice.text)
    # logprobs=0: the sampled token's own entry only
    reply = client.completions.create(model=tiny, prompt="Rivers", max_tokens=3,
                                      temperature=0, logprobs=0)
    zero = reply.choices[0].logprobs
    assert zero is not None and zero.top_logprobs is not None and zero.tokens is not None
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_streamed_logprobs_are_the_same_as_unstreamed_ones(client: openai.OpenAI,
                                                           tiny: str) -> None:
    ask: dict[str, Any] = {"model": tiny, "prompt": "Rivers run", "max_tokens": 6,
                           "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**ask).choices[0].logprobs
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                offsets += choice.logprobs.text_offset or []
    assert whole is not None and (whole.tokens, whole.text_offset) == (tokens, offsets)


# -- streaming ------------------------------------------------------------------------------
def test_a_streamed_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="echo", prompt="streamed words", max_tokens=50,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "streamed words" and len(texts) > 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len("streamed words")


def test_a_streamed_list_with_n_and_echo(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="echo", prompt=["one", "two"], n=2, echo=True,
                                       max_tokens=9, stream=True)
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {0: "oneone", 1: "oneone", 2: "twotwo", 3: "twotwo"}
    assert finished == {0, 1, 2, 3}


def test_a_client_that_leaves_cancels_the_generation(client: openai.OpenAI,
                                                     live: Live) -> None:
    stream = client.completions.create(model="slow-echo", prompt="x" * 300, max_tokens=300,
                                       stream=True)
    received = 0
    for chunk in stream:
        received += sum(len(c.text) for c in chunk.choices)
        if received >= 3:
            break
    stream.close()
    worker = live.workers["slow-echo"]
    deadline = time.monotonic() + 10
    while worker.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.active, "generation stopped when the client left"


# -- refusals, in OpenAI's error shape ------------------------------------------------------
@pytest.mark.parametrize(("ask", "param"), [
    ({"suffix": " and then"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"temperature": 5}, "temperature"),
    ({"prompt": ["p"] * 9, "n": 2}, "n"),
])
def test_what_this_server_does_not_do_is_a_400_naming_the_field(
        client: openai.OpenAI, ask: dict[str, Any], param: str) -> None:
    body = {"model": "echo", "prompt": "hi", **ask}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**body)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    assert refused.value.type == "invalid_request_error"
    assert param in refused.value.message
    assert "messages" not in refused.value.message  # this API's words, not chat's


def test_an_unknown_argument_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="echo", prompt="hi", extra_body={"colour": 1})
    assert refused.value.code == "unknown_parameter" and refused.value.param == "colour"


def test_a_wrong_key_and_an_unknown_model(live: Live, client: openai.OpenAI) -> None:
    stranger = openai.OpenAI(base_url=live.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        stranger.completions.create(model="echo", prompt="hi")
    assert unauthenticated.value.type == "authentication_error"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_rate_limited_is_a_429_with_the_headers_the_sdk_reads(client: openai.OpenAI,
                                                              org: Org) -> None:
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant, requests_per_minute=60,
                                   burst_requests=1)
    assert_rate_limited(client.completions, model="echo", prompt="hi")


def test_a_list_refused_part_way_cancels_the_prompts_already_admitted(
        client: openai.OpenAI, org: Org, live: Live) -> None:
    # given room for one request only
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant, requests_per_minute=60,
                                   burst_requests=1)
    # when two prompts ask: the first is admitted, the second refused
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="slow-echo", prompt=["x" * 300, "y"], max_tokens=300)
    # then the first is cancelled (its final event says so), not left generating
    rds = sync_client(settings.REDIS_URL)
    deadline, finals = time.monotonic() + 10, list[dict[str, Any]]()
    while not finals and time.monotonic() < deadline:
        finals = [json.loads(f[b"e"]) for key in rds.scan_iter("sluice:{compl}:out:*")
                  for _i, f in rds.xrange(key) if b'"done"' in f[b"e"]]
        time.sleep(0.05)
    assert [f.get("finish") for f in finals] == ["cancelled"]


def test_an_exhausted_quota_is_a_429_insufficient_quota(client: openai.OpenAI,
                                                        org: Org) -> None:
    Quota.objects.create(tenant=org.tenant, model="echo", period="minute", max_requests=1)
    assert_quota_exhausted(client.completions, model="echo", prompt="hi")


def test_calls_are_audited_as_completions(client: openai.OpenAI, live: Live,
                                          org: Org) -> None:
    client.completions.create(model="echo", prompt="audited")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="echo", prompt="hi", suffix="!")
    audit.drain()
    statuses = sorted(AuditEvent.objects.filter(tenant=org.tenant, action="completions")
                      .values_list("status", flat=True))
    assert statuses == [200, 400]


def test_a_get_is_refused_in_openais_shape(live: Live, org: Org) -> None:
    response = httpx.get(f"{live.base_url}/completions", timeout=10,
                         headers={"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "method_not_allowed"
