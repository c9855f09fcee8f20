"""Causal LMs decoded with static shapes: a preallocated KV cache of slots, one decode
step a replayed CUDA graph on a CUDA device (the same code eagerly on the CPU).

The cache (slots.py) has max_batch_size slots of `max_context` positions, the capacity
(kv.py) shared between them: with less capacity than max_batch_size x the model's
context, each slot holds less and `max_context` is lowered to it, so the caller's
context checks keep every sequence inside its slot. A sequence joins at a token boundary
(`add`: its prompt prefilled eagerly, as in CausalLMRuntime, then copied into the next
free slot, positions 0 onwards) and leaves at one (`drop`: the last running row moves
into its slot, so the running rows stay the first n). A step feeds each row its last
token at its own position (its length so far) through static buffers written in place:
the input ids and positions ([2, slots], copied from the host once a step), an attention
mask computed from the positions, the slots. It runs b rows (n padded up to a bucket,
graphs.py: padding rows write at position 0 of free slots, which nothing reads) over
the first k positions (the longest row rounded up), so its shapes come from a short
list, each captured once. Sampling, penalties, logit_bias, logprobs and grammar masks
apply to the step's logits [n, V] exactly as in CausalLMRuntime: a row's tokens are
those it gets running alone.

A sequence that has filled its slot (the caller went past max_context) gets FAILED,
as does one whose logits turn NaN or infinite; a slot such a sequence held is zeroed
when it leaves. Forward hooks on the model do not run on a replayed graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from inference.runtimes.base import FAILED, KVRefusal, NewSequence
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.runtimes.graphs import (
    StepGraphs,
    batch_bucket,
    graph_batch_sizes,
    length_bucket,
)
from inference.runtimes.kv import DecodeOptions
from inference.runtimes.slots import SlotCache
from inference.structured import masks as grammar_masks


class StaticCausalLMRuntime(CausalLMRuntime):
    def __init__(self, model: Any, tokenizer: Any, *, device: str, max_context: int,
                 options: DecodeOptions | None = None) -> None:
        options = options or DecodeOptions(decode="static")
        super().__init__(model, tokenizer, device=device, max_context=max_context,
                         options=options)
        rows = options.max_batch_size
        capacity = self.kv_capacity_tokens or rows * self.max_context
        if capacity // rows < 2:
            raise ValueError(f"a KV cache of {capacity} tokens leaves less than 2 a slot "
                             f"for max_batch_size {rows}")
        self.max_context = min(self.max_context, capacity // rows)
        self.kv_capacity_tokens = rows * self.max_context
        graphs = options.cuda_graphs and device.startswith("cuda")
        # Padding to buckets is for the graphs; eagerly a padded row is work for nothing,
        # unless buckets were asked for (tests check padding on the CPU that way).
        self.buckets = options.graph_batch_sizes or (graph_batch_sizes(rows) if graphs else ())
        with torch.inference_mode():
            # Row 0: each row's input id; row 1: its position (its length so far).
            self._io = torch.zeros((2, rows), dtype=torch.long, device=device)
            self._arange = torch.arange(self.max_context, device=device)
            self._slots = SlotCache(model.config, rows=rows, length=self.max_context,
                                    positions=self._io[1], dtype=self.model.dtype,
                                    device=device)
            self.graphs = (StepGraphs(self._forward, torch.empty(
                (rows, int(model.config.vocab_size)), dtype=self.model.dtype, device=device))
                if graphs else None)
        # Per running row, on the host: its length (tokens in its slot), the token it
        # feeds next, and whether its values may hold NaN (its slot is zeroed on leaving).
        self._lengths: list[int] = []
        self._next: list[int] = []
        self._faulted: list[bool] = []

    def warm_up(self) -> None:
        self.capture_graphs()

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: Sequence[int] | None = None,
                       max_length: int | None = None) -> int:
        """Capture the decode graphs ahead of serving: for these batch buckets (default
        all) and every length bucket up to `max_length` (default a slot's length); a
        step that meets a shape first otherwise captures it then (two eager forwards and
        a capture). Call it with no sequence running: the captures' warm-up forwards
        write into free slots only. How many graphs it captured; 0 without graphs."""
        if self.graphs is None:
            return 0
        if self._rids:
            raise RuntimeError("capture_graphs runs before any sequence joins")
        limit = self.max_context
        top = length_bucket(max_length or limit, limit)
        lengths = {min(limit, 1 << k) for k in range(6, limit.bit_length() + 1)} | {limit}
        before = len(self.graphs.graphs)
        for rows in batch_sizes or self.buckets:
            for length in sorted(n for n in lengths if n <= top):
                self._io.zero_()
                if (rows, length) not in self.graphs.graphs:
                    self.graphs.graphs[rows, length] = self.graphs.capture(rows, length)
        return len(self.graphs.graphs) - before

    # -- KV cache capacity -----------------------------------------------------------
    def kv_used_tokens(self) -> int:
        return sum(self._lengths)

    def kv_admission(self, seq: NewSequence,
                     joining: Sequence[NewSequence] = ()) -> KVRefusal | None:
        capacity = self.kv_capacity_tokens or 0
        need = len(seq.prompt_ids) + 1
        if need > self.max_context:
            return KVRefusal(False, "kv_cache_too_small",
                             f"The prompt has {len(seq.prompt_ids)} tokens; a sequence holds "
                             f"at most {self.max_context} in this model's KV cache.",
                             need, capacity)
        if len(self._rids) + len(joining) + 1 > self._slots.rows:
            return KVRefusal(True, "kv_cache_full",
                             f"Every KV cache slot is taken ({self._slots.rows}); retry when "
                             f"running requests finish.", need, capacity)
        return None

    # -- batching ------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, seqs: Sequence[NewSequence]) -> dict[str, int]:
        if not seqs:
            return {}
        self._check_fits(seqs)
        done = self._prefill(seqs)
        start = len(self._rids)
        first = self._first_tokens(seqs, done.logits)
        lengths = [len(s.prompt_ids) for s in seqs]
        self._slots.store(list(range(start, start + len(seqs))), done.cache, lengths,
                          int(done.mask.shape[1]))
        self._lengths += lengths
        self._next += [self.pad_id if t == FAILED else t for t in first]
        self._faulted += [t == FAILED for t in first]
        return {s.rid: tok for s, tok in zip(seqs, first, strict=True)}

    @torch.inference_mode()
    def step(self) -> dict[str, int]:
        n = len(self._rids)
        if not n:
            return {}
        limit = self.max_context
        # A row that failed, or has filled its slot, may not go on: it is fed padding at
        # position 0 of its own slot (harmless, and zeroed as it leaves) and gets FAILED.
        for row, length in enumerate(self._lengths):
            if length >= limit:
                self._faulted[row] = True
        out = [row for row, faulted in enumerate(self._faulted) if faulted]
        rows = batch_bucket(n, self.buckets) if self.buckets else n
        positions = [0 if faulted else length
                     for length, faulted in zip(self._lengths, self._faulted, strict=True)]
        ids = [self.pad_id if faulted else token
               for token, faulted in zip(self._next, self._faulted, strict=True)]
        pad = rows - n
        self._io[:, :rows].copy_(torch.tensor([ids + [self.pad_id] * pad,
                                               positions + [0] * pad]))
        length = length_bucket(max(positions) + 1, limit)
        masks = grammar_masks.start(self._constraints)
        logits = (self.graphs.run(rows, length) if self.graphs is not None
                  else self._forward(rows, length))[:n]
        if out:  # NaN logits: sampled as FAILED (no grammar advanced, no token counted)
            logits[out] = float("nan")
        # Nothing to undo if sampling raises: the positions only move on below, and the
        # next step writes the same positions again.
        tokens = self._sample_rows(logits, masks)
        for row, token in enumerate(tokens):
            if token == FAILED:
                self._faulted[row] = True
            else:
                self._next[row] = token
                self._lengths[row] += 1
        return dict(zip(self._rids, tokens, strict=True))

    def _forward(self, rows: int, length: int) -> torch.Tensor:
        """One decode forward over the static buffers: rows [0, rows) at their positions,
        reading positions [0, length). Logits [rows, V]. What a graph captures."""
        self._slots.view(rows, length)
        positions = self._io[1, :rows]
        mask = self._arange[:length][None, :] <= positions[:, None]
        out = self.model(input_ids=self._io[0, :rows, None], position_ids=positions[:, None],
                         attention_mask=mask[:, None, None, :], cache=self._slots,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def drop(self, rids: Iterable[str]) -> None:
        gone = set(rids)
        leaving = [row for row, rid in enumerate(self._rids) if rid in gone]
        if not leaving:
            return
        for rid in gone:
            self._logprobs.pop(rid, None)
            self._cached.pop(rid, None)
        # The last running rows fill the holes the leaving ones make below them. A slot
        # that becomes free and held NaN values is zeroed (the leaving row's, or a moved
        # row's old one).
        n, kept = len(self._rids), len(self._rids) - len(leaving)
        holes = [row for row in leaving if row < kept]
        staying = set(range(kept, n)) - set(leaving)
        movers = sorted(staying)
        self._slots.clear([row for row in leaving if self._faulted[row]])
        if movers:
            self._slots.move(movers, holes, max(self._lengths[row] for row in movers))
            self._slots.clear([row for row in movers if self._faulted[row]])
        order = list(range(kept))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self._take_rows(order)

    def _take_rows(self, order: list[int]) -> None:
        super()._take_rows(order)
        self._lengths = [self._lengths[row] for row in order]
        self._next = [self._next[row] for row in order]
        self._faulted = [self._faulted[row] for row in order]
