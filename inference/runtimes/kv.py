"""How a causal LM runtime decodes and how large its KV cache is: a deployment's
settings, read from `DeploymentSpec.extra` and range-checked here (the one place they
are read), and the cache's capacity in tokens worked out from them.

`spec.extra` keys (all optional):
  decode                    "dynamic" (default): one DynamicCache, re-spliced when
                            sequences join; "static": preallocated slots, static-shape
                            decode steps, CUDA graphs on a CUDA device (static_lm.py).
  kv_cache_tokens           int, 1 to 2**31: the cache's capacity in tokens.
  kv_cache_memory_fraction  float, (0, 0.95]: the capacity as this share of the
                            device's free memory once the weights are loaded (CUDA).
  cuda_graphs               bool (default true): static decode on CUDA replays
                            captured graphs; false runs it eagerly.
  graph_batch_sizes         list of ints, 1 to 4096: the batch sizes a static step is
                            padded up to (default: graph_batch_sizes(max_batch_size)).
  prefix_cache_tokens       int, 0 to 2**31: the prefix cache's pool (prefix_cache.py),
                            in tokens; 0 turns the cache off. Default: see prefix_budget.
  prefix_block_tokens       int, 1 to 1024 (default 16): tokens per cached block.
At most one of kv_cache_tokens and kv_cache_memory_fraction. Without either, a dynamic
cache on the CPU is unbounded (as the process's memory is), on CUDA it gets
DEFAULT_MEMORY_FRACTION of the free memory; a static cache gets max_batch_size slots of
max_context tokens, on CUDA no more than DEFAULT_MEMORY_FRACTION of the free memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The options are read where no model runs (the deployments API checks them): torch is
# imported by the functions that need it, not by this module.
DEFAULT_BLOCK_TOKENS = 16  # tokens per prefix cache block (prefix_cache.py)
DECODE_MODES = ("dynamic", "static")
# What a cache sized from free memory leaves to activations, the prefill's temporary
# cache, the sampler and (static decode) the graphs' memory pool.
DEFAULT_MEMORY_FRACTION = 0.85
MAX_MEMORY_FRACTION = 0.95
MAX_TOKENS = 2**31
# The prefix cache's default pool: this share of a cache sized from free memory (taken
# from it), a quarter of one sized otherwise (beside it), PREFIX_CONTEXTS contexts
# beside an unbounded one.
PREFIX_MEMORY_SHARE = 0.2
PREFIX_CONTEXTS = 4


@dataclass(frozen=True)
class DecodeOptions:
    decode: str = "dynamic"
    max_batch_size: int = 8
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float | None = None
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = ()
    prefix_cache_tokens: int | None = None
    prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def static(self) -> bool:
        return self.decode == "static"

    @classmethod
    def parse(cls, extra: Mapping[str, Any], *, max_batch_size: int) -> DecodeOptions:
        """The options `extra` holds; ValueError naming the key for one out of range."""
        if not isinstance(max_batch_size, int) or not 1 <= max_batch_size <= 4096:
            raise ValueError(f"max_batch_size must be an integer from 1 to 4096, "
                             f"not {max_batch_size!r}")
        decode = extra.get("decode", "dynamic")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        tokens = extra.get("kv_cache_tokens")
        if tokens is not None and not _int_in(tokens, 1, MAX_TOKENS):
            raise ValueError(f"kv_cache_tokens must be an integer from 1 to {MAX_TOKENS}, "
                             f"not {tokens!r}")
        fraction = extra.get("kv_cache_memory_fraction")
        if fraction is not None and not (
                isinstance(fraction, int | float) and not isinstance(fraction, bool)
                and 0 < fraction <= MAX_MEMORY_FRACTION):
            raise ValueError(f"kv_cache_memory_fraction must be a number in "
                             f"(0, {MAX_MEMORY_FRACTION}], not {fraction!r}")
        if tokens is not None and fraction is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory_fraction, not both")
        graphs = extra.get("cuda_graphs", True)
        if not isinstance(graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, not {graphs!r}")
        sizes = extra.get("graph_batch_sizes", ())
        if not isinstance(sizes, list | tuple) or not all(_int_in(s, 1, 4096) for s in sizes):
            raise ValueError(f"graph_batch_sizes must be a list of integers from 1 to 4096, "
                             f"not {sizes!r}")
        prefix = extra.get("prefix_cache_tokens")
        if prefix is not None and not _int_in(prefix, 0, MAX_TOKENS):
            raise ValueError(f"prefix_cache_tokens must be an integer from 0 to {MAX_TOKENS}, "
                             f"not {prefix!r}")
        block = extra.get("prefix_block_tokens", DEFAULT_BLOCK_TOKENS)
        if not _int_in(block, 1, 1024):
            raise ValueError(f"prefix_block_tokens must be an integer from 1 to 1024, "
                             f"not {block!r}")
        return cls(decode=decode, max_batch_size=max_batch_size, kv_cache_tokens=tokens,
                   kv_cache_memory_fraction=float(fraction) if fraction is not None else None,
                   cuda_graphs=graphs, graph_batch_sizes=tuple(sorted(set(sizes))),
                   prefix_cache_tokens=prefix, prefix_block_tokens=block)


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token takes in the KV cache: keys and values of every layer."""
    import torch

    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * int(config.num_hidden_layers) * heads * head_dim * itemsize


def free_device_memory(device: str) -> int | None:
    """Free bytes on a CUDA device (None on the CPU: there the process's memory is)."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def kv_capacity(options: DecodeOptions, *, bytes_per_token: int, device: str,
                max_context: int, free_bytes: int | None = None) -> int | None:
    """The KV cache's capacity in tokens (None: unbounded, a dynamic cache on the CPU
    without a setting). `free_bytes`: the device's free memory (read from the device
    when None). ValueError when a setting cannot be met: more tokens than the device
    has room for, a fraction without a CUDA device."""
    if free_bytes is None:
        free_bytes = free_device_memory(device)
    ceiling = options.max_batch_size * max_context if options.static else None
    if options.kv_cache_tokens is not None:
        tokens = options.kv_cache_tokens
        if free_bytes is not None and tokens * bytes_per_token > free_bytes:
            raise ValueError(
                f"kv_cache_tokens {tokens} needs {tokens * bytes_per_token / 2**30:.2f} GiB; "
                f"the device has {free_bytes / 2**30:.2f} GiB free")
    elif options.kv_cache_memory_fraction is not None or free_bytes is not None:
        if free_bytes is None:
            raise ValueError("kv_cache_memory_fraction sizes the cache on a CUDA device; "
                             "on the CPU give kv_cache_tokens")
        fraction = options.kv_cache_memory_fraction or DEFAULT_MEMORY_FRACTION
        tokens = int(free_bytes * fraction) // bytes_per_token
    else:
        return ceiling
    return min(tokens, ceiling) if ceiling is not None else tokens


def kv_budget(options: DecodeOptions, *, bytes_per_token: int, device: str,
              max_context: int, free_bytes: int | None = None) -> tuple[int | None, int]:
    """The running cache's capacity in tokens (as `kv_capacity`) and the prefix cache's
    pool in tokens (0: none). An explicit `prefix_cache_tokens` is the pool (beside the
    cache; on CUDA both must fit the free memory). By default: a cache sized from the
    device's free memory gives PREFIX_MEMORY_SHARE of its tokens to the pool (so the
    two together take the fraction asked for); a cache of a given size gets a pool of
    a quarter of it beside it; an unbounded one (the CPU) PREFIX_CONTEXTS contexts."""
    if free_bytes is None:
        free_bytes = free_device_memory(device)
    capacity = kv_capacity(options, bytes_per_token=bytes_per_token, device=device,
                           max_context=max_context, free_bytes=free_bytes)
    explicit = options.prefix_cache_tokens
    if explicit is not None:
        used = (capacity or 0) + explicit
        if free_bytes is not None and used * bytes_per_token > free_bytes:
            raise ValueError(
                f"the KV cache and prefix_cache_tokens {explicit} need "
                f"{used * bytes_per_token / 2**30:.2f} GiB; the device has "
                f"{free_bytes / 2**30:.2f} GiB free")
        return capacity, explicit
    if capacity is None:
        return None, PREFIX_CONTEXTS * max_context
    if free_bytes is not None and options.kv_cache_tokens is None:
        pool = int(capacity * PREFIX_MEMORY_SHARE)
        return capacity - pool, pool
    return capacity, capacity // 4
