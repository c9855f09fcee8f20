"""/api/v1/governance/guardrails: guardrail policies (services.py says who may do what).
Handlers only parse, call a service, and serialize."""
# No `from __future__ import annotations`: ninja reads the annotations at import time.

from datetime import datetime
from typing import Annotated, Any

from django.http import HttpRequest
from ninja import Router, Schema, Status
from pydantic import Field, StringConstraints

from governance.guardrail_models import GuardAction, GuardKind, GuardPhase, GuardScope, OnError
from governance.guardrails import services
from sluice.schemas import Id, Line, StrictSchema
from tenants.api import actor_of

router = Router(tags=["governance"])
URL = "/governance/guardrails"

Name = Annotated[str, StringConstraints(min_length=1, max_length=64,
                                        pattern=r"^[A-Za-z0-9 ._:-]+$")]
ModelName = Annotated[str, StringConstraints(max_length=100, pattern=r"^[A-Za-z0-9._:/-]*$")]
TimeoutMs = Annotated[int, Field(ge=1, le=30_000)]
Secret = Annotated[Line, StringConstraints(min_length=16, max_length=200)]
Category = Annotated[Line, StringConstraints(min_length=1, max_length=32)]


class GuardrailFields(StrictSchema):
    name: Name | None = None
    action: GuardAction | None = None
    categories: Annotated[list[Category], Field(max_length=32)] | None = None
    config: dict[str, Any] | None = None
    secret: Secret | None = None  # a webhook's; write-only
    mandatory: bool | None = None
    shadow: bool | None = None
    enabled: bool | None = None
    timeout_ms: TimeoutMs | None = None
    on_error: OnError | None = None


class GuardrailIn(GuardrailFields):
    name: Name
    guard: GuardKind
    phase: GuardPhase
    action: GuardAction
    scope: GuardScope
    tenant_id: Id | None = None  # default: the caller's (none for scope platform)
    key_id: Id | None = None  # scope key
    deployment: ModelName = ""  # scope deployment: a deployment's or alias's name


class GuardrailOut(Schema):
    id: int
    name: str
    guard: str
    phase: str
    action: str
    scope: str
    tenant_id: int | None
    key_id: int | None = Field(None, validation_alias="api_key_id")
    deployment: str
    categories: list[str]
    config: dict[str, Any]
    secret_hint: str
    mandatory: bool
    shadow: bool
    enabled: bool
    timeout_ms: int
    on_error: str
    created_at: datetime


class GuardrailCreatedOut(GuardrailOut):
    secret: str | None = None  # a webhook secret Sluice made: shown this once


@router.get(URL, response=list[GuardrailOut])
def guardrail_list(request: HttpRequest, tenant_id: Id | None = None):
    return list(services.guardrail_list(actor=actor_of(request), tenant_id=tenant_id))


@router.post(URL, response={201: GuardrailCreatedOut})
def guardrail_create(request: HttpRequest, data: GuardrailIn):
    row, made = services.guardrail_create(actor=actor_of(request),
                                          **data.model_dump(exclude_unset=True))
    return Status(201, {**GuardrailOut.from_orm(row).model_dump(), "secret": made})


@router.get(URL + "/{int:policy_id}", response=GuardrailOut)
def guardrail_get(request: HttpRequest, policy_id: int):
    return services.guardrail_get(actor=actor_of(request), policy_id=policy_id)


@router.patch(URL + "/{int:policy_id}", response=GuardrailOut)
def guardrail_update(request: HttpRequest, policy_id: int, data: GuardrailFields):
    return services.guardrail_update(actor=actor_of(request), policy_id=policy_id,
                                     **data.model_dump(exclude_unset=True))


@router.delete(URL + "/{int:policy_id}", response={204: None})
def guardrail_delete(request: HttpRequest, policy_id: int):
    services.guardrail_delete(actor=actor_of(request), policy_id=policy_id)
    return Status(204, None)
