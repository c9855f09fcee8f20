"""The echo runtime: no model, no compute. It answers with the prompt's own tokens (the
last user message, as UTF-8 bytes) at a configurable per-token delay. For gateway and
queue benchmarks only: it measures everything around a model, never a model. Offered
tools under `tool_choice` "auto" it answers in text (it never calls one); a forced call
or a response format is refused (inference/engine/inputs.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from inference.runtimes.base import ChatRuntime, NewSequence

EOS = 256  # byte tokens are 0..255


class EchoRuntime(ChatRuntime):
    eos_token_ids = frozenset({EOS})

    def __init__(self, *, token_delay_ms: float = 0.0, max_context: int = 2048) -> None:
        self.token_delay_s = token_delay_ms / 1000
        self.max_context = max_context
        self._pending: dict[str, list[int]] = {}

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        users = [m for m in messages if m.get("role") == "user"]
        content = users[-1].get("content", "") if users else ""
        return self.encode(content if isinstance(content, str) else str(content))

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_chars(self) -> int:
        return 1  # a token per UTF-8 byte: a character is one to four of them

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def add(self, seqs: Sequence[NewSequence]) -> dict[str, int]:
        for seq in seqs:
            cut = len(seq.prompt_ids) - seq.generated
            prompt, done = seq.prompt_ids[:cut], seq.generated
            self._pending[seq.rid] = [*prompt[done:], EOS]
        return self._next(rids=[s.rid for s in seqs])

    def step(self) -> dict[str, int]:
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        return self._next(rids=list(self._pending))

    def _next(self, rids: list[str]) -> dict[str, int]:
        out = {}
        for rid in rids:
            queue = self._pending[rid]
            out[rid] = queue.pop(0) if queue else EOS
        return out

    def drop(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._pending.pop(rid, None)

    @property
    def active(self) -> list[str]:
        return list(self._pending)
