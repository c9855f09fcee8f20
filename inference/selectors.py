"""Reads of the deployment registry and the model aliases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Prefetch, QuerySet

from inference.autoscaler import events, state
from inference.models import AliasFallback, AliasTarget, Deployment, ModelAlias
from inference.queue import live_heartbeats, workers_key
from inference.routing import Route, Target
from inference.spec import MaxTokensPolicy
from sluice.db import async_db
from sluice.errors import NotFound
from sluice.redis import sync_redis
from sluice.ttlcache import AsyncTTLCache
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require


def deployment_list(*, actor: Principal) -> QuerySet[Deployment]:
    """All deployments (admins see disabled ones too)."""
    require(actor, Action.MODEL_LIST)
    deployments = Deployment.objects.order_by("name")
    if not actor.can(Action.DEPLOYMENT_MANAGE):
        deployments = deployments.filter(enabled=True)
    return deployments


def deployment_get(*, actor: Principal, name: str) -> Deployment:
    deployment = deployment_list(actor=actor).filter(name=name).first()
    if deployment is None:
        raise NotFound(f"The model '{name}' does not exist.", code="model_not_found",
                       param="model")
    return deployment


def models_for(*, actor: Principal) -> list[Deployment]:
    """The enabled deployments this caller may use (a key's allow-list narrows it)."""
    require(actor, Action.MODEL_LIST)
    return [d for d in Deployment.objects.filter(enabled=True).order_by("name")
            if actor.may_use_model(d.name)]


def aliases_for(*, actor: Principal) -> list[tuple[ModelAlias, list[Deployment]]]:
    """The enabled model aliases this caller may use, each with its enabled deployments
    (targets and fallbacks): a key's allow-list must name the alias itself; an alias
    none of whose deployments is enabled cannot serve a call and is left out."""
    require(actor, Action.MODEL_LIST)
    aliases = ModelAlias.objects.filter(enabled=True).order_by("name").prefetch_related(
        Prefetch("targets", AliasTarget.objects.select_related("deployment")),
        Prefetch("fallbacks", AliasFallback.objects.select_related("deployment")))
    out = []
    for alias in aliases:
        rows: list[AliasTarget | AliasFallback] = [*alias.targets.all(),
                                                   *alias.fallbacks.all()]
        serving = [row.deployment for row in rows if row.deployment.enabled]
        if serving and actor.may_use_model(alias.name):
            out.append((alias, serving))
    return out


@dataclass(frozen=True)
class UsableModel:
    """A model as /v1/models and gRPC ListModels list it: its id and the limits a
    client sizes its requests by (an alias: the smallest of its enabled deployments')."""

    id: str
    created: int
    context_window: int  # the prompt's and the reply's tokens together
    max_output_tokens: int  # the most max_tokens a call may ask for


def usable_models(*, actor: Principal) -> dict[str, UsableModel]:
    """The models `actor` may call, by id: the enabled deployments and model aliases its
    key allows (a name that is both is the deployment, as a call reads it)."""
    usable = {d.name: UsableModel(d.name, int(d.created_at.timestamp()), d.max_context,
                                  output_limit(d))
              for d in models_for(actor=actor)}
    for alias, serving in aliases_for(actor=actor):
        usable.setdefault(alias.name, UsableModel(
            alias.name, int(alias.created_at.timestamp()),
            min(d.max_context for d in serving), min(output_limit(d) for d in serving)))
    return usable


def output_limit(deployment: Deployment) -> int:
    """The most max_tokens a call to `deployment` may ask for: its output ceiling, and
    below its context (a reply needs at least one token of prompt beside it)."""
    room = deployment.max_context - 1
    ceiling = deployment.max_output_tokens
    return room if ceiling is None else min(ceiling, room)


def scaling(*, actor: Principal, name: str, limit: int = 50) -> dict[str, Any]:
    """What the autoscaler decided for a deployment, and why (platform admins)."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    deployment = deployment_get(actor=actor, name=name)
    client = sync_redis()
    now = state(client).get(deployment.name, {})
    live = live_heartbeats(client.hgetall(workers_key(deployment.name)))
    rows = []
    for event in events(client, deployment=deployment.name, limit=limit):
        rows.append({
            "id": event["id"], "ts": float(event["ts"]), "deployment": event["deployment"],
            "kind": event["kind"], "reason": event["reason"],
            "from_replicas": int(event["from"]) if "from" in event else None,
            "to_replicas": int(event["to"]) if "to" in event else None,
            "cold_start_s": float(event["cold_start_s"]) if "cold_start_s" in event else None,
        })
    return {"deployment": deployment.name, "desired": now.get("desired"),
            "running": now.get("running"), "live_workers": len(live),
            "depth": now.get("depth"), "oldest_age_s": now.get("oldest_age_s"),
            "driver": now.get("driver"), "updated_at": now.get("ts"), "events": rows}


# -- model aliases ---------------------------------------------------------------------
def alias_list(*, actor: Principal) -> QuerySet[ModelAlias]:
    """Every model alias (platform admins)."""
    require(actor, Action.DEPLOYMENT_MANAGE)
    return ModelAlias.objects.order_by("name").prefetch_related(
        Prefetch("targets", AliasTarget.objects.select_related("deployment")),
        Prefetch("fallbacks", AliasFallback.objects.select_related("deployment")))


def alias_get(*, actor: Principal, name: str) -> ModelAlias:
    alias = alias_list(actor=actor).filter(name=name).first()
    if alias is None:
        raise NotFound(f"The model alias '{name}' does not exist.", param="name")
    return alias


def route_of(alias: ModelAlias) -> Route:
    """An alias as inference/routing.py reads it (its targets and fallbacks loaded)."""
    clamps = alias.max_tokens_policy == MaxTokensPolicy.CLAMP

    def target(row: AliasTarget | AliasFallback, weight: int) -> Target:
        return Target(row.deployment.name, weight, row.deployment.max_context,
                      row.deployment.enabled, clamps=clamps or
                      row.deployment.max_tokens_policy == MaxTokensPolicy.CLAMP)
    return Route(alias=alias.name,
                 targets=tuple(target(t, t.weight) for t in alias.targets.all()),
                 fallbacks=tuple(target(f, 1) for f in alias.fallbacks.all()),
                 clamps=clamps)


def _load_route(name: str) -> Route | None:
    alias = ModelAlias.objects.filter(name=name, enabled=True).prefetch_related(
        Prefetch("targets", AliasTarget.objects.select_related("deployment")),
        Prefetch("fallbacks", AliasFallback.objects.select_related("deployment"))).first()
    return route_of(alias) if alias is not None else None


_routes: AsyncTTLCache[str, Route | None] = AsyncTTLCache(max_entries=10_000)


async def alias_route(name: str) -> Route | None:
    """The enabled alias `name` for the hot path (None: no such enabled alias), cached
    in-process like the deployment specs (inference/cache.py): an edit reaches every
    gateway within SLUICE_REGISTRY_CACHE_TTL_S."""
    return await _routes.get(name, lambda: async_db(_load_route)(name),
                             float(settings.SLUICE_REGISTRY_CACHE_TTL_S))


def clear_routes() -> None:
    _routes.clear()
