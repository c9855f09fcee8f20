"""Noisy neighbours (issue #41): tenant B's calls while tenant A abuses the platform.

A real Sluice on a private Redis, as `sluice run` starts it: the gateway's HTTP processes
(uvicorn), the gRPC server, model workers (an echo deployment, a slow echo one with a
per-token delay, and the toy-weights chat model `tiny_causal_lm`), the audit and stored
responses writers, a Celery worker on the batches queue; SQLite in a temporary state dir
(the run command's default) unless --database-url names an empty PostgreSQL database.
Two tenants, A and B, each with a developer key; A also has a key limited to 2 requests
a minute.

First B's baseline on each deployment an abuse targets, with no abuse: 4 clients (a
process of their own, so the abuse's client work takes no time from them) calling
streamed chat completions with a short prompt, each pausing PAUSE_S between calls, for
BASELINE_S; and B's small batch alone. Then each abuse from A (bounded in count and
time, loopback only) while B calls the deployment it targets, and TAIL_S after it:
  grammar   schema bombs (an allOf of N search patterns on one string, N = 18, 24, 30)
            on every API and transport, and 60 tools x 2,000 optional properties
  deadlines gRPC Chat calls with a 0.3 s deadline on the slow deployment
  streams   long streams held open at once on the slow deployment
  batches   a batch on A's 2-a-minute key and a large batch of tiny echo lines, beside
            B's small batch (its completion time against its baseline's)
  bodies    a 2 GB declared body and a 300 MB chunked one, no credentials, raw sockets
  prompts   ~4 MB prompts to chat completions and count_tokens, a few at once
Meanwhile every gateway, gRPC, worker, writer and Celery process's VmRSS is sampled
(/proc/<pid>/status, every SAMPLE_S, their children included); a process that was
there when an abuse started and is gone at its end died (the grammar checker's children
excepted: replacing one over its budget is their contract).

Printed: what A got back for each abuse, then per abuse B's calls ok/total, p50 and p99
time to first token, the p99's ratio to B's baseline p99 on that deployment, the largest
RSS growth of one process, the deaths, and PASS when B's calls all succeeded, its p99
stayed within 2x of the baseline, no process grew by more than 256 MB and none died.

    .venv/bin/python tests/bench/bench_neighbours.py [--quick] [--only grammar,bodies]
        [--database-url postgresql://.../empty_db]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_http as bench

from sluice.localinfra import free_port, start_redis
from sluice.processes import ProcessGroup
from sluice.servers import default_workers, http_command
from tests.procstat import process_tree, rss_mb

CLIENTS, PAUSE_S, SAMPLE_S = 4, 0.2, 0.1
RSS_LIMIT_MB, P99_LIMIT = 256.0, 2.0
RAISED = "the abuse itself raised"
HELLO: Any = [{"role": "user", "content": "hello"}]  # the SDKs' TypedDicts
SEED = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from governance.models import RateLimitPolicy
from inference.models import Deployment
from tenants.models import Member
from tenants.principal import AuthMethod, Principal
from tenants.roles import Role
from tenants.services import apikey_create, demo_seed
Deployment.objects.create(name="echo", runtime="echo", max_batch_size=64,
                          max_queue_depth=100000)
Deployment.objects.create(name="slow", runtime="echo", max_batch_size=64,
                          echo_token_delay_ms=10, max_context=4096)
Deployment.objects.create(name="tiny", runtime="tiny_causal_lm", max_batch_size=8,
                          max_context=1024)
a, b = demo_seed(tenant_slug="tenant-a", username="a"), demo_seed(tenant_slug="tenant-b",
                                                                  username="b")
m = Member.objects.get(tenant__slug="tenant-a", user__username="a")
p = Principal(tenant_id=m.tenant_id, tenant_slug="tenant-a", role=Role.PLATFORM_ADMIN,
              subject=m.subject, method=AuthMethod.SESSION, member_id=m.pk)
slow = apikey_create(actor=p, name="slow key", role=Role.DEVELOPER)
RateLimitPolicy.objects.create(scope="api_key", tenant_id=m.tenant_id, api_key=slow.key,
                               requests_per_minute=2, burst_requests=1)
print(json.dumps({"a": a.api_key, "b": b.api_key, "a_limited": slow.secret}))
"""


@dataclass
class Platform:
    base: str  # http://127.0.0.1:port
    grpc: str  # 127.0.0.1:port
    keys: dict[str, str]
    group: ProcessGroup
    quick: bool

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def roots(self) -> dict[str, int]:
        return {name: child.proc.pid for name, child in self.group.children.items()}


def start(database_url: str | None, stack: contextlib.ExitStack, quick: bool) -> Platform:
    state = tempfile.mkdtemp(prefix="sluice-neighbours-")
    stack.callback(shutil.rmtree, state, ignore_errors=True)
    redis = start_redis()
    stack.callback(redis.stop)
    env = {**os.environ, "SLUICE_STATE_DIR": state, "REDIS_URL": redis.url,
           "DJANGO_SETTINGS_MODULE": "sluice.settings.base", "SLUICE_LOG_LEVEL": "ERROR",
           "PYTHONPATH": f"{bench.REPO}:{bench.REPO / 'platform'}"}
    env.pop("DATABASE_URL", None)
    if database_url:
        env["DATABASE_URL"] = database_url
    keys = json.loads(subprocess.run([sys.executable, "-c", SEED], cwd=bench.REPO, env=env,
                                     check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    group = ProcessGroup(env)
    stack.callback(group.stop, first=bench.FRONT)
    port, grpc_port = free_port(), free_port()
    manage = [sys.executable, str(bench.REPO / "manage.py")]
    log = Path(state) / "processes.log"
    with contextlib.chdir(bench.REPO):
        group.start("sluice", http_command("uvicorn", "sluice.root.asgi:application",
                                           host="127.0.0.1", port=port,
                                           workers=default_workers("uvicorn")), output=log)
        group.start("grpc", [*manage, "rungrpc", "--address", f"127.0.0.1:{grpc_port}"],
                    output=log)
        for deployment in ("echo", "slow", "tiny"):
            group.start(f"worker-{deployment}", [*manage, "runworker", "--deployment",
                                                 deployment], output=log)
        for writer in ("auditwriter", "responseswriter"):
            group.start(writer, [*manage, writer], output=log)
        group.start("celery-batches", [sys.executable, "-m", "celery", "-A", "sluice.celery",
                                       "worker", "--pool", "prefork", "--loglevel", "WARNING",
                                       "--queues", "batches", "--concurrency", "2",
                                       "--hostname", "batches@%h"], output=log)
    bench.wait_http(f"http://127.0.0.1:{port}/healthz")
    return Platform(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", keys, group, quick)


# -- tenant B: its clients in a process of their own --------------------------------------

def neighbour(v1: str, key: str, model: str, stop: Any, out: Any) -> None:
    """CLIENTS loops of streamed chat completions until `stop` is set; puts a list of
    (ok, seconds to the first content token or None, error) on `out`."""
    import openai

    async def main() -> list[tuple[bool, float | None, str]]:
        client = openai.AsyncOpenAI(base_url=v1, api_key=key, max_retries=0, timeout=60)
        results: list[tuple[bool, float | None, str]] = []

        async def one() -> None:
            began, first, finish = time.perf_counter(), None, None
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=HELLO, stream=True, max_tokens=8)
                async for chunk in stream:
                    for choice in chunk.choices:
                        if first is None and choice.delta.content:
                            first = time.perf_counter() - began
                        finish = choice.finish_reason or finish
                results.append((finish is not None and first is not None, first,
                                "" if finish else "no finish_reason"))
            except Exception as exc:
                results.append((False, None, f"{type(exc).__name__}: {str(exc)[:120]}"))

        async def loop() -> None:
            while not stop.is_set():
                await one()
                await asyncio.sleep(PAUSE_S)

        await asyncio.gather(*(loop() for _ in range(CLIENTS)))
        return results

    out.put(asyncio.run(main()))


@dataclass
class Calls:
    results: list[tuple[bool, float | None, str]] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(r[0] for r in self.results)

    def pct(self, p: float) -> float:
        ttft = sorted(r[1] for r in self.results if r[1] is not None)
        if not ttft:
            return float("nan")
        return ttft[min(len(ttft) - 1, int(p / 100 * len(ttft)))] * 1000

    def errors(self) -> Counter[str]:
        return Counter(r[2] for r in self.results if not r[0])


def with_neighbour(platform: Platform, model: str, work: Callable[[], Any],
                   min_s: float, tail_s: float) -> tuple[Calls, Any]:
    """B's clients on `model` while `work` runs, at least `min_s` in all and `tail_s`
    after it: (B's calls, what `work` returned)."""
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=neighbour, args=(platform.v1, platform.keys["b"], model, stop,
                                               out), daemon=True)
    proc.start()
    began = time.monotonic()
    try:
        time.sleep(1.5)  # the clients' interpreter started and calling
        try:
            result = work()
        except Exception as exc:  # the abuse broke: reported, the other abuses go on
            result = Counter({f"{RAISED} {type(exc).__name__}: {str(exc)[:300]}": 1})
        time.sleep(max(tail_s, min_s - (time.monotonic() - began)))
    finally:
        stop.set()
    calls = Calls(out.get(timeout=120))
    proc.join(30)
    return calls, result


# -- memory and deaths ---------------------------------------------------------------------

class Watch:
    """Samples every process under the platform's roots: the largest VmRSS growth of one
    process over its first sample, and the processes that were there at the start and
    are gone at the end."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.first: dict[int, tuple[str, float]] = {}
        self.peak: dict[int, float] = {}
        self.stopping = threading.Event()
        self.at_start = self.pids()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def pids(self) -> dict[int, str]:
        found = {}
        for name, root in self.platform.roots().items():
            for pid in process_tree(root):
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    checker = b"inference.structured.grammar_check" in cmd
                    found[pid] = f"{name}/grammar_check" if checker else name
        return found

    def run(self) -> None:
        while not self.stopping.is_set():
            for pid, name in self.pids().items():
                with contextlib.suppress(OSError, AssertionError):
                    rss = rss_mb(pid)
                    self.first.setdefault(pid, (name, rss))
                    self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
            self.stopping.wait(SAMPLE_S)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(5)

    def growth(self) -> tuple[float, str]:
        grown = [(self.peak[pid] - rss, f"{name}[{pid}]")
                 for pid, (name, rss) in self.first.items()]
        return max(grown, default=(0.0, "-"))

    def deaths(self) -> list[str]:
        now = self.pids()
        return [f"{name}[{pid}]" for pid, name in self.at_start.items()
                if pid not in now and not name.endswith("grammar_check")]


# -- the abuses (tenant A) ------------------------------------------------------------------

def outcome(call: Callable[[], Any]) -> str:
    """What one abusive call got back, in a word: the error's class and code."""
    try:
        result = call()
    except Exception as exc:
        code = getattr(exc, "code", None)
        code = code() if callable(code) else code
        if code is None:  # Anthropic's errors: the type and the message's start
            error = getattr(exc, "body", None) or {}
            error = error.get("error", {}) if isinstance(error, dict) else {}
            code = f"{error.get('type')} '{str(error.get('message'))[:40]}'"
        return f"{type(exc).__name__}:{code}"
    return result if isinstance(result, str) else "ok"


def bomb(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"type": "string", "allOf": [
        {"pattern": f".*{chr(97 + i % 26)}{i}.*"} for i in range(n)]}}, "required": ["x"]}


def grammar(platform: Platform) -> Counter[str]:
    import anthropic
    import grpc
    import openai
    import websockets
    from google.protobuf.struct_pb2 import Struct

    from streaming.protos import inference_pb2 as pb
    from streaming.protos import inference_pb2_grpc as pb_grpc

    key, model = platform.keys["a"], "tiny"
    oa = openai.OpenAI(base_url=platform.v1, api_key=key, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=platform.base, api_key=key, max_retries=0, timeout=120)

    def over_grpc(schema: dict[str, Any]) -> Any:
        struct = Struct()
        struct.update(schema)

        async def go() -> Any:
            async with grpc.aio.insecure_channel(platform.grpc) as channel:
                return await pb_grpc.InferenceStub(channel).Chat(pb.ChatRequest(
                    model=model, messages=[pb.ChatMessage(role="user", content="hi")],
                    response_format=pb.ResponseFormat(type="json_schema", json_schema=(
                        pb.JsonSchema(name="x", schema=struct)))),
                    metadata=(("authorization", f"Bearer {key}"),), timeout=120)
        return asyncio.run(go())

    def over_socket(schema: dict[str, Any]) -> str:
        async def go() -> str:
            url = platform.v1.replace("http://", "ws://") + "/chat/socket"
            async with websockets.connect(url, additional_headers={
                    "Authorization": f"Bearer {key}"}) as ws:
                await ws.send(json.dumps({"type": "chat.request", "id": "r", "request": {
                    "model": model, "messages": HELLO, "response_format": {
                        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}))
                frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
                return f"ws:{frame.get('error', {}).get('code') or frame['type']}"
        return asyncio.run(go())

    def over_batch(schema: dict[str, Any]) -> str:
        line = {"custom_id": "0", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": model, "messages": HELLO, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}
        batch = run_batch(oa, [line], timeout_s=60)
        return f"batch:{batch.status}:{batch.request_counts}"

    def streamed(tools: Any) -> list[Any]:
        return list(oa.chat.completions.create(model=model, messages=HELLO, tools=tools,
                                               stream=True))

    calls: list[Callable[[], Any]] = []
    for n in (18, 24, 30):
        schema = bomb(n)
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        calls += [
            functools.partial(oa.chat.completions.create, model=model, messages=HELLO,
                              response_format=fmt),
            functools.partial(streamed, tools=[tool]),
            functools.partial(oa.responses.create, model=model, input="hi", text={
                "format": {"type": "json_schema", "name": "x", "schema": schema}}),
            functools.partial(an.messages.create, model=model, max_tokens=10,
                              messages=HELLO, tools=[{"name": "f", "input_schema": schema}]),
            functools.partial(an.messages.count_tokens, model=model, messages=HELLO,
                              tools=[{"name": "f", "input_schema": schema}]),
            functools.partial(over_grpc, schema),
            functools.partial(over_socket, schema),
            functools.partial(over_batch, schema),
        ]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                              for i in range(2000)}}
    tools: Any = [{"type": "function", "function": {"name": f"t{i}", "parameters": wide}}
             for i in range(60)]
    calls.append(lambda: oa.chat.completions.create(model=model, messages=HELLO, tools=tools))
    with ThreadPoolExecutor(4) as pool:
        return Counter(pool.map(outcome, calls))


def run_batch(client: Any, lines: list[dict[str, Any]], timeout_s: float,
              cancel: bool = True) -> Any:
    """Upload `lines`, create their batch and wait for it to end (cancelled past
    `timeout_s` when `cancel`): the batch as last read."""
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("lines.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            if cancel:
                client.batches.cancel(batch.id)
            return client.batches.retrieve(batch.id)
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    return batch


def echo_lines(n: int, tag: str) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "echo", "messages": [{"role": "user", "content": f"l{i}"}]}}
            for i in range(n)]


def deadlines(platform: Platform) -> Counter[str]:
    import grpc

    from streaming.protos import inference_pb2 as pb
    from streaming.protos import inference_pb2_grpc as pb_grpc

    count = 40 if platform.quick else 100

    async def go() -> list[str]:
        async with grpc.aio.insecure_channel(platform.grpc) as channel:
            stub = pb_grpc.InferenceStub(channel)

            async def one() -> str:
                try:
                    await stub.Chat(pb.ChatRequest(
                        model="slow", max_tokens=2000,
                        messages=[pb.ChatMessage(role="user", content="x" * 2000)]),
                        metadata=(("authorization", f"Bearer {platform.keys['a']}"),),
                        timeout=0.3)
                except grpc.aio.AioRpcError as exc:
                    return str(exc.code().name)
                return "ok"
            out = []
            for wave in range(0, count, 20):
                out += await asyncio.gather(*(one() for _ in range(min(20, count - wave))))
            return out
    return Counter(asyncio.run(go()))


def streams(platform: Platform) -> Counter[str]:
    import openai

    count, tokens = (20, 600) if platform.quick else (40, 1500)

    async def go() -> list[str]:
        client = openai.AsyncOpenAI(base_url=platform.v1, api_key=platform.keys["a"],
                                    max_retries=0, timeout=300)

        async def one() -> str:
            got = 0
            try:
                async for chunk in await client.chat.completions.create(
                        model="slow", stream=True, max_tokens=tokens,
                        messages=[{"role": "user", "content": "y" * tokens}]):
                    got += sum(len(c.delta.content or "") for c in chunk.choices)
            except Exception as exc:
                return type(exc).__name__
            return f"streamed {got} chars" if got >= tokens else f"short ({got})"
        return await asyncio.gather(*(one() for _ in range(count)))
    return Counter(asyncio.run(go()))


def batches(platform: Platform, b_batch: list[float]) -> Counter[str]:
    """A's two batches started and running (the large one's first lines done), then B's
    small batch timed into `b_batch`, B's calls going on for a while more beside A's
    batches; A's cancelled at the end."""
    import openai

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=platform.v1, api_key=key, max_retries=0, timeout=120)

    big = 5_000 if platform.quick else 50_000
    a, limited, b = client(platform.keys["a"]), client(platform.keys["a_limited"]), \
        client(platform.keys["b"])
    got: Counter[str] = Counter()
    started = []
    for who, lines in ((limited, echo_lines(40, "r")), (a, echo_lines(big, "big"))):
        try:
            upload = who.files.create(file=("a.jsonl", "".join(
                json.dumps(line) + "\n" for line in lines).encode()), purpose="batch")
            started.append((who, who.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions",
                completion_window="24h")))
        except Exception as exc:
            got[f"A batch refused: {type(exc).__name__}"] += 1
    began = time.monotonic()
    while started and time.monotonic() - began < 30:  # A's large batch under way
        counts = started[-1][0].batches.retrieve(started[-1][1].id).request_counts
        if counts is not None and counts.completed > 0:
            break
        time.sleep(0.5)
    began = time.monotonic()
    mine = run_batch(b, echo_lines(10, "b"), timeout_s=120 if not platform.quick else 60)
    b_batch.append(time.monotonic() - began if mine.status == "completed" else float("inf"))
    got[f"B batch {mine.status} {mine.request_counts}"] += 1
    time.sleep(max(0.0, (15 if platform.quick else 45) - (time.monotonic() - began)))
    for who, batch in started:
        now = who.batches.retrieve(batch.id)
        got[f"A batch {now.status} {now.request_counts}"] += 1
        with contextlib.suppress(Exception):
            who.batches.cancel(batch.id)
    return got


def raw_body(host: str, port: int, path: str, chunked: bool, total: int) -> str:
    """POST `total` bytes to `path` (declared, or chunked), stopping once the server
    answers or closes: its status line and how many MB were sent."""
    sock = socket.create_connection((host, port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n")
            + "\r\n")
    piece = b"a" * 65536
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    sent = 0
    try:
        sock.sendall(head.encode())
        sock.setblocking(False)
        reply = b""
        while sent < total:
            try:  # an answer (or the server's close) ends the sending
                reply = sock.recv(4096)
                break
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sent += sock.send(frame)
            except BlockingIOError:
                time.sleep(0.005)
            except OSError:
                break
        sock.settimeout(30)
        with contextlib.suppress(OSError):
            reply = reply or sock.recv(4096)
    finally:
        sock.close()
    status = reply.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    return f"{path} {'chunked' if chunked else 'declared'}: {status} after {sent >> 20} MB"


def bodies(platform: Platform) -> Counter[str]:
    port = int(platform.base.rsplit(":", 1)[1])
    jobs = [(path, chunked, 300 << 20 if chunked else 2 << 30)
            for path in ("/api/v1/tenants", "/v1/files", "/v1/chat/completions")
            for chunked in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return Counter(pool.map(lambda j: raw_body("127.0.0.1", port, *j), jobs))


def prompts(platform: Platform) -> Counter[str]:
    import anthropic
    import openai

    huge: Any = [{"role": "user", "content": "word " * 780_000}]  # 3.9 MB, under the 4 MiB body
    oa = openai.OpenAI(base_url=platform.v1, api_key=platform.keys["a"], max_retries=0,
                       timeout=120)
    an = anthropic.Anthropic(base_url=platform.base, api_key=platform.keys["a"],
                             max_retries=0, timeout=120)
    calls: list[Callable[[], Any]] = []
    for _ in range(2 if platform.quick else 4):
        calls += [functools.partial(oa.chat.completions.create, model="tiny", messages=huge),
                  functools.partial(an.messages.count_tokens, model="tiny", messages=huge)]
    with ThreadPoolExecutor(4) as pool:
        return Counter(pool.map(outcome, calls))


# -- the run --------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    model: str
    calls: Calls
    growth: tuple[float, str]
    deaths: list[str]
    got: Counter[str]
    extra: str = ""


ABUSES: dict[str, str] = {"grammar": "tiny", "deadlines": "slow", "streams": "slow",
                          "batches": "echo", "bodies": "echo", "prompts": "tiny"}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", default=None, help=f"of: {', '.join(ABUSES)}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()
    only = args.only.split(",") if args.only else list(ABUSES)
    if unknown := set(only) - set(ABUSES):
        sys.exit(f"unknown abuse: {', '.join(sorted(unknown))}")
    baseline_s, tail_s = (6.0, 3.0) if args.quick else (15.0, 5.0)
    with contextlib.ExitStack() as stack:
        platform = start(args.database_url, stack, args.quick)
        import openai
        warm = openai.OpenAI(base_url=platform.v1, api_key=platform.keys["b"],
                             max_retries=0, timeout=120)
        for model in ("echo", "slow", "tiny"):  # warm: workers up, model loaded
            bench_wait(functools.partial(warm.chat.completions.create, model=model,
                                         messages=HELLO, max_tokens=4))
        base: dict[str, Calls] = {}
        for model in sorted({ABUSES[name] for name in only}):
            base[model], _ = with_neighbour(platform, model, lambda: None, baseline_s, 0)
        b_batch: list[float] = []
        if "batches" in only:
            b = openai.OpenAI(base_url=platform.v1, api_key=platform.keys["b"], max_retries=0)
            began = time.monotonic()
            alone = run_batch(b, echo_lines(10, "b"), timeout_s=120)
            b_batch.append(time.monotonic() - began if alone.status == "completed"
                           else float("inf"))
        rows = []
        for name in only:
            work: Callable[[], Any] = {
                "grammar": lambda: grammar(platform), "deadlines": lambda: deadlines(platform),
                "streams": lambda: streams(platform),
                "batches": lambda: batches(platform, b_batch),
                "bodies": lambda: bodies(platform), "prompts": lambda: prompts(platform)}[name]
            with Watch(platform) as watch:
                calls, got = with_neighbour(platform, ABUSES[name], work, baseline_s, tail_s)
            extra = ""
            if name == "batches" and len(b_batch) == 2:
                extra = f"B's batch {b_batch[1]:.1f} s against {b_batch[0]:.1f} s alone"
            rows.append(Row(name, ABUSES[name], calls, watch.growth(), watch.deaths(), got,
                            extra))
        report(platform, base, rows, b_batch, args)


def bench_wait(call: Callable[[], Any], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def report(platform: Platform, base: dict[str, Calls], rows: list[Row], b_batch: list[float],
           args: argparse.Namespace) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bench.REPO,
                            capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M"),
                      "quick": args.quick, "clients": CLIENTS,
                      "database": "postgresql" if args.database_url else "sqlite",
                      "gateway_processes": default_workers("uvicorn")}))
    for model, calls in base.items():
        print(f"baseline B on {model}: {calls.ok}/{len(calls.results)} ok, "
              f"TTFT p50 {calls.pct(50):.1f} ms, p99 {calls.pct(99):.1f} ms")
    for row in rows:
        print(f"\n{row.name}: A got {dict(row.got)}")
        if row.calls.errors():
            print(f"  B's failures: {dict(row.calls.errors())}")
        print(f"  largest growth: {row.growth[1]}; deaths: {row.deaths or 'none'}"
              + (f"; {row.extra}" if row.extra else ""))
    print(f"\n{'abuse':10} {'model':5} {'B ok/total':>11} {'B p50 ms':>9} {'B p99 ms':>9} "
          f"{'vs base':>8} {'RSS MB':>7} {'deaths':>6}  verdict")
    failed = False
    for row in rows:
        ratio = row.calls.pct(99) / base[row.model].pct(99)
        ok = (row.calls.ok == len(row.calls.results) > 0 and ratio <= P99_LIMIT
              and row.growth[0] <= RSS_LIMIT_MB and not row.deaths
              and not any(what.startswith(RAISED) for what in row.got))
        failed |= not ok
        print(f"{row.name:10} {row.model:5} {row.calls.ok:5}/{len(row.calls.results):<5} "
              f"{row.calls.pct(50):9.1f} {row.calls.pct(99):9.1f} {ratio:7.2f}x "
              f"{row.growth[0]:7.0f} {len(row.deaths):6}  {'PASS' if ok else 'FAIL'}")
    if len(b_batch) == 2:
        ratio = b_batch[1] / b_batch[0]
        ok = ratio <= P99_LIMIT
        failed |= not ok
        print(f"{'B batch':10} {'echo':5} {'':11} {b_batch[0]:8.1f}s {b_batch[1]:8.1f}s "
              f"{ratio:7.2f}x {'':7} {'':6}  {'PASS' if ok else 'FAIL'}")
    print(f"\ngoal (B all ok, p99 <= {P99_LIMIT:g}x baseline, <= {RSS_LIMIT_MB:g} MB growth, "
          f"no deaths): {'met' if not failed else 'NOT met'}")
    bench.report("neighbours", **{r.name: {"ok": r.calls.ok, "total": len(r.calls.results),
                                           "p99_ms": r.calls.pct(99),
                                           "rss_mb": r.growth[0]} for r in rows})


if __name__ == "__main__":
    main()
