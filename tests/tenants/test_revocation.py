"""Revoking a key takes the rights that creating it would: a key of the caller's reach
whose role, priority or model scope the caller could not have given is a 403 and stays
usable; a key out of reach is a 404, like a missing one. Against a live server."""

from __future__ import annotations

import httpx

from tenants.models import ApiKey
from tenants.roles import Role
from tenants.services import CreatedKey, apikey_create
from tests.conftest import make_org, principal_for
from tests.tenants import test_throttle

server = test_throttle.server  # the live-server fixture, used here by that name


def revoke(base: str, key: str, key_id: int) -> httpx.Response:
    return httpx.delete(f"{base}/api/v1/keys/{key_id}", timeout=30,
                        headers={"Authorization": f"Bearer {key}"})


def me(base: str, key: str) -> int:
    return httpx.get(f"{base}/api/v1/me", timeout=30,
                     headers={"Authorization": f"Bearer {key}"}).status_code


def assert_refused(response: httpx.Response, status: int, key: CreatedKey, base: str) -> None:
    """Refused with `status` in OpenAI's shape, and the key unchanged and still usable."""
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert ApiKey.objects.get(pk=key.key.pk).revoked_at is None
    assert me(base, key.secret) == 200


def test_a_developer_key_cannot_revoke_its_members_platform_admin_key(server: str) -> None:
    # Given a platform admin with its own key and a developer key it made for itself
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    admin = principal_for(ops.members[Role.PLATFORM_ADMIN])
    admin_key = CreatedKey(ops.key_rows[Role.PLATFORM_ADMIN], ops.keys[Role.PLATFORM_ADMIN])
    dev_key = apikey_create(actor=admin, name="ci", role=Role.DEVELOPER)
    # When the developer key revokes the platform-admin key
    answer = revoke(server, dev_key.secret, admin_key.key.pk)
    # Then it is a 403, and the admin key still works
    assert_refused(answer, 403, admin_key, server)
    assert answer.json()["error"]["type"] == "permission_error"


def test_an_auditor_key_cannot_revoke_a_developer_key_of_the_same_member(server: str) -> None:
    # Given a tenant admin with a developer key and an auditor key
    alice = make_org("alice", [Role.TENANT_ADMIN])
    admin = principal_for(alice.members[Role.TENANT_ADMIN])
    dev_key = apikey_create(actor=admin, name="dev", role=Role.DEVELOPER)
    auditor_key = apikey_create(actor=admin, name="audit", role=Role.AUDITOR)
    # When the auditor key revokes the developer key
    answer = revoke(server, auditor_key.secret, dev_key.key.pk)
    # Then it is a 403, and the developer key still works
    assert_refused(answer, 403, dev_key, server)


def test_a_key_cannot_revoke_what_it_could_not_create(server: str) -> None:
    # Given a tenant admin's priority key, unrestricted key, and a developer key
    # narrowed to one model, all of the same member
    alice = make_org("alice", [Role.TENANT_ADMIN])
    admin = principal_for(alice.members[Role.TENANT_ADMIN])
    priority = apikey_create(actor=admin, name="prio", role=Role.DEVELOPER, priority=5)
    wide = apikey_create(actor=admin, name="wide", role=Role.DEVELOPER)
    narrow = apikey_create(actor=admin, name="narrow", role=Role.DEVELOPER,
                           allowed_models=["tiny"])
    # When the narrowed developer key revokes the priority key and the unrestricted one
    # Then both are 403s and both keys still work
    assert_refused(revoke(server, narrow.secret, priority.key.pk), 403, priority, server)
    assert_refused(revoke(server, narrow.secret, wide.key.pk), 403, wide, server)
    # and the unrestricted developer key may not revoke the priority key either
    assert_refused(revoke(server, wide.secret, priority.key.pk), 403, priority, server)


def test_keys_still_revoke_what_they_could_have_created(server: str) -> None:
    # Given a tenant admin's key, two developer keys of its own, and a narrowed one
    alice = make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])
    admin = principal_for(alice.members[Role.TENANT_ADMIN])
    dev_a = apikey_create(actor=admin, name="a", role=Role.DEVELOPER)
    dev_b = apikey_create(actor=admin, name="b", role=Role.DEVELOPER)
    narrow = apikey_create(actor=admin, name="n", role=Role.DEVELOPER, allowed_models=["tiny"])
    also_narrow = apikey_create(actor=admin, name="n2", role=Role.DEVELOPER,
                                allowed_models=["tiny"])
    # When each revokes a key it could have made
    answers = [revoke(server, dev_a.secret, dev_b.key.pk),
               revoke(server, narrow.secret, also_narrow.key.pk),
               revoke(server, alice.keys[Role.TENANT_ADMIN], alice.key_rows[Role.DEVELOPER].pk)]
    # Then each is revoked
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert all(a.json()["revoked_at"] for a in answers)
    assert me(server, dev_b.secret) == me(server, also_narrow.secret) == 401


def test_a_key_out_of_reach_is_a_404_like_a_missing_one(server: str) -> None:
    # Given alice's developer, alice's tenant admin and bob's developer
    alice = make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])
    bob = make_org("bob", [Role.DEVELOPER])
    dev = alice.keys[Role.DEVELOPER]
    admin_key = CreatedKey(alice.key_rows[Role.TENANT_ADMIN], alice.keys[Role.TENANT_ADMIN])
    bob_key = CreatedKey(bob.key_rows[Role.DEVELOPER], bob.keys[Role.DEVELOPER])
    # When alice's developer revokes another member's key, another tenant's, a missing one
    answers = [revoke(server, dev, admin_key.key.pk), revoke(server, dev, bob_key.key.pk),
               revoke(server, dev, 10**9)]
    # Then all three are the same 404, and nothing changed
    assert {a.status_code for a in answers} == {404}
    assert len({a.text for a in answers}) == 1
    assert_refused(answers[0], 404, admin_key, server)
    assert_refused(answers[1], 404, bob_key, server)
