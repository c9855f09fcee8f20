"""What GET /api/v1/deployments shows to whom: platform admins read a deployment in
full; every role of a tenant reads what it can call, nothing of where calls go."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tenants.roles import Role
from tests.conftest import ApiClient, Org

pytestmark = pytest.mark.django_db

UPSTREAM: dict[str, Any] = {"name": "relay", "runtime": "openai_upstream", "description": "a relay",
            "upstream_url": "http://10.20.30.40:8000/v1", "max_context": 8192,
            "upstream_model": "meta-llama/Llama-3.1-8B-Instruct", "upstream_dialect": "vllm",
            "upstream_api_key": "sk-upstream-relay-0123456789abcdef-QZ7W"}
SUMMARY = {"name", "kind", "description", "max_context", "enabled", "created_at"}
# What an answer must not hold for a tenant, wherever it is (values, not only keys).
INTERNALS = ["10.20.30.40", "Llama-3.1", "QZ7W", "upstream", "openai_upstream", "vllm"]


@pytest.fixture
def relay(ops: Org, settings: Any) -> ApiClient:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True
    admin = ops.client(Role.PLATFORM_ADMIN)
    assert admin.post("/api/v1/deployments", UPSTREAM).status == 201
    return admin


@pytest.mark.parametrize("role", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
def test_a_tenant_reads_no_upstream_internals(relay: ApiClient, alice: Org,
                                              role: Role) -> None:
    # given an upstream deployment, when any role of a tenant lists it or reads it
    client = alice.client(role)
    listed, one = client.get("/api/v1/deployments"), client.get("/api/v1/deployments/relay")
    # then it sees what it can call: name, kind, description, context length
    assert listed.status == 200 and one.status == 200, (listed.body, one.body)
    [row] = [d for d in listed.body["items"] if d["name"] == "relay"]
    assert row == one.body
    assert set(row) == SUMMARY, row
    assert (row["kind"], row["max_context"], row["description"]) == ("chat", 8192, "a relay")
    # and nothing of where its calls go or of the operator's settings
    dumped = json.dumps([listed.body, one.body])
    for internal in INTERNALS:
        assert internal not in dumped, internal


def test_a_platform_admin_reads_a_deployment_in_full(relay: ApiClient) -> None:
    # when the operator lists or reads the deployment
    listed, one = relay.get("/api/v1/deployments"), relay.get("/api/v1/deployments/relay")
    # then the upstream's URL, model and key hint are there (the key itself never is)
    [row] = [d for d in listed.body["items"] if d["name"] == "relay"]
    assert row == one.body
    assert row["upstream_url"] == "http://10.20.30.40:8000/v1"
    assert row["upstream_model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert row["upstream_api_key_hint"] == "QZ7W" and row["upstream_api_key_set"] is True
    assert row["runtime"] == "openai_upstream" and "max_queue_depth" in row
    assert UPSTREAM["upstream_api_key"][:-4] not in json.dumps([listed.body, one.body])


def test_the_api_documents_both_views() -> None:
    schemas = ApiClient().get("/api/openapi.json").body["components"]["schemas"]
    assert [s["$ref"].rsplit("/", 1)[1] for s in schemas["DeploymentView"]["oneOf"]] == \
        ["DeploymentOut", "DeploymentSummaryOut"]
    # a full view is never also a summary: exactly one of oneOf matches either
    summary = schemas["DeploymentSummaryOut"]
    assert set(summary["properties"]) == SUMMARY and summary["additionalProperties"] is False


def test_engine_options_are_checked_and_reach_the_spec(ops: Org) -> None:
    from inference.models import Deployment

    admin = ops.client(Role.PLATFORM_ADMIN)
    created = admin.post("/api/v1/deployments", {
        "name": "lm", "runtime": "tiny_causal_lm",
        "engine": {"decode": "static", "prefix_cache_tokens": 4096, "prefix_block_tokens": 32}})
    assert created.status == 201, created.body
    assert created.body["engine"] == {"decode": "static", "prefix_cache_tokens": 4096,
                                      "prefix_block_tokens": 32}
    extra = Deployment.objects.get(name="lm").to_spec().extra
    assert extra == {"decode": "static", "prefix_cache_tokens": 4096, "prefix_block_tokens": 32}
    # Out of range, unknown, or both KV sizes: a 422 naming the field; nothing changes.
    for engine in ({"prefix_cache_tokens": -1}, {"prefix_block_tokens": 0},
                   {"decode": "paged"}, {"kv_cache_memory_fraction": 0.99}, {"speed": 2},
                   {"kv_cache_tokens": 100, "kv_cache_memory_fraction": 0.5}):
        refused = admin.patch("/api/v1/deployments/lm", {"engine": engine})
        assert refused.status == 422 and "engine" in json.dumps(refused.body), refused.body
    assert Deployment.objects.get(name="lm").engine["prefix_block_tokens"] == 32
    # Replaced as a whole; {} is the defaults.
    assert admin.patch("/api/v1/deployments/lm", {"engine": {}}).body["engine"] == {}
