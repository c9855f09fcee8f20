"""The static KV cache: `rows` slots of `length` positions, allocated once per layer.

Layout: each layer's keys and values are [rows, kv_heads, length, head_dim]. Slot r holds
the sequence in row r of the runtime's batch, its token t at position t (no padding).
The runtime keeps its running sequences in the first slots (a sequence that leaves is
replaced by the last one, `move`), so a decode step over b >= n rows reads the views
keys[:b, :, :k] of every layer: the same addresses at every step, which is what lets a
CUDA graph replay it.

A decode step's positions (where each row writes its new key and value, and the row's
position id) are a tensor of the runtime's, read through `positions`; `view(b, k)` says
how many rows and positions the next forward reads. The model calls `update` per layer
(transformers' Cache interface: the attention layers call `cache.update(keys, values,
layer_idx)`), which writes in place and returns those views.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's slots; writes each row's new key and value at its position."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: str) -> None:
        super().__init__()
        self.owner = owner
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.keys, self.values = self.k, self.v  # what transformers' code reads
        self.device = torch.device(device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocated up front: nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = self.owner.view_rows, self.owner.view_length
        index = self.owner.write_index(key_states.shape)
        keys, values = self.k[:rows], self.v[:rows]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, :length], values[:, :, :length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.view_length, 0

    def get_seq_length(self) -> int:
        return self.owner.view_length

    def get_max_length(self) -> int:
        return self.owner.length


class SlotCache(Cache):
    """Every layer's slots, and the view the next decode forward reads (see module)."""

    def __init__(self, config: Any, *, rows: int, length: int, positions: torch.Tensor,
                 dtype: torch.dtype, device: str) -> None:
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        shape = (rows, heads, length, head_dim)
        self.slot_layers = [SlotLayer(self, shape, dtype, device)
                            for _ in range(int(config.num_hidden_layers))]
        super().__init__(layers=list(self.slot_layers))
        self.rows, self.length, self.heads, self.head_dim = rows, length, heads, head_dim
        self.positions = positions  # [rows] long: where each row writes next
        self.view_rows, self.view_length = rows, length

    def view(self, rows: int, length: int) -> None:
        """The next forward reads the first `rows` slots, positions 0 to `length` - 1."""
        if not (1 <= rows <= self.rows and 1 <= length <= self.length):
            raise ValueError(f"view ({rows}, {length}) outside the cache "
                             f"({self.rows}, {self.length})")
        self.view_rows, self.view_length = rows, length

    def write_index(self, shape: torch.Size) -> torch.Tensor:
        """The scatter index that puts a [rows, heads, 1, head_dim] step at each row's
        position (a view of `positions`: no copy, the same addresses every step)."""
        rows = self.view_rows
        return self.positions[:rows].view(rows, 1, 1, 1).expand(rows, shape[1], 1, shape[3])

    def store(self, slots: list[int], prefill: Any, lengths: list[int], width: int) -> None:
        """Copy a prefill's cache (a DynamicCache over prompts left-padded to `width`)
        into `slots`: row i's last lengths[i] positions go to slot slots[i], 0 onwards."""
        device = self.slot_layers[0].device
        src_rows: list[int] = []
        src_pos: list[int] = []
        dst_rows: list[int] = []
        dst_pos: list[int] = []
        for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
            src_rows += [i] * n
            src_pos += range(width - n, width)
            dst_rows += [slot] * n
            dst_pos += range(n)
        src = (torch.tensor(src_rows, device=device), torch.tensor(src_pos, device=device))
        dst = (torch.tensor(dst_rows, device=device), torch.tensor(dst_pos, device=device))
        for layer, new in zip(self.slot_layers, prefill.layers, strict=True):
            layer.k[dst[0], :, dst[1]] = new.keys[src[0], :, src[1]]
            layer.v[dst[0], :, dst[1]] = new.values[src[0], :, src[1]]

    def move(self, sources: list[int], targets: list[int], upto: int) -> None:
        """Copy slots `sources` to `targets` (disjoint), positions 0 to `upto` - 1."""
        if not sources:
            return
        device = self.slot_layers[0].device
        src = torch.tensor(sources, device=device)
        dst = torch.tensor(targets, device=device)
        for layer in self.slot_layers:
            layer.k[dst, :, :upto] = layer.k[src, :, :upto]
            layer.v[dst, :, :upto] = layer.v[src, :, :upto]

    def clear(self, slots: list[int]) -> None:
        """Zero `slots`: a sequence whose values turned NaN or infinite leaves none
        behind (a masked position still multiplies its value by 0, and 0 x NaN is NaN)."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.slot_layers[0].device)
        for layer in self.slot_layers:
            layer.k.index_fill_(0, index, 0)
            layer.v.index_fill_(0, index, 0)
