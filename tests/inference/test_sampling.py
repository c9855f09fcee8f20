"""The batch sampler: rows sample from the distribution their temperature and top-p
give, a seeded row draws the same tokens whatever else is in the batch, and greedy and
forced rows are left alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from inference.runtimes.base import FAILED, SamplingParams
from inference.runtimes.sampling import generator_for, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
N = 4000


def frequencies(params: SamplingParams, logits: torch.Tensor,
                counts: dict[int, int] | None = None) -> torch.Tensor:
    """N rows of the same logits, each seeded differently, sampled as one batch."""
    rows = [replace(params, seed=i) for i in range(N)]
    tokens = sample(logits.repeat(N, 1), rows, [generator_for(p) for p in rows],
                    counts=[counts] * N)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / N


def test_rows_sample_their_distribution() -> None:
    freq = frequencies(SamplingParams(temperature=1.0), PROBS.log())
    assert torch.allclose(freq, PROBS, atol=0.03), freq  # 4 standard deviations


def test_temperature_sharpens_and_flattens() -> None:
    for temperature in (0.5, 2.0):
        expected = torch.softmax(PROBS.log() / temperature, dim=-1)
        freq = frequencies(SamplingParams(temperature=temperature), PROBS.log())
        assert torch.allclose(freq, expected, atol=0.03), (temperature, freq)


def test_top_p_keeps_the_nucleus_only() -> None:
    # 0.5 + 0.3 reach 0.7: the nucleus is the first two tokens, renormalised.
    freq = frequencies(SamplingParams(temperature=1.0, top_p=0.7), PROBS.log())
    assert freq[2] == 0 and freq[3] == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03), freq
    # A top_p below the top token's mass keeps the top token alone.
    assert frequencies(SamplingParams(temperature=1.0, top_p=0.01), PROBS.log())[0] == 1


def test_a_seeded_row_draws_the_same_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits = torch.randn(50, 1000, generator=torch.Generator().manual_seed(0))

    def run(neighbours: int) -> list[int]:
        rows = [SamplingParams(temperature=0.7, seed=i) for i in range(neighbours)]
        rows.insert(neighbours // 2, seeded)
        gens = [generator_for(p) for p in rows]
        where = neighbours // 2
        return [sample(step.repeat(len(rows), 1), rows, gens)[where] for step in logits]

    alone = run(0)
    assert run(7) == alone and run(31) == alone
    assert len(set(alone)) > 10, "a sampled row, not a constant"


def test_a_masked_row_samples_only_what_its_grammar_allows_and_advances() -> None:
    """Row 2's grammar mask (inference.structured.masks) allows token 3 alone: sampled at
    temperature 1 it is 3, its constraint is advanced with it, and the unmasked rows
    sample as before."""
    import numpy as np

    from inference.structured.masks import Masks

    class Row:
        done, masking, advanced = False, True, -1

        def advance(self, token: int) -> None:
            self.advanced = token

    bits = np.zeros((1, (PROBS.numel() + 31) // 32), dtype=np.int32)
    bits[0, 0] = 1 << 3
    logits = PROBS.log().repeat(3, 1)
    rows = [SamplingParams(), SamplingParams(temperature=1.0, seed=1),
            SamplingParams(temperature=1.0, seed=2)]
    row = Row()
    tokens = sample(logits, rows, [generator_for(p) for p in rows], [None, None, row],
                    masks=Masks([2], bits))
    assert tokens[0] == 0 and tokens[2] == 3 and row.advanced == 3


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.4), (0.3, 0.2),
                                                 (-0.5, -0.2)])
def test_penalties_lower_what_was_generated_as_openai_describes(
        presence: float, frequency: float) -> None:
    """logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty, over
    the tokens the row has generated; negative penalties raise them."""
    counts = {0: 3, 2: 1}
    params = SamplingParams(temperature=1.0, presence_penalty=presence,
                            frequency_penalty=frequency)
    expected = PROBS.log().clone()
    expected[0] -= 3 * frequency + presence
    expected[2] -= frequency + presence
    freq = frequencies(params, PROBS.log(), counts)
    assert torch.allclose(freq, torch.softmax(expected, dim=-1), atol=0.03), freq


def test_penalties_move_greedy_rows_and_only_their_own() -> None:
    def logits() -> torch.Tensor:  # sample() penalizes its logits in place
        return PROBS.log().repeat(3, 1)  # token 0 ahead of token 1 by log(5/3) = 0.51

    rows = [SamplingParams(frequency_penalty=0.2), SamplingParams(presence_penalty=0.4),
            SamplingParams()]
    counts: list[dict[int, int] | None] = [{0: 3}, {0: 3}, {0: 3}]
    # 3 * 0.2 = 0.6 > 0.51: token 1 wins; presence counts once: 0.4 < 0.51, no penalty
    # for the third row (it has none).
    assert sample(logits(), rows, [None] * 3, counts=counts) == [1, 0, 0]
    assert sample(logits(), rows, [None] * 3, counts=[{0: 1}, None, None]) == [0, 0, 0]
    # Several rows, several tokens each, in place: exactly the formula.
    many = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(presence_penalty=0.3 * i, frequency_penalty=-0.2 * i)
              for i in range(4)]
    seen: list[dict[int, int] | None] = [{1: 2, 7: 1}, None, {3: 5}, {0: 1, 49: 4}]
    expected = many.clone()
    for row, tokens in enumerate(seen):
        for token, times in (tokens or {}).items():
            expected[row, token] -= times * params[row].frequency_penalty \
                + params[row].presence_penalty
    sample(many, params, [None] * 4, counts=seen)
    assert torch.allclose(many, expected)


def test_logit_bias_is_added_to_its_tokens_and_only_its_rows_own() -> None:
    """OpenAI's logit_bias: the amount is added to the token's logit; -100 bans it, +100
    makes it all but certain, a small bias shifts the distribution."""
    bias = {1: 0.7, 3: -0.4}
    params = SamplingParams(temperature=1.0, logit_bias=tuple(bias.items()))
    expected = PROBS.log().clone()
    for token, amount in bias.items():
        expected[token] += amount
    freq = frequencies(params, PROBS.log(), None)
    assert torch.allclose(freq, torch.softmax(expected, dim=-1), atol=0.03), freq

    many = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    top = many.argmax(dim=-1).tolist()
    rows = [SamplingParams(logit_bias=((top[0], -100.0),)),  # greedy, its argmax banned
            SamplingParams(logit_bias=((7, 100.0),)),  # greedy, forced to 7
            SamplingParams(temperature=1.0, logit_bias=((9, 100.0),)),  # sampled, 9
            SamplingParams(temperature=0.0)]  # no bias: its own argmax
    gens = [generator_for(p) for p in rows]
    tokens = sample(many.clone(), rows, gens)
    assert tokens[0] != top[0] and tokens[0] == many[0].topk(2).indices[1].item()
    assert tokens[1:] == [7, 9, top[3]]
    # Together with penalties, both apply.
    both = [SamplingParams(frequency_penalty=1.0, logit_bias=((2, 0.5),))]
    logits = torch.zeros(1, 5)
    sample(logits, both, [None], counts=[{2: 1}])
    assert logits[0].tolist() == [0.0, 0.0, -0.5, 0.0, 0.0]


def peaked_and_flat() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits over 5,000 tokens: a peaked row (its 0.9 nucleus fits the sampler's first
    top-k look) and a flat one (it does not: its whole vocabulary is sorted)."""
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(5000, generator=gen)
    peaked[:8] += 12  # eight tokens hold ~all the mass
    return peaked, torch.randn(5000, generator=gen) * 0.1


def test_rows_the_top_k_holds_and_rows_it_does_not_draw_as_alone_in_one_batch() -> None:
    """Only the rows whose top-k misses their nucleus are sorted; each row of a mixed
    batch draws what it draws alone (fails if the two groups' results are misplaced)."""
    logits = torch.stack(peaked_and_flat() * 8)
    rows = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(len(logits))]
    together = [generator_for(p) for p in rows]
    apart = [generator_for(p) for p in rows]
    for _ in range(20):
        mixed = sample(logits, rows, together)
        assert mixed == [sample(row[None], [p], [gen])[0]
                         for row, p, gen in zip(logits, rows, apart, strict=True)]
    assert len(set(mixed[1::2])) > 1, "the flat rows sample"


def test_the_nucleus_is_exact_whether_the_top_k_holds_it_or_not() -> None:
    # 5,000 tokens: a peaked row (its nucleus fits the sampler's first top-k look) and a
    # flat one (it does not: the whole vocabulary is sorted). Both sample their true
    # nucleus, in proportion.
    for logits in peaked_and_flat():
        probs = torch.softmax(logits, dim=-1)
        ordered, order = probs.sort(descending=True)
        nucleus = order[(ordered.cumsum(0) - ordered) < 0.9]
        assert 1 < len(nucleus) < 5000
        freq = frequencies(SamplingParams(temperature=1.0, top_p=0.9), logits)
        assert set(torch.nonzero(freq).flatten().tolist()) <= set(nucleus.tolist())
        # In proportion: by ranks, in ten buckets (the flat row's nucleus is ~4,500
        # tokens, too many to compare one by one; a cut taken from the top-k alone
        # would leave the buckets past rank 1,024 empty).
        expected = probs[nucleus] / probs[nucleus].sum()
        buckets = torch.arange(len(nucleus)) * 10 // len(nucleus)
        assert torch.allclose(torch.zeros(10).index_add_(0, buckets, freq[nucleus]),
                              torch.zeros(10).index_add_(0, buckets, expected), atol=0.03)


@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.7)])
def test_a_row_whose_logits_are_not_finite_fails_alone(
        bad: str, temperature: float, top_p: float) -> None:
    """That row gets FAILED (argmax or a draw would make a token up); every other row
    samples exactly what it samples without it, seeded, greedy, cut or masked (-inf
    logits beside finite ones are a mask, not a fault)."""
    masked = PROBS.log().clone()
    masked[3] = float("-inf")
    good = [PROBS.log(), masked, PROBS.log()]
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.0)]
    faulty = PROBS.log().clone()
    if bad == "all -inf":
        faulty[:] = float("-inf")
    else:
        faulty[2] = float(bad)
    alone = sample(torch.stack(good), params, [generator_for(p) for p in params])
    rows = [*params[:1], SamplingParams(temperature=temperature, top_p=top_p, seed=3),
            *params[1:]]
    tokens = sample(torch.stack([good[0], faulty, *good[1:]]), rows,
                    [generator_for(p) for p in rows])
    assert tokens[1] == FAILED
    assert [tokens[0], *tokens[2:]] == alone and FAILED not in alone


