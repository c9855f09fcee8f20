"""Per-row sampling from a batch of logits: greedy, temperature and nucleus (top-p)."""

from __future__ import annotations

from typing import Any

import torch

from inference.runtimes.base import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           constraints: list[Any] | None = None) -> list[int]:
    """One token per row of `logits` [B, V]. A row with a constraint
    (inference.constrained.JsonConstraint) gets its forced token, or samples only
    among the tokens it allows."""
    forced: list[int | None] = [None] * len(params)
    if constraints is not None and any(c is not None for c in constraints):
        from inference.constrained import apply

        logits = logits.clone()
        forced = apply(logits, constraints)
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        token = forced[row]
        if token is not None:
            out.append(token)
            continue
        if p.temperature <= 0:
            out.append(int(greedy[row]))
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # always keeps the top one
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    for row, constraint in enumerate(constraints or []):
        if constraint is not None and not constraint.done:
            constraint.advance(out[row])
    return out


def generator_for(params: SamplingParams, device: str) -> torch.Generator | None:
    if params.temperature <= 0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen
