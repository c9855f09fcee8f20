"""Worker throughput through the Redis queue against direct batched model calls.

For each model and batch size B, the same work (R rounds of B sequences, each N new
tokens, EOS ignored) runs twice in one process tree:
  direct  - the runtime's add()/step() in this process, a full batch at a time;
  queue   - R*B requests submitted at once through the gateway client to a worker
            process with max_batch_size=B (real Redis, continuous batching, events
            streamed back per token).
It prints tokens/s for both and the ratio (goal: queue >= 90% of direct). Both paths use
--threads torch threads (default 1), so that on a small machine the gateway client and
Redis have a core of their own, as they would beside a real GPU worker.

    .venv/bin/python tests/bench/bench_queue.py [--models tiny,smollm2,echo]
        [--batch-sizes 1,8,32] [--tokens 32] [--rounds 3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import redis
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.client import InferenceClient  # noqa: E402
from inference.jobs import ChatJob  # noqa: E402
from inference.runtimes import load_runtime  # noqa: E402
from inference.runtimes.base import ChatRuntime, NewSequence, SamplingParams  # noqa: E402
from inference.spec import DeploymentSpec, RuntimeName  # noqa: E402
from inference.weights import SMOLLM2, pick_device  # noqa: E402
from inference.worker import heartbeats  # noqa: E402
from sluice.localinfra import ensure_redis  # noqa: E402

MODELS = {
    "tiny": dict(runtime=RuntimeName.TINY_CAUSAL_LM),
    "smollm2": dict(runtime=RuntimeName.CAUSAL_LM, weights=SMOLLM2),
    "echo": dict(runtime=RuntimeName.ECHO),
}
PROMPT = "Write a short poem about the sea and the wind over the harbour."


def direct(rt: ChatRuntime, batch: int, tokens: int, rounds: int) -> float:
    prompt = rt.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    # Warm-up: one whole request, as the queue side's (on a GPU, kernels and their plans
    # are chosen per shape on first use).
    rt.add([NewSequence("warm", prompt, params)])
    for _ in range(tokens - 1):
        rt.step()
    rt.drop(["warm"])
    started = time.perf_counter()
    for r in range(rounds):
        rids = [f"{r}-{i}" for i in range(batch)]
        rt.add([NewSequence(rid, prompt, params) for rid in rids])
        for _ in range(tokens - 1):
            rt.step()
        rt.drop(rids)
    return batch * rounds * tokens / (time.perf_counter() - started)


async def through_queue(spec: DeploymentSpec, url: str, batch: int, tokens: int,
                        rounds: int) -> float:
    client = InferenceClient(url)
    await client.start()
    body = ChatJob(messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens,
                   ignore_eos=True, temperature=0.0)
    # warm-up
    warm = await client.submit(spec, tenant="bench", job=body)
    async for _ in warm.events():
        pass

    async def one(handle):  # type: ignore[no-untyped-def]
        count = 0
        async for event in handle.events():
            if event["t"] == "done":
                count = event["usage"]["completion_tokens"]
        return count

    started = time.perf_counter()
    handles = await asyncio.gather(*[
        client.submit(spec, tenant=f"bench{i % 4}", job=body, timeout_s=600)
        for i in range(batch * rounds)])
    produced = sum(await asyncio.gather(*[one(h) for h in handles]))
    elapsed = time.perf_counter() - started
    await client.close()
    assert produced == batch * rounds * tokens, (produced, batch * rounds * tokens)
    return produced / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2,echo")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the model, direct and worker alike (the "
                             "other core runs the gateway client)")
    parser.add_argument("--device", default="auto",
                        help="the deployments' device: auto (CUDA when present), cpu, cuda")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                              "redis://127.0.0.1:6379/13"))
    args = parser.parse_args()
    os.environ["SLUICE_TORCH_THREADS"] = str(args.threads)
    url, started = ensure_redis(args.redis_url)
    rds = redis.Redis.from_url(url)
    device = pick_device(args.device)
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)}, torch "
                                 f"{torch.__version__})" if device != "cpu" else ""))
    print(f"{'model':10} {'batch':>5} {'direct tok/s':>13} {'queue tok/s':>12} {'ratio':>7}")
    try:
        for model in args.models.split(","):
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                spec = DeploymentSpec(f"bench-{model}-{batch}", max_batch_size=batch,
                                      max_wait_ms=50, max_queue_depth=100_000,
                                      tenant_queue_share=1.0, device=device,
                                      **MODELS[model])
                rt = load_runtime(spec)
                assert isinstance(rt, ChatRuntime)
                direct_tps = direct(rt, batch, args.tokens, args.rounds)
                del rt
                worker = subprocess.Popen(
                    [sys.executable, "-m", "inference.worker", "--spec", spec.to_json(),
                     "--redis-url", url], cwd=REPO, env={**os.environ,
                                                        "SLUICE_LOG_LEVEL": "WARNING"})
                try:
                    while not heartbeats(rds, spec.name):
                        time.sleep(0.1)
                    queue_tps = asyncio.run(through_queue(spec, url, batch, args.tokens,
                                                          args.rounds))
                finally:
                    worker.terminate()
                    worker.wait()
                print(f"{model:10} {batch:5d} {direct_tps:13.0f} {queue_tps:12.0f} "
                      f"{queue_tps / direct_tps:7.1%}", flush=True)
    finally:
        if started:
            started.stop()


if __name__ == "__main__":
    main()
