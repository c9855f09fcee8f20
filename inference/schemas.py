"""Management API and /v1/models shapes for deployments."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from ninja import Schema
from pydantic import Field, StringConstraints

from inference.models import NAME_PATTERN
from inference.spec import RuntimeName
from sluice.schemas import Line, StrictSchema, Text


class DeploymentOut(Schema):
    name: str
    runtime: RuntimeName
    kind: str
    weights: str
    device: str
    description: str
    max_batch_size: int
    max_wait_ms: int
    max_context: int
    max_queue_depth: int
    tenant_queue_share: float
    max_deliveries: int
    echo_token_delay_ms: float
    enabled: bool
    min_replicas: int
    max_replicas: int
    target_inflight: int | None
    scale_up_delay_s: float
    scale_down_delay_s: float
    scale_to_zero_delay_s: float
    max_queue_age_s: float
    created_at: datetime

    @staticmethod
    def resolve_kind(obj: object) -> str:
        return obj.to_spec().kind.value  # type: ignore[attr-defined]


class DeploymentUpdateIn(StrictSchema):
    runtime: RuntimeName | None = None
    weights: Annotated[Line, StringConstraints(max_length=500)] | None = None
    device: Annotated[str, StringConstraints(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] | None = None
    description: Annotated[Text, StringConstraints(max_length=300)] | None = None
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] | None = None
    max_wait_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    max_context: Annotated[int, Field(ge=16, le=1_048_576)] | None = None
    max_queue_depth: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    tenant_queue_share: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_deliveries: Annotated[int, Field(ge=1, le=100)] | None = None
    echo_token_delay_ms: Annotated[float, Field(ge=0.0, le=60_000)] | None = None
    enabled: bool | None = None
    min_replicas: Annotated[int, Field(ge=0, le=64)] | None = None
    max_replicas: Annotated[int, Field(ge=1, le=64)] | None = None
    target_inflight: Annotated[int, Field(ge=1, le=100_000)] | None = None
    scale_up_delay_s: Annotated[float, Field(ge=0.0, le=3600.0)] | None = None
    scale_down_delay_s: Annotated[float, Field(ge=0.0, le=86_400.0)] | None = None
    scale_to_zero_delay_s: Annotated[float, Field(ge=0.0, le=86_400.0)] | None = None
    max_queue_age_s: Annotated[float, Field(ge=0.1, le=3600.0)] | None = None


class DeploymentCreateIn(DeploymentUpdateIn):
    name: Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
    runtime: RuntimeName


class ModelOut(Schema):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"


class ModelListOut(Schema):
    object: Literal["list"] = "list"
    data: list[ModelOut]


class ScalingEventOut(Schema):
    id: str
    ts: float
    deployment: str
    kind: str  # scale | restart | ready
    reason: str
    from_replicas: int | None = None
    to_replicas: int | None = None
    cold_start_s: float | None = None


class ScalingOut(Schema):
    deployment: str
    desired: int | None  # None until an autoscaler has looked at it
    running: int | None
    live_workers: int
    depth: int | None
    oldest_age_s: float | None
    driver: str | None
    updated_at: float | None
    events: list[ScalingEventOut]
