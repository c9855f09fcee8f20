"""The prefix cache's goals (issue #46), end to end, in one run on this machine's CPU:
the gateway, two SmolLM2-135M workers of the same weights (one deployment with the
prefix cache, one with `prefix_cache_tokens: 0`), the official openai client.

1. Time to first token of a streamed chat call whose prompt is a 2,000-token system
   prompt and a 50-token question: a miss (a system prompt nobody sent) against a hit
   (the same system prompt, a new question), interleaved; goal: hit <= 1/10 of miss.
2. A 10-turn conversation replayed by 8 concurrent clients (one shared 400-token
   system prompt, ~100-token user turns, 32-token greedy replies appended to the
   history; each turn resends the whole history), once per deployment: prefill tokens
   computed (prompt_tokens - cached_tokens, from each reply's usage) and turns per
   minute; goals: at least 5x fewer tokens and 2x the turns per minute with the cache.
3. Tenant isolation: the hit's system prompt sent by another tenant's key: cached_tokens 0
   and a time to first token like a miss's.

    .venv/bin/python tests/bench/bench_prefix_cache.py [--samples 5] [--clients 8] [--turns 10]

(`--turns 0`: the time to first token alone.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import bench_http as bench
import openai

MODEL = "smollm2-135m-instruct"
COLD = "smollm2-nocache"
WORDS = [
    "river", "stone", "garden", "window", "market", "lantern", "harbor", "quiet",
    "winter", "summer", "signal", "engine", "copper", "silver", "forest", "meadow",
    "bridge", "castle", "letter", "figure", "planet", "orange", "yellow", "violet",
    "button", "candle", "mirror", "pocket", "ladder", "shadow", "thunder"
]
OTHER_TENANT = ("from tenants.services import demo_seed; "
                "print(demo_seed(username='other-admin', tenant_slug='other').api_key)")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def seed(env: dict[str, str]) -> str:
    """The shipped SmolLM2 deployment with a 4,096-token context, and a copy of it
    without a prefix cache; another tenant's key (printed)."""
    code = ("import django; django.setup(); from inference.models import Deployment; "
            f"d = Deployment.objects.get(name={MODEL!r}); d.max_context = 4096; d.save(); "
            f"d.pk = None; d.name = {COLD!r}; "
            "d.engine = {**(d.engine or {}), 'prefix_cache_tokens': 0}; d.save(); "
            + OTHER_TENANT)
    out = subprocess.run([sys.executable, "-c", code], cwd=bench.REPO, env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


async def ttft(client: openai.AsyncOpenAI, model: str, system: str, question: str
               ) -> tuple[float, int, int]:
    """(seconds to the first token, prompt_tokens, cached_tokens) of one streamed call."""
    began = time.perf_counter()
    first = 0.0
    usage: Any = None
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=2, temperature=0,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None and not first:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    return (first or time.perf_counter()) - began, usage.prompt_tokens, \
        usage.prompt_tokens_details.cached_tokens


async def conversation(client: openai.AsyncOpenAI, model: str, system: str, seed_no: int,
                       turns: int) -> tuple[int, int]:
    """One client's conversation: (prompt tokens sent, prompt tokens computed)."""
    rng = random.Random(seed_no)
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    sent = computed = 0
    for _ in range(turns):
        history.append({"role": "user", "content": words(rng, 100)})
        reply = await client.chat.completions.create(model=model, messages=history,  # type: ignore[arg-type]
                                                     max_tokens=32, temperature=0)
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        sent += usage.prompt_tokens
        computed += usage.prompt_tokens - (usage.prompt_tokens_details.cached_tokens or 0)
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return sent, computed


async def replay(client: openai.AsyncOpenAI, model: str, clients: int, turns: int
                 ) -> dict[str, float]:
    system = words(random.Random(f"system-{model}"), 400)
    began = time.perf_counter()
    results = await asyncio.gather(*(conversation(client, model, system, i, turns)
                                     for i in range(clients)))
    seconds = time.perf_counter() - began
    return {"sent": sum(r[0] for r in results), "computed": sum(r[1] for r in results),
            "seconds": seconds, "turns_per_min": clients * turns * 60 / seconds}


async def run(url: str, key: str, other_key: str, samples: int, clients: int,
              turns: int) -> None:
    """Both parts; `turns` 0 runs the time to first token's alone."""
    client = openai.AsyncOpenAI(base_url=url, api_key=key, timeout=600, max_retries=0)
    other = openai.AsyncOpenAI(base_url=url, api_key=other_key, timeout=600, max_retries=0)
    rng = random.Random(46)
    await ttft(client, MODEL, words(rng, 50), words(rng, 40))  # warm-up
    misses, hits, foreign = [], [], []
    for _ in range(samples):
        system = words(rng, 2000)
        miss = await ttft(client, MODEL, system, words(rng, 45))
        hit = await ttft(client, MODEL, system, words(rng, 45))
        cross = await ttft(other, MODEL, system, words(rng, 45))
        assert miss[2] == 0 and hit[2] > 0 and cross[2] == 0, (miss, hit, cross)
        misses.append(miss)
        hits.append(hit)
        foreign.append(cross)
    miss_s = statistics.median(m[0] for m in misses)
    hit_s = statistics.median(h[0] for h in hits)
    foreign_s = statistics.median(f[0] for f in foreign)
    print(f"prompt {misses[0][1]} tokens; hit reused {hits[0][2]}")
    print(f"TTFT miss {miss_s * 1000:.0f} ms, hit {hit_s * 1000:.0f} ms: "
          f"hit/miss {hit_s / miss_s:.4f} (goal <= 0.1)")
    print(f"TTFT another tenant's same prefix {foreign_s * 1000:.0f} ms: "
          f"/miss {foreign_s / miss_s:.2f} (cached_tokens 0)")
    if not turns:
        return
    cold = await replay(client, COLD, clients, turns)
    warm = await replay(client, MODEL, clients, turns)
    for name, r in (("no cache", cold), ("prefix cache", warm)):
        print(f"{clients} x {turns} turns, {name}: prompt tokens {r['sent']:.0f}, computed "
              f"{r['computed']:.0f}, {r['seconds']:.1f} s, {r['turns_per_min']:.1f} turns/min")
    print(f"prefill tokens computed: {cold['computed'] / warm['computed']:.1f}x fewer "
          f"(goal >= 5); turns per minute {warm['turns_per_min'] / cold['turns_per_min']:.2f}x "
          f"(goal >= 2)")
    bench.report("prefix_cache", ttft_miss_ms=round(miss_s * 1000), ttft_hit_ms=round(
        hit_s * 1000), ttft_other_tenant_ms=round(foreign_s * 1000),
        prefill_fewer_x=round(cold["computed"] / warm["computed"], 1),
        turns_per_min_x=round(warm["turns_per_min"] / cold["turns_per_min"], 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    with bench.platform() as (env, _state, group, _private):
        key = bench.seed_demo(env)
        other_key = seed(env)
        port = bench.free_port()
        manage = [sys.executable, str(bench.REPO / "manage.py")]
        group.start("sluice", bench.http_command("uvicorn", "sluice.root.asgi:application",
                                                 host="127.0.0.1", port=port, workers=1))
        for name in (MODEL, COLD):
            group.start(name, [*manage, "runworker", "--deployment", name])
        bench.wait_http(f"http://127.0.0.1:{port}/healthz")
        asyncio.run(run(f"http://127.0.0.1:{port}/v1", key, other_key, args.samples,
                        args.clients, args.turns))


if __name__ == "__main__":
    main()
