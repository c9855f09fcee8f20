"""Time to first token of a stream under a post-call guardrail, against the same stream
without one, in one run (issue #45's goal: later by at most the hold-back window).

One pipeline (bench_apis.py's: the gateway, one echo worker, the audit writer, a private
Redis; SQLite) where echo writes one byte per token every 2 ms, and two keys: the plain
demo key, and one whose replies go through a post-call PII policy that masks
(bench_seeds.py POST_SEED). Streamed chat calls of a 600-character prompt (echoed back;
nothing in it to mask) alternate between the keys, one at a time. For each call: the
time from sending the request to the first non-empty content chunk (TTFT), and for the
plain key the time from that chunk to the one that completes the first `window + 1`
characters: how long the model takes to write one hold-back window. By design the
guarded first token leaves once a window more has been written, so the delay is that
window time plus the guards' own work per token; the goal is met when the guarded
median TTFT minus the plain one is within 5% of the window time (median).

    .venv/bin/python tests/bench/bench_guard_ttft.py [--calls 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import bench_http as bench
import httpx
from bench_apis import start_side
from bench_seeds import POSTED

WINDOW = 128  # SLUICE_GUARD_HOLDBACK_CHARS's default
PROMPT = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 9)[:600]


def one(client: httpx.Client, url: str, key: str) -> tuple[float, float]:
    """(TTFT, seconds from the first content to the first WINDOW + 1 characters)."""
    body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    began = time.perf_counter()
    first = window_at = 0.0
    seen = 0
    with client.stream("POST", url, json=body,
                       headers={"Authorization": f"Bearer {key}"}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if not text:
                continue
            now = time.perf_counter()
            first = first or now
            seen += len(text)
            if seen > WINDOW and not window_at:
                window_at = now
    if not window_at or seen != len(PROMPT):
        raise RuntimeError(f"the stream sent {seen} characters of {len(PROMPT)}")
    return first - began, window_at - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(prefix="sluice-ttft-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        side = start_side("this checkout", bench.REPO, None, 1, folder, stack,
                          keyed=[POSTED])
        url = side.modes["chat"].url
        plain: list[tuple[float, float]] = []
        guarded: list[tuple[float, float]] = []
        with httpx.Client(timeout=60) as client:
            for _ in range(3):  # warm-up
                one(client, url, side.key)
                one(client, url, side.keys[POSTED])
            for _ in range(args.calls):
                plain.append(one(client, url, side.key))
                guarded.append(one(client, url, side.keys[POSTED]))
    p_ttft = statistics.median(t for t, _ in plain)
    g_ttft = statistics.median(t for t, _ in guarded)
    window_s = statistics.median(w for _, w in plain)
    added = g_ttft - p_ttft
    print(json.dumps({"calls": args.calls, "window_chars": WINDOW,
                      "ttft_ms_plain": round(p_ttft * 1000, 1),
                      "ttft_ms_guarded": round(g_ttft * 1000, 1),
                      "added_ms": round(added * 1000, 1),
                      "window_ms": round(window_s * 1000, 1)}))
    print(f"TTFT goal (a post-call guard delays the first token by at most the hold-back "
          f"window): {'met' if added <= 1.05 * window_s else 'not met'} (+{added * 1000:.0f} ms; "
          f"the window is {window_s * 1000:.0f} ms of generation, "
          f"{added / window_s:.2f}x of it)")
    bench.report("guard_ttft", ttft_ms_plain=p_ttft * 1000, ttft_ms_guarded=g_ttft * 1000,
                 window_ms=window_s * 1000)


if __name__ == "__main__":
    main()
