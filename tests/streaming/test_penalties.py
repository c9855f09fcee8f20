"""presence_penalty, frequency_penalty and logit_bias reach the model: over REST (the
openai SDK) and gRPC, a greedy request with them gets what the runtime gives with them,
and not what it gives without (the penalties were accepted and ignored before;
logit_bias was refused)."""

from __future__ import annotations

import openai
import pytest

from inference.runtimes import load_runtime
from inference.runtimes.base import NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
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


def test_logit_bias_reaches_the_model_over_rest_and_grpc(live: Live, tiny: str,
                                                        grpc_target: str) -> None:
    """A banned token (-100) is never said and a forced one (+100) is all that is said,
    over REST (the openai SDK) and gRPC, as the runtime gives it; a token id outside
    the model's vocabulary and a bias outside -100..100 are 400s."""
    key = make_org("biased", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    plain = tiny_reply(TEXT, SamplingParams(max_tokens=TOKENS))
    rt = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM))
    assert isinstance(rt, CausalLMRuntime)
    first = rt.add([NewSequence("r", rt.encode_chat([{"role": "user", "content": TEXT}]),
                                SamplingParams(max_tokens=TOKENS))])["r"]
    forced = rt.encode_chat([{"role": "user", "content": "ok"}])[-3]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    for bias in ({first: -100.0}, {forced: 100.0}):
        expected = tiny_reply(TEXT, SamplingParams(max_tokens=TOKENS,
                                                   logit_bias=tuple(bias.items())))
        assert expected != plain
        reply = client.chat.completions.create(
            model=tiny, messages=[{"role": "user", "content": TEXT}], max_tokens=TOKENS,
            temperature=0, logit_bias={str(t): b for t, b in bias.items()})
        assert reply.choices[0].message.content == expected
        over_grpc = call(grpc_target, "Chat", chat(TEXT, model=tiny, max_tokens=TOKENS,
                                                   temperature=0, logit_bias=bias), key=key)
        assert over_grpc.message.content == expected
    assert expected == rt.decode([forced] * TOKENS).rstrip("\ufffd")
    for bad, code in (({"10000000": 5}, "invalid_logit_bias"), ({"1": 101}, "invalid_value"),
                      ({"x": 1}, "invalid_value")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=tiny, max_tokens=2, logit_bias=bad,
                                           messages=[{"role": "user", "content": "hi"}])
        assert caught.value.code == code, (bad, caught.value)
