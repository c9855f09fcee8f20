"""The runtime interface: what a worker needs from a model, nothing more.

Contract for chat runtimes (continuous batching, vLLM-style but small):
- `add(seqs)` prefills new sequences and returns each one's first sampled token;
- `step()` decodes one token for every active sequence and returns them by request id;
- `drop(rids)` removes finished or cancelled sequences (freeing their KV cache rows);
- sequences join and leave only between steps; a step never blocks on I/O;
- a sequence whose model output cannot be sampled (its logits are NaN or infinite:
  a numerical fault of the model on that input) gets `FAILED` instead of a token, from
  `add` or `step`; the runtime stays consistent (the other sequences go on) and the
  caller drops it. One bad sequence never fails its batch.
- KV cache capacity: `kv_capacity_tokens` (None: the runtime sets no bound) and
  `kv_used_tokens()` describe the cache; before `add`, the caller asks
  `kv_admission(seq, joining=...)` for each new sequence, passing the sequences it has
  already accepted for the same `add`. None: it fits. A `KVRefusal` says why not:
  `retriable` False (answer 400: the sequence alone is more than the cache can ever
  hold) or True (answer 503 and retry: it fits once running sequences leave). `add`
  raises `KVCapacityError` (and changes nothing) for a batch that does not fit, so a
  caller that skips the check gets a typed error, never an out-of-memory crash.
- `warm_up()` once before serving lets a runtime prepare ahead (CUDA graphs).
Tokenizer methods are pure and thread-safe. Embedding runtimes batch per call.
"""

from __future__ import annotations

import os
import resource
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAILED = -1  # in place of a token: the sequence's logits were not finite


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    # OpenAI's: subtracted from the logit of every token the sequence has generated,
    # once (presence) and once per time it was generated (frequency); -2.0 to 2.0.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, amount) pairs added to those tokens' logits at
    # every step; -100 bans a token, +100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's logprobs: None, none; k >= 0, each token's log probability under the
    # model and the k most likely tokens' (top_logprobs, 0 to 20).
    logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model (its raw logits: before
    penalties, logit_bias, constraints and temperature), and the most likely tokens'
    as (token id, log probability), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NewSequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # The last `generated` ids of prompt_ids were produced by an earlier delivery of this
    # request (a worker that died): the sequence continues after them.
    generated: int = 0
    # Restricts what may be generated (inference.structured.constraint.Constraint), if set.
    constraint: Any = None
    # Roots the prefix cache's block keys (inference.runtimes.prefix_cache): sequences
    # share cached blocks only under the same salt (the worker makes it from the
    # request's tenant, and key when the tenant narrows it).
    cache_salt: str = ""


@dataclass(frozen=True)
class KVRefusal:
    """Why the KV cache cannot take a sequence: `retriable` False, never (the request
    alone exceeds the cache: a 400); True, not now (it fits once running sequences
    leave: a retriable 503). `needed` and `capacity` are in tokens."""

    retriable: bool
    code: str  # "kv_cache_too_small" | "kv_cache_full"
    message: str
    needed: int
    capacity: int

    @property
    def status(self) -> int:
        return 503 if self.retriable else 400


class KVCapacityError(RuntimeError):
    """`add` was given sequences the KV cache cannot hold; nothing was changed."""

    def __init__(self, refusal: KVRefusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class ChatRuntime(ABC):
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int = 2048
    # Tokens the KV cache holds at most (None: the runtime sets no bound of its own).
    kv_capacity_tokens: int | None = None

    @abstractmethod
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt token ids for OpenAI-style messages, generation prompt included."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def token_chars(self) -> int | None:
        """No token covers more than this many characters of text (so n * this
        characters make at least n tokens); None: unknown. Lets a caller cut an
        over-long text before encoding it."""
        return None

    @abstractmethod
    def add(self, seqs: Sequence[NewSequence]) -> dict[str, int]: ...

    @abstractmethod
    def step(self) -> dict[str, int]: ...

    @abstractmethod
    def drop(self, rids: Iterable[str]) -> None: ...

    def pop_logprob(self, rid: str) -> TokenLogprob | None:
        """The log probabilities of `rid`'s oldest generated token not yet popped (a
        sequence whose params ask for logprobs), or None. Tokens are popped in the
        order they were generated, by the thread that handles them, while the next
        step may already be adding its own."""
        return None

    @property
    @abstractmethod
    def active(self) -> list[str]: ...

    def kv_used_tokens(self) -> int:
        """Tokens the KV cache takes now (padding included where the layout pads)."""
        return 0

    def exhausted(self) -> bool:
        """Whether every running sequence has made its last token (its max_tokens, or an
        end-of-sequence token it does not ignore): a next step would make tokens nobody
        takes. False when unknown (a stop string or a grammar may still end them)."""
        return False

    def cached_tokens(self, rid: str) -> int:
        """How many of running sequence `rid`'s prompt tokens its prefill did not
        compute (a prefix cache hit, a prompt shared with another sequence); 0 once it
        has been dropped."""
        return 0

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's heartbeat fields ({}: the runtime has none)."""
        return {}

    def warm_up(self) -> None:
        """Prepare to serve (a static decode path captures its CUDA graphs here); call
        once, before the first `add`. Optional: what it prepares is otherwise prepared
        when first needed, in the middle of serving."""
        return None

    def kv_admission(self, seq: NewSequence,
                     joining: Sequence[NewSequence] = ()) -> KVRefusal | None:
        """None if `seq` can join the running sequences beside `joining` (those the
        caller accepted for the same `add`), else why not. Pure: reserves nothing."""
        return None

    def memory(self) -> tuple[int, int]:
        return process_memory()


class EmbeddingRuntime(ABC):
    max_context: int = 512
    dimensions: int = 0

    @abstractmethod
    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        """Unit-normalised vectors and each text's token count, in order."""

    @abstractmethod
    def count_tokens(self, text: str) -> int: ...

    def memory(self) -> tuple[int, int]:
        return process_memory()


class TorchModel:
    """What every runtime holding a transformers model and tokenizer shares."""

    model: Any
    tokenizer: Any
    device: str
    max_context: int

    def _bind(self, model: Any, tokenizer: Any, *, device: str, max_context: int) -> None:
        if device.startswith("cuda"):
            import torch

            # Our batches carry a padding mask, and with a mask torch picks cuDNN's fused
            # attention on Hopper, which plans its graph again for every new key length:
            # about 2 ms of CPU per layer per decode step. Measured on an H200 (SmolLM2's
            # shape, 30 layers): 57-77 ms a step with it, 16-21 ms without (the memory-
            # efficient kernel), as fast as an unpadded forward (tests/bench/bench_step.py).
            # Process-wide: a worker process serves one runtime.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        limit = getattr(model.config, "max_position_embeddings", max_context)
        self.max_context = min(max_context, int(limit))

    _token_chars: int | None = None

    def token_chars(self) -> int | None:
        """The longest token of the vocabulary, in characters (byte-level vocabularies
        spell one byte per character, so this bounds the text's characters too)."""
        if self._token_chars is None:
            self._token_chars = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        return self._token_chars

    def memory(self) -> tuple[int, int]:
        return device_memory(self.device)


def process_memory() -> tuple[int, int]:
    """(used, total) bytes: the process's RSS against the machine's memory."""
    try:
        statm = Path("/proc/self/statm").read_text()
        rss = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return rss, total


def device_memory(device: str) -> tuple[int, int]:
    """(used, total) bytes of the device: torch.cuda.mem_get_info on GPU, RSS on CPU."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total - free, total
    return process_memory()
