"""Sampling a batch of logits: greedy, temperature and nucleus (top-p), one token per row.

The rows that sample are done together: one softmax, one top-p cut and one inverse-CDF
draw for all of them, and a single copy of the tokens to the host. Each request keeps
its own random stream: a seeded row draws its uniform number from its own generator
(on the CPU, whatever the model's device), so what it samples does not depend on the
other rows of the batch, nor on the device's random state. (A loop of per-row softmax,
sort and `multinomial(...).item()` had cost ~6 kernel launches and a device sync per
sampling row per step: about 8 ms a step at batch 128 on a GPU.)"""

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
    rows = [row for row, p in enumerate(params)
            if forced[row] is None and p.temperature > 0]
    chosen = logits.argmax(dim=-1)
    if rows:
        chosen[rows] = _draw(logits[rows], [params[row] for row in rows],
                             [generators[row] for row in rows])
    out = chosen.tolist()
    for row, token in enumerate(forced):
        if token is not None:
            out[row] = token
    for row, constraint in enumerate(constraints or []):
        if constraint is not None and not constraint.done:
            constraint.advance(out[row])
    return [int(token) for token in out]


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of `logits` [N, V] (every row at temperature > 0)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        # Nucleus: keep the most likely tokens until their mass reaches top_p (the top
        # one always: the mass before it is 0 < top_p), in each row; rows at top_p 1.0
        # keep everything.
        ordered, order = probs.sort(dim=-1, descending=True)
        keep = ordered.cumsum(-1) - ordered < torch.tensor(top_p, device=device)[:, None]
        ordered = torch.where(keep, ordered, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    cdf = probs.cumsum(-1)
    # One uniform number per row from the row's own generator (CPU), scaled to the row's
    # kept mass: the token is the first whose cumulative probability exceeds it.
    uniform = torch.cat([torch.rand(1, generator=gen) for gen in generators]).to(device)
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    return tokens.squeeze(-1).clamp_(max=logits.shape[-1] - 1)


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
