"""One decode step of the chat runtime against two baselines measured in the same process
on the same model: issue #31's table.

For each shape and batch size B, B copies of one prompt join, then one step is timed over
--steps steps after --warmup (ms per step; every step ends with the tokens on the host):
  runtime  CausalLMRuntime.step(), the default (dynamic) path;
  static   StaticCausalLMRuntime.step() (spec.extra decode: static): preallocated slots,
           a CUDA-graph replay per step on CUDA (graphs captured before timing), the
           same code eagerly on the CPU;
  eager    a bare transformers forward of one token per row over a DynamicCache,
           argmax, tokens to the host;
  graph    a CUDA-graph replay of a static-cache decode (transformers' StaticCache,
           a mask from static positions; argmax in the graph), tokens to the host. On
           the CPU the same decode runs eagerly ("graph" is then no graph).
It prints each runtime's ratio to each baseline (issue #31's goal: runtime / graph <=
1.25 at batch 1, 32 and 128). With --temperature T every row samples (seeded, T, top_p
1.0) and the baselines draw with one torch.multinomial for the batch.

Shapes (Llama architecture, random weights from a config: nothing is fetched; in the
dtype CausalLMRuntime.from_folder loads weights in, bfloat16 on CUDA): smollm2 (30 x 576,
SmolLM2-135M), 1b (16 x 2048, Llama 3.2 1B), 8b (32 x 4096, Llama 3.1 8B). On the CPU
only smollm2 runs by default, and --layers N cuts a shape's layers for a quick run.
--paths picks columns: A/B runs of the default path against an older checkout
(tests/bench/ab.sh) use --paths runtime,eager (the older runtime has no static path).

    .venv/bin/python tests/bench/bench_step.py [--device auto|cpu|cuda]
        [--shapes smollm2,1b,8b] [--layers N] [--batch-sizes 1,32,128] [--steps 50]
        [--warmup 20] [--temperature 0] [--paths runtime,static,eager,graph]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.runtimes.base import ChatRuntime, NewSequence, SamplingParams  # noqa: E402
from inference.runtimes.causal_lm import CausalLMRuntime, weights_dtype  # noqa: E402
from inference.weights import pick_device, smollm2_tokenizer_dir  # noqa: E402

PROMPT = "Write a short poem about the sea and the wind over the harbour."
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0),
}
PATHS = ("runtime", "static", "eager", "graph")


def build_model(shape: str, device: str, layers: int | None) -> tuple[Any, Any]:
    """A Llama of `shape` with random weights, built on the device in its dtype, and
    SmolLM2's tokenizer (its ids are valid in every shape's vocabulary)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    dims = dict(SHAPES[shape], max_position_embeddings=8192,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if layers:
        dims["num_hidden_layers"] = layers
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(weights_dtype(device))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**dims))
    finally:
        torch.set_default_dtype(default)
    return model.eval(), tokenizer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, step: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - started) / steps * 1e3


def runtime_step_ms(rt: ChatRuntime, prompt: list[int], batch: int, args: argparse.Namespace,
                    device: str) -> float:
    rids = [f"r{i}" for i in range(batch)]
    rt.add([NewSequence(rid, prompt, SamplingParams(
        max_tokens=args.warmup + args.steps + 1, ignore_eos=True,
        temperature=args.temperature, seed=i)) for i, rid in enumerate(rids)])
    ms = timed(device, rt.step, args.steps, args.warmup)  # step() returns Python ints
    rt.drop(rids)
    return ms


def pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)


@torch.inference_mode()
def eager_ms(model: Any, prompt: list[int], batch: int, args: argparse.Namespace,
             device: str) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([prompt] * batch, device=device), cache=cache, use_cache=True,
                logits_to_keep=1)
    token = pick(out.logits[:, -1], args.temperature)

    def step() -> None:
        nonlocal token
        out = model(token, cache=cache, use_cache=True)
        token = pick(out.logits[:, -1], args.temperature)
        token.tolist()

    return timed(device, step, args.steps, args.warmup)


@torch.inference_mode()
def graph_ms(model: Any, prompt: list[int], batch: int, args: argparse.Namespace,
             device: str) -> float:
    """A static-cache decode of `batch` rows at one length, the next token fed back on
    the device: captured once and replayed on CUDA, run eagerly on the CPU."""
    from transformers import StaticCache

    length = len(prompt) + args.warmup + args.steps + 8  # warm-up runs before a capture
    cache = StaticCache(config=model.config, max_cache_len=length)
    out = model(torch.tensor([prompt] * batch, device=device), cache=cache, use_cache=True,
                logits_to_keep=1)
    ids = pick(out.logits[:, -1], args.temperature)
    positions = torch.full((batch, 1), len(prompt), device=device)
    columns = torch.arange(length, device=device)

    def decode() -> None:
        mask = (columns[None, :] <= positions)[:, None, None, :]
        logits = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                       cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        ids.copy_(pick(logits, args.temperature))
        positions.add_(1)

    if device.startswith("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                decode()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode()

        def step() -> None:
            graph.replay()
            ids.tolist()
    else:
        def step() -> None:
            decode()
            ids.tolist()

    return timed(device, step, args.steps, args.warmup)


def static_runtime(model: Any, tokenizer: Any, device: str, batches: list[int],
                   needed: int) -> CausalLMRuntime | None:
    """The static path over the same model (None in a checkout without it)."""
    try:
        from inference.runtimes.kv import DecodeOptions
        from inference.runtimes.static_lm import StaticCausalLMRuntime
    except ImportError:
        return None
    rows = max(batches)
    slot = -(-needed // 64) * 64
    return StaticCausalLMRuntime(model, tokenizer, device=device, max_context=4096,
                                 options=DecodeOptions("static", max_batch_size=rows,
                                                       kv_cache_tokens=rows * slot))


def measure_shape(shape: str, device: str, args: argparse.Namespace) -> None:
    model, tokenizer = build_model(shape, device, args.layers)
    paths = args.paths.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dynamic = CausalLMRuntime(model, tokenizer, device=device, max_context=4096)
    prompt = dynamic.encode_chat([{"role": "user", "content": PROMPT}])
    needed = len(prompt) + args.warmup + args.steps + 2
    static = static_runtime(model, tokenizer, device, batches, needed) \
        if "static" in paths else None
    config = model.config
    print(f"\nshape {shape}: {config.num_hidden_layers} layers x {config.hidden_size}, "
          f"vocabulary {config.vocab_size}, {str(model.dtype).removeprefix('torch.')}, "
          f"prompt {len(prompt)} tokens", flush=True)
    columns = [p for p in PATHS if p in paths]
    ratios = [(ours, base) for ours in ("runtime", "static") for base in ("graph", "eager")
              if ours in columns and base in columns]
    print(f"{'batch':>5} " + " ".join(f"{p + ' ms':>10}" for p in columns)
          + "".join(f" {o + '/' + b:>14}" for o, b in ratios), flush=True)
    for batch in batches:
        ms: dict[str, float] = {}
        if "runtime" in columns:
            ms["runtime"] = runtime_step_ms(dynamic, prompt, batch, args, device)
        if "static" in columns:
            if static is None:
                ms["static"] = float("nan")
            else:
                if device.startswith("cuda"):  # as a server would, before serving
                    from inference.runtimes.graphs import batch_bucket

                    rows = batch_bucket(batch, static.buckets)  # type: ignore[attr-defined]
                    static.capture_graphs([rows], needed)  # type: ignore[attr-defined]
                ms["static"] = runtime_step_ms(static, prompt, batch, args, device)
        if "eager" in columns:
            ms["eager"] = eager_ms(model, prompt, batch, args, device)
        if "graph" in columns:
            ms["graph"] = graph_ms(model, prompt, batch, args, device)
        print(f"{batch:5d} " + " ".join(f"{ms[p]:10.2f}" for p in columns)
              + "".join(f" {ms[o] / ms[b]:13.2f}x" for o, b in ratios), flush=True)
    del dynamic, static, model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--shapes", default="", help="default: smollm2,1b,8b on CUDA, "
                                                      "smollm2 on the CPU")
    parser.add_argument("--layers", type=int, default=0, help="cut each shape to N layers")
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--paths", default=",".join(PATHS))
    args = parser.parse_args()
    device = pick_device(args.device)
    shapes = (args.shapes or ("smollm2,1b,8b" if device.startswith("cuda") else "smollm2"))
    unknown = set(shapes.split(",")) - set(SHAPES) or set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown shape or path: {', '.join(sorted(unknown))}")
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"device: {device} ({name}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads), {args.steps} steps after {args.warmup}, temperature {args.temperature}")
    for shape in shapes.split(","):
        measure_shape(shape, device, args)


if __name__ == "__main__":
    main()
