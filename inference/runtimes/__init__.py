"""Model runtimes behind one small interface (see base.py), and the loader: the one
place that knows every runtime class (a runtime's module knows only itself and its
bases)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from inference.runtimes.base import ChatRuntime, EmbeddingRuntime
from inference.spec import DeploymentSpec, RuntimeName

if TYPE_CHECKING:
    from inference.runtimes.causal_lm import CausalLMRuntime
    from inference.runtimes.kv import DecodeOptions


def load_runtime(spec: DeploymentSpec) -> ChatRuntime | EmbeddingRuntime:
    # Imports are lazy on purpose: an echo worker must not pay for torch + transformers.
    from inference.weights import pick_device, resolve

    if spec.runtime == RuntimeName.ECHO:
        from inference.runtimes.echo import EchoRuntime

        return EchoRuntime(token_delay_ms=spec.echo_token_delay_ms, max_context=spec.max_context)
    device = pick_device(spec.device)
    if device == "cpu":
        keep_large_allocations()
    threads = os.environ.get("SLUICE_TORCH_THREADS")
    if threads:  # CPU workers sharing a machine: give each a fixed share of the cores
        import torch

        torch.set_num_threads(int(threads))
    if spec.runtime in (RuntimeName.TINY_CAUSAL_LM, RuntimeName.CAUSAL_LM):
        from inference.runtimes.causal_lm import tiny_llama
        from inference.runtimes.kv import DecodeOptions

        # The decode path and the KV cache's size (spec.extra; kv.py lists the keys).
        options = DecodeOptions.parse(spec.extra, max_batch_size=spec.max_batch_size)
        runtime = causal_lm_class(options)
        if spec.runtime == RuntimeName.TINY_CAUSAL_LM:
            model, tokenizer = tiny_llama(max_context=spec.max_context)
            return runtime(model, tokenizer, device=device, max_context=spec.max_context,
                           options=options)
        return runtime.from_folder(resolve(spec.weights), device=device,
                                   max_context=spec.max_context, options=options)
    if spec.runtime == RuntimeName.CLASSIFIER:
        from inference.runtimes.classifier import ClassifierRuntime

        return ClassifierRuntime.from_folder(resolve(spec.weights), device=device,
                                             max_context=spec.max_context)
    from inference.runtimes.encoder import EncoderRuntime

    return EncoderRuntime.from_folder(resolve(spec.weights), device=device,
                                      max_context=spec.max_context)


# glibc's mallopt parameters: allocations at least this large are mmapped (default: a
# threshold that adapts up to 32 MiB), and free memory at the heap's top beyond this is
# given back to the system.
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
LARGE_ALLOCATIONS_BYTES = 1 << 30


def keep_large_allocations() -> None:
    """Let the process's allocator reuse the memory of large tensors (up to 1 GiB each)
    instead of mapping fresh pages for each one: a model on the CPU allocates and frees
    tensors of tens of MiB every forward pass (a prefill's attention scores, the KV cache
    copied at a prefix cache hit), and fresh pages cost a fault each: 92 MiB of cached
    prefix took 28 ms to gather with fresh pages, 6 ms with reused ones. Freed memory is
    then kept by the process (its RSS stays at its peak). A no-op where the C library is
    not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATIONS_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * LARGE_ALLOCATIONS_BYTES)


def causal_lm_class(options: DecodeOptions) -> type[CausalLMRuntime]:
    """The causal LM runtime that decodes as `options` say: over a shared, growing KV
    cache (causal_lm.py), or over preallocated slots (static_lm.py, "decode": "static")."""
    if options.static:
        from inference.runtimes.static_lm import StaticCausalLMRuntime

        return StaticCausalLMRuntime
    from inference.runtimes.causal_lm import CausalLMRuntime

    return CausalLMRuntime
