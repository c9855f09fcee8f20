"""A conversation's history trimmed to the context (inference/engine/inputs.py
`conversation_prompt`) on the toy model: the fewest oldest messages are dropped, the same
as dropping them one at a time would, in a few encodings of the prompt however long the
history."""

from __future__ import annotations

from typing import Any

import pytest

from inference.engine.inputs import conversation_prompt
from inference.jobs import Message, conversation
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


def test_the_requests_instructions_come_first_and_stay_while_history_is_dropped(
        runtime: ChatRuntime) -> None:
    # Given a request that opens with its instructions, after a long history
    system = [Message(role="system", content="Answer in French."),
              Message(role="developer", content="Be brief.")]
    asked = [Message(role="user", content="and now?")]
    history = turns(60)
    # When its prompt is built
    prompt = conversation_prompt(runtime, [*system, *asked], history, max_tokens=16)
    # Then the instructions open it, before the history's newest turns that fit, and the
    # question ends it
    fewest = next(k for k in range(61)
                  if len(runtime.encode_chat([*system, *history[k:], *asked])) <= 240)
    assert 0 < fewest < 60
    assert prompt == runtime.encode_chat([*system, *history[fewest:], *asked])
    assert conversation([*system, *asked], history, 3) == [*system, *history[3:], *asked]
    # and a request without instructions keeps the history first, as does a system
    # message that does not open the request
    later = [*asked, Message(role="system", content="late")]
    assert conversation(later, history[:2]) == [*history[:2], *later]
