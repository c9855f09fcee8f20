"""transformers causal LMs with continuous batching over a shared, left-padded KV cache.

The running batch is one DynamicCache whose rows are sequences. New sequences are
prefilled together (left-padded), then spliced into the running cache (padding whichever
side is shorter on the left); finished ones are removed by row, and columns that became
padding for every row are trimmed. Each decode step is one forward pass for the whole
batch with per-row position ids and an attention mask that hides the padding.

The cache is bounded by `kv_capacity_tokens` (inference.runtimes.kv: a setting, or a
share of the device's free memory on CUDA). Its footprint is rows x width, and the width
is the longest row: a sequence reserves its prompt plus the tokens it may generate
(capped at max_context), and `kv_admission` accepts it while rows x the longest
reservation stays within the capacity.

Works with full-attention decoder models (Llama, SmolLM, Qwen2, Mistral without sliding
windows...). The weights may be any local transformers folder. `static_lm.py` decodes
the same models over preallocated slots instead (spec.extra "decode": "static").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from inference.runtimes.base import (
    FAILED,
    ChatRuntime,
    KVCapacityError,
    KVRefusal,
    NewSequence,
    SamplingParams,
    TokenLogprob,
    TorchModel,
)
from inference.runtimes.kv import DecodeOptions, kv_budget, kv_bytes_per_token
from inference.runtimes.prefill import Prefilled, prefill
from inference.runtimes.prefix_cache import PrefixCache
from inference.runtimes.sampling import generator_for, sample
from inference.structured import masks as grammar_masks

T = TypeVar("T")


class CausalLMRuntime(TorchModel, ChatRuntime):
    def __init__(self, model: Any, tokenizer: Any, *, device: str, max_context: int,
                 options: DecodeOptions | None = None) -> None:
        self._bind(model, tokenizer, device=device, max_context=max_context)
        self.options = options or DecodeOptions()
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos else [])
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if tokenizer else None
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            eos.add(im_end)
        self.eos_token_ids = frozenset(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._rids: list[str] = []
        self._params: list[SamplingParams] = []
        self._gens: list[torch.Generator | None] = []
        self._constraints: list[Any] = []
        # Per row, the tokens it has generated and how often (rows with penalties only).
        self._counts: list[dict[int, int] | None] = []
        # Per sequence that asks for them, its tokens' log probabilities not yet popped.
        self._logprobs: dict[str, deque[TokenLogprob]] = {}
        # Per row, the most tokens it may take in the cache (kv_admission's unit).
        self._reserved: list[int] = []
        # Per row, the tokens it may still make: what its max_tokens allows after those it
        # has made, 0 once it made an end-of-sequence token it does not ignore (or none).
        self._left: list[int] = []
        self.kv_bytes_per_token = kv_bytes_per_token(self.model.config, self.model.dtype)
        self.kv_capacity_tokens, pool = self._size_cache()
        block = self.options.prefix_block_tokens
        # Prompts' blocks kept for later prompts (None: turned off, prefix_cache_tokens 0).
        self.prefix = (PrefixCache(capacity_blocks=pool // block, block_tokens=block)
                       if pool >= block else None)
        self._cached: dict[str, int] = {}  # per running sequence, cached_tokens()
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self._pos = torch.zeros((0,), dtype=torch.long, device=device)
        self._last = torch.zeros((0,), dtype=torch.long, device=device)
        # Decoding is on every token's path (the worker's detokenizer): call the Rust
        # tokenizer itself where transformers' decode would add nothing to it (no clean-up
        # of spaces). Its wrapper was more than half of a token's detokenizing: 5.5 -> 2.4 us.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = (backend.decode if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True) else None)

    @classmethod
    def from_folder(cls, folder: Path, *, device: str, max_context: int,
                    options: DecodeOptions | None = None) -> CausalLMRuntime:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=weights_dtype(device),
                                                     use_kernels=False)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return cls(model, tokenizer, device=device, max_context=max_context, options=options)

    def _size_cache(self) -> tuple[int | None, int]:
        """The cache's capacity and the prefix cache's pool in tokens, once the weights
        are on the device."""
        return kv_budget(self.options, bytes_per_token=self.kv_bytes_per_token,
                         device=self.device, max_context=self.max_context)

    def cached_tokens(self, rid: str) -> int:
        return self._cached.get(rid, 0)

    def prefix_stats(self) -> dict[str, int]:
        return self.prefix.stats.beat() if self.prefix is not None else {}

    # -- KV cache capacity -----------------------------------------------------------
    def reserved_tokens(self, seq: NewSequence) -> int:
        """The most tokens `seq` may take in the cache: its prompt and what it may
        generate, capped at max_context (the caller stops a sequence there)."""
        prompt = len(seq.prompt_ids)
        return max(prompt + 1, min(prompt + max(seq.params.max_tokens, 1), self.max_context))

    def kv_used_tokens(self) -> int:
        return len(self._rids) * int(self._mask.shape[1]) if self._rids else 0

    def kv_admission(self, seq: NewSequence,
                     joining: Sequence[NewSequence] = ()) -> KVRefusal | None:
        capacity = self.kv_capacity_tokens
        if capacity is None:
            return None
        need = self.reserved_tokens(seq)
        if need > capacity:
            return KVRefusal(False, "kv_cache_too_small",
                             f"The request needs {need} tokens of KV cache (prompt and "
                             f"max_tokens); this model's cache holds {capacity}.",
                             need, capacity)
        rows = [*self._reserved, *(self.reserved_tokens(j) for j in joining), need]
        if len(rows) * max(rows) > capacity:
            return KVRefusal(True, "kv_cache_full",
                             f"The KV cache is full ({capacity} tokens); retry when running "
                             f"requests finish.", need, capacity)
        return None

    def _check_fits(self, seqs: Sequence[NewSequence]) -> None:
        """KVCapacityError for the first sequence of `seqs` that does not fit."""
        for i, seq in enumerate(seqs):
            refusal = self.kv_admission(seq, seqs[:i])
            if refusal is not None:
                raise KVCapacityError(refusal)

    # -- tokenizer -----------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        text = "\n".join(f"{m.get('role')}: {m.get('content', '')}" for m in messages)
        return self.encode(text + "\nassistant:")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return str(self._backend_decode(list(ids), skip_special_tokens=True))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- batching ------------------------------------------------------------------
    @property
    def active(self) -> list[str]:
        return list(self._rids)

    @torch.inference_mode()
    def add(self, seqs: Sequence[NewSequence]) -> dict[str, int]:
        if not seqs:
            return {}
        self._check_fits(seqs)
        done = self._prefill(seqs)
        first = self._first_tokens(seqs, done.logits)
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        self._splice(done.cache, done.mask, lengths, self._next_input(first))
        return {s.rid: tok for s, tok in zip(seqs, first, strict=True)}

    def _prefill(self, seqs: Sequence[NewSequence]) -> Prefilled:
        """One forward pass over the prompts (inference.runtimes.prefill: each distinct
        prompt once, cached blocks skipped); records each sequence's cached tokens."""
        done = prefill(self.model, seqs, pad_id=self.pad_id, device=self.device,
                       prefix=self.prefix)
        for seq, cached in zip(seqs, done.cached, strict=True):
            self._cached[seq.rid] = cached
        return done

    def _first_tokens(self, seqs: Sequence[NewSequence], logits: torch.Tensor) -> list[int]:
        """Sample the new sequences' first tokens from their prefill `logits` and append
        their rows to the per-row state (the caller appends their cache rows)."""
        params = [s.params for s in seqs]
        gens = [generator_for(p) for p in params]
        constraints = [s.constraint for s in seqs]
        # A resumed sequence's penalties count what its earlier delivery generated.
        counts = [_tally({}, s.prompt_ids[len(s.prompt_ids) - s.generated:])
                  if s.params.penalized else None for s in seqs]
        rids = [s.rid for s in seqs]
        asked = _log_softmax(logits, params)
        first = sample(logits, params, gens, constraints, counts)
        self._keep_logprobs(rids, params, asked, first)
        _tally_rows(counts, first)
        self._rids += rids
        self._params += params
        self._gens += gens
        self._constraints += constraints
        self._counts += counts
        self._reserved += [self.reserved_tokens(s) for s in seqs]
        self._left += self._still_left([s.params.max_tokens for s in seqs], params, first)
        return first

    def _splice(self, cache: Any, mask: torch.Tensor, pos: torch.Tensor,
                last: torch.Tensor) -> None:
        if self._cache is None:  # no running rows (drop clears it with the last one)
            self._cache, self._mask, self._pos, self._last = cache, mask, pos, last
            return
        old_w, new_w = self._mask.shape[1], mask.shape[1]
        width = max(old_w, new_w)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width),
                                        _left_pad(new_layer.keys, width)], dim=0)
            old_layer.values = torch.cat([_left_pad(old_layer.values, width),
                                          _left_pad(new_layer.values, width)], dim=0)
        self._mask = torch.cat([_left_pad_mask(self._mask, width),
                                _left_pad_mask(mask, width)], dim=0)
        self._pos = torch.cat([self._pos, pos])
        self._last = torch.cat([self._last, last])

    @torch.inference_mode()
    def step(self) -> dict[str, int]:
        if not self._rids:
            return {}
        ones = torch.ones((len(self._rids), 1), dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, ones], dim=1)
        # The grammar masks are computed on llguidance's threads while the model runs.
        masks = grammar_masks.start(self._constraints)
        out = self.model(input_ids=self._last[:, None], attention_mask=mask,
                         position_ids=self._pos[:, None], cache=self._cache,
                         use_cache=True)
        try:
            tokens = self._sample_rows(out.logits[:, -1, :], masks)
        except Exception:
            # The forward pass already grew the cache by a column: take it back, so the
            # batch stays consistent for the caller that handles the error.
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :-1, :], layer.values[:, :, :-1, :]
            raise
        self._mask = mask
        self._pos = self._pos + 1
        self._last = self._next_input(tokens)
        return dict(zip(self._rids, tokens, strict=True))

    def _sample_rows(self, logits: torch.Tensor, masks: Any) -> list[int]:
        """Each running row's token from its step `logits` [n, V] (scratch: adjusted in
        place) and its grammar `masks` (a pending `grammar_masks.start`, or None); the
        rows' log probabilities are queued and their penalty counts updated."""
        asked = _log_softmax(logits, self._params)
        tokens = sample(logits, self._params, self._gens, self._constraints, self._counts,
                        masks.result() if masks is not None else None)
        _tally_rows(self._counts, tokens)
        self._keep_logprobs(self._rids, self._params, asked, tokens)
        self._left = self._still_left(self._left, self._params, tokens)
        return tokens

    def _still_left(self, left: list[int], params: list[SamplingParams],
                    tokens: list[int]) -> list[int]:
        """Each row's tokens left after `tokens`: none after an end-of-sequence token
        (the caller ends the row there) or a FAILED one (the caller drops it)."""
        eos = self.eos_token_ids
        return [0 if token == FAILED or (token in eos and not p.ignore_eos) else n - 1
                for n, p, token in zip(left, params, tokens, strict=True)]

    def _keep_logprobs(self, rids: list[str], params: list[SamplingParams],
                       asked: tuple[list[int], torch.Tensor] | None,
                       tokens: list[int]) -> None:
        """Queue each asking row's token log probability and its top ones."""
        if asked is None:
            return
        rows, logprobs = asked
        chosen = logprobs.gather(1, torch.tensor(
            [max(tokens[row], 0) for row in rows], device=logprobs.device)[:, None])
        k = max(params[row].logprobs or 0 for row in rows)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],) * 2
        for row, value, values, ids in zip(rows, chosen[:, 0].tolist(), top_values.tolist(),
                                           top_ids.tolist(), strict=True):
            if tokens[row] == FAILED:
                continue
            n = params[row].logprobs or 0
            entry = TokenLogprob(value, tuple(zip(ids[:n], values[:n], strict=True)))
            self._logprobs.setdefault(rids[row], deque()).append(entry)

    def pop_logprob(self, rid: str) -> TokenLogprob | None:
        queued = self._logprobs.get(rid)
        return queued.popleft() if queued else None

    def _next_input(self, tokens: list[int]) -> torch.Tensor:
        """The tokens the next step feeds back; a FAILED sequence (dropped by the
        caller, but still in the batch for a step that overlaps) is fed padding."""
        return torch.tensor([self.pad_id if t == FAILED else t for t in tokens],
                            device=self.device)

    def drop(self, rids: Iterable[str]) -> None:
        gone = set(rids)
        keep = [i for i, rid in enumerate(self._rids) if rid not in gone]
        if len(keep) == len(self._rids):
            return
        self._take_rows(keep)
        for rid in gone:
            self._logprobs.pop(rid, None)
            self._cached.pop(rid, None)
        if not keep:
            self._cache = None
            return
        index = torch.tensor(keep, device=self.device)
        self._mask, self._pos, self._last = self._mask[index], self._pos[index], self._last[index]
        # Columns that are padding in every remaining row can go: the cache shrinks back
        # when a long sequence leaves.
        used = self._mask.sum(0) > 0
        start = int(used.nonzero()[0].item()) if bool(used.any()) else 0
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index][:, :, start:, :]
            layer.values = layer.values[index][:, :, start:, :]


    def _take_rows(self, order: list[int]) -> None:
        """Keep the per-row state of rows `order`, in that order (the cache apart)."""
        self._rids, self._params = _rows(self._rids, order), _rows(self._params, order)
        self._gens, self._constraints = _rows(self._gens, order), _rows(self._constraints, order)
        self._counts, self._reserved = _rows(self._counts, order), _rows(self._reserved, order)
        self._left = _rows(self._left, order)

    def exhausted(self) -> bool:
        return bool(self._left) and max(self._left) <= 0


def _rows(column: list[T], keep: list[int]) -> list[T]:
    return [column[i] for i in keep]


def _tally(counts: dict[int, int], tokens: Iterable[int]) -> dict[int, int]:
    """Count generated tokens into `counts` (a FAILED one is no token)."""
    for token in tokens:
        if token != FAILED:
            counts[token] = counts.get(token, 0) + 1
    return counts


def _tally_rows(counts: list[dict[int, int] | None], tokens: list[int]) -> None:
    """Count each row's new token, for the rows that keep counts (penalties)."""
    for seen, token in zip(counts, tokens, strict=True):
        if seen is not None:
            _tally(seen, (token,))


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[-2]
    if missing <= 0:
        return t
    pad = torch.zeros((*t.shape[:-2], missing, t.shape[-1]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=-2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing <= 0:
        return mask
    pad = torch.zeros((mask.shape[0], missing), dtype=mask.dtype, device=mask.device)
    return torch.cat([pad, mask], dim=1)


def weights_dtype(device: str) -> torch.dtype:
    """What a chat model's weights are loaded as: bfloat16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def tiny_llama(*, max_context: int, seed: int = 0) -> tuple[Any, Any]:
    """SmolLM2's architecture and tokenizer at a toy size with random weights (the model
    and its tokenizer): loads in about a second, for tests. Its output is gibberish by
    design."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference.weights import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


def _log_softmax(logits: torch.Tensor, params: list[SamplingParams]
                 ) -> tuple[list[int], torch.Tensor] | None:
    """The rows that ask for logprobs and their log probabilities, taken from the raw
    logits before sampling adjusts them in place (None: no row asks)."""
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    return rows, torch.log_softmax(logits[rows].float(), dim=-1)
