"""What Sluice stores beyond a call, redacted per the tenant's policy.

The policy (tenants/privacy.py: redact or not, set by a tenant admin, audited; on by
default) applies to conversation turns, batch output and error files and batch
metadata. Redaction here is the same engine as the audit log's
(platform/sluice/pii/redaction.py) with the tenant's own patterns added.

For the async hot path the tenant's flag is cached in-process for
SLUICE_POLICY_CACHE_TTL_S; a policy change bumps tenants.privacy.EPOCH_KEY on commit
and every process drops its cache within about a second. Sync callers (services,
the batch job) read the policy once per operation with `redactor_now`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings

from governance.cache import load_tenant, tenant_policies
from sluice.db import async_db
from sluice.epoch import Epoch
from sluice.pii.redaction import redact
from sluice.ttlcache import AsyncTTLCache
from tenants.principal import Principal
from tenants.privacy import EPOCH_KEY, PrivacyPolicy, policy_of

Redactor = Callable[[str], str]
Patterns = Iterable[tuple[str, re.Pattern[str]]]

_policies: AsyncTTLCache[int, PrivacyPolicy] = AsyncTTLCache(max_entries=100_000)
_epoch = Epoch(EPOCH_KEY)


def _keep(text: str) -> str:
    return text


async def _policy(tenant_id: int) -> PrivacyPolicy:
    """The tenant's policy (cached; see the module's doc)."""
    if await _epoch.moved():
        _policies.clear()
    return await _policies.get(tenant_id, lambda: async_db(policy_of)(tenant_id),
                               float(settings.SLUICE_POLICY_CACHE_TTL_S))


async def redacts(tenant_id: int) -> bool:
    """Whether the tenant's stored data is redacted (cached; see the module's doc)."""
    return (await _policy(tenant_id)).redact_stored


async def cache_scope(principal: Principal) -> str:
    """A chat job's `cache_scope` (inference/jobs.py): the caller's API key (or token
    subject) when its tenant shares the prefix cache per key, else "" (the tenant's
    calls share it; the queue entry's tenant always salts it)."""
    if not (await _policy(principal.tenant_id)).prefix_cache_per_key:
        return ""
    return principal.key_prefix or principal.subject


async def redactor(tenant_id: int) -> Redactor:
    """The tenant's `text -> stored text` (the identity when it turned redaction off)."""
    if not await redacts(tenant_id):
        return _keep
    patterns = (await tenant_policies(tenant_id)).redaction
    return lambda text: redact(text, patterns)


async def stored_text(principal: Principal, text: str) -> str:
    """`text` as it may be stored for the principal's tenant."""
    return (await redactor(principal.tenant_id))(text)


async def stored_messages(principal: Principal,
                          messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation turn (chat messages) as it may be stored: each `content`
    redacted unless the tenant turned redaction off. Call before
    tenants.conversations.conversation_append."""
    clean = await redactor(principal.tenant_id)
    return [{**m, "content": clean(m.get("content") or "")} for m in messages]


def redactor_now(tenant_id: int) -> Redactor:
    """`redactor` for sync code: reads the policy (and the tenant's patterns) now."""
    if not policy_of(tenant_id).redact_stored:
        return _keep
    patterns = load_tenant(tenant_id).redaction
    return lambda text: redact(text, patterns)


def redact_json(value: Any, clean: Redactor, *, keys: bool = False) -> Any:
    """Every string in a JSON value through `clean` (object keys too when `keys`);
    numbers, booleans and structure stay (redacting serialized JSON could turn a
    timestamp into an unquoted placeholder)."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, list):
        return [redact_json(v, clean, keys=keys) for v in value]
    if isinstance(value, dict):
        return {(clean(k) if keys and isinstance(k, str) else k): redact_json(v, clean, keys=keys)
                for k, v in value.items()}
    return value


def clear() -> None:
    """Forget the cached policies (tests; a process that changed a policy itself)."""
    _policies.clear()
    _epoch.reset()
