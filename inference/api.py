"""Deployment registry (management API) and the OpenAI-style model list."""

from __future__ import annotations

from typing import Annotated

from django.http import HttpRequest
from ninja import Field, Router, Status
from ninja.pagination import paginate

from inference import selectors, services
from inference.models import Deployment
from inference.schemas import (
    DeploymentCreateIn,
    DeploymentOut,
    DeploymentUpdateIn,
    ModelListOut,
    ModelOut,
    ScalingOut,
)
from sluice.errors import NotFound
from sluice.pagination import Pagination
from tenants.api import actor_of

router = Router(tags=["deployments"])
models_router = Router(tags=["models"])


@router.get("/deployments", response=list[DeploymentOut])
@paginate(Pagination)
def deployment_list(request: HttpRequest):
    return selectors.deployment_list(actor=actor_of(request))


@router.post("/deployments", response={201: DeploymentOut})
def deployment_create(request: HttpRequest, data: DeploymentCreateIn):
    fields = data.model_dump(exclude_none=True)
    name = fields.pop("name")
    return Status(201, services.deployment_create(actor=actor_of(request), name=name, **fields))


@router.get("/deployments/{name}", response=DeploymentOut)
def deployment_get(request: HttpRequest, name: str):
    return selectors.deployment_get(actor=actor_of(request), name=name)


@router.patch("/deployments/{name}", response=DeploymentOut)
def deployment_update(request: HttpRequest, name: str, data: DeploymentUpdateIn):
    return services.deployment_update(actor=actor_of(request), name=name,
                                      **data.model_dump(exclude_none=True))


@router.get("/deployments/{name}/scaling", response=ScalingOut)
def deployment_scaling(request: HttpRequest, name: str,
                       limit: Annotated[int, Field(ge=1, le=500)] = 50):
    """The autoscaler's view of a deployment and its recent decisions, restarts and cold
    starts (newest first), each with its reason."""
    return selectors.scaling(actor=actor_of(request), name=name, limit=limit)


def _model(deployment: Deployment) -> ModelOut:
    return ModelOut(id=deployment.name, created=int(deployment.created_at.timestamp()))


@models_router.get("/models", response=ModelListOut)
def model_list(request: HttpRequest):
    return ModelListOut(data=[_model(d) for d in selectors.models_for(actor=actor_of(request))])


@models_router.get("/models/{model}", response=ModelOut)
def model_get(request: HttpRequest, model: str):
    usable = {d.name: d for d in selectors.models_for(actor=actor_of(request))}
    if model not in usable:
        raise NotFound(f"The model '{model}' does not exist or you do not have access to it.",
                       code="model_not_found", param="model")
    return _model(usable[model])
