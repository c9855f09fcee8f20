"""A batch's prefill: one forward pass over new sequences' prompts that computes each
distinct prompt once and skips the blocks the prefix cache holds.

Sharing. Sequences with the same prompt and cache salt (the `n` choices of one call, a
request sent twice at once) are one row of the forward pass; its cache, mask and last
logits are copied to each of them afterwards, so each samples its own first token from
the same distribution.

Reuse. A distinct prompt's leading full blocks found in the prefix cache (at most all
but its last token: the forward pass must compute at least one position, whose logits
are the first token's) are copied in as the forward pass's past keys and values; the
pass computes the rest of the prompt only, at its own positions. The rows are laid out
[past, left-padded] then [rest, left-padded] for the pass and compacted to the usual
left-padded layout (each prompt's tokens right-aligned, no gap) after it, so the
runtimes splice, store and trim the result as they would a full prefill's. The prompt's
blocks that were not cached are stored, from this pass's keys and values, unless the
row's logits are not finite (a model fault must not be served to later prompts).

Token-exactness: a cached block holds the keys and values the model computed for the
same tokens at the same positions under the same salt; the forward pass attends over
them as it would over its own. Floating-point results may differ in the last bits from
a full prefill (a different batch shape), as they do between batch compositions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from inference.runtimes.base import NewSequence
from inference.runtimes.prefix_cache import PrefixCache


@dataclass
class Prefilled:
    """A prefill's result, one row per sequence given, left-padded to `mask`'s width:
    the cache (a DynamicCache), the padding mask, each row's last logits [N, V] and
    how many of each prompt's tokens were not computed for it (`cached`: its prefix
    cache hit, or the whole prompt for a row that shares another's)."""

    cache: Any
    mask: torch.Tensor
    logits: torch.Tensor
    cached: list[int]


def prefill(model: Any, seqs: Sequence[NewSequence], *, pad_id: int, device: str,
            prefix: PrefixCache | None) -> Prefilled:
    """See the module. Precondition: every prompt has at least one token."""
    index: dict[tuple[str, tuple[int, ...]], int] = {}
    of: list[int] = []  # each sequence's row in the forward pass
    rows: list[NewSequence] = []
    for seq in seqs:
        row = index.setdefault((seq.cache_salt, tuple(seq.prompt_ids)), len(rows))
        if row == len(rows):
            rows.append(seq)
        of.append(row)
    keys = [prefix.block_keys(s.cache_salt, s.prompt_ids) if prefix is not None else []
            for s in rows]
    size = prefix.block_tokens if prefix is not None else 1
    found = [prefix.match(k, (len(s.prompt_ids) - 1) // size) if prefix is not None else 0
             for s, k in zip(rows, keys, strict=True)]
    reused = [n * size for n in found]
    cache: Any = DynamicCache(config=model.config)
    past = max(reused)
    if past:
        assert prefix is not None  # noqa: S101
        _load_past(cache, prefix, rows, keys, found, past, device)
    mask, logits = _forward(model, cache, rows, reused, pad_id=pad_id, device=device,
                            past=past)
    lengths = [len(s.prompt_ids) for s in rows]
    if past:
        mask = _compact(cache, mask, lengths)
    if prefix is not None:
        _store(prefix, cache, keys, found, lengths, logits, width=int(mask.shape[1]))
    cached = [reused[row] if seqs[i] is rows[row] else len(seqs[i].prompt_ids)
              for i, row in enumerate(of)]
    if len(rows) < len(seqs):
        pick = torch.tensor(of, device=device)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[pick], layer.values[pick]
        mask, logits = mask[pick], logits[pick]
    return Prefilled(cache, mask, logits, cached)


def _load_past(cache: Any, prefix: PrefixCache, rows: Sequence[NewSequence],
               keys: list[list[bytes]], found: list[int], past: int, device: str) -> None:
    """Fill `cache` with each row's cached blocks, right-aligned in `past` columns."""
    if len(rows) == 1:  # the blocks as gathered, without a second copy
        single = prefix.gather(keys[0][:found[0]])
        for layer, own in enumerate(cache.layers):
            keys_, values = single[layer, 0][None], single[layer, 1][None]
            own.lazy_initialization(keys_, values)
            own.keys, own.values = keys_, values  # update() would copy them
        return
    first = next(i for i, n in enumerate(found) if n)
    sample = prefix.gather(keys[first][:1])
    layers, two, heads, _, dim = sample.shape
    kv = torch.zeros((layers, two, len(rows), heads, past, dim), dtype=sample.dtype,
                     device=device)
    for row, n in enumerate(found):
        if n:
            kv[:, :, row, :, past - n * prefix.block_tokens:] = prefix.gather(keys[row][:n])
    for layer in range(layers):
        cache.update(kv[layer, 0], kv[layer, 1], layer)


def _forward(model: Any, cache: Any, rows: Sequence[NewSequence], reused: list[int], *,
             pad_id: int, device: str, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass over each row's prompt after its first reused[row] tokens, left-padded,
    after `past` columns of cached keys and values: the mask over both, last logits."""
    width = max(len(s.prompt_ids) - n for s, n in zip(rows, reused, strict=True))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), past + width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (seq, n) in enumerate(zip(rows, reused, strict=True)):
        rest = len(seq.prompt_ids) - n
        ids[row, width - rest:] = torch.tensor(seq.prompt_ids[n:])
        mask[row, past - n:past] = 1
        mask[row, past + width - rest:] = 1
        positions[row, width - rest:] = torch.arange(n, n + rest)
    mask = mask.to(device)
    # logits_to_keep=1: the last position's logits only.
    out = model(input_ids=ids.to(device), attention_mask=mask,
                position_ids=positions.to(device), cache=cache, use_cache=True,
                logits_to_keep=1)
    return mask, out.logits[:, -1, :]


def _compact(cache: Any, mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Move each row's tokens (the mask's ones, in order) right-aligned into
    max(lengths) columns, zeros before them; the new mask. Where every row's tokens
    are already contiguous and right-aligned (one row, rows that reused alike), only
    the leading columns go (views, no copy)."""
    rows, width = len(lengths), max(lengths)
    lead = int(mask.shape[1]) - width
    tail = mask[:, lead:]
    if int(tail.sum()) == sum(lengths) and all(
            bool(tail[row, width - n:].all()) for row, n in enumerate(lengths)):
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        return tail
    source = torch.zeros((rows, width), dtype=torch.long, device=mask.device)
    real = torch.zeros((rows, width), dtype=torch.long, device=mask.device)
    for row, n in enumerate(lengths):
        source[row, width - n:] = mask[row].nonzero()[:, 0]
        real[row, width - n:] = 1
    for layer in cache.layers:
        heads, dim = layer.keys.shape[1], layer.keys.shape[3]
        pick = source[:, None, :, None].expand(rows, heads, width, dim)
        keep = real[:, None, :, None].to(layer.keys.dtype)
        layer.keys = layer.keys.gather(2, pick) * keep
        layer.values = layer.values.gather(2, pick) * keep
    return real


def _store(prefix: PrefixCache, cache: Any, keys: list[list[bytes]], found: list[int],
           lengths: list[int], logits: torch.Tensor, *, width: int) -> None:
    """Keep each row's full blocks that were not cached (see the module)."""
    size = prefix.block_tokens
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    for row, (row_keys, n) in enumerate(zip(keys, found, strict=True)):
        if len(row_keys) <= n or not finite[row]:
            continue
        start = width - lengths[row] + n * size
        stop = width - lengths[row] + len(row_keys) * size
        kv = torch.stack([torch.stack((layer.keys[row, :, start:stop],
                                       layer.values[row, :, start:stop]))
                          for layer in cache.layers])
        prefix.store(row_keys, n, kv)
