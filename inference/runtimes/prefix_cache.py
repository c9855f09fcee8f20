"""The prefix cache: the KV of full blocks of prompt tokens, kept for later prompts that
start with the same tokens (vLLM's automatic prefix caching, at block granularity).

Keys. A prompt's i-th block (tokens [i*B, (i+1)*B), B = `block_tokens`) is keyed by a
128-bit BLAKE2b hash chained over the blocks before it and rooted in a salt: block i's
key hashes block i-1's key and block i's tokens; block 0's hashes the salt's. Two
prompts share block i's key only if they share the salt and all their first (i+1)*B
tokens. The runtime's caller makes the salt from the request's tenant (and, when its
tenant narrowed it, the API key), so no block is ever shared across tenants: another
tenant's identical prefix is a miss, computed as if nobody had sent it.

Values. A block is one tensor [layers, 2, kv_heads, B, head_dim] (keys and values of
every layer), a copy: the running cache never points into the pool, so evicting a
block never touches a running sequence; a hit copies the blocks out (`gather`).

Pool. At most `capacity_blocks` blocks, least recently used evicted first. A hit or an
insert touches a chain's blocks deepest first, so a block is always more recent than
the blocks after it in its chain: eviction takes a chain's tail before its head, and no
cached block is orphaned behind an evicted one (it would be unreachable: matching stops
at the first missing block).

One thread uses a cache (the runtime's: its `add` runs between steps); the counters are
plain ints that other threads (heartbeats, metrics) may read.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.runtimes.kv import DEFAULT_BLOCK_TOKENS


@dataclass
class PrefixStats:
    """What the pool holds and has done since it started (heartbeats and metrics)."""

    capacity_blocks: int
    block_tokens: int
    blocks: int = 0
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of those, prompts that found at least one block
    hit_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    stored: int = 0  # blocks inserted
    evictions: int = 0

    def beat(self) -> dict[str, int]:
        """The heartbeat's fields (inference/engine/health.py)."""
        return {"prefix_cache_blocks": self.blocks,
                "prefix_cache_capacity_blocks": self.capacity_blocks,
                "prefix_cache_block_tokens": self.block_tokens,
                "prefix_cache_lookups": self.lookups, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_evictions": self.evictions}


class PrefixCache:
    def __init__(self, *, capacity_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS
                 ) -> None:
        if capacity_blocks < 1 or block_tokens < 1:
            raise ValueError("a prefix cache holds at least one block of one token")
        self.block_tokens = block_tokens
        self.stats = PrefixStats(capacity_blocks=capacity_blocks, block_tokens=block_tokens)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def block_keys(self, salt: str, ids: Sequence[int]) -> list[bytes]:
        """The keys of `ids`' full blocks, in order, under `salt` (see the module)."""
        size = self.block_tokens
        key = hashlib.blake2b(salt.encode(), digest_size=16, person=b"sluice-prefix").digest()
        keys = []
        for start in range(0, len(ids) - size + 1, size):
            block = array("q", ids[start:start + size]).tobytes()
            key = hashlib.blake2b(key + block, digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, keys: Sequence[bytes], limit: int) -> int:
        """How many leading blocks of `keys` (at most `limit`) the pool holds; counts
        one lookup and touches the blocks found. Precondition: `gather` them before the
        next `store` (which may evict them)."""
        found = 0
        for key in keys[:max(0, limit)]:
            if key not in self._blocks:
                break
            found += 1
        self.stats.lookups += 1
        if found:
            self.stats.hits += 1
            self.stats.hit_tokens += found * self.block_tokens
            self._touch(keys[:found])
        return found

    def gather(self, keys: Sequence[bytes]) -> torch.Tensor:
        """The KV of blocks `keys` (all in the pool), end to end:
        [layers, 2, kv_heads, len(keys) * B, head_dim]."""
        stacked = torch.stack([self._blocks[key] for key in keys], dim=3)
        layers, two, heads, n, size, dim = stacked.shape
        return stacked.reshape(layers, two, heads, n * size, dim)

    def store(self, keys: Sequence[bytes], first: int, kv: torch.Tensor) -> None:
        """Keep blocks `keys[first:]`, whose KV `kv` [layers, 2, kv_heads, T, head_dim]
        holds from token first * B on (T >= (len(keys) - first) * B); blocks the pool
        has already are only touched. Evicts the least recently used beyond capacity."""
        size = self.block_tokens
        for i in range(first, len(keys)):
            key = keys[i]
            if key in self._blocks:
                continue
            start = (i - first) * size
            self._blocks[key] = kv[:, :, :, start:start + size].clone()
            self.stats.stored += 1
        self._touch(keys)
        while len(self._blocks) > self.stats.capacity_blocks:
            self._blocks.popitem(last=False)
            self.stats.evictions += 1
        self.stats.blocks = len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.stats.blocks = 0

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Most recent: the chain's head (see the module on eviction order)."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
