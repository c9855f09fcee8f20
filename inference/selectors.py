"""Reads of the deployment registry."""

from __future__ import annotations

from django.db.models import QuerySet

from inference.models import Deployment
from sluice.errors import NotFound
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
