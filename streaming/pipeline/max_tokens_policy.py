"""A call's max_tokens against what a deployment can produce: its context (prompt and
reply together) and its output ceiling (`max_output_tokens`).

    fit(asked, spec, texts, clamps=...) -> the max_tokens the job carries, or a 400

A deployment's (or the alias's) `max_tokens_policy` decides what a call asking for
more gets:
- refuse (the default): a 400 `max_tokens_too_large` (naming the neutral
  `max_output_tokens`, which each API names its own way) when max_tokens reaches the
  context or passes the ceiling, as OpenAI's and Anthropic's APIs do; one the context
  cannot hold beside this prompt goes through and the worker stops the reply where the
  context ends (inference/engine/inputs.py caps it at the room the prompt leaves).
- clamp: max_tokens is lowered to the ceiling and to the context less a lower bound of
  the prompt's tokens (streaming/pipeline/prompting.py `prompt_floor`: it never overstates the
  prompt, so a clamped value never refuses a reply the context could hold; the worker
  still stops at the exact room). The reply says so: `CLAMPED_HEADER` on REST and SSE,
  gRPC trailing metadata, the WebSocket's chat.done `max_tokens_clamped`.
A call without max_tokens is never refused or clamped here: its default fits the
deployment (inference/jobs.py default_max_tokens, under the ceiling).
"""

from __future__ import annotations

from inference.spec import DeploymentSpec
from streaming.pipeline.callrequest import ParamError
from streaming.pipeline.prompting import prompt_floor

CLAMPED_HEADER = "x-sluice-max-tokens-clamped"


def fit(asked: int | None, spec: DeploymentSpec, texts: list[str], *,
        clamps: bool) -> tuple[int | None, bool]:
    """(the max_tokens the call runs with, whether it was lowered). `texts`: the
    prompt's texts that stay in it (not history the worker may drop)."""
    if asked is None:
        return None, False
    ceiling = spec.max_output_tokens
    if clamps:
        room = max(1, spec.max_context - prompt_floor(texts))
        fitted = min(asked, room, ceiling or room)
        return fitted, fitted < asked
    if asked >= spec.max_context:
        raise ParamError("", "max_output_tokens", f" is {asked}; this model's context is "
                         f"{spec.max_context} tokens.", code="max_tokens_too_large")
    if ceiling is not None and asked > ceiling:
        raise ParamError("", "max_output_tokens", f" is {asked}; this model writes at most "
                         f"{ceiling} tokens a reply.", code="max_tokens_too_large")
    return asked, False
