"""The admin UI's upstream and model-alias pages through Django's test client: platform
admins only, the API key never shown, bad input refused inline with nothing saved."""

from __future__ import annotations

from typing import Any

import pytest

from inference.models import Deployment, ModelAlias
from inference.upstream import secrets
from tenants.roles import Role
from tests.conftest import Org, signed_in

pytestmark = pytest.mark.django_db

KEY = "sk-upstream-UIPLUM-0123456789abcdef"
PAGES = ["/ui/upstreams", "/ui/upstreams/new", "/ui/aliases", "/ui/aliases/new"]


@pytest.fixture
def private_ok(settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True


def _form(**extra: Any) -> dict[str, Any]:
    return {"name": "big", "upstream_url": "http://127.0.0.1:8000/v1",
            "upstream_model": "meta-llama/Llama-3.1-8B-Instruct", "upstream_dialect": "vllm",
            "max_context": 8192, "upstream_concurrency": 32,
            "upstream_connect_timeout_s": 5, "upstream_read_timeout_s": 60,
            "description": "", **extra}


@pytest.mark.parametrize("role", [Role.DEVELOPER, Role.AUDITOR, Role.TENANT_ADMIN])
def test_only_platform_admins_open_the_pages(alice: Org, role: Role) -> None:
    client = signed_in(alice, role)
    for url in PAGES:
        assert client.get(url).status_code == 403, url
    response = client.post("/ui/upstreams/new", _form(upstream_api_key=KEY))
    assert response.status_code == 403 and not Deployment.objects.exists()


def test_an_admin_adds_an_upstream_and_its_key_is_never_shown(ops: Org,
                                                              private_ok: None) -> None:
    client = signed_in(ops, Role.PLATFORM_ADMIN)
    for url in PAGES:
        assert client.get(url).status_code == 200, url
    nav = client.get("/ui/upstreams").content.decode()
    assert 'href="/ui/upstreams"' in nav and 'href="/ui/aliases"' in nav
    created = client.post("/ui/upstreams/new", _form(upstream_api_key=KEY))
    assert created.status_code == 302 and created["Location"] == "/ui/upstreams"
    row = Deployment.objects.get(name="big")
    assert row.runtime == "openai_upstream" and row.enabled is True
    assert secrets.unseal(row.upstream_secret).reveal() == KEY
    listing = client.get("/ui/upstreams").content.decode()
    edit = client.get("/ui/upstreams/big").content.decode()
    assert "meta-llama/Llama-3.1-8B-Instruct" in listing and "…cdef" in listing
    assert "ending in …cdef" in edit
    for page in (listing, edit):
        assert KEY not in page and KEY[:-4] not in page


def test_editing_keeps_replaces_or_removes_the_key(ops: Org, private_ok: None) -> None:
    client = signed_in(ops, Role.PLATFORM_ADMIN)
    client.post("/ui/upstreams/new", _form(upstream_api_key=KEY))
    form = {k: v for k, v in _form().items() if k != "name"}
    assert client.post("/ui/upstreams/big", {**form, "upstream_read_timeout_s": 30}
                       ).status_code == 302
    row = Deployment.objects.get(name="big")
    assert row.upstream_read_timeout_s == 30 and secrets.unseal(row.upstream_secret).reveal() == KEY
    client.post("/ui/upstreams/big", {**form, "upstream_api_key": "sk-new-key-abcdefgh-WXYZ"})
    assert Deployment.objects.get(name="big").upstream_secret_hint == "WXYZ"
    client.post("/ui/upstreams/big", {**form, "remove_api_key": "on"})
    assert Deployment.objects.get(name="big").upstream_secret == ""


@pytest.mark.parametrize(("changes", "field"), [
    ({"upstream_url": "http://169.254.169.254/latest"}, "upstream_url"),
    ({"upstream_url": "ftp://example.com/v1"}, "upstream_url"),
    ({"upstream_concurrency": 0}, "upstream_concurrency"),
    ({"upstream_model": ""}, "upstream_model"),
    ({"name": "bad name"}, "name"),
])
def test_bad_upstreams_are_refused_inline_and_nothing_is_saved(
        ops: Org, private_ok: None, changes: dict[str, Any], field: str) -> None:
    response = signed_in(ops, Role.PLATFORM_ADMIN).post(
        "/ui/upstreams/new", _form(upstream_api_key=KEY, **changes))
    assert response.status_code == 422
    page = response.content.decode()
    assert f'data-field="{field}"' in page, page
    assert KEY not in page  # the key is not put back into the form
    assert not Deployment.objects.exists()


def test_an_admin_manages_an_alias(ops: Org) -> None:
    for name in ("a", "b", "c"):
        Deployment.objects.create(name=name, runtime="echo")
    client = signed_in(ops, Role.PLATFORM_ADMIN)
    made = client.post("/ui/aliases/new", {"name": "org/chat", "enabled": "on",
                                            "targets": "a=3\nb", "fallbacks": "c"})
    assert made.status_code == 302, made.content
    alias = ModelAlias.objects.get(name="org/chat")
    assert [(t.deployment.name, t.weight) for t in alias.targets.all()] == [("a", 3), ("b", 1)]
    page = client.get("/ui/aliases/org/chat/edit").content.decode()
    assert "75.0%" in page and "25.0%" in page and "fallback 1" in page
    assert "org/chat" in client.get("/ui/aliases").content.decode()
    saved = client.post("/ui/aliases/org/chat/edit", {"targets": "b=1", "fallbacks": "a, c",
                                                      "description": "moved"})
    assert saved.status_code == 302
    alias.refresh_from_db()
    assert alias.enabled is False and alias.description == "moved"
    assert [f.deployment.name for f in alias.fallbacks.all()] == ["a", "c"]
    bad = client.post("/ui/aliases/org/chat/edit", {"targets": "nope=1"})
    assert bad.status_code == 422 and 'data-field="targets"' in bad.content.decode()
    assert [t.deployment.name for t in alias.targets.all()] == ["b"]
    gone = client.post("/ui/aliases/org/chat/edit", {"delete": "1"})
    assert gone.status_code == 302 and not ModelAlias.objects.exists()


@pytest.mark.parametrize(("targets", "fallbacks"), [
    ("a=0", ""), ("a=x", ""), ("", ""), ("a\na", ""), ("a", "a"), ("zz", ""),
])
def test_bad_aliases_are_refused_inline(ops: Org, targets: str, fallbacks: str) -> None:
    Deployment.objects.create(name="a", runtime="echo")
    response = signed_in(ops, Role.PLATFORM_ADMIN).post(
        "/ui/aliases/new", {"name": "chat", "targets": targets, "fallbacks": fallbacks})
    assert response.status_code == 422
    assert 'class="error"' in response.content.decode()
    assert not ModelAlias.objects.exists()


def test_a_non_upstream_deployment_has_no_upstream_page(ops: Org) -> None:
    Deployment.objects.create(name="echo", runtime="echo")
    response = signed_in(ops, Role.PLATFORM_ADMIN).get("/ui/upstreams/echo")
    assert response.status_code == 404
