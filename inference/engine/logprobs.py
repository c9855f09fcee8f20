"""OpenAI's `logprobs` entries (`choices[].logprobs.content[]`) from a runtime's
TokenLogprob: each token as text and as its bytes, since a byte-level BPE token can be
part of a character (its text then shows the bytes it cannot decode as `\\xNN`)."""

from __future__ import annotations

from typing import Any

from inference.runtimes.base import ChatRuntime, TokenLogprob

_CACHE_MAX = 200_000  # token ids whose text and bytes are kept (a vocabulary's worth)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others are shifted past 255 (as its tokenizers write token pieces)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = dict(zip(printable, printable, strict=True)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


_BYTE_OF = _byte_level_alphabet()


class TokenTexts:
    """Token ids as OpenAI's logprobs show them, cached per id."""

    def __init__(self, runtime: ChatRuntime) -> None:
        self._tokenizer = getattr(runtime, "tokenizer", None)
        self._decode = runtime.decode
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        hit = self._cache.get(token)
        if hit is None:
            raw = self._bytes(token)
            hit = (raw.decode("utf-8", "backslashreplace"), list(raw))
            if len(self._cache) < _CACHE_MAX:
                self._cache[token] = hit
        return hit

    def _bytes(self, token: int) -> bytes:
        if self._tokenizer is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
        return self._decode([token]).encode()  # not byte-level BPE: its decoded text

    def entry(self, token: int, logprob: TokenLogprob) -> dict[str, Any]:
        text, raw = self.of(token)
        top = []
        for other, value in logprob.top:
            other_text, other_raw = self.of(other)
            top.append({"token": other_text, "logprob": value, "bytes": other_raw})
        return {"token": text, "logprob": logprob.logprob, "bytes": raw, "top_logprobs": top}
