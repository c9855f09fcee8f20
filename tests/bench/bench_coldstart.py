"""Cold starts and scale-up reaction under the autoscaler (local driver, forked workers).

For each seeded model (and the tiny test LM), scaled to zero: the time from sending a
request to its first token (chat, streamed) or its result (embeddings), against the
same request once the worker is warm; and the autoscaler's own figure (fork to first
heartbeat). Then a burst on a slow echo deployment: how long until the autoscaler
decides to scale out, and until the new workers are live.

    .venv/bin/python tests/bench/bench_coldstart.py
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

import redis  # noqa: E402
from bench_http import bench_env, seed_demo, wait_http  # noqa: E402
from openai import OpenAI  # noqa: E402

from inference import autoscaler  # noqa: E402
from inference.worker import heartbeats  # noqa: E402
from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import DEFAULT, http_command  # noqa: E402

MODELS = [("echo", "chat"), ("tiny-lm", "chat"), ("all-minilm-l6-v2", "embedding"),
          ("smollm2-135m-instruct", "chat")]
SETUP = """
import django; django.setup()
from inference.models import Deployment
Deployment.objects.get_or_create(name="tiny-lm", defaults={"runtime": "tiny_causal_lm",
                                                            "max_context": 512})
Deployment.objects.get_or_create(name="burst", defaults={
    "runtime": "echo", "echo_token_delay_ms": 20, "max_batch_size": 8, "target_inflight": 4,
    "max_replicas": 4, "scale_up_delay_s": 0.5})
Deployment.objects.update(min_replicas=0, scale_to_zero_delay_s=3600,
                          scale_down_delay_s=3600)
Deployment.objects.filter(name="burst").update(max_replicas=4)
"""


def first_token_s(client: OpenAI, model: str, kind: str) -> float:
    began = time.perf_counter()
    if kind == "embedding":
        client.embeddings.create(model=model, input=["a cold start"])
        return time.perf_counter() - began
    stream = client.chat.completions.create(
        model=model, max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "Say hello."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            took = time.perf_counter() - began
            for _ in stream:  # let it finish
                pass
            return took
    raise RuntimeError(f"{model} streamed no token")


def main() -> None:
    env, state, private = bench_env()
    env["SLUICE_LOG_LEVEL"] = "WARNING"
    group = ProcessGroup(env)
    rds = redis.Redis.from_url(env["REDIS_URL"])
    rds.delete(autoscaler.EVENTS_KEY)
    try:
        key = seed_demo(env)
        subprocess.run([sys.executable, "-c", SETUP], cwd=REPO, env=env, check=True)
        port = free_port()
        logs = Path(state) / "sluice.log"
        group.start("http", http_command(DEFAULT, "sluice.root.asgi:application",
                                         host="127.0.0.1", port=port), output=logs)
        group.start("autoscaler", [sys.executable, str(REPO / "manage.py"), "autoscale"],
                    output=logs)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        time.sleep(3)  # the autoscaler's imports (torch, transformers) happen once, here
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=300,
                        max_retries=0)
        rows = []
        for model, kind in MODELS:
            assert not heartbeats(rds, model), f"{model} is not at zero"
            cold = first_token_s(client, model, kind)
            warm = min(first_token_s(client, model, kind) for _ in range(3))
            ready = [e for e in autoscaler.events(rds, deployment=model)
                     if e["kind"] == "ready"]
            rows.append((model, cold, warm, float(ready[-1]["cold_start_s"]) if ready
                         else float("nan")))

        # Scale-up reaction: one warm worker, then 16 streams of ~1 s each against 4 in
        # flight per worker.
        first_token_s(client, "burst", "chat")
        stop = threading.Event()

        def caller() -> None:
            while not stop.is_set():
                for _ in client.chat.completions.create(
                        model="burst", max_tokens=50, stream=True,
                        messages=[{"role": "user", "content": "word " * 60}]):
                    pass

        threads = [threading.Thread(target=caller, daemon=True) for _ in range(16)]
        t0, began = time.time(), time.monotonic()
        for t in threads:
            t.start()
        decided = live_all = None
        while time.monotonic() - began < 30 and live_all is None:
            if decided is None:
                out = [float(e["ts"]) - t0 for e in autoscaler.events(rds, deployment="burst")
                       if e["kind"] == "scale" and float(e["ts"]) >= t0]
                decided = min(out) if out else None
            if len(heartbeats(rds, "burst")) >= 4:
                live_all = time.monotonic() - began
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
        steps = [(e["from"], e["to"], e["reason"]) for e in
                 reversed(autoscaler.events(rds, deployment="burst")) if e["kind"] == "scale"]
    finally:
        group.stop(timeout_s=30)
        if private:
            private.stop()

    print(f"{'model':26} {'cold TTFT s':>11} {'warm TTFT s':>11} {'worker start s':>14}")
    for model, cold, warm, start in rows:
        print(f"{model:26} {cold:11.2f} {warm:11.3f} {start:14.2f}")
    print("(cold TTFT: request sent with no worker -> first token; worker start: fork -> "
          "first heartbeat, model loaded)")
    print(f"burst of 16 streams on 'burst' (4 in flight per worker, up delay 0.5 s): "
          f"first scale-out decided after {decided or float('nan'):.2f} s, all 4 workers "
          f"live after {live_all or float('nan'):.2f} s")
    for step in steps:
        print(f"  {step[0]} -> {step[1]}: {step[2]}")


if __name__ == "__main__":
    main()
