"""Governance policies (how much) and usage records (how much was used).

Rows here are the persistent truth that admins edit; the live counters (token buckets,
quota windows, breaker state) live in Redis and are keyed by these rows' ids. Validation
that spans fields (low < high, a limit present) is in `clean()`, which every service
calls before saving.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from inference.models import Deployment
from tenants.models import ApiKey, Member, Tenant

_POSITIVE = [MinValueValidator(1)]
_FRACTION = [MinValueValidator(0.0), MaxValueValidator(1.0)]


class RateLimitScope(models.TextChoices):
    TENANT = "tenant", "All of a tenant's traffic"
    API_KEY = "api_key", "Each API key"
    MODEL = "model", "Each tenant x model"


class RateLimitPolicy(models.Model):
    """A token bucket per scope: requests and tokens per minute, with a burst capacity.

    `tenant` None makes it the platform default for every tenant; a tenant's own policy
    of the same scope replaces the default. For scope api_key, `api_key` None applies to
    each key, a set key only to that one. For scope model, an empty `model` applies to
    each model separately, a named one only to that model.
    """

    name = models.CharField(max_length=100, blank=True, default="")
    scope = models.CharField(max_length=16, choices=RateLimitScope.choices)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE,
                               related_name="rate_limits")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="rate_limits")
    model = models.CharField(max_length=100, blank=True, default="")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True,
                                                      validators=_POSITIVE)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True,
                                                    validators=_POSITIVE)
    # Bucket capacity: the most admitted at once. None: a tenth of a minute's rate.
    burst_requests = models.PositiveIntegerField(null=True, blank=True, validators=_POSITIVE)
    burst_tokens = models.PositiveIntegerField(null=True, blank=True, validators=_POSITIVE)
    # Adaptive refill: rate = base x clamp(QPS / qps_ref, qps_min, qps_max)
    #                             x max(1 - p99_slope x (P99_ms - p99_target_ms), floor)
    adaptive = models.BooleanField(default=False)
    qps_ref = models.FloatField(default=1000.0, validators=[MinValueValidator(0.001)])
    qps_min = models.FloatField(default=0.5, validators=[MinValueValidator(0.0)])
    qps_max = models.FloatField(default=2.0, validators=[MinValueValidator(0.0)])
    p99_target_ms = models.FloatField(default=200.0, validators=[MinValueValidator(0.0)])
    p99_slope = models.FloatField(default=0.01, validators=[MinValueValidator(0.0)])
    floor = models.FloatField(default=0.3, validators=_FRACTION)
    window_s = models.PositiveIntegerField(default=60, validators=[MinValueValidator(1),
                                                                   MaxValueValidator(3600)])
    # Redis unreachable: admit (True) or refuse with 503 (False).
    fail_open = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.name or f"{self.scope} limit #{self.pk}"

    def clean(self) -> None:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValidationError("Set requests_per_minute, tokens_per_minute or both.")
        # clean() runs even when a field failed its own check (None here): compare only
        # what is there.
        if None not in (self.qps_min, self.qps_max) and self.qps_min > self.qps_max:
            raise ValidationError("qps_min must not exceed qps_max.")
        if self.api_key_id is not None and self.scope != RateLimitScope.API_KEY:
            raise ValidationError("api_key is only for scope 'api_key'.")
        if self.model and self.scope != RateLimitScope.MODEL:
            raise ValidationError("model is only for scope 'model'.")
        if self.api_key is not None and self.api_key.tenant_id != self.tenant_id:
            raise ValidationError("The API key belongs to another tenant.")


class QuotaPeriod(models.TextChoices):
    MINUTE = "minute", "Minute"
    DAY = "day", "Day"
    MONTH = "month", "Month"


class QuotaWindow(models.TextChoices):
    CALENDAR = "calendar", "Calendar (resets at the period's start, UTC)"
    ROLLING = "rolling", "Rolling (the last period, in 60 slots)"


class Quota(models.Model):
    """How much a tenant may use of a model (or of all models, `model` empty) per period.

    Tokens are reserved before a call (prompt bound + max_tokens) and settled with the
    real usage after, so concurrent calls cannot overshoot. Shadow quotas count and
    report but never refuse.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quotas")
    model = models.CharField(max_length=100, blank=True, default="")
    period = models.CharField(max_length=8, choices=QuotaPeriod.choices,
                              default=QuotaPeriod.DAY)
    window = models.CharField(max_length=8, choices=QuotaWindow.choices,
                              default=QuotaWindow.CALENDAR)
    max_requests = models.PositiveBigIntegerField(null=True, blank=True, validators=_POSITIVE)
    max_tokens = models.PositiveBigIntegerField(null=True, blank=True, validators=_POSITIVE)
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, validators=_POSITIVE)
    shadow = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model or '*'} per {self.period}"

    def clean(self) -> None:
        if self.max_requests is None and self.max_tokens is None and self.max_concurrent is None:
            raise ValidationError("Set max_requests, max_tokens, max_concurrent or a mix.")


class Price(models.Model):
    """What a model (a deployment or an alias) costs, from `valid_from` until the next
    price of the same model: US dollars per million input, output and cached-input
    tokens, and for a self-hosted deployment optionally per GPU-second of its steps.
    Decimals, stored exactly; a call is priced by the row valid when it was admitted
    (governance.pricing), so a report re-prices the past the same way every time."""

    model = models.CharField(max_length=100)
    input_per_mtok_usd = models.DecimalField(max_digits=16, decimal_places=6)
    output_per_mtok_usd = models.DecimalField(max_digits=16, decimal_places=6)
    # None: cached input tokens cost what input tokens do.
    cached_input_per_mtok_usd = models.DecimalField(max_digits=16, decimal_places=6,
                                                    null=True, blank=True)
    gpu_second_usd = models.DecimalField(max_digits=16, decimal_places=9, null=True,
                                         blank=True)
    valid_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model", "-valid_from"]
        constraints = [models.UniqueConstraint(fields=["model", "valid_from"],
                                               name="price_unique_model_from")]

    def __str__(self) -> str:
        return f"{self.model} from {self.valid_from:%Y-%m-%d %H:%M}"


class BudgetScope(models.TextChoices):
    TENANT = "tenant", "All of a tenant's calls"
    MEMBER = "member", "One member's calls (JWT or their keys)"
    KEY = "key", "One API key's calls"


class BudgetWindow(models.TextChoices):
    DAY = "day", "Calendar day (the tenant's time zone)"
    WEEK = "week", "Calendar week from Monday (the tenant's time zone)"
    MONTH = "month", "Calendar month (the tenant's time zone)"
    TOTAL = "total", "Never resets"


def default_alert_at() -> list[int]:
    return [50, 80, 100]


class Budget(models.Model):
    """The most a tenant, one member or one key may spend per window, in US dollars, on
    every model or one (`model`). Each call reserves its worst-case cost against every
    budget that applies before it is queued and settles its real cost after
    (governance/quota.py), so concurrent calls cannot overshoot it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budgets")
    scope = models.CharField(max_length=8, choices=BudgetScope.choices,
                             default=BudgetScope.TENANT)
    member = models.ForeignKey(Member, null=True, blank=True, on_delete=models.CASCADE,
                               related_name="budgets")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="budgets")
    model = models.CharField(max_length=100, blank=True, default="")
    window = models.CharField(max_length=8, choices=BudgetWindow.choices,
                              default=BudgetWindow.MONTH)
    limit_usd = models.DecimalField(max_digits=16, decimal_places=6)
    # Percentages of limit_usd whose crossing alerts, each once per window
    # (governance/alerts.py): an audit event, the tenant's webhook, the UI's banner.
    alert_at = models.JSONField(default=default_alert_at, blank=True)
    # A model or alias the tenant's calls go to instead while this budget refuses them
    # ("": refused with budget_exceeded).
    fallback_model = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.scope}/{self.model or '*'} per {self.window}"

    def clean(self) -> None:
        if (self.scope == BudgetScope.MEMBER) != (self.member_id is not None):
            raise ValidationError({"member_id": "A member budget names its member (and "
                                                "only a member budget does)."})
        if (self.scope == BudgetScope.KEY) != (self.api_key_id is not None):
            raise ValidationError({"key_id": "A key budget names its key (and only a key "
                                             "budget does)."})


class AlertWebhook(models.Model):
    """Where a tenant's budget alerts are POSTed (governance/alerts.py), signed with a
    secret that is sealed at rest (inference/upstream/secrets.py) and never shown again
    after it is set."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE,
                                  related_name="alert_webhook")
    url = models.CharField(max_length=2048)
    secret_sealed = models.TextField()
    secret_hint = models.CharField(max_length=8, blank=True, default="")
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"alerts of tenant {self.tenant_id}"


class WindowKind(models.TextChoices):
    COUNT = "count", "The last N calls"
    TIME = "time", "The calls of the last N seconds"


class DegradeMode(models.TextChoices):
    SHORTEN = "shorten", "Cap max_tokens"
    REJECT = "reject", "Refuse with 503"


class BreakerPolicy(models.Model):
    """Circuit breaker, memory guard and load shedding for one deployment."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE,
                                      related_name="breaker")
    window_kind = models.CharField(max_length=8, choices=WindowKind.choices,
                                   default=WindowKind.COUNT)
    window_size = models.PositiveIntegerField(  # calls, or seconds
        default=100, validators=[MinValueValidator(1), MaxValueValidator(10_000)])
    min_calls = models.PositiveIntegerField(default=20, validators=_POSITIVE)
    failure_rate = models.FloatField(default=0.5, validators=_FRACTION)  # opens at >=
    slow_call_ms = models.PositiveIntegerField(default=30_000, validators=_POSITIVE)
    slow_call_rate = models.FloatField(default=1.0, validators=_FRACTION)  # opens at >=
    open_wait_s = models.FloatField(default=30.0, validators=[MinValueValidator(0.01)])
    half_open_probes = models.PositiveIntegerField(default=3, validators=[
        MinValueValidator(1), MaxValueValidator(1000)])
    probe_timeout_s = models.FloatField(default=60.0, validators=[MinValueValidator(0.01)])
    # Device memory guard (workers read it from Redis on every heartbeat).
    memory_high = models.FloatField(default=0.92, validators=_FRACTION)
    memory_low = models.FloatField(default=0.85, validators=_FRACTION)
    memory_hold_s = models.FloatField(default=10.0, validators=[MinValueValidator(0.0)])
    degrade_mode = models.CharField(max_length=8, choices=DegradeMode.choices,
                                    default=DegradeMode.SHORTEN)
    degraded_max_tokens = models.PositiveIntegerField(default=64, validators=_POSITIVE)
    # Load shedding: None turns a signal off. Priority traffic (key priority > 0) keeps
    # `priority_share` of the room: normal traffic is shed at (1 - share) x the limit.
    shed_queue_depth = models.PositiveIntegerField(null=True, blank=True, validators=_POSITIVE)
    shed_oldest_age_ms = models.PositiveIntegerField(null=True, blank=True,
                                                     validators=_POSITIVE)
    priority_share = models.FloatField(default=0.2, validators=_FRACTION)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"breaker of {self.deployment_id}"

    def clean(self) -> None:
        if None not in (self.memory_low, self.memory_high) and \
                self.memory_low >= self.memory_high:
            raise ValidationError("memory_low must be below memory_high.")
        if None not in (self.min_calls, self.window_size) and \
                self.min_calls > self.window_size and self.window_kind == WindowKind.COUNT:
            raise ValidationError("min_calls cannot exceed a count window's size.")


class UsageRecord(models.Model):
    """Daily usage per tenant x model x key, rolled up from Redis counters (billing)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=100)
    # The key's public prefix ("" for JWT/OIDC callers): stays readable after deletion.
    key_prefix = models.CharField(max_length=16, blank=True, default="")
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # What the calls cost at the prices valid when each was admitted (1e-9 USD).
    cost_nanousd = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-day", "tenant_id", "model"]
        constraints = [models.UniqueConstraint(fields=["tenant", "model", "key_prefix", "day"],
                                               name="usage_unique_day")]
        indexes = [models.Index(fields=["tenant", "day"])]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model}/{self.key_prefix or '-'} on {self.day}"


class RedactionPattern(models.Model):
    """A tenant's own pattern to redact (employee ids, case numbers...), as [LABEL]."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="redaction_patterns")
    label = models.CharField(max_length=32, validators=[RegexValidator(r"^[A-Z][A-Z0-9_]*$")])
    pattern = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.tenant_id}:{self.label}"


class AuditQuerySet(models.QuerySet["AuditEvent"]):
    """No bulk update or delete: the only way out is the retention purge."""

    def update(self, **kwargs: Any) -> int:
        raise PermissionError("Audit events are append-only.")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise PermissionError("Audit events are append-only; use the retention purge.")


class AuditEvent(models.Model):
    """One API call or admin action, with personal data redacted before it got here.

    Append-only (no update or delete in code; on PostgreSQL a trigger refuses both
    unless the retention purge asks), and hash-chained per tenant: `hash` is SHA-256 over
    the previous event's hash and this event's canonical content, so changing, removing
    or reordering a stored event breaks verification at that event.
    """

    chain = models.CharField(max_length=80)  # the tenant slug, or "platform"
    seq = models.PositiveBigIntegerField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)
    at = models.DateTimeField()
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.DO_NOTHING,
                               db_constraint=False, related_name="+")
    actor = models.CharField(max_length=300, blank=True, default="")  # principal subject
    role = models.CharField(max_length=32, blank=True, default="")
    key_prefix = models.CharField(max_length=16, blank=True, default="")
    action = models.CharField(max_length=64)  # "chat.completions", "apikey.create", ...
    target = models.CharField(max_length=200, blank=True, default="")
    model = models.CharField(max_length=100, blank=True, default="")
    protocol = models.CharField(max_length=16, blank=True, default="")  # rest, sse, admin
    status = models.PositiveSmallIntegerField(default=0)
    latency_ms = models.FloatField(default=0.0)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    request_id = models.CharField(max_length=64, blank=True, default="")
    trace_id = models.CharField(max_length=32, blank=True, default="")
    request_excerpt = models.TextField(blank=True, default="")
    response_excerpt = models.TextField(blank=True, default="")
    detail = models.JSONField(default=dict, blank=True)
    # The audit stream entry it came from (redeliveries are not inserted twice).
    source = models.CharField(max_length=40, blank=True, default="")

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ["chain", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["chain", "seq"], name="audit_chain_seq"),
            models.UniqueConstraint(fields=["source"], condition=~models.Q(source=""),
                                    name="audit_source_once"),
        ]
        indexes = [models.Index(fields=["tenant", "at"]), models.Index(fields=["at"])]

    def __str__(self) -> str:
        return f"{self.chain}#{self.seq} {self.action}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None and not kwargs.get("force_insert"):
            raise PermissionError("Audit events are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise PermissionError("Audit events are append-only; use the retention purge.")


class AuditChain(models.Model):
    """The head of one tenant's chain, locked by writers (so seq and prev_hash are never
    taken twice), and the anchor the retention purge leaves behind."""

    chain = models.CharField(max_length=80, unique=True)
    seq = models.PositiveBigIntegerField(default=0)
    last_hash = models.CharField(max_length=64, default="0" * 64)
    anchor_seq = models.PositiveBigIntegerField(default=0)  # events <= this were purged
    anchor_hash = models.CharField(max_length=64, default="0" * 64)

    def __str__(self) -> str:
        return f"{self.chain} @ {self.seq}"


class ExportStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class AuditExport(models.Model):
    """An export of audit events to JSONL or CSV, made by a Celery job."""

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE,
                               related_name="+")  # None: every tenant (platform admins)
    requested_by = models.CharField(max_length=300)
    format = models.CharField(max_length=8, choices=[("jsonl", "JSONL"), ("csv", "CSV")])
    filters = models.JSONField(default=dict)
    status = models.CharField(max_length=8, choices=ExportStatus.choices,
                              default=ExportStatus.QUEUED)
    total = models.PositiveBigIntegerField(default=0)
    done = models.PositiveBigIntegerField(default=0)
    path = models.CharField(max_length=500, blank=True, default="")
    error = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"export #{self.pk} ({self.status})"


# The spend history's and guardrail policies' rows live in their own modules; imported so
# that Django loads them.
from governance.guardrail_models import GuardrailPolicy  # noqa: E402, F401
from governance.rollup_models import UsageDay, UsageHour  # noqa: E402, F401
