"""Incremental detokenization: what streams out, token by token, is the whole decode;
a half-received character is held back, never sent as a replacement character; and it
costs about one decode per token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.engine.detokenize import Detokenizer
from inference.weights import smollm2_tokenizer_dir

# ASCII words and spaces, accents, CJK and emoji: byte-level BPE splits the last two into
# tokens that are not whole characters.
TEXT = st.text(st.sampled_from([*"abc xyz\n.,", *"éüñ", *"日本語鑫", "🙂", "🦩", "𝄞"]),
               max_size=60)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


class Counting:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


@settings(max_examples=150, deadline=None)
@given(text=TEXT, resume_at=st.integers(0, 40))
def test_the_streamed_text_is_the_whole_decode(tokenizer: Any, text: str, resume_at: int
                                               ) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = Counting(tokenizer)
    # A resumed request starts from the ids it already streamed, as context.
    done = ids[:min(resume_at, len(ids))]
    already = decode(done)
    detok = Detokenizer(decode, done)
    pieces = [detok.push(token) for token in ids[len(done):]]
    assert not any("\ufffd" in piece for piece in pieces)
    if not already.endswith("\ufffd"):  # the context ended on a whole character
        assert already + "".join(pieces) == decode(ids)


def test_a_split_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    ids = tokenizer.encode("I 🦩", add_special_tokens=False)  # 4 tokens: the bird is 3
    detok = Detokenizer(Counting(tokenizer))
    assert [detok.push(token) for token in ids] == ["I", "", "", " 🦩"]


def test_about_one_decode_per_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20,
                           add_special_tokens=False)
    decode = Counting(tokenizer)
    detok = Detokenizer(decode)
    for token in ids:
        detok.push(token)
    assert len(ids) > 100 and decode.calls <= 1.25 * len(ids)


def test_the_end_flushes_held_text_but_not_a_character_cut_in_half(tokenizer: Any) -> None:
    """Generation that stops inside a character (max_tokens, end of sequence): the
    whole characters held with it still go out; the half character does not."""
    ids = tokenizer.encode("I 🦩", add_special_tokens=False)  # " " + the bird's 3 bytes
    cut = Detokenizer(Counting(tokenizer))
    held = [cut.push(token) for token in ids[:-1]]
    assert held == ["I", "", ""] and cut.flush() == " " and cut.flush() == ""
    whole = Detokenizer(Counting(tokenizer))
    assert "".join(whole.push(token) for token in ids) == "I 🦩" and whole.flush() == ""


@settings(max_examples=100, deadline=None)
@given(text=TEXT, cut=st.integers(1, 40))
def test_pushes_then_the_flush_are_the_whole_decode_less_a_cut_character(
        tokenizer: Any, text: str, cut: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)[:cut]
    detok = Detokenizer(Counting(tokenizer))
    out = "".join(detok.push(token) for token in ids) + detok.flush()
    assert out == tokenizer.decode(ids).rstrip("\ufffd")
