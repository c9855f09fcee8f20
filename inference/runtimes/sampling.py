"""Sampling a batch of logits: greedy, temperature and nucleus (top-p), one token per row,
after OpenAI's presence and frequency penalties and logit_bias for the rows that have
them.

The rows that sample are done together: one softmax, one top-p cut and one inverse-CDF
draw for all of them, and a single copy of the tokens to the host. Each request keeps
its own random stream: a seeded row draws its uniform number from its own generator
(on the CPU, whatever the model's device), so what it samples does not depend on the
other rows of the batch, nor on the device's random state. (It was a loop of per-row
softmax, sort and `multinomial(...).item()`: ~6 kernel launches and a device sync per
sampling row per step on a GPU; on the CPU at batch 128, 151-188 ms a step against
24-33 ms batched. docs/BENCHMARKS.md, twelfth pass.)"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch

from inference.runtimes.base import FAILED, SamplingParams

_TOP_K = 1024  # where a top-p cut looks first


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           constraints: list[Any] | None = None,
           counts: Sequence[dict[int, int] | None] | None = None,
           masks: Any = None) -> list[int]:
    """One token per row of `logits` [B, V]; `FAILED` for a row whose logits are NaN
    or +infinity, or all -infinity (a model's numerical fault on that sequence: no
    token can be drawn from them, and argmax would pick a made-up one). The other rows
    are sampled as if it were not there. A row with a masking constraint
    (inference.structured.constraint.Constraint) samples only among the tokens its grammar allows:
    `masks` (inference.structured.masks.Masks) were computed for these constraints beside the
    forward pass, or are computed here when None; every constraint that is not done
    is advanced with its row's token. `counts`: per row, how often it has generated each token, for
    its presence and frequency penalties (None: the row has none); the penalties and
    each row's logit_bias are applied to `logits` in place (the caller's logits are
    scratch: a copy of a batch's was ~6 ms on the CPU at batch 128)."""
    # max propagates NaN, so one reduction finds the greedy tokens and the faulty rows.
    top, chosen = logits.max(dim=-1)
    finite = torch.isfinite(top)
    adjusted = counts is not None and _penalize(logits, params, counts)
    if _bias(logits, params) or adjusted:
        chosen = logits.argmax(dim=-1)
    if constraints is not None and any(c is not None for c in constraints):
        from inference.structured import masks as grammar_masks

        masks = masks if masks is not None else grammar_masks.now(constraints)
        if masks is not None:
            masks.apply(logits)
            chosen = logits.argmax(dim=-1)  # among what the grammars allow
    rows = [row for row, p in enumerate(params) if p.temperature > 0]
    if rows:
        # A faulty row draws a meaningless token here (nothing checks, nothing syncs);
        # `finite` replaces it below.
        chosen[rows] = _draw(logits[rows], [params[row] for row in rows],
                             [generators[row] for row in rows])
    out = torch.where(finite, chosen, FAILED).tolist()
    for row, constraint in enumerate(constraints or []):
        if constraint is not None and not constraint.done and out[row] != FAILED:
            constraint.advance(out[row])
    return [int(token) for token in out]


def _penalize(logits: torch.Tensor, params: list[SamplingParams],
              counts: Sequence[dict[int, int] | None]) -> bool:
    """OpenAI's presence and frequency penalties, in place: in each row, every token
    generated c > 0 times so far is lowered by c * frequency_penalty + presence_penalty
    (a negative penalty raises it). False when no row has any. The (row, token) pairs
    go to torch through typed arrays: `torch.tensor` of Python lists was 11 of a 15 ms
    step at batch 128 with 256 distinct tokens a row."""
    penalized = [(row, seen) for row, (p, seen) in enumerate(zip(params, counts, strict=True))
                 if seen and p.penalized]
    if not penalized:
        return False
    rows: list[int] = []
    tokens, times, lengths = array("q"), array("f"), []
    for row, seen in penalized:
        rows.append(row)
        tokens.extend(seen.keys())
        times.extend(seen.values())
        lengths.append(len(seen))
    per_row = torch.tensor(lengths)
    frequency = torch.tensor([params[r].frequency_penalty for r in rows]).repeat_interleave(
        per_row)
    presence = torch.tensor([params[r].presence_penalty for r in rows]).repeat_interleave(
        per_row)
    amounts = torch.frombuffer(times, dtype=torch.float32) * frequency + presence
    _add_at(logits, torch.tensor(rows).repeat_interleave(per_row), tokens, -amounts)
    return True


def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> bool:
    """Each row's logit_bias, added in place; False when no row has one."""
    if not any(p.logit_bias for p in params):
        return False
    rows: list[int] = []
    tokens, amounts = array("q"), array("f")
    for row, p in enumerate(params):
        for token, amount in p.logit_bias:
            rows.append(row)
            tokens.append(token)
            amounts.append(amount)
    _add_at(logits, torch.tensor(rows), tokens, torch.frombuffer(amounts, dtype=torch.float32))
    return True


def _add_at(logits: torch.Tensor, rows: torch.Tensor, tokens: array,
            amounts: torch.Tensor) -> None:
    """logits[rows[i], tokens[i]] += amounts[i] for every pair, in place (one indexed
    add on the logits' device; `tokens` an array("q") of token ids)."""
    device = logits.device
    index = (rows.to(device), torch.frombuffer(tokens, dtype=torch.int64).to(device))
    logits.index_put_(index, amounts.to(device, logits.dtype), accumulate=True)


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of `logits` [N, V] (every row at temperature > 0)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    # One uniform number per row from the row's own generator (CPU).
    uniform = torch.cat([torch.rand(1, generator=gen) for gen in generators]).to(device)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    whole = [row for row, p in enumerate(params) if p.top_p >= 1.0]
    if whole:
        tokens[whole] = _inverse_cdf(probs[whole], uniform[whole])
    cut = [row for row, p in enumerate(params) if p.top_p < 1.0]
    if cut:
        limit = torch.tensor([params[row].top_p for row in cut], device=device)[:, None]
        tokens[cut] = _nucleus_draw(probs[cut], limit, uniform[cut])
    return tokens


def _nucleus_draw(probs: torch.Tensor, limit: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """Per row, a draw from the row's nucleus: its most likely tokens until their mass
    reaches the row's limit (the top one always). Looked for in the top _TOP_K, which
    hold it in a trained model's usual case; a row whose top _TOP_K hold less than its
    limit (a flat distribution, a high temperature) sorts its whole vocabulary (~4.7 ms
    a row of 49,152 tokens on the CPU), that row alone: one such request no longer makes
    every top-p row of its batch sort."""
    vocab = probs.shape[-1]
    k = min(vocab, _TOP_K)
    kept, ids = probs.topk(k, dim=-1)
    short = (kept.sum(-1, keepdim=True) < limit).squeeze(-1).nonzero().flatten().tolist() \
        if k < vocab else []
    if not short:
        return _cut_draw(kept, ids, limit, uniform)
    tokens = torch.empty(len(probs), dtype=torch.long, device=probs.device)
    skip = set(short)
    held = [row for row in range(len(probs)) if row not in skip]
    if held:
        tokens[held] = _cut_draw(kept[held], ids[held], limit[held], uniform[held])
    ordered, order = probs[short].sort(dim=-1, descending=True)
    tokens[short] = _cut_draw(ordered, order, limit[short], uniform[short])
    return tokens


def _cut_draw(kept: torch.Tensor, ids: torch.Tensor, limit: torch.Tensor,
              uniform: torch.Tensor) -> torch.Tensor:
    """A draw from each row's nucleus, given the row's probabilities most likely first
    (`kept`, token ids `ids`): those past the limit's mass are zeroed (the mass before
    the top one is 0: it stays)."""
    kept = torch.where(kept.cumsum(-1) - kept < limit, kept, 0.0)
    return ids.gather(-1, _inverse_cdf(kept, uniform)[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds the row's uniform
    number scaled to the row's mass (rows need not sum to 1). In range whatever the
    row holds (a NaN row gets some index; `sample` marks it FAILED)."""
    cdf = probs.cumsum(-1)
    mass = cdf[:, -1]
    picked = torch.searchsorted(cdf, (uniform * mass)[:, None], right=True)
    return picked.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def generator_for(params: SamplingParams) -> torch.Generator | None:
    """A request's random stream (CPU: one number a step): seeded, or from the OS."""
    if params.temperature <= 0:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen
