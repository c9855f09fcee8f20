"""gRPC unary Chat against REST non-streaming chat: the same pipeline, the same echo
deployment and worker, the same run. Both load generators are Python asyncio clients
(grpc.aio and httpx) with the same concurrency, so the ratio compares the two edges.

    .venv/bin/python tests/bench/bench_grpc.py [--concurrency 32] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

import grpc  # noqa: E402
import httpx  # noqa: E402

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import DEFAULT, http_command  # noqa: E402
from streaming.protos import inference_pb2 as pb  # noqa: E402
from streaming.protos import inference_pb2_grpc as pb_grpc  # noqa: E402
from tests.bench.bench_http import (  # noqa: E402
    FRONT,
    bench_env,
    report,
    seed_demo,
    start_sluice,
    wait_http,
)

BODY = {"model": "echo", "messages": [{"role": "user", "content": "hello"}]}


async def _load(one, concurrency: int, seconds: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal errors
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                await one()
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1

    began = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.monotonic() - began
    latencies.sort()
    return {"rps": len(latencies) / elapsed,
            "p50": statistics.median(latencies) * 1000 if latencies else float("nan"),
            "p99": latencies[int(len(latencies) * 0.99) - 1] * 1000 if latencies else
            float("nan"), "errors": errors}


async def rest(base: str, key: str, concurrency: int, seconds: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        async def one() -> None:
            response = await client.post("/v1/chat/completions", json=BODY)
            response.raise_for_status()
        await _load(one, concurrency, 1.0)  # warm-up
        return await _load(one, concurrency, seconds)


async def rpc(target: str, key: str, concurrency: int, seconds: float) -> dict[str, float]:
    request = pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user",
                                                                    content="hello")])
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one() -> None:
            await stub.Chat(request, metadata=metadata, timeout=30)
        await _load(one, concurrency, 1.0)
        return await _load(one, concurrency, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8)
    args = parser.parse_args()
    env, state, private = bench_env()
    group = ProcessGroup(env)
    try:
        key = seed_demo(env)
        http_port, grpc_port = free_port(), free_port()
        start_sluice(group, http_command(DEFAULT, "sluice.root.asgi:application", host="127.0.0.1",
                                         port=http_port))
        group.start("grpc", [sys.executable, str(REPO / "manage.py"), "rungrpc", "--address",
                             f"127.0.0.1:{grpc_port}"])
        wait_http(f"http://127.0.0.1:{http_port}/healthz")
        time.sleep(2)  # the gRPC process imports Django too
        base = f"http://127.0.0.1:{http_port}"
        r = asyncio.run(rest(base, key, args.concurrency, args.seconds))
        g = asyncio.run(rpc(f"127.0.0.1:{grpc_port}", key, args.concurrency, args.seconds))
        print(f"concurrency {args.concurrency}, {args.seconds:.0f} s each, echo model")
        print(f"{'edge':22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
        for label, row in (("REST (httpx)", r), ("gRPC unary (grpc.aio)", g)):
            print(f"{label:22} {row['rps']:8.0f} {row['p50']:8.2f} {row['p99']:8.2f} "
                  f"{row['errors']:7.0f}")
        print(f"ratio: gRPC / REST = {g['rps'] / r['rps']:.2f}x (goal >= 1.5x)")
        report("grpc", rest=r, grpc=g)
    finally:
        group.stop(first=FRONT)
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
