"""Guardrail policies: which guard checks which calls' text, when, and what it does about
it (governance/guardrails/ runs them). Imported by governance/models.py, so Django
knows them.

A policy names a guard (`pii`, `words`, `webhook`, `classifier`, `judge`), a phase
(`pre`: the request, before admission; `during`: the request, beside the queued call;
`post`: the reply, held back in streams), an action (`block`, `mask`, `flag`) and a
scope: the platform (tenant None), a tenant, one API key, or one deployment or alias by
name. For each guard and
phase the most specific scope's enabled policy is the one that applies (key, then
deployment, then tenant, then platform; a tenant's own before the platform's at the
same scope); a platform policy marked `mandatory` applies besides, whatever a tenant
sets. `shadow` makes a policy flag and audit only. `config` is the guard's own settings
(governance/guardrails/guards.py says what each takes); a webhook's secret is sealed
at rest and write-only.
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from tenants.models import ApiKey, Tenant


class GuardKind(models.TextChoices):
    PII = "pii", "Personal data and secrets"
    WORDS = "words", "Deny and allow lists"
    WEBHOOK = "webhook", "A guardrail service (LiteLLM's generic guardrail API)"
    CLASSIFIER = "classifier", "A classification model served as a deployment"
    JUDGE = "judge", "An LLM judge served as a chat deployment"


class GuardPhase(models.TextChoices):
    PRE = "pre", "The request, before admission"
    DURING = "during", "The request, beside the queued call"
    POST = "post", "The reply (streams held back)"


class GuardAction(models.TextChoices):
    BLOCK = "block", "Refuse (or stop the reply)"
    MASK = "mask", "Replace what was found"
    FLAG = "flag", "Audit only"


class GuardScope(models.TextChoices):
    PLATFORM = "platform", "Every call"
    TENANT = "tenant", "A tenant's calls"
    KEY = "key", "One API key's calls"
    DEPLOYMENT = "deployment", "Calls of one deployment or alias"


class OnError(models.TextChoices):
    OPEN = "open", "Allow the call when the guard fails"
    CLOSED = "closed", "Refuse the call when the guard fails"


class GuardrailPolicy(models.Model):
    """See the module docstring."""

    name = models.CharField(max_length=64)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE,
                               related_name="guardrails")
    scope = models.CharField(max_length=10, choices=GuardScope.choices)
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="guardrails")
    deployment = models.CharField(max_length=100, blank=True, default="")
    guard = models.CharField(max_length=10, choices=GuardKind.choices)
    phase = models.CharField(max_length=6, choices=GuardPhase.choices)
    action = models.CharField(max_length=5, choices=GuardAction.choices)
    categories = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True)
    secret_sealed = models.TextField(blank=True, default="")
    secret_hint = models.CharField(max_length=8, blank=True, default="")
    mandatory = models.BooleanField(default=False)
    shadow = models.BooleanField(default=False)
    enabled = models.BooleanField(default=True)
    timeout_ms = models.PositiveIntegerField(
        default=1000, validators=[MinValueValidator(1), MaxValueValidator(30_000)])
    on_error = models.CharField(max_length=6, choices=OnError.choices, default=OnError.OPEN)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.guard}/{self.phase}/{self.action})"
