"""Management API and /v1/models shapes for deployments."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from ninja import Schema
from pydantic import ConfigDict, Discriminator, Field, RootModel, SecretStr, StringConstraints, Tag

from inference.models import ALIAS_PATTERN, NAME_PATTERN, Deployment, ModelAlias
from inference.spec import Dialect, MaxTokensPolicy, RuntimeName
from sluice.schemas import Line, StrictSchema, Text


class DeploymentOut(Schema):
    """A deployment as its operators see it: where and how it runs (platform admins)."""

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
    max_output_tokens: int | None
    max_tokens_policy: MaxTokensPolicy
    tenant_queue_share: float
    tenant_running_share: float | None
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
    engine: dict[str, object]  # EngineIn's fields that are set
    # openai_upstream: where calls go. The API key is write-only: only whether one is
    # set and, for a long one, its last four characters.
    upstream_url: str
    upstream_model: str
    upstream_dialect: Dialect
    upstream_concurrency: int
    upstream_connect_timeout_s: float
    upstream_read_timeout_s: float
    upstream_api_key_set: bool
    upstream_api_key_hint: str
    created_at: datetime

    @staticmethod
    def resolve_kind(obj: object) -> str:
        return obj.to_spec().kind.value  # type: ignore[attr-defined]

    @staticmethod
    def resolve_upstream_api_key_set(obj: object) -> bool:
        return bool(obj.upstream_secret)  # type: ignore[attr-defined]

    @staticmethod
    def resolve_upstream_api_key_hint(obj: object) -> str:
        return str(obj.upstream_secret_hint)  # type: ignore[attr-defined]


class DeploymentSummaryOut(Schema):
    """A deployment as a tenant sees it: what it serves, nothing of where or how it runs
    (no upstream URL, model or key hint, runtime, weights, device, batching, queue or
    scaling settings: they name the operator's infrastructure and size its capacity)."""

    # No other field: a full view is then never also a summary (OpenAPI's oneOf).
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    description: str
    max_context: int
    enabled: bool
    created_at: datetime

    @staticmethod
    def of(row: Deployment) -> dict[str, object]:
        """`row`'s summary, as the reply's data (see `DeploymentView`)."""
        return {"name": row.name, "kind": row.to_spec().kind.value,
                "description": row.description, "max_context": row.max_context,
                "enabled": row.enabled, "created_at": row.created_at}


def _view(value: object) -> str:
    return "summary" if isinstance(value, dict | DeploymentSummaryOut) else "operator"


class DeploymentView(RootModel[Annotated[Annotated[DeploymentOut, Tag("operator")]
                                         | Annotated[DeploymentSummaryOut, Tag("summary")],
                                         Discriminator(_view)]]):
    """What GET /deployments answers: a row is read in full, a row's
    `DeploymentSummaryOut.of` (a dict) as its summary; each is serialized as read."""


class EngineIn(StrictSchema):
    """A causal LM's engine options (inference/runtimes/kv.py); absent: the default."""

    decode: Literal["dynamic", "static"] | None = None
    kv_cache_tokens: Annotated[int, Field(ge=1, le=2**31)] | None = None
    kv_cache_memory_fraction: Annotated[float, Field(gt=0.0, le=0.95)] | None = None
    cuda_graphs: bool | None = None
    graph_batch_sizes: Annotated[list[Annotated[int, Field(ge=1, le=4096)]],
                                 Field(max_length=64)] | None = None
    # The prefix cache's pool in tokens (0: off) and its block size.
    prefix_cache_tokens: Annotated[int, Field(ge=0, le=2**31)] | None = None
    prefix_block_tokens: Annotated[int, Field(ge=1, le=1024)] | None = None


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
    max_output_tokens: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    max_tokens_policy: MaxTokensPolicy | None = None
    tenant_running_share: Annotated[float, Field(ge=0.01, le=1.0)] | None = None
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
    upstream_url: Annotated[Line, StringConstraints(max_length=2000)] | None = None
    upstream_model: Annotated[Line, StringConstraints(max_length=200)] | None = None
    upstream_dialect: Dialect | None = None
    upstream_concurrency: Annotated[int, Field(ge=1, le=4096)] | None = None
    upstream_connect_timeout_s: Annotated[float, Field(ge=0.1, le=300.0)] | None = None
    upstream_read_timeout_s: Annotated[float, Field(ge=1.0, le=3600.0)] | None = None
    # Write-only: a new key ("" removes it). Never echoed, in replies or in errors.
    upstream_api_key: Annotated[SecretStr, Field(max_length=4096)] | None = None
    engine: EngineIn | None = None  # replaces the options as a whole


class DeploymentCreateIn(DeploymentUpdateIn):
    name: Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
    runtime: RuntimeName


class ModelOut(Schema):
    """An OpenAI model entry, with the limits a client sizes its requests by (an alias:
    the smallest of its deployments')."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    context_window: int  # the prompt's and the reply's tokens together
    max_output_tokens: int  # the most max_tokens a call may ask for


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


# -- model aliases ---------------------------------------------------------------------
DeploymentName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class AliasTargetIn(StrictSchema):
    deployment: DeploymentName
    weight: Annotated[int, Field(ge=1, le=10_000)] = 1


class AliasUpdateIn(StrictSchema):
    description: Annotated[Text, StringConstraints(max_length=300)] | None = None
    enabled: bool | None = None
    max_tokens_policy: MaxTokensPolicy | None = None
    # Each replaces its list as a whole.
    targets: Annotated[list[AliasTargetIn], Field(min_length=1, max_length=32)] | None = None
    fallbacks: Annotated[list[DeploymentName], Field(max_length=16)] | None = None

    def routes(self) -> tuple[list[tuple[str, int]] | None, list[str] | None]:
        targets = None if self.targets is None else \
            [(t.deployment, t.weight) for t in self.targets]
        return targets, self.fallbacks


class AliasCreateIn(AliasUpdateIn):
    name: Annotated[str, StringConstraints(pattern=ALIAS_PATTERN)]
    targets: Annotated[list[AliasTargetIn], Field(min_length=1, max_length=32)]


class AliasTargetOut(Schema):
    deployment: str
    weight: int
    share: float  # of the calls this target is tried first for, all targets available


class AliasOut(Schema):
    name: str
    description: str
    enabled: bool
    max_tokens_policy: MaxTokensPolicy
    targets: list[AliasTargetOut]
    fallbacks: list[str]
    created_at: datetime
    updated_at: datetime

    @staticmethod
    def resolve_targets(obj: ModelAlias) -> list[dict[str, object]]:
        rows = list(obj.targets.all())
        total = sum(t.weight for t in rows) or 1
        return [{"deployment": t.deployment.name, "weight": t.weight,
                 "share": round(t.weight / total, 4)} for t in rows]

    @staticmethod
    def resolve_fallbacks(obj: ModelAlias) -> list[str]:
        return [f.deployment.name for f in obj.fallbacks.all()]
