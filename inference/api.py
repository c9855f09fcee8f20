"""Deployment registry (management API) and the OpenAI-style model list."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from django.db.models import QuerySet
from django.http import HttpRequest
from ninja import Field, Router, Status
from ninja.pagination import paginate

from inference import selectors, services
from inference.models import Deployment
from inference.schemas import (
    AliasCreateIn,
    AliasOut,
    AliasUpdateIn,
    DeploymentCreateIn,
    DeploymentOut,
    DeploymentSummaryOut,
    DeploymentUpdateIn,
    DeploymentView,
    ModelListOut,
    ModelOut,
    ScalingOut,
)
from inference.spec import MaxTokensPolicy
from sluice.errors import NotFound
from sluice.pagination import Pagination
from tenants.api import actor_of
from tenants.principal import Principal
from tenants.roles import Action

router = Router(tags=["deployments"])
models_router = Router(tags=["models"])


def _secret(fields: dict[str, Any]) -> str | None:
    """The write-only API key out of a body's fields, as the services take it."""
    value = fields.pop("upstream_api_key", None)
    return None if value is None else value.get_secret_value()


def _shown(actor: Principal, rows: QuerySet[Deployment]) -> Iterable[Any]:
    """The rows as `actor` may read them: in full for those who manage deployments,
    else as summaries (a tenant learns what it can call, not where calls go). A list
    of summaries holds the whole registry, which only operators grow."""
    if actor.can(Action.DEPLOYMENT_MANAGE):
        return rows
    return [DeploymentSummaryOut.of(row) for row in rows]


@router.get("/deployments", response=list[DeploymentView])
@paginate(Pagination)
def deployment_list(request: HttpRequest):
    """The deployments: in full for platform admins, as summaries (name, kind,
    description, context length) for everyone else."""
    actor = actor_of(request)
    return _shown(actor, selectors.deployment_list(actor=actor))


@router.post("/deployments", response={201: DeploymentOut})
def deployment_create(request: HttpRequest, data: DeploymentCreateIn):
    """A deployment. `openai_upstream`: `upstream_url` (http or https; loopback and
    private addresses only where the operator allows them), `upstream_model`, and an
    optional write-only `upstream_api_key`."""
    fields = data.model_dump(exclude_none=True)
    name = fields.pop("name")
    return Status(201, services.deployment_create(actor=actor_of(request), name=name,
                                                  upstream_api_key=_secret(fields), **fields))


@router.get("/deployments/{name}", response=DeploymentView)
def deployment_get(request: HttpRequest, name: str):
    """One deployment, shown as in the list."""
    actor = actor_of(request)
    row = selectors.deployment_get(actor=actor, name=name)
    return row if actor.can(Action.DEPLOYMENT_MANAGE) else DeploymentSummaryOut.of(row)


@router.patch("/deployments/{name}", response=DeploymentOut)
def deployment_update(request: HttpRequest, name: str, data: DeploymentUpdateIn):
    """Change the given fields; `upstream_api_key` "" removes the key."""
    fields = data.model_dump(exclude_none=True)
    return services.deployment_update(actor=actor_of(request), name=name,
                                      upstream_api_key=_secret(fields), **fields)


@router.get("/deployments/{name}/scaling", response=ScalingOut)
def deployment_scaling(request: HttpRequest, name: str,
                       limit: Annotated[int, Field(ge=1, le=500)] = 50):
    """The autoscaler's view of a deployment and its recent decisions, restarts and cold
    starts (newest first), each with its reason."""
    return selectors.scaling(actor=actor_of(request), name=name, limit=limit)


# Alias names may hold "/" (OpenAI-style "org/model"): the path converter takes it.
@router.get("/model-aliases", response=list[AliasOut], tags=["model aliases"])
@paginate(Pagination)
def alias_list(request: HttpRequest):
    return selectors.alias_list(actor=actor_of(request))


@router.post("/model-aliases", response={201: AliasOut}, tags=["model aliases"])
def alias_create(request: HttpRequest, data: AliasCreateIn):
    """A public model name served by deployments: `targets` share its calls by weight,
    `fallbacks` are tried in order after them."""
    alias = services.alias_create(actor=actor_of(request), name=data.name,
                                  targets=[(t.deployment, t.weight) for t in data.targets],
                                  fallbacks=data.fallbacks, description=data.description or "",
                                  enabled=data.enabled is not False,
                                  max_tokens_policy=data.max_tokens_policy
                                  or MaxTokensPolicy.REFUSE)
    return Status(201, selectors.alias_get(actor=actor_of(request), name=alias.name))


@router.get("/model-aliases/{path:name}", response=AliasOut, tags=["model aliases"])
def alias_get(request: HttpRequest, name: str):
    return selectors.alias_get(actor=actor_of(request), name=name)


@router.patch("/model-aliases/{path:name}", response=AliasOut, tags=["model aliases"])
def alias_update(request: HttpRequest, name: str, data: AliasUpdateIn):
    targets, fallbacks = data.routes()
    services.alias_update(actor=actor_of(request), name=name, targets=targets,
                          fallbacks=fallbacks, description=data.description,
                          enabled=data.enabled, max_tokens_policy=data.max_tokens_policy)
    return selectors.alias_get(actor=actor_of(request), name=name)


@router.delete("/model-aliases/{path:name}", response={204: None}, tags=["model aliases"])
def alias_delete(request: HttpRequest, name: str):
    services.alias_delete(actor=actor_of(request), name=name)
    return Status(204, None)


def _usable(request: HttpRequest) -> dict[str, ModelOut]:
    """The models the caller may call, by id, with their limits."""
    return {name: ModelOut(id=m.id, created=m.created, context_window=m.context_window,
                           max_output_tokens=m.max_output_tokens)
            for name, m in selectors.usable_models(actor=actor_of(request)).items()}


@models_router.get("/models", response=ModelListOut)
def model_list(request: HttpRequest):
    """The deployments and model aliases the caller may call, by id."""
    usable = _usable(request)
    return ModelListOut(data=[usable[name] for name in sorted(usable)])


# An alias's id may hold "/" ("org/model"): the path converter takes it.
@models_router.get("/models/{path:model}", response=ModelOut)
def model_get(request: HttpRequest, model: str):
    found = _usable(request).get(model)
    if found is None:
        raise NotFound(f"The model '{model}' does not exist or you do not have access to it.",
                       code="model_not_found", param="model")
    return found
