"""What the toy chat model (`tiny_causal_lm`, fixed seed) says to one user message, run
here directly on its runtime: the reference that tests compare what came through the
queue, the gateway or a worker's takeover with."""

from __future__ import annotations

from inference.runtimes.base import ChatRuntime, NewSequence, SamplingParams
from inference.spec import DeploymentSpec, RuntimeName
from tests import runtimes


def tiny_reply(content: str, params: SamplingParams) -> str:
    spec = DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM)
    rt = runtimes.take(spec)  # the process's idle toy model, or a new one
    assert isinstance(rt, ChatRuntime)
    try:
        prompt = rt.encode_chat([{"role": "user", "content": content}])
        tokens = [rt.add([NewSequence("r", prompt, params)])["r"]]
        while len(tokens) < params.max_tokens and tokens[-1] not in rt.eos_token_ids:
            tokens.append(rt.step()["r"])
    finally:
        rt.drop(["r"])
        runtimes.give_back(spec, rt)
    # Less a character the generation stopped inside, as the worker sends it.
    return rt.decode([t for t in tokens if t not in rt.eos_token_ids]).rstrip("\ufffd")
