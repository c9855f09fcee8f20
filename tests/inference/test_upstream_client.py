"""The upstream client against a real OpenAI-compatible server: a second Sluice started by
the test (tests/streaming/conftest.py's live server: uvicorn on a loopback port with real
workers on the test Redis; the echo and tiny models need no weights). No mock: every
event below went over HTTP through that server's gateway and workers."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from django.db import connection

from inference.jobs import ChatJob, ResponseFormat, ToolSpec
from inference.models import Deployment
from inference.services import deployment_create
from inference.spec import DeploymentSpec, Dialect, RuntimeName, UpstreamSpec
from inference.upstream.body import Continuation
from inference.upstream.client import Event, UpstreamClient
from inference.upstream.secrets import seal
from sluice.localinfra import free_port
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, eventually, gateway_process, make_org, principal_for, process_env
from tests.streaming.conftest import Live, roomy  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


def _spec(base_url: str, model: str, key: str, *, dialect: Dialect = Dialect.SLUICE,
          max_context: int = 2048, read_timeout_s: float = 30.0,
          concurrency: int = 8) -> DeploymentSpec:
    return DeploymentSpec(name="up", runtime=RuntimeName.OPENAI_UPSTREAM,
                          max_context=max_context, upstream=UpstreamSpec(
                              base_url=base_url, model=model, secret_sealed=seal(key),
                              dialect=dialect, read_timeout_s=read_timeout_s,
                              connect_timeout_s=5.0, concurrency=concurrency))


# Events as plain dicts: the tests read fields of whichever kind each one is.
Got = dict[str, Any]


def _collect(spec: DeploymentSpec, job: ChatJob, *, tenant: str = "alice",
             private_ok: bool = True, **kwargs: Any) -> list[Got]:
    async def run() -> list[Got]:
        client = UpstreamClient(spec, private_ok=private_ok)
        try:
            return [dict(e) async for e in client.stream(job, tenant=tenant, **kwargs)]
        finally:
            await client.aclose()
    return asyncio.run(run())


def _text(events: list[Got]) -> str:
    return "".join(e["text"] for e in events if e["t"] == "delta")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_chat_reply_streams_as_the_worker_s_events(live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER])
    events = _collect(spec, ChatJob(messages=_user("Hello, upstream! ünïcödé")))
    assert _text(events) == "Hello, upstream! ünïcödé"
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert all(e["ids"] == [] for e in events if e["t"] == "delta")
    assert len(events) > 3  # streamed, not one piece
    final = events[-1]
    size = len("Hello, upstream! ünïcödé".encode())
    assert final["t"] == "done" and final["finish"] == "stop"
    assert final["usage"] == {"prompt_tokens": size, "completion_tokens": size}


def test_a_job_not_streamed_gets_its_text_in_one_piece(live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER])
    events = _collect(spec, ChatJob(messages=_user("all at once"), stream=False))
    assert [e["t"] for e in events] == ["delta", "done"]
    assert events[0]["text"] == "all at once" and events[1]["seq"] == 1


def test_sampling_limits_and_stop_strings_reach_the_upstream(live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER])
    cut = _collect(spec, ChatJob(messages=_user("hello world"), max_tokens=3))
    assert _text(cut) == "hel" and cut[-1]["finish"] == "length"
    stopped = _collect(spec, ChatJob(messages=_user("hello world"), stop=["o w"],
                                     temperature=0.0, seed=3))
    assert _text(stopped) == "hell" and stopped[-1]["finish"] == "stop"


def test_a_legacy_completion_and_its_continuation(live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER])
    whole = _collect(spec, ChatJob(prompt="abcdef", max_tokens=20))
    assert _text(whole) == "abcdef"
    # A takeover after "abc" was streamed (3 tokens, events 0-2): the upstream gets the
    # prompt plus that text (the echo model answers with its whole prompt), the events go
    # on from sequence 3, and the usage counts the 3 tokens once, as completion.
    resumed = _collect(spec, ChatJob(prompt="abcdef", max_tokens=20),
                       continuation=Continuation(text="abc", seq=3, completion_tokens=3))
    assert _text(resumed) == "abcdefabc"
    assert resumed[0]["seq"] == 3 and resumed[-1]["t"] == "done"
    assert resumed[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 12}


def test_a_chat_continuation_where_the_upstream_cannot_is_a_retriable_error(
        live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER], dialect=Dialect.SLUICE)
    events = _collect(spec, ChatJob(messages=_user("hi")),
                      continuation=Continuation(text="h", seq=1, completion_tokens=1))
    assert len(events) == 1 and events[0]["t"] == "error"
    assert events[0]["code"] == "upstream_cannot_resume" and events[0]["retry"] is True
    assert events[0]["seq"] == 1


def test_tools_structured_outputs_and_logprobs_pass_through(live: Live, org: Org,
                                                            roomy: str) -> None:  # noqa: F811
    spec = _spec(live.base_url, roomy, org.keys[Role.DEVELOPER], max_context=1024)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    called = _collect(spec, ChatJob(messages=_user("Weather in Oslo?"), max_tokens=60,
                                    tools=[ToolSpec("get_weather", params)],
                                    tool_choice="required"))
    done = called[-1]
    assert done["t"] == "done" and done["finish"] == "tool_calls", done
    calls = done.get("tool_calls") or []
    assert [c["name"] for c in calls][:1] == ["get_weather"]
    assert set(json.loads(calls[0]["arguments"])) == {"city"}
    assert calls[0]["id"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = _collect(spec, ChatJob(messages=_user("Answer in JSON"), max_tokens=40,
                                    response_format=ResponseFormat(schema=schema, strict=True)))
    assert isinstance(json.loads(_text(shaped))["ok"], bool)
    scored = _collect(spec, ChatJob(messages=_user("hi"), max_tokens=4, logprobs=2))
    entries = [lp for e in scored if e["t"] == "delta" for lp in e.get("lp", [])]
    assert len(entries) == scored[-1]["usage"]["completion_tokens"] == 4
    assert all(len(x["top_logprobs"]) == 2 and x["logprob"] <= 0 for x in entries)


def test_cancellation_reaches_the_upstream(live: Live, org: Org, settings: Any) -> None:
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2  # the upstream Sluice's own grace
    spec = _spec(live.base_url, "slow-echo", org.keys[Role.DEVELOPER])
    worker = live.workers["slow-echo"]

    async def run() -> int:
        client = UpstreamClient(spec, private_ok=True)
        stream = client.stream(ChatJob(messages=_user("x" * 300)), tenant="alice")
        got = 0
        async for event in stream:
            got += event["t"] == "delta"
            if got == 3:
                break
        await stream.aclose()  # what a cancelled worker task does
        await client.aclose()
        return got

    assert asyncio.run(run()) == 3
    eventually(lambda: not worker.active, 10, what="the upstream's worker to stop")
    rds = sync_client(settings.REDIS_URL)
    finals = [f[b"e"] for key in rds.scan_iter("sluice:{alice}:out:*")
              for _i, f in rds.xrange(key) if b'"done"' in f[b"e"]]
    assert any(b'"cancelled"' in e for e in finals), finals


def test_requests_in_flight_stay_within_the_concurrency(live: Live, org: Org) -> None:
    spec = _spec(live.base_url, "slow-echo", org.keys[Role.DEVELOPER], concurrency=2)
    worker = live.workers["slow-echo"]
    seen: list[int] = []

    async def run() -> list[str]:
        client = UpstreamClient(spec, private_ok=True)

        async def one(i: int) -> str:
            events = [dict(e) async for e in client.stream(ChatJob(messages=_user(f"call {i}")),
                                                     tenant="alice")]
            return _text(events)

        async def watch() -> None:
            while True:
                seen.append(len(worker.active))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(*(one(i) for i in range(5)))
        finally:
            watcher.cancel()
            await client.aclose()

    assert asyncio.run(run()) == [f"call {i}" for i in range(5)]
    assert max(seen) == 2, "two at a time, and two were reached"


# -- failures, and the secret ----------------------------------------------------------
SECRET = "sk-PLUMBOB-upstream-7c1d2e3f4a5b6c7d8e9f"  # distinctive: searched for below


def _dump() -> str:
    db = connection.settings_dict
    out = subprocess.run(
        ["pg_dump", "--data-only", "-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432),
         "-U", db["USER"], db["NAME"]], capture_output=True, text=True, check=True,
        env={"PGPASSWORD": db.get("PASSWORD") or "", "PATH": "/usr/bin:/bin"})
    return out.stdout


@pytest.fixture
def everything_logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # httpx and httpcore at their most talkative
    yield caplog


def test_failures_are_typed_and_the_secret_appears_nowhere(
        live: Live, org: Org, ops: Org, everything_logged: pytest.LogCaptureFixture,
        settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    # Given the secret stored the way a platform admin stores it.
    deployment_create(actor=principal_for(ops.members[Role.PLATFORM_ADMIN]), name="up",
                      runtime="openai_upstream", upstream_url=live.base_url,
                      upstream_model="echo", upstream_api_key=SECRET, max_context=2048,
                      upstream_read_timeout_s=1.0)
    spec = Deployment.objects.get(name="up").to_spec()
    assert spec.upstream is not None and SECRET not in spec.to_json()
    job = ChatJob(messages=_user("hi"))
    events: list[Got] = []
    # The upstream refuses the key (it is not one of its keys): final.
    refused = _collect(spec, job)
    assert refused[-1]["t"] == "error" and refused[-1]["code"] == "upstream_auth_failed"
    assert refused[-1]["retry"] is False and refused[-1]["status"] == 502
    events += refused
    # Nobody listens on the port: retriable.
    closed = _spec(f"http://127.0.0.1:{free_port()}/v1", "echo", SECRET)
    down = _collect(closed, job)
    assert down[-1]["code"] == "upstream_unavailable" and down[-1]["retry"] is True
    events += down
    # A name that resolves to loopback, without the operator's permission: the guard at
    # connect time refuses it (the URL was never validated for this process).
    named = _spec(live.base_url.replace("127.0.0.1", "localhost"), "echo", SECRET)
    guarded = _collect(named, job, private_ok=False)
    assert guarded[-1]["code"] == "upstream_address_refused" and guarded[-1]["retry"] is False
    events += guarded
    # A model nobody serves keeps the upstream silent past the read timeout: retriable.
    silent = _spec(live.base_url, "idle", org.keys[Role.DEVELOPER], read_timeout_s=1.0)
    waited = _collect(silent, job)
    assert waited[-1]["code"] == "upstream_timeout" and waited[-1]["retry"] is True
    events += waited
    # vLLM's cache_salt sent to a server that does not take it: the upstream's 400,
    # its message quoted.
    vllm = _spec(live.base_url, "echo", org.keys[Role.DEVELOPER], dialect=Dialect.VLLM)
    bad = _collect(vllm, job)
    assert bad[-1]["code"] == "upstream_bad_request" and bad[-1]["status"] == 400
    assert "cache_salt" in bad[-1]["message"] and bad[-1]["retry"] is False
    # Then the secret is in no event, log record or database row.
    assert SECRET not in json.dumps(events)
    for record in everything_logged.records:
        assert SECRET not in record.getMessage() and SECRET not in str(record.args)
        assert not record.exc_text or SECRET not in record.exc_text
    assert SECRET not in everything_logged.text
    assert SECRET not in _dump()


def test_an_upstream_killed_mid_reply_ends_the_stream_with_a_retriable_error(
        live: Live, org: Org) -> None:
    # A second Sluice as its own process (the live server's workers serve its queue).
    with gateway_process(process_env()) as (proc, base):
        spec = _spec(f"{base}/v1", "slow-echo", org.keys[Role.DEVELOPER])

        async def run() -> list[Got]:
            client = UpstreamClient(spec, private_ok=True)
            out: list[Got] = []
            stream: AsyncIterator[Event] = client.stream(ChatJob(messages=_user("y" * 200)),
                                                         tenant="alice")
            async for event in stream:
                out.append(dict(event))
                if len(out) == 3:
                    proc.send_signal(signal.SIGKILL)
            await client.aclose()
            return out

        events = asyncio.run(run())
        proc.wait(10)
    deltas = [e for e in events if e["t"] == "delta"]
    final = events[-1]
    assert final["t"] == "error" and final["retry"] is True, final
    assert final["code"] == "upstream_disconnected"
    assert final["seq"] == len(deltas) >= 3 and final["usage"]["completion_tokens"] == len(deltas)
