"""A batch's grammar masks: computed by llguidance's thread pool into one bitmask (one
bit per token, 32 to an int32 word) while the model's forward pass runs, then applied
to the logits in place: by numpy for CPU logits, by torch on a GPU (no per-row Python
loop over the vocabulary either way).

`start(constraints)` takes a snapshot of which rows mask and begins computing; it must
be called after the previous step's tokens were advanced into the constraints and
before anything advances them again (the runtime calls it right before its forward
pass and applies the result right after). `Masks.apply` sets every disallowed logit of
a masking row to -inf; a row whose constraint is `closing` keeps only its closing
tokens when any is allowed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from inference.structured.constraint import Constraint, Vocabulary

_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-masks")
_SHIFTS = torch.arange(32, dtype=torch.int32)
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)
# Bit k of int32 word w is token 32w + k: in memory, byte by byte, on a little-endian host.
_LITTLE = sys.byteorder == "little"


class Masks:
    """The bitmask rows of one step: `rows[i]`'s mask is `bits[i]`."""

    def __init__(self, rows: list[int], bits: np.ndarray) -> None:
        self.rows, self.bits = rows, bits

    def apply(self, logits: torch.Tensor) -> None:
        """Mask `logits` [B, V] in place."""
        if not self.rows:
            return
        width = logits.shape[-1]
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS and _LITTLE:
            # On the CPU, numpy unpacks the bits and writes -inf where they are 0 in
            # place: the tensor path below (int32 shifts over 32 x the vocabulary, then
            # a gather and a scatter of the rows) was 5.3 ms at batch 32 over SmolLM2's
            # 49,152 tokens, this is ~1 ms (docs/BENCHMARKS.md, structured generation).
            denied = np.unpackbits((~self.bits).view(np.uint8), axis=-1,
                                   bitorder="little")[:, :width].view(np.bool_)
            values = logits.numpy()
            if self.rows == list(range(len(values))):
                np.copyto(values, -np.inf, where=denied)
            else:
                for i, row in enumerate(self.rows):
                    np.copyto(values[row], -np.inf, where=denied[i])
            return
        bits = torch.from_numpy(self.bits).to(logits.device)
        allowed = ((bits.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1).bool()
        allowed = allowed.view(len(self.rows), -1)[:, :width]
        index = torch.tensor(self.rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _compute(vocab: Vocabulary, constraints: list[Constraint], rows: list[int]) -> Masks:
    bits = np.full((len(rows), vocab.words), -1, dtype=np.int32)
    vocab.executor.unsafe_compute_mask_ptr(
        [(c.matcher, i) for i, c in enumerate(constraints)], bits.ctypes.data,
        vocab.words * 4, len(rows))
    for i, constraint in enumerate(constraints):
        if constraint.closing:
            _close(vocab, constraint, bits[i])
    return Masks(rows, bits)


def _close(vocab: Vocabulary, constraint: Constraint, row: np.ndarray) -> None:
    """Narrow a row whose budget is nearly spent to the tokens that end it soonest."""
    candidates = [t for t in (*vocab.eos, *vocab.closer_ids)
                  if (row[t >> 5] >> (t & 31)) & 1]
    chosen = constraint.closing_choice(candidates)
    if chosen:
        row[:] = 0
        for token in chosen:
            row[token >> 5] |= np.int32(1 << (token & 31)) if (token & 31) < 31 \
                else np.int32(-(1 << 31))


def start(constraints: Sequence[Constraint | None]) -> Future[Masks] | None:
    """Begin computing the masks of the masking rows; None when no row masks."""
    rows = [row for row, c in enumerate(constraints) if c is not None and c.masking]
    if not rows:
        return None
    masking = [c for c in constraints if c is not None and c.masking]
    return _pool.submit(_compute, masking[0].vocab, masking, rows)


def now(constraints: Sequence[Constraint | None]) -> Masks | None:
    """The masks, computed in the caller's thread (a prefill: nothing runs beside it)."""
    pending = start(constraints)
    return pending.result() if pending is not None else None
