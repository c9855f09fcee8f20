"""A conversation's history trimmed to the context (inference/engine/inputs.py
`conversation_prompt`) on the toy model: the fewest oldest messages are dropped, the same
as dropping them one at a time would, in a few encodings of the prompt however long the
history."""

from __future__ import annotations

from typing import Any

import pytest

from inference.engine.inputs import conversation_prompt
from inference.jobs import Message
from inference.runtimes import load_runtime
from inference.runtimes.base import ChatRuntime
from inference.spec import DeploymentSpec, RuntimeName


@pytest.fixture(scope="module")
def runtime() -> ChatRuntime:
    loaded = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, max_context=256))
    assert isinstance(loaded, ChatRuntime)
    return loaded


def turns(n: int) -> list[Message]:
    return [{"role": "user" if k % 2 == 0 else "assistant",
             "content": f"turn {k}: " + "word " * (3 + k % 5)} for k in range(n)]


@pytest.mark.parametrize("size", [0, 3, 60, 400])
def test_the_fewest_oldest_messages_are_dropped_in_a_few_encodings(
        runtime: ChatRuntime, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    history, messages = turns(size), [Message(role="user", content="and now?")]
    real = runtime.encode_chat
    encodings = []

    def counted(chat: list[dict[str, Any]]) -> list[int]:
        encodings.append(len(chat))
        return real(chat)

    monkeypatch.setattr(runtime, "encode_chat", counted)
    prompt = conversation_prompt(runtime, messages, history, max_tokens=16)
    # the reference: drop the oldest one at a time until the reply has room
    budget = runtime.max_context - 16
    fewest = next(k for k in range(size + 1)
                  if k == size or len(real([*history[k:], *messages])) <= budget)
    assert prompt == real([*history[fewest:], *messages])
    assert len(encodings) <= 2 + max(1, size).bit_length()
