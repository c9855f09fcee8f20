"""The agent CLIs people point at Sluice, unchanged: Claude Code's captured first requests
through the official anthropic SDK (no Node needed), and the real pinned CLIs
(tests/streaming/agent_clis.py) run against a live Sluice, in a temporary HOME and
working directory, with no permission to run tools and no network beyond loopback; each
gets a streamed reply from a long-context deployment that clamps max_tokens, and every
request it sent is audited with status 200."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from django.conf import settings

from governance import audit
from governance.models import AuditEvent
from inference import cache as registry_cache
from inference.models import Deployment
from inference.selectors import clear_routes
from inference.services import alias_create, deployment_create
from inference.spec import MaxTokensPolicy
from inference.upstream.worker import UpstreamWorker
from inference.worker import Worker
from sluice.localinfra import free_port
from sluice.redis import sync_client
from streaming.apis.messages.codec import AnthropicMessagesRequest, call_request, offered, parse
from streaming.pipeline.max_tokens_policy import CLAMPED_HEADER
from tenants.roles import Role
from tests.conftest import Org, eventually, make_org, principal_for
from tests.streaming import agent_clis
from tests.streaming.conftest import Live, _tiny_worker

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
CLAUDE_FIRST = [FIXTURES / "claude_code_2.1.332_first_request.json",
                FIXTURES / "claude_code_2.1.332_first_request_default_model.json"]
CLI_TIMEOUT_S = 45  # a hung CLI is killed here and the test fails saying so
MAX_OUTPUT = 24  # random weights write noise: a short reply keeps each run quick


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


@pytest.fixture
def long_context(live: Live) -> Iterator[str]:
    """The tiny random-weights model with room for an agent CLI's prompt (Claude Code's
    is ~12,700 tokens with its full tool list), clamping the CLIs' max_tokens (32,000)
    to a short reply."""
    deployment = _tiny_worker("tiny-long", 16384)
    name = next(deployment)
    Deployment.objects.filter(name=name).update(max_tokens_policy="clamp",
                                                max_output_tokens=MAX_OUTPUT)
    registry_cache.clear()
    yield name
    next(deployment, None)


@pytest.fixture
def long_echo(live: Live) -> Iterator[str]:
    """An echo deployment with room for any agent CLI's prompt, clamping its max_tokens:
    offered the CLI's tools under "auto", it answers in text (the prompt's last user
    message) and ends its reply, as a CLI needs to exit cleanly."""
    spec = Deployment.objects.create(name="echo-long", runtime="echo", max_context=262_144,
                                     max_tokens_policy="clamp").to_spec()
    registry_cache.clear()
    worker = Worker(spec, sync_client(settings.REDIS_URL), block_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    yield spec.name
    worker.stopping.set()
    thread.join(10)


@pytest.fixture(scope="session")
def agent_cli() -> Callable[[str], Path]:
    """`agent_cli("claude")`: the pinned CLI's command, installed on first use. Without
    Node, or when npm cannot install, the test is skipped; under CI it fails."""
    def find(name: str) -> Path:
        try:
            if shutil.which("npm") is None:
                raise FileNotFoundError("no Node/npm on this machine")
            bins = agent_clis.install(agent_clis.cache_dir())
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("CI"):
                pytest.fail(f"CI needs the pinned agent CLIs (dev.sh installs them): {exc}")
            pytest.skip(f"agent CLIs not installed: {exc}")
        return bins / name
    return find


def _audited(org: Org) -> list[tuple[str, int]]:
    audit.drain(settle_s=0.1)
    return list(AuditEvent.objects.filter(tenant=org.tenant).order_by("seq")
                .values_list("action", "status"))


def _all_audited_ok(org: Org, action: str) -> None:
    def settled() -> list[tuple[str, int]] | None:
        rows = _audited(org)
        return rows if rows and any(a == action for a, _ in rows) else None
    rows = eventually(settled, timeout=15, what=f"an audited {action} call")
    assert rows and all(status == 200 for _, status in rows), rows


def _session(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "home" / "project"
    work.mkdir(parents=True)
    return home, work


def _ran(done: agent_clis.Done) -> None:
    """The CLI ended by itself, with success, and printed a reply."""
    assert done.rc is not None, (f"the CLI hung: killed after {CLI_TIMEOUT_S}s\n"
                                 f"stdout: {done.stdout[-1500:]}\nstderr: {done.stderr[-1500:]}")
    assert done.rc == 0, (f"exit {done.rc}\nstdout: {done.stdout[-1500:]}\n"
                          f"stderr: {done.stderr[-3000:]}")
    assert done.stdout.strip(), f"no reply printed\nstderr: {done.stderr[-3000:]}"


# ------------------------------------------------ Claude Code's body, through the SDK


def _body(path: Path) -> tuple[dict[str, Any], list[str]]:
    data = json.loads(path.read_text())
    return copy.deepcopy(data["body"]), data["headers"]["anthropic-beta"].split(",")


@pytest.mark.parametrize("path", CLAUDE_FIRST, ids=["named-model", "default-model"])
def test_claude_codes_first_request_streams_unchanged(live: Live, org: Org, long_context: str,
                                                      path: Path) -> None:
    body, betas = _body(path)
    body["model"] = long_context
    client = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), max_retries=0,
                                 api_key=org.keys[Role.DEVELOPER], timeout=60)
    known = {k: v for k, v in body.items() if k not in ("context_management",)}
    with client.beta.messages.with_streaming_response.create(
            **known, betas=betas, extra_body={"context_management": body["context_management"]}
    ) as raw:
        assert raw.headers[CLAMPED_HEADER] == str(MAX_OUTPUT)
        names = [line.removeprefix("event: ") for line in raw.iter_lines()
                 if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop", names


def test_a_deferred_tool_is_offered_once_a_tool_search_loads_it() -> None:
    body, _ = _body(CLAUDE_FIRST[0])
    req = parse(AnthropicMessagesRequest, body)
    names = [t.name for t in offered(req)]
    assert "DeferredToolPlaceholder" not in names and "ToolSearch" in names
    assert len(names) == len(body["tools"]) - 1
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "ToolSearch", "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference",
                                                   "tool_name": "DeferredToolPlaceholder"}]}]}]
    loaded = call_request(parse(AnthropicMessagesRequest, body))
    assert "DeferredToolPlaceholder" in [t.name for t in loaded.tools]


def test_a_system_message_clears_at_the_next_user_turn_when_asked() -> None:
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "one"},
        {"role": "system", "content": "brief", "clear_at": "next_user_message",
         "output_config": {"effort": "low"}},
        {"role": "assistant", "content": "ok"}]
    req = {"model": "m", "max_tokens": 5, "messages": turns}
    shown = call_request(parse(AnthropicMessagesRequest, req)).messages
    assert [m["role"] for m in shown] == ["user", "system", "assistant"]
    later = {**req, "messages": [*turns, {"role": "user", "content": "two"}]}
    assert [m["role"] for m in call_request(parse(AnthropicMessagesRequest,
                                                  later)).messages] == [
        "user", "assistant", "user"]


@pytest.mark.parametrize("field", [{"output_config": {"effort": "low"}},
                                   {"clear_at": "never"},
                                   {"output_config": {"effort": "huge"}}])
def test_a_turns_output_config_outside_a_system_message_is_refused(
        live: Live, org: Org, field: dict[str, Any]) -> None:
    client = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), max_retries=0,
                                 api_key=org.keys[Role.DEVELOPER], timeout=30)
    role = "system" if field.get("output_config", {}).get("effort") == "huge" else "user"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="echo", max_tokens=5, messages=[
            {"role": "user", "content": "hi"}, {"role": role, "content": "x", **field}])  # type: ignore[list-item]
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"messages.1.{next(iter(field))}"), error


# ------------------------------------------------ the real CLIs


@pytest.fixture
def fallback_alias(live: Live, long_echo: str, settings: Any) -> Iterator[str]:
    """The alias `agents`: first an upstream deployment whose server is down (each call a
    retriable 503 before any text), then `long_echo` as its fallback; clamping. A CLI's
    every call is answered by the fallback, as after a model switch."""
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    admin = principal_for(make_org("ops", [Role.PLATFORM_ADMIN]).members[Role.PLATFORM_ADMIN])
    down = deployment_create(actor=admin, name="up-down", runtime="openai_upstream",
                             upstream_url=f"http://127.0.0.1:{free_port()}/v1",
                             upstream_model="m", max_context=262_144,
                             max_tokens_policy="clamp")
    worker = UpstreamWorker(down.to_spec(), sync_client(settings.REDIS_URL), private_ok=True,
                            block_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    alias_create(actor=admin, name="agents", targets=[("up-down", 1)], fallbacks=[long_echo],
                 max_tokens_policy=MaxTokensPolicy.CLAMP)
    clear_routes()
    yield "agents"
    worker.stopping.set()
    thread.join(15)


MODELS = ["long_echo", "fallback_alias"]


def _answered_by_the_fallback(org: Org) -> None:
    rows = AuditEvent.objects.filter(tenant=org.tenant).exclude(model="")
    assert rows and all(r.model == "echo-long" and
                        r.detail.get("failed_attempts", "").startswith("up-down")
                        for r in rows), [(r.model, r.detail) for r in rows]


@pytest.mark.parametrize("model", MODELS)
def test_claude_code_says_hello(live: Live, org: Org, model: str,
                                request: pytest.FixtureRequest,
                                agent_cli: Callable[[str], Path], tmp_path: Path) -> None:
    claude = agent_cli("claude")
    name = request.getfixturevalue(model)
    home, work = _session(tmp_path)
    env = agent_clis.quiet_env(home, live.base_url.removesuffix("/v1"),
                               org.keys[Role.DEVELOPER])
    done = agent_clis.run([str(claude), "-p", "--model", name, "Say hello"],
                          cwd=work, env=env, timeout=CLI_TIMEOUT_S)
    _all_audited_ok(org, "messages")
    _ran(done)
    if model == "fallback_alias":  # each call was the fallback's, after a failed attempt
        _answered_by_the_fallback(org)


@pytest.mark.parametrize("model", MODELS)
def test_codex_says_hello(live: Live, org: Org, model: str, request: pytest.FixtureRequest,
                          agent_cli: Callable[[str], Path], tmp_path: Path) -> None:
    codex = agent_cli("codex")
    name = request.getfixturevalue(model)
    home, work = _session(tmp_path)
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(agent_clis.codex_config(live.base_url))
    env = agent_clis.quiet_env(home, live.base_url.removesuffix("/v1"),
                               org.keys[Role.DEVELOPER])
    done = agent_clis.run([str(codex), "exec", "--skip-git-repo-check", "--sandbox",
                           "read-only", "--color", "never", "-C", str(work),
                           "--model", name, "Say hello"],
                          cwd=work, env=env, timeout=CLI_TIMEOUT_S)
    _all_audited_ok(org, "responses")
    _ran(done)
    if model == "fallback_alias":  # each call was the fallback's, after a failed attempt
        _answered_by_the_fallback(org)
