"""Guardrail policies written and read: who may set which, and what a policy may say.

Who: platform admins set platform policies (every call; `mandatory` ones a tenant
cannot weaken) and any tenant's; tenant admins set their tenant's (tenant, key and
deployment scopes); auditors and tenant admins read their tenant's and the platform's.
Every write is validated before anything is saved (a 4xx saves nothing), audited
(`guardrail.create` / `.update` / `.delete`, never a secret) and reaches the gateways
within a second (governance/cache.py).

What: `guard` pii, words, webhook, classifier or judge;
`action` mask is refused in phase `during` (the request is already queued: only block
or flag) and for a classifier or judge (they find, they do not rewrite); scope `key` names a key
of the policy's tenant (another tenant's is the same 404 as a missing one); scope
`deployment` names a deployment or alias that exists; `config` is checked per guard
(guards.py `check_words_config`; a webhook's `url` passes the upstream SSRF guard, its
`params` are a small object; a classifier's `deployment` is a classifier deployment; a
judge's `model` a chat deployment or alias);
a webhook's secret is sealed at rest and write-only: Sluice makes one when none is
given and returns it once, in the reply that created the policy.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.db import transaction
from django.db.models import Q, QuerySet

from governance import cache
from governance.alerts import signing_secret
from governance.audit import record_action
from governance.guardrail_models import GuardrailPolicy, GuardScope
from governance.guardrails.classifier import check_config as check_classifier_config
from governance.guardrails.guards import check_words_config
from governance.guardrails.judge import check_config as check_judge_config
from governance.models import RedactionPattern
from governance.selectors import governed_key, governed_tenant
from inference.models import Deployment, ModelAlias
from inference.spec import RuntimeName
from inference.upstream.urls import UpstreamURLError, validate_url
from sluice.errors import NotFound, PermissionDenied, Unprocessable
from sluice.pii.redaction import RECOGNIZERS
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require

PARAMS_MAX_BYTES = 4096
_FIELDS = ("name", "action", "categories", "config", "mandatory", "shadow", "enabled",
           "timeout_ms", "on_error")


def guardrail_list(*, actor: Principal, tenant_id: int | None = None
                   ) -> QuerySet[GuardrailPolicy]:
    """Platform admins: every policy (or one tenant's and the platform's); anyone else
    with governance or audit rights: their tenant's and the platform's."""
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY, Action.AUDIT_READ)
    rows = GuardrailPolicy.objects.order_by("id")
    if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
        tenant_id = actor.tenant_id
    elif tenant_id is None:
        return rows
    return rows.filter(Q(tenant_id=tenant_id) | Q(tenant__isnull=True))


def guardrail_get(*, actor: Principal, policy_id: int) -> GuardrailPolicy:
    row = guardrail_list(actor=actor).filter(pk=policy_id).first()
    if row is None:
        raise NotFound("No such guardrail policy.", code="guardrail_not_found")
    return row


@transaction.atomic
def guardrail_create(*, actor: Principal, scope: str, tenant_id: int | None = None,
                     key_id: int | None = None, deployment: str = "",
                     secret: str | None = None, **fields: Any
                     ) -> tuple[GuardrailPolicy, str | None]:
    """A policy, and the webhook secret Sluice made for it (None when given or not a
    webhook): shown only in this reply."""
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    anyone = actor.can(Action.GOVERNANCE_MANAGE_ANY)
    row = GuardrailPolicy(scope=scope, guard=fields.pop("guard"), phase=fields.pop("phase"))
    if scope == GuardScope.PLATFORM:
        if not anyone:
            raise PermissionDenied("Platform policies are set by platform admins.")
        if tenant_id is not None:
            raise Unprocessable("tenant_id: a platform policy has no tenant.",
                                param="tenant_id")
    elif tenant_id is not None or not anyone or scope != GuardScope.DEPLOYMENT:
        # a platform admin's deployment policy without a tenant binds every tenant
        row.tenant = governed_tenant(actor=actor, tenant_id=actor.tenant_id
                                     if tenant_id is None else tenant_id)
    if scope == GuardScope.KEY:
        if key_id is None or row.tenant_id is None:
            raise Unprocessable("key_id: a key policy names its key.", param="key_id")
        row.api_key = governed_key(actor=actor, tenant_id=row.tenant_id, key_id=key_id,
                                   param="key_id")
    elif key_id is not None:
        raise Unprocessable("key_id: only a key policy names a key.", param="key_id")
    if scope == GuardScope.DEPLOYMENT:
        if not (Deployment.objects.filter(name=deployment).exists()
                or ModelAlias.objects.filter(name=deployment).exists()):
            raise Unprocessable("deployment: name a deployment or alias that exists.",
                                param="deployment")
        row.deployment = deployment
    elif deployment:
        raise Unprocessable("deployment: only a deployment policy names one.",
                            param="deployment")
    made = _write(actor, row, fields, secret)
    return row, made


@transaction.atomic
def guardrail_update(*, actor: Principal, policy_id: int, secret: str | None = None,
                     **fields: Any) -> GuardrailPolicy:
    row = GuardrailPolicy.objects.select_for_update().get(
        pk=guardrail_get(actor=actor, policy_id=policy_id).pk)
    _may_write(actor, row)
    _write(actor, row, fields, secret, action="guardrail.update")
    return row


@transaction.atomic
def guardrail_delete(*, actor: Principal, policy_id: int) -> None:
    row = guardrail_get(actor=actor, policy_id=policy_id)
    _may_write(actor, row)
    record_action(actor=actor, action="guardrail.delete", target=f"guardrail:{row.pk}",
                  detail=_detail(row))
    row.delete()
    cache.invalidate()


def _may_write(actor: Principal, row: GuardrailPolicy) -> None:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    if row.tenant_id is None and not actor.can(Action.GOVERNANCE_MANAGE_ANY):
        raise PermissionDenied("Platform policies are set by platform admins.")


def _write(actor: Principal, row: GuardrailPolicy, fields: dict[str, Any],
           secret: str | None, *, action: str = "guardrail.create") -> str | None:
    for key in _FIELDS:
        if key in fields and fields[key] is not None:
            setattr(row, key, fields[key])
    if row.phase == "during" and row.action == "mask":
        raise Unprocessable("action: a during policy blocks or flags (the request is "
                            "already queued: it cannot be masked).", param="action")
    if row.guard in ("classifier", "judge") and row.action == "mask":
        raise Unprocessable(f"action: a {row.guard} finds what it reads, it does not "
                            "rewrite it: block or flag.", param="action")
    if row.mandatory and (row.tenant_id is not None or not actor.can(
            Action.GOVERNANCE_MANAGE_ANY)):
        raise Unprocessable("mandatory: only a platform admin's policy without a tenant "
                            "can be mandatory.", param="mandatory")
    row.categories = _categories(row)
    row.config = _config(row)
    made = None
    if row.guard == "webhook":
        sealed = signing_secret(secret, has_one=bool(row.secret_sealed), param="secret")
        if sealed is not None:
            row.secret_sealed, row.secret_hint, made = sealed
    elif secret is not None:
        raise Unprocessable("secret: only a webhook guard has one.", param="secret")
    row.full_clean(exclude=["tenant", "api_key"])
    row.save()
    cache.invalidate()
    record_action(actor=actor, action=action, target=f"guardrail:{row.pk}",
                  detail=_detail(row))
    return made


def _categories(row: GuardrailPolicy) -> list[str]:
    given = row.categories or []
    if not isinstance(given, list) or len(given) > 32 or not all(
            isinstance(c, str) and 0 < len(c) <= 32 for c in given):
        raise Unprocessable("categories: at most 32 names of 1 to 32 characters.",
                            param="categories")
    if row.guard == "pii":
        known = {label for label, _ in RECOGNIZERS} | set(
            RedactionPattern.objects.filter(tenant_id=row.tenant_id).values_list(
                "label", flat=True) if row.tenant_id is not None else ())
        unknown = sorted({c.upper() for c in given} - known)
        if unknown:
            raise Unprocessable(f"categories: unknown PII category '{unknown[0]}' (known: "
                                f"{', '.join(sorted(known))}).", param="categories")
        return sorted({c.upper() for c in given})
    return list(given)


def _config(row: GuardrailPolicy) -> dict[str, Any]:
    config = row.config or {}
    if not isinstance(config, dict):
        raise Unprocessable("config: an object.", param="config")
    try:
        if row.guard == "words":
            return check_words_config(config)
        if row.guard == "webhook":
            return _webhook_config(config)
        if row.guard == "classifier":
            checked = check_classifier_config(config)
            if not Deployment.objects.filter(name=checked["deployment"],
                                             runtime=RuntimeName.CLASSIFIER).exists():
                raise ValueError("deployment: name a classifier deployment that exists")
            return checked
        if row.guard == "judge":
            checked = check_judge_config(config)
            name = checked["model"]
            if not (Deployment.objects.filter(name=name).exclude(
                    runtime__in=(RuntimeName.ENCODER, RuntimeName.CLASSIFIER)).exists()
                    or ModelAlias.objects.filter(name=name).exists()):
                raise ValueError("model: name a chat deployment or alias that exists")
            return checked
    except ValueError as exc:
        raise Unprocessable(f"config.{exc}", param="config") from None
    if config:
        raise Unprocessable(f"config: the {row.guard} guard takes no settings.",
                            param="config")
    return {}


def _webhook_config(config: dict[str, Any]) -> dict[str, Any]:
    unknown = set(config) - {"url", "params"}
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown (known: url, params)")
    try:
        url = validate_url(str(config.get("url") or ""))
    except UpstreamURLError as exc:
        raise ValueError(f"url: {exc}") from None
    params = config.get("params") or {}
    if not isinstance(params, dict) or len(orjson.dumps(params)) > PARAMS_MAX_BYTES:
        raise ValueError(f"params: an object of at most {PARAMS_MAX_BYTES} bytes as JSON")
    return {"url": url, "params": params}


def _detail(row: GuardrailPolicy) -> dict[str, Any]:
    return {"name": row.name, "guard": row.guard, "phase": row.phase, "action": row.action,
            "scope": row.scope, "key_id": row.api_key_id, "deployment": row.deployment,
            "categories": ",".join(row.categories or ()), "mandatory": row.mandatory,
            "shadow": row.shadow, "enabled": row.enabled, "timeout_ms": row.timeout_ms,
            "on_error": row.on_error}
