"""Reads of the deployment registry."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from inference.autoscaler import events, state
from inference.models import Deployment
from inference.queue import live_heartbeats, workers_key
from sluice.errors import NotFound
from sluice.redis import sync_redis
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
