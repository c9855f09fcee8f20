"""presence_penalty and frequency_penalty reach the model: over REST (the openai SDK)
and gRPC, a greedy request with them gets what the runtime gives with them, and not
what it gives without (they were accepted and ignored before)."""

from __future__ import annotations

import openai
import pytest

from inference.runtimes.base import SamplingParams
from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import make_org
from tests.reference import tiny_reply
from tests.streaming.conftest import Live
from tests.streaming.test_grpc import call, chat

pytestmark = pytest.mark.slow

TEXT = "x " * 30
TOKENS = 12


def test_penalties_reach_the_model_over_rest_and_grpc(live: Live, tiny: str,
                                                      grpc_target: str) -> None:
    key = make_org("penalised", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    # Negative (they raise what was generated): the toy model never repeats a token in
    # a dozen, so positive ones would change nothing it says.
    penalties = {"presence_penalty": -1.5, "frequency_penalty": -2.0}
    expected = tiny_reply(TEXT, SamplingParams(max_tokens=TOKENS, **penalties))
    assert expected != tiny_reply(TEXT, SamplingParams(max_tokens=TOKENS))
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(
        model=tiny, messages=[{"role": "user", "content": TEXT}], max_tokens=TOKENS,
        temperature=0, **penalties)
    assert reply.choices[0].message.content == expected
    over_grpc = call(grpc_target, "Chat", chat(TEXT, model=tiny, max_tokens=TOKENS,
                                               temperature=0, **penalties), key=key)
    assert isinstance(over_grpc, pb.ChatResponse)
    assert over_grpc.message.content == expected
