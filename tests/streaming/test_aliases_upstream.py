"""Sluice in front of another Sluice, end to end. The front is the live gateway
(tests/streaming/conftest.py); the upstreams are second Sluice gateways, each the run
command's HTTP server in a process of its own (tests/conftest.py `gateway_process`),
whose echo and tiny models are served by the live fixture's workers (the same Redis).
The front has `openai_upstream` deployments pointing at them, upstream workers in
threads (inference/upstream/worker.py) and aliases over them; the caller is the
official openai SDK (or plain HTTP) against the front. No mock anywhere."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.db import connection
from openai import OpenAI

from governance import audit
from governance import cache as policy_cache
from governance.models import AuditEvent, BreakerPolicy
from inference.models import Deployment
from inference.selectors import clear_routes
from inference.services import alias_create, deployment_create
from inference.upstream.worker import UpstreamWorker
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import eventually, gateway_process, make_org, principal_for, process_env
from tests.streaming.conftest import Live, roomy  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


class Front:
    """The front Sluice's side: its platform admin, the tenant whose key it holds at the
    upstreams (`relay_key`), the caller's tenant, and the upstream Sluice processes and
    upstream workers it starts (stopped when the test ends)."""

    def __init__(self, live: Live, stack: contextlib.ExitStack, logs: Path) -> None:
        self.live, self.stack, self.logs = live, stack, logs
        self.admin = principal_for(make_org("ops", [Role.PLATFORM_ADMIN])
                                   .members[Role.PLATFORM_ADMIN])
        self.relay_key = make_org("relay", [Role.DEVELOPER]).keys[Role.DEVELOPER]
        self.org = make_org("alice", [Role.DEVELOPER])
        self.workers: dict[str, UpstreamWorker] = {}

    def caller(self) -> OpenAI:
        return OpenAI(base_url=self.live.base_url, api_key=self.org.keys[Role.DEVELOPER],
                      max_retries=0, timeout=60)

    def upstream_server(self) -> tuple[subprocess.Popen[bytes], str]:
        """A second Sluice gateway process: (process, its /v1 base URL)."""
        out = self.stack.enter_context((self.logs / f"upstream-{len(self.workers)}-"
                                        f"{time.monotonic_ns()}.log").open("wb"))
        proc, base = self.stack.enter_context(gateway_process(
            process_env(SLUICE_STREAM_RESUME_GRACE_MS="200", SLUICE_LOG_LEVEL="DEBUG"),
            output=out))
        return proc, f"{base}/v1"

    def deployment(self, name: str, base_url: str, model: str = "echo", *,
                   key: str | None = None, **fields: Any) -> UpstreamWorker:
        """An upstream deployment at `base_url`'s `model`, as a platform admin makes it,
        and its upstream worker, running."""
        made = deployment_create(actor=self.admin, name=name, runtime="openai_upstream",
                                 upstream_url=base_url, upstream_model=model,
                                 upstream_api_key=key or self.relay_key,
                                 upstream_dialect="sluice", **{"max_context": 2048, **fields})
        worker = UpstreamWorker(made.to_spec(), sync_client(settings.REDIS_URL),
                                block_ms=200)
        thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
        thread.start()

        def stop() -> None:
            worker.stopping.set()
            thread.join(15)

        self.stack.callback(stop)
        self.workers[name] = worker
        return worker

    def audited(self, count: int) -> list[AuditEvent]:
        """The caller's last `count` chat call events at the front, oldest first."""
        def stored() -> list[AuditEvent]:
            audit.drain(settle_s=0.1)
            rows = list(AuditEvent.objects.filter(tenant=self.org.tenant,
                                                  action="chat.completions")
                        .order_by("-seq")[:count])
            return rows if len(rows) == count else []
        return list(reversed(eventually(stored, 20, what=f"{count} audit events")))


@pytest.fixture
def front(live: Live, settings: Any, tmp_path: Path) -> Iterator[Front]:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2
    clear_routes()
    policy_cache.clear()
    with contextlib.ExitStack() as stack:
        yield Front(live, stack, tmp_path)


def _ask(client: OpenAI, model: str, text: str, **params: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], **params)


def test_streaming_tools_and_structured_outputs_pass_through_an_upstream(
        front: Front, roomy: str) -> None:  # noqa: F811
    _proc, base = front.upstream_server()
    front.deployment("up-echo", base)
    front.deployment("up-tiny", base, roomy, max_context=1024)
    alias_create(actor=front.admin, name="org/echo", targets=[("up-echo", 1)])
    alias_create(actor=front.admin, name="org/tiny", targets=[("up-tiny", 1)])
    caller = front.caller()
    # Streamed, chunk by chunk, as the upstream streamed it.
    chunks = [c for c in caller.chat.completions.create(
        model="org/echo", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Streamed through two Sluices"}])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streamed through two Sluices"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(text)
    # Tools: passed natively; the upstream's model writes the call.
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    called = _ask(caller, "org/tiny", "Weather in Oslo?", max_tokens=60,
                  tool_choice="required", parallel_tool_calls=False,
                  tools=[{"type": "function", "function": {
                      "name": "get_weather", "description": "The weather in a city",
                      "parameters": params}}])
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id
    assert set(json.loads(call.function.arguments)) == {"city"}
    # Structured outputs: the upstream enforces the schema.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = _ask(caller, "org/tiny", "Answer in JSON", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    assert isinstance(json.loads(shaped.choices[0].message.content)["ok"], bool)
    events = front.audited(3)
    assert [e.model for e in events] == ["up-echo", "up-tiny", "up-tiny"]
    assert {e.detail["alias"] for e in events} == {"org/echo", "org/tiny"}


def test_weighted_targets_share_the_calls_as_configured(front: Front) -> None:
    _proc, base = front.upstream_server()
    heavy, light = front.deployment("up-heavy", base), front.deployment("up-light", base)
    alias_create(actor=front.admin, name="org/split",
                 targets=[("up-heavy", 3), ("up-light", 1)])
    caller = front.caller()
    calls, errors = 240, []

    def send(i: int) -> None:
        try:
            assert _ask(caller, "org/split", f"call {i}").choices[0].message.content == \
                f"call {i}"
        except Exception as exc:  # raised below
            errors.append(exc)

    def sender(first: int) -> None:
        for i in range(first, calls, 6):
            send(i)

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    served = {name: sum(len(b) for b in w.admitted) for name, w in
              (("up-heavy", heavy), ("up-light", light))}
    assert sum(served.values()) == calls
    # 3:1 is 180 of 240; binomial sd 6.7: within 4.5 sd (30 calls) unless the split is off.
    assert abs(served["up-heavy"] - 180) <= 30, served
    # The audit events name the alias and the deployment that answered each call.
    events = front.audited(calls)
    assert Counter(e.model for e in events) == Counter(served)
    assert {e.detail["alias"] for e in events} == {"org/split"}


def test_an_upstream_killed_mid_load_loses_no_call(front: Front) -> None:
    upstream_a, base_a = front.upstream_server()
    _proc_b, base_b = front.upstream_server()
    primary = front.deployment("up-a", base_a, "slow-echo")
    front.deployment("up-b", base_b, "slow-echo")
    # A breaker that opens after 3 failures of the last 6 calls, and stays open.
    BreakerPolicy.objects.create(deployment=Deployment.objects.get(name="up-a"), min_calls=3,
                                 window_size=6, failure_rate=0.5, open_wait_s=600)
    policy_cache.clear()
    alias_create(actor=front.admin, name="org/ha", targets=[("up-a", 1)], fallbacks=["up-b"])
    caller = front.caller()
    done, errors = [], []
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            text = f"{k}-{i} lorem ipsum"  # ~0.7 s on slow-echo: calls are in flight
            try:
                reply = _ask(caller, "org/ha", text)
                assert reply.choices[0].message.content == text
                done.append(text)
            except Exception as exc:  # raised below
                errors.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    # Killed while calls are running on it.
    eventually(lambda: len(primary.active) >= 3 and len(done) >= 6, 30,
               what="calls in flight on up-a")
    upstream_a.send_signal(signal.SIGKILL)
    killed_at = len(done)
    eventually(lambda: len(done) >= killed_at + 30 or errors, 60, what="calls after the kill")
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    events = front.audited(len(done))
    assert all(e.status == 200 for e in events)
    answered = Counter(e.model for e in events)
    assert answered["up-a"] >= 6 and answered["up-b"] >= 30, answered
    # Calls cut on up-a, or refused by its dead port, moved to up-b; then its breaker
    # opened and calls skipped it.
    moved = [e.detail["failed_attempts"] for e in events if "failed_attempts" in e.detail]
    assert moved and all(m.startswith("up-a (50") for m in moved), moved
    assert any("upstream_disconnected" in m for m in moved), "a call cut mid-reply"
    assert events[-1].detail.get("skipped") == "up-a (breaker_open)"


def test_a_cancelled_call_stops_generating_on_the_upstream(front: Front, live: Live) -> None:
    _proc, base = front.upstream_server()
    worker = front.deployment("up-slow", base, "slow-echo")
    alias_create(actor=front.admin, name="org/slow", targets=[("up-slow", 1)])
    upstream = live.workers["slow-echo"]  # the upstream Sluice's model worker
    with httpx.Client(base_url=live.base_url, timeout=30) as http, http.stream(
            "POST", "/chat/completions", headers={
                "Authorization": f"Bearer {front.org.keys[Role.DEVELOPER]}"}, json={
                "model": "org/slow", "stream": True,
                "messages": [{"role": "user", "content": "z" * 600}]}) as reply:
        assert reply.status_code == 200
        lines = 0
        for line in reply.iter_lines():
            lines += line.startswith("data: {")
            if lines == 5:
                break  # the client goes away
    # The front cancels (after its resume grace), its upstream worker closes the call,
    # the upstream Sluice cancels its model's job (after its own grace): 600 tokens at
    # 50 ms would run for 30 s.
    began = time.monotonic()
    eventually(lambda: not worker.active and not upstream.active, 15,
               what="the call to stop on both Sluices")
    assert time.monotonic() - began < 15
    rds = sync_client(settings.REDIS_URL)
    finals = [f[b"e"] for key in rds.scan_iter("sluice:{relay}:out:*")
              for _i, f in rds.xrange(key) if b'"t":"done"' in f[b"e"]]
    assert any(b'"cancelled"' in e for e in finals), "the upstream's own request cancelled"
    [event] = front.audited(1)
    assert event.model == "up-slow" and event.status == 200


def _dump() -> str:
    db = connection.settings_dict
    return subprocess.run(
        ["pg_dump", "--data-only", "-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432),
         "-U", db["USER"], db["NAME"]], capture_output=True, text=True, check=True,
        env={"PGPASSWORD": db.get("PASSWORD") or "", "PATH": "/usr/bin:/bin"}).stdout


def test_the_upstream_key_is_in_no_dump_log_or_reply(
        front: Front, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # httpx and httpcore at their most talkative
    wrong = "sk-PLUMBOB-upstream-7c1d2e3f4a5b6c7d8e9f"  # a key the upstream refuses
    _proc, base = front.upstream_server()
    front.deployment("up-good", base)
    front.deployment("up-wrong", base, key=wrong)
    alias_create(actor=front.admin, name="org/good", targets=[("up-good", 1)])
    caller = front.caller()
    replies = [_ask(caller, "org/good", "a reply").model_dump_json(),
               _ask(caller, "up-good", "called by name").model_dump_json()]
    with pytest.raises(openai.InternalServerError) as refused:
        _ask(caller, "up-wrong", "refused upstream")
    assert refused.value.code == "upstream_auth_failed"
    replies.append(refused.value.response.text)
    admin = front.live.base_url.removesuffix("/v1")
    ops = make_org("ops2", [Role.PLATFORM_ADMIN]).keys[Role.PLATFORM_ADMIN]
    with httpx.Client(base_url=admin, headers={"Authorization": f"Bearer {ops}"}) as http:
        for path in ("/api/v1/deployments", "/api/v1/deployments/up-good",
                     "/api/v1/deployments/up-wrong", "/v1/models"):
            answer = http.get(path)
            assert answer.status_code == 200, path
            replies.append(answer.text)
    audit.drain(settle_s=0.2)
    logs = caplog.text + "".join(p.read_text(errors="replace")
                                 for p in front.logs.glob("upstream-*.log"))
    dump = _dump()
    for secret in (front.relay_key, wrong):
        hidden = secret[:-4]  # the last four are a hint that may be shown
        for where, text in (("a reply", "\n".join(replies)), ("the logs", logs),
                            ("the database dump", dump)):
            assert hidden not in text, f"the upstream key is in {where}"
    assert "upstream_api_key_set" in replies[-4]  # the listing was read
