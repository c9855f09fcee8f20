"""Incremental detokenization in O(1) per token (the prefix/read-offset method of TGI and
vLLM): decode only a short window of recent ids, and release text once it is stable (no
trailing replacement character from half a UTF-8 sequence)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_WINDOW = 6  # ids of left context: enough for tokenizers that merge across boundaries


class Detokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids: list[int] = list(ids)
        self.prefix_offset = max(0, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)

    def push(self, token: int) -> str:
        """Add a token; return the text it completes ('' while a character is partial)."""
        self.ids.append(token)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = max(self.prefix_offset, self.read_offset - _WINDOW)
        self.read_offset = len(self.ids)
        return full[len(prefix):]
