"""Upstream deployments and model aliases in the registry: who may set them, the SSRF
guard on their URLs, the write-only API key, and the audit trail."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import Any

import pytest
from pydantic import ValidationError

from governance import audit
from governance.models import AuditEvent
from inference import selectors
from inference.models import Deployment, ModelAlias
from inference.routing import Route, Target
from inference.spec import DeploymentSpec
from inference.upstream import secrets
from inference.upstream.urls import UpstreamURLError, address_refusal, validate_url
from streaming.apis.completions import CompletionRequest
from streaming.apis.messages.codec import AnthropicMessagesRequest
from streaming.apis.responses.codec import ResponsesRequest
from streaming.pipeline.schemas import ChatCompletionRequest, EmbeddingRequest
from tenants.roles import Role
from tests.conftest import ApiClient, Org, assert_openai_error

pytestmark = pytest.mark.django_db

KEY = "sk-upstream-PLUM-7f3a9c1e5b2d8f4a0c6e"  # distinctive: searched for below


@pytest.fixture
def private_ok(settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True


def _upstream(**extra: Any) -> dict[str, Any]:
    return {"name": "big", "runtime": "openai_upstream", "upstream_url": "http://127.0.0.1:8000/v1/",
            "upstream_model": "meta-llama/Llama-3.1-8B-Instruct", "max_context": 8192,
            "upstream_dialect": "vllm", **extra}


# -- the write-only key ----------------------------------------------------------------
def test_an_upstream_key_is_write_only_and_sealed_at_rest(ops: Org, private_ok: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    created = pa.post("/api/v1/deployments", _upstream(upstream_api_key=KEY))
    assert created.status == 201, created.body
    body = created.body
    assert body["upstream_url"] == "http://127.0.0.1:8000/v1"  # no trailing slash
    assert body["upstream_api_key_set"] is True and body["upstream_api_key_hint"] == KEY[-4:]
    assert body["enabled"] is True and body["kind"] == "chat"
    listed, one = pa.get("/api/v1/deployments"), pa.get("/api/v1/deployments/big")
    for response in (created, listed, one):
        assert KEY not in json.dumps(response.body)
        assert KEY[:-4] not in json.dumps(response.body)
    row = Deployment.objects.get(name="big")
    assert KEY not in row.upstream_secret and row.upstream_secret
    assert secrets.unseal(row.upstream_secret).reveal() == KEY
    spec = row.to_spec()
    assert spec.upstream is not None and spec.upstream.secret_sealed == row.upstream_secret
    assert KEY not in spec.to_json()
    assert DeploymentSpec.from_json(spec.to_json()) == spec  # what a worker process gets


def test_a_new_key_replaces_the_old_and_an_empty_one_removes_it(ops: Org,
                                                                private_ok: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    pa.post("/api/v1/deployments", _upstream(upstream_api_key=KEY))
    other = "sk-other-key-0123456789abcdef-WXYZ"
    assert pa.patch("/api/v1/deployments/big",
                    {"upstream_api_key": other}).body["upstream_api_key_hint"] == "WXYZ"
    assert secrets.unseal(Deployment.objects.get(name="big").upstream_secret).reveal() == other
    kept = pa.patch("/api/v1/deployments/big", {"upstream_read_timeout_s": 30})
    assert kept.body["upstream_api_key_set"] is True  # not given: unchanged
    cleared = pa.patch("/api/v1/deployments/big", {"upstream_api_key": ""}).body
    assert cleared["upstream_api_key_set"] is False and cleared["upstream_api_key_hint"] == ""
    assert Deployment.objects.get(name="big").upstream_secret == ""


def test_a_short_key_shows_no_hint(ops: Org, private_ok: None) -> None:
    made = ops.client(Role.PLATFORM_ADMIN).post("/api/v1/deployments",
                                                _upstream(upstream_api_key="short-key"))
    assert made.body["upstream_api_key_set"] is True and made.body["upstream_api_key_hint"] == ""


def test_a_key_that_could_break_a_header_is_refused_without_being_quoted(
        ops: Org, private_ok: None) -> None:
    bad = "sk-line\r\nX-Injected: 1-PLUMSECRET"
    error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).post(
        "/api/v1/deployments", _upstream(upstream_api_key=bad)), 422)
    assert error["param"] == "upstream_api_key" and "PLUMSECRET" not in error["message"]
    assert not Deployment.objects.exists()


def test_the_secret_is_unreadable_with_another_secret_key(settings: Any) -> None:
    sealed = secrets.seal(KEY)
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "another key " * 5, []
    with pytest.raises(secrets.SecretUnavailable) as refused:
        secrets.unseal(sealed)
    assert KEY not in str(refused.value)
    settings.SECRET_KEY_FALLBACKS = []
    assert secrets.seal(KEY) != sealed  # a new key seals differently (and randomly)


def test_a_rotated_secret_key_still_opens_what_the_old_one_sealed(settings: Any) -> None:
    sealed = secrets.seal(KEY)
    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
    settings.SECRET_KEY = "the new secret key " * 3
    assert secrets.unseal(sealed).reveal() == KEY


def test_a_secret_does_not_print_itself() -> None:
    secret = secrets.Secret(KEY)
    assert KEY not in repr(secret) and KEY not in str(secret) and KEY not in f"{secret}"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(secret)


def test_cache_salts_differ_per_tenant_and_name_no_tenant() -> None:
    alice, bob = secrets.cache_salt("alice"), secrets.cache_salt("bob")
    assert alice != bob and alice == secrets.cache_salt("alice")
    assert "alice" not in alice and len(alice) == 32


# -- who may set upstreams -------------------------------------------------------------
@pytest.mark.parametrize("role", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
def test_only_platform_admins_set_upstreams(alice: Org, ops: Org, role: Role,
                                           private_ok: None) -> None:
    ops.client(Role.PLATFORM_ADMIN).post("/api/v1/deployments", _upstream())
    client = alice.client(role)
    assert_openai_error(client.post("/api/v1/deployments", _upstream(name="mine")), 403)
    refused = client.patch("/api/v1/deployments/big",
                           {"upstream_url": "http://10.0.0.9:8000/v1"})
    assert refused.status in (403, 404)
    assert not Deployment.objects.filter(name="mine").exists()
    assert Deployment.objects.get(name="big").upstream_url == "http://127.0.0.1:8000/v1"


def test_an_upstream_is_enabled_and_disabled_like_any_deployment(ops: Org,
                                                                  private_ok: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    assert pa.post("/api/v1/deployments", _upstream()).status == 201
    assert Deployment.objects.get(name="big").enabled is True
    assert pa.patch("/api/v1/deployments/big", {"enabled": False}).status == 200
    assert Deployment.objects.get(name="big").enabled is False
    assert pa.patch("/api/v1/deployments/big", {"enabled": True}).status == 200
    assert Deployment.objects.get(name="big").enabled is True


@pytest.mark.parametrize(("body", "param"), [
    ({"upstream_url": None}, "upstream_url"),
    ({"upstream_model": None}, "upstream_model"),
    ({"upstream_concurrency": 0}, "upstream_concurrency"),
    ({"upstream_read_timeout_s": 0.5}, "upstream_read_timeout_s"),
    ({"upstream_connect_timeout_s": 301}, "upstream_connect_timeout_s"),
    ({"upstream_dialect": "bedrock"}, "upstream_dialect"),
])
def test_incomplete_or_out_of_range_upstreams_are_422(ops: Org, private_ok: None,
                                                      body: dict[str, Any], param: str) -> None:
    data = {k: v for k, v in {**_upstream(), **body}.items() if v is not None}
    error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).post("/api/v1/deployments",
                                                                     data), 422)
    assert error["param"] == param
    assert not Deployment.objects.exists()


def test_upstream_fields_belong_to_upstream_deployments_only(ops: Org) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    error = assert_openai_error(pa.post("/api/v1/deployments", {
        "name": "e", "runtime": "echo", "upstream_api_key": KEY}), 422)
    assert error["param"] == "upstream_api_key" and KEY not in error["message"]
    assert_openai_error(pa.post("/api/v1/deployments", {
        "name": "e", "runtime": "echo", "upstream_url": "http://8.8.8.8/v1"}), 422)


# -- the SSRF guard ----------------------------------------------------------------------
@pytest.mark.parametrize(("url", "why"), [
    ("http://169.254.169.254/latest/meta-data", "metadata"),
    ("http://[fd00:ec2::254]/v1", "metadata"),
    ("http://[::ffff:169.254.169.254]/v1", "metadata"),
    ("http://100.100.100.200/v1", "metadata"),
    ("http://0.0.0.0:8000/v1", "unicast"),
    ("http://127.0.0.1:8000/v1", "private"),
    ("http://localhost:8000/v1", "private"),
    ("http://10.1.2.3/v1", "private"),
    ("http://[::1]:8000/v1", "private"),
    ("file:///etc/passwd", "http and https"),
    ("gopher://127.0.0.1:6379/_FLUSHALL", "http and https"),
    ("http://admin:hunter2-PLUM@8.8.8.8/v1", "user name or password"),
    ("http://8.8.8.8/v1?api_key=x", "query"),
    ("http://8.8.8.8/v1#frag", "fragment"),
    ("http://no-such-host.invalid/v1", "does not resolve"),
    ("http://8.8.8.8:99999/v1", "cannot be parsed"),
    ("http:///v1", "no host"),
    ("http://8.8.8.8/v1 x", "spaces"),
])
def test_the_guard_refuses_urls_that_are_not_plain_public_http(ops: Org, url: str,
                                                               why: str, settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = False
    error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).post(
        "/api/v1/deployments", _upstream(upstream_url=url)), 422)
    assert error["param"] == "upstream_url" and why in error["message"]
    assert "hunter2" not in error["message"]
    assert not Deployment.objects.exists()


def test_private_upstreams_need_the_operator_s_permission(ops: Org, settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    pa = ops.client(Role.PLATFORM_ADMIN)
    assert pa.post("/api/v1/deployments", _upstream(upstream_url="http://localhost:8000/v1")
                   ).status == 201
    # Metadata stays refused whatever the operator allows.
    assert_openai_error(pa.patch("/api/v1/deployments/big",
                                 {"upstream_url": "http://169.254.169.254/v1"}), 422)
    assert Deployment.objects.get(name="big").upstream_url == "http://localhost:8000/v1"


def test_a_name_resolving_to_any_forbidden_address_is_refused() -> None:
    # The attacker's DNS answers with a public address and the metadata one.
    def rebinding(host: str, port: int) -> list[str]:
        return ["8.8.8.8", "169.254.169.254"]

    with pytest.raises(UpstreamURLError, match="metadata"):
        validate_url("https://llm.example.com/v1", private_ok=True, resolve=rebinding)
    assert validate_url("https://LLM.example.com/v1/", private_ok=False,
                        resolve=lambda h, p: ["8.8.8.8"]) == "https://llm.example.com/v1"


@pytest.mark.parametrize("ip", ["64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "fe80::1",
                                "224.0.0.1", "240.0.0.1", "255.255.255.255", "0.1.2.3"])
def test_addresses_refused_even_when_private_ones_are_allowed(ip: str) -> None:
    assert address_refusal(ipaddress.ip_address(ip), private_ok=True) is not None


@pytest.mark.parametrize("body", [
    ChatCompletionRequest, CompletionRequest, EmbeddingRequest, AnthropicMessagesRequest,
    ResponsesRequest,
])
@pytest.mark.parametrize("field", ["api_base", "base_url", "upstream_url"])
def test_no_request_body_can_choose_an_upstream(body: type[Any], field: str) -> None:
    # LiteLLM's CVE-2024-6587: a caller-set api_base. Every /v1 body refuses unknown
    # fields, so the field is a 400 ("Unrecognized request argument") before routing.
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "prompt": "x", "input": "x", "max_tokens": 5}
    valid = {k: v for k, v in base.items() if k in body.model_fields}
    body.model_validate(valid)
    with pytest.raises(ValidationError) as refused:
        body.model_validate({**valid, field: "http://169.254.169.254/"})
    assert refused.value.errors()[0]["type"] == "extra_forbidden"


# -- model aliases ---------------------------------------------------------------------
@pytest.fixture
def chat_models(db: None) -> None:
    for name, context in (("a", 2048), ("b", 4096), ("c", 8192)):
        Deployment.objects.create(name=name, runtime="echo", max_context=context)
    Deployment.objects.create(name="minilm", runtime="encoder", weights="pkg:x")


def test_platform_admins_manage_aliases(ops: Org, chat_models: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    made = pa.post("/api/v1/model-aliases", {
        "name": "meta-llama/Llama-3.1-8B-Instruct", "description": "the big one",
        "targets": [{"deployment": "a", "weight": 3}, {"deployment": "b"}],
        "fallbacks": ["c"]})
    assert made.status == 201, made.body
    assert made.body["targets"] == [{"deployment": "a", "weight": 3, "share": 0.75},
                                    {"deployment": "b", "weight": 1, "share": 0.25}]
    assert made.body["fallbacks"] == ["c"]
    one = pa.get("/api/v1/model-aliases/meta-llama/Llama-3.1-8B-Instruct")
    assert one.status == 200 and one.body["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    changed = pa.patch("/api/v1/model-aliases/meta-llama/Llama-3.1-8B-Instruct",
                       {"fallbacks": ["b", "c"], "targets": [{"deployment": "a"}]}).body
    assert [t["deployment"] for t in changed["targets"]] == ["a"]
    assert changed["fallbacks"] == ["b", "c"]
    kept = pa.patch("/api/v1/model-aliases/meta-llama/Llama-3.1-8B-Instruct",
                    {"enabled": False}).body
    assert kept["fallbacks"] == ["b", "c"] and kept["enabled"] is False
    assert [a["name"] for a in pa.get("/api/v1/model-aliases").body["items"]] == [
        "meta-llama/Llama-3.1-8B-Instruct"]
    assert pa.delete("/api/v1/model-aliases/meta-llama/Llama-3.1-8B-Instruct").status == 204
    assert not ModelAlias.objects.exists()
    assert_openai_error(pa.get("/api/v1/model-aliases/meta-llama/Llama-3.1-8B-Instruct"), 404)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"targets": []}, 422, "targets"),
    ({"targets": [{"deployment": "a", "weight": 0}]}, 422, "targets.0.weight"),
    ({"targets": [{"deployment": "nope"}]}, 422, "targets"),
    ({"targets": [{"deployment": "a"}, {"deployment": "a"}]}, 422, "targets"),
    ({"targets": [{"deployment": "a"}], "fallbacks": ["a"]}, 422, "fallbacks"),
    ({"targets": [{"deployment": "a"}], "fallbacks": ["zz"]}, 422, "fallbacks"),
    ({"targets": [{"deployment": "a"}, {"deployment": "minilm"}]}, 422, "targets"),
    ({"name": "b", "targets": [{"deployment": "a"}]}, 409, "name"),
    ({"name": "bad name", "targets": [{"deployment": "a"}]}, 422, "name"),
    ({"targets": [{"deployment": "a"}], "api_base": "http://x"}, 422, "api_base"),
])
def test_invalid_aliases_are_refused_and_not_saved(ops: Org, chat_models: None,
                                                   body: dict[str, Any], status: int,
                                                   param: str) -> None:
    error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).post(
        "/api/v1/model-aliases", {"name": "chat", **body}), status)
    assert error["param"] == param
    assert not ModelAlias.objects.exists()


def test_a_deployment_cannot_take_an_alias_s_name(ops: Org, chat_models: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    pa.post("/api/v1/model-aliases", {"name": "chat", "targets": [{"deployment": "a"}]})
    assert_openai_error(pa.post("/api/v1/deployments", {"name": "chat", "runtime": "echo"}), 409)


@pytest.mark.parametrize("role", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
def test_tenants_neither_read_nor_change_aliases(ops: Org, alice: Org, chat_models: None,
                                                 role: Role) -> None:
    ops.client(Role.PLATFORM_ADMIN).post("/api/v1/model-aliases", {
        "name": "chat", "targets": [{"deployment": "a"}]})
    client = alice.client(role)
    assert_openai_error(client.get("/api/v1/model-aliases"), 403)
    assert_openai_error(client.patch("/api/v1/model-aliases/chat",
                                     {"targets": [{"deployment": "b"}]}), 403)
    assert_openai_error(client.delete("/api/v1/model-aliases/chat"), 403)
    assert_openai_error(client.post("/api/v1/model-aliases", {
        "name": "x", "targets": [{"deployment": "a"}]}), 403)
    alias = ModelAlias.objects.get(name="chat")
    assert [t.deployment.name for t in alias.targets.all()] == ["a"]
    assert ModelAlias.objects.count() == 1


@pytest.mark.django_db(transaction=True)  # read from another thread's connection
def test_the_hot_path_reads_enabled_aliases_as_routes(ops: Org, chat_models: None,
                                                      settings: Any) -> None:
    settings.SLUICE_REGISTRY_CACHE_TTL_S = 0
    pa = ops.client(Role.PLATFORM_ADMIN)
    pa.post("/api/v1/model-aliases", {"name": "chat", "targets": [
        {"deployment": "a", "weight": 2}, {"deployment": "b"}], "fallbacks": ["c"]})
    Deployment.objects.filter(name="b").update(enabled=False)
    selectors.clear_routes()
    route = asyncio.run(selectors.alias_route("chat"))
    assert route == Route(alias="chat", targets=(Target("a", 2, 2048), Target("b", 1, 4096,
                                                                                  enabled=False)),
                          fallbacks=(Target("c", 1, 8192),))
    pa.patch("/api/v1/model-aliases/chat", {"enabled": False})
    assert asyncio.run(selectors.alias_route("chat")) is None
    assert asyncio.run(selectors.alias_route("a")) is None  # a deployment is no alias
    audit.drain()  # this test's admin events land before its tables go


@pytest.mark.django_db(transaction=True)
def test_upstream_and_alias_writes_are_audited_without_the_key(ops: Org, chat_models: None,
                                                                private_ok: None) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    pa.post("/api/v1/deployments", _upstream(upstream_api_key=KEY))
    pa.patch("/api/v1/deployments/big", {"upstream_api_key": KEY + "2", "upstream_model": "m2"})
    pa.post("/api/v1/model-aliases", {"name": "chat", "targets": [{"deployment": "a"}]})
    pa.patch("/api/v1/model-aliases/chat", {"fallbacks": ["big"]})
    pa.delete("/api/v1/model-aliases/chat")
    audit.drain()
    events = list(AuditEvent.objects.filter(protocol="admin", tenant_id=ops.tenant.pk).exclude(
        action="apikey.create").order_by("id"))
    actions = [(e.action, e.target) for e in events]
    assert actions == [("deployment.create", "deployment:big"),
                       ("deployment.update", "deployment:big"),
                       ("model_alias.create", "model_alias:chat"),
                       ("model_alias.update", "model_alias:chat"),
                       ("model_alias.delete", "model_alias:chat")]
    dumped = json.dumps([{f.name: str(getattr(e, f.name)) for f in e._meta.concrete_fields}
                         for e in events])
    assert KEY[:-4] not in dumped
    assert events[0].detail == {"upstream_api_key": "set"}
    assert events[1].detail == {"upstream_api_key": "set", "upstream_model": "m2"}
    assert "big" in events[3].detail["fallbacks"]


def test_the_api_documents_the_key_as_write_only() -> None:
    schema = ApiClient().get("/api/openapi.json").body
    create = schema["components"]["schemas"]["DeploymentCreateIn"]["properties"]
    key = create["upstream_api_key"]
    options = key.get("anyOf", [key])
    assert any(o.get("writeOnly") or o.get("format") == "password" for o in options), key
    out = schema["components"]["schemas"]["DeploymentOut"]["properties"]
    assert "upstream_api_key" not in out and "upstream_secret" not in out
