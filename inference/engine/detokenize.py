"""Incremental detokenization in O(1) per token (the prefix/read-offset method of TGI and
vLLM): decode only a short window of recent ids, and release text once it is stable (no
trailing replacement character from half a UTF-8 sequence).

One decode per token: the window's text up to the last released token (the "prefix")
is the previous push's full text, kept; the window's start moves only every _WINDOW
released tokens or so, and only then is the prefix decoded afresh. (Decoding it every
push, as TGI does, was half of the worker's detokenizing.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_WINDOW = 6  # ids of left context: enough for tokenizers that merge across boundaries


class Detokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids: list[int] = list(ids)
        self.prefix_offset = max(0, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)
        self._prefix = decode(self.ids[self.prefix_offset:]) if self.ids else ""

    def push(self, token: int) -> str:
        """Add a token; return the text it completes ('' while a character is partial)."""
        self.ids.append(token)
        full = self.decode(self.ids[self.prefix_offset:])
        prefix = self._prefix
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.read_offset = len(self.ids)
        if self.read_offset - self.prefix_offset > 2 * _WINDOW:
            # Slide the window, keeping _WINDOW ids of left context.
            self.prefix_offset = self.read_offset - _WINDOW
            self._prefix = self.decode(self.ids[self.prefix_offset:])
        else:
            self._prefix = full
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of generation: the text not released yet, less a partial
        character at the very end (the generation stopped inside it)."""
        if self.read_offset == len(self.ids):
            return ""
        full = self.decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        text = full[len(self._prefix):].rstrip("\ufffd") if len(full) > len(self._prefix) \
            else ""
        self._prefix = full
        return text
