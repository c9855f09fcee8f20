"""The deployment registry API and the OpenAI-style model list."""

from __future__ import annotations

import pytest

from inference.models import AliasFallback, AliasTarget, Deployment, ModelAlias
from inference.services import deployment_seed_defaults
from tenants.roles import Role
from tests.conftest import ApiClient, Org, assert_openai_error

pytestmark = pytest.mark.django_db


def test_platform_admin_registers_and_tunes_a_deployment(ops: Org) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    created = pa.post("/api/v1/deployments", {"name": "my-llama", "runtime": "causal_lm",
                                              "weights": "/models/llama", "max_batch_size": 32})
    assert created.status == 201 and created.body["kind"] == "chat"
    updated = pa.patch("/api/v1/deployments/my-llama", {"max_wait_ms": 25, "enabled": False})
    assert updated.body["max_wait_ms"] == 25 and updated.body["max_batch_size"] == 32
    spec = Deployment.objects.get(name="my-llama").to_spec()
    assert (spec.max_batch_size, spec.max_wait_ms) == (32, 25)


@pytest.mark.parametrize("body", [
    {"name": "bad name!", "runtime": "echo"},
    {"name": "x", "runtime": "quantum"},
    {"name": "x", "runtime": "causal_lm"},  # weights required
    {"name": "x", "runtime": "echo", "max_batch_size": 0},
    {"name": "x", "runtime": "echo", "tenant_queue_share": 1.5},
    {"name": "x", "runtime": "echo", "device": "tpu"},
    {"name": "{x}", "runtime": "echo"},
    {"name": "x", "runtime": "echo", "min_replicas": 3, "max_replicas": 2},
    {"name": "x", "runtime": "echo", "max_replicas": 0},
    {"name": "x", "runtime": "echo", "scale_up_delay_s": -1},
    {"name": "x", "runtime": "echo", "max_queue_age_s": 0},
    {"name": "x", "runtime": "echo", "target_inflight": 0},
])
def test_invalid_deployments_are_422_and_not_saved(ops: Org, body: dict[str, object]) -> None:
    error = assert_openai_error(ops.client(Role.PLATFORM_ADMIN).post("/api/v1/deployments", body),
                                422)
    assert error["param"]
    assert not Deployment.objects.exists()


def test_duplicate_deployment_is_409(ops: Org) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    pa.post("/api/v1/deployments", {"name": "e", "runtime": "echo"})
    assert_openai_error(pa.post("/api/v1/deployments", {"name": "e", "runtime": "echo"}), 409)


def test_model_list_shows_enabled_models_within_the_key_allow_list(alice: Org) -> None:
    deployment_seed_defaults()
    Deployment.objects.create(name="retired", runtime="echo", enabled=False)
    dev = alice.client(Role.DEVELOPER)
    listed = dev.get("/v1/models").body
    assert listed["object"] == "list"
    names = {m["id"] for m in listed["data"]}
    assert names == {"smollm2-135m-instruct", "all-minilm-l6-v2", "injection-guard", "echo"}
    assert all(m["object"] == "model" and m["owned_by"] == "sluice" for m in listed["data"])
    narrow = dev.post("/api/v1/keys", {"name": "n", "allowed_models": ["echo"]}).body["key"]
    assert [m["id"] for m in ApiClient(narrow).get("/v1/models").body["data"]] == ["echo"]
    assert ApiClient(narrow).get("/v1/models/echo").body["id"] == "echo"
    error = assert_openai_error(ApiClient(narrow).get("/v1/models/smollm2-135m-instruct"), 404)
    assert error["code"] == "model_not_found"
    assert_openai_error(dev.get("/v1/models/retired"), 404)
    assert_openai_error(ApiClient().get("/v1/models"), 401)


def test_model_list_shows_the_aliases_a_key_may_use(alice: Org) -> None:
    # Given aliases over echo (one a fallback only), a disabled one, one whose only
    # deployment is disabled, and a key that allows one alias and echo.
    deployment_seed_defaults()
    echo = Deployment.objects.get(name="echo")
    retired = Deployment.objects.create(name="retired", runtime="echo", enabled=False)
    served = ModelAlias.objects.create(name="org/chat")
    AliasTarget.objects.create(alias=served, deployment=echo, weight=2)
    backup = ModelAlias.objects.create(name="backup")
    AliasTarget.objects.create(alias=backup, deployment=retired)
    AliasFallback.objects.create(alias=backup, deployment=echo, position=0)
    off = ModelAlias.objects.create(name="org/off", enabled=False)
    AliasTarget.objects.create(alias=off, deployment=echo)
    dead = ModelAlias.objects.create(name="org/dead")
    AliasTarget.objects.create(alias=dead, deployment=retired)
    dev = alice.client(Role.DEVELOPER)
    # When the developer lists the models, then the aliases that can serve are there, in
    # OpenAI's model shape with the limits of their deployments, sorted by id with the
    # deployments.
    listed = dev.get("/v1/models").body["data"]
    assert [m["id"] for m in listed] == ["all-minilm-l6-v2", "backup", "echo",
                                         "injection-guard", "org/chat",
                                         "smollm2-135m-instruct"]
    chat = dev.get("/v1/models/org/chat").body
    assert chat == {"id": "org/chat", "object": "model", "owned_by": "sluice",
                    "created": int(served.created_at.timestamp()),
                    "context_window": echo.max_context,
                    "max_output_tokens": echo.max_context - 1}
    for hidden in ("org/off", "org/dead", "org/none"):
        assert assert_openai_error(dev.get(f"/v1/models/{hidden}"), 404)["code"] == \
            "model_not_found"
    # A key's allow-list must name the alias: allowing its deployment is not enough.
    narrow = dev.post("/api/v1/keys", {"name": "n", "allowed_models": ["echo", "backup"]}
                      ).body["key"]
    assert [m["id"] for m in ApiClient(narrow).get("/v1/models").body["data"]] == \
        ["backup", "echo"]
    assert_openai_error(ApiClient(narrow).get("/v1/models/org/chat"), 404)
    assert ApiClient(narrow).get("/v1/models/backup").body["id"] == "backup"


def test_seeding_is_idempotent_and_keeps_edits(db: None) -> None:
    deployment_seed_defaults()
    Deployment.objects.filter(name="echo").update(max_batch_size=3)
    deployment_seed_defaults()
    assert Deployment.objects.count() == 4
    assert Deployment.objects.get(name="echo").max_batch_size == 3
