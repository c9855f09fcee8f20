"""The deployment registry: which models exist, how they run and how they batch."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from inference.spec import DeploymentSpec, Dialect, MaxTokensPolicy, RuntimeName, UpstreamSpec

POLICY_CHOICES = [(p.value, p.value) for p in MaxTokensPolicy]
_POLICY_HELP = ("A max_tokens beyond what the model can produce: refuse (a 400) or clamp "
                "(lowered to what it can produce; the reply's x-sluice-max-tokens-clamped "
                "header says to what).")

# Names end up inside Redis hash tags ({name}): no braces, no spaces.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
# A public model name an alias answers to: also "org/model:tag" as OpenAI-style clients
# send them (never inside a Redis key: calls run on the deployments behind it).
ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}$"


class Deployment(models.Model):
    name = models.CharField(max_length=100, unique=True, validators=[RegexValidator(NAME_PATTERN)])
    runtime = models.CharField(max_length=32, choices=[(r.value, r.value) for r in RuntimeName])
    weights = models.CharField(max_length=500, blank=True, default="")
    device = models.CharField(max_length=32, default="auto")
    description = models.CharField(max_length=300, blank=True, default="")
    max_batch_size = models.PositiveIntegerField(
        default=8, validators=[MinValueValidator(1), MaxValueValidator(1024)])
    max_wait_ms = models.PositiveIntegerField(default=10, validators=[MaxValueValidator(10_000)])
    max_context = models.PositiveIntegerField(
        default=2048, validators=[MinValueValidator(16), MaxValueValidator(1_048_576)])
    max_output_tokens = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(1_048_576)],
        help_text="The most tokens one reply may ask for (max_tokens): more is a 400. "
                  "Empty: what the context leaves.")
    max_tokens_policy = models.CharField(max_length=8, choices=POLICY_CHOICES,
                                         default=MaxTokensPolicy.REFUSE.value,
                                         help_text=_POLICY_HELP)
    tenant_running_share = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="While other tenants wait, the share of the batch one tenant's "
                  "sequences may hold (empty: SLUICE_TENANT_RUNNING_SHARE).")
    max_queue_depth = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1), MaxValueValidator(1_000_000)])
    tenant_queue_share = models.FloatField(
        default=0.5, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    max_deliveries = models.PositiveIntegerField(
        default=3, validators=[MinValueValidator(1), MaxValueValidator(100)])
    echo_token_delay_ms = models.FloatField(default=0.0, validators=[MinValueValidator(0.0)])
    enabled = models.BooleanField(default=True)
    # Autoscaling (inference/autoscale.py): min 0 lets the deployment scale to zero.
    min_replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(64)])
    max_replicas = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(64)])
    target_inflight = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(100_000)],
        help_text="Requests in flight per worker the autoscaler aims for "
                  "(default: max_batch_size).")
    scale_up_delay_s = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.0), MaxValueValidator(3600.0)])
    scale_down_delay_s = models.FloatField(
        default=30.0, validators=[MinValueValidator(0.0), MaxValueValidator(86_400.0)])
    scale_to_zero_delay_s = models.FloatField(
        default=300.0, validators=[MinValueValidator(0.0), MaxValueValidator(86_400.0)])
    max_queue_age_s = models.FloatField(
        default=2.0, validators=[MinValueValidator(0.1), MaxValueValidator(3600.0)],
        help_text="A queued request older than this asks for one more worker.")
    # An openai_upstream deployment's server (inference/upstream/). The URL is checked
    # by the SSRF guard (inference/upstream/urls.py) in the services, never here alone;
    # the API key is stored sealed (inference/upstream/secrets.py), with its last four
    # characters as the only readable part.
    upstream_url = models.CharField(max_length=2000, blank=True, default="")
    upstream_model = models.CharField(max_length=200, blank=True, default="")
    upstream_secret = models.TextField(blank=True, default="", editable=False)
    upstream_secret_hint = models.CharField(max_length=4, blank=True, default="",
                                            editable=False)
    upstream_dialect = models.CharField(
        max_length=16, choices=[(d.value, d.value) for d in Dialect], default=Dialect.OPENAI.value)
    upstream_concurrency = models.PositiveIntegerField(
        default=64, validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="Requests in flight to the upstream per worker.")
    upstream_connect_timeout_s = models.FloatField(
        default=5.0, validators=[MinValueValidator(0.1), MaxValueValidator(300.0)])
    upstream_read_timeout_s = models.FloatField(
        default=60.0, validators=[MinValueValidator(1.0), MaxValueValidator(3600.0)],
        help_text="The longest silence between two chunks of a reply.")
    # A causal LM's engine options (inference/runtimes/kv.py DecodeOptions: decode
    # path, KV cache and prefix cache sizes), checked at the edge; {}: the defaults.
    engine = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_upstream(self) -> bool:
        return self.runtime == RuntimeName.OPENAI_UPSTREAM

    def clean(self) -> None:
        if None not in (self.min_replicas, self.max_replicas) and \
                self.min_replicas > self.max_replicas:
            raise ValidationError({"min_replicas": "must not exceed max_replicas"})

    def to_spec(self) -> DeploymentSpec:
        return DeploymentSpec(
            name=self.name, runtime=RuntimeName(self.runtime), weights=self.weights,
            device=self.device, max_batch_size=self.max_batch_size, max_wait_ms=self.max_wait_ms,
            max_context=self.max_context, max_queue_depth=self.max_queue_depth,
            tenant_queue_share=self.tenant_queue_share, max_deliveries=self.max_deliveries,
            max_output_tokens=self.max_output_tokens,
            max_tokens_policy=MaxTokensPolicy(self.max_tokens_policy),
            tenant_running_share=self.tenant_running_share,
            echo_token_delay_ms=self.echo_token_delay_ms, extra=dict(self.engine or {}),
            upstream=UpstreamSpec(
                base_url=self.upstream_url, model=self.upstream_model,
                secret_sealed=self.upstream_secret, dialect=Dialect(self.upstream_dialect),
                concurrency=self.upstream_concurrency,
                connect_timeout_s=self.upstream_connect_timeout_s,
                read_timeout_s=self.upstream_read_timeout_s) if self.is_upstream else None,
        )


class ModelAlias(models.Model):
    """A public model name served by one or more deployments: a weighted draw among its
    targets first, then its fallbacks in order (inference/routing.py)."""

    name = models.CharField(max_length=100, unique=True,
                            validators=[RegexValidator(ALIAS_PATTERN)])
    description = models.CharField(max_length=300, blank=True, default="")
    enabled = models.BooleanField(default=True)
    # clamp: a call through the alias is clamped on whichever deployment serves it (a
    # deployment's own clamp applies however it is called).
    max_tokens_policy = models.CharField(max_length=8, choices=POLICY_CHOICES,
                                         default=MaxTokensPolicy.REFUSE.value,
                                         help_text=_POLICY_HELP)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class AliasTarget(models.Model):
    """A deployment an alias sends a share of its calls to: weight / sum of weights."""

    alias = models.ForeignKey(ModelAlias, on_delete=models.CASCADE, related_name="targets")
    deployment = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="+")
    weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(10_000)])

    class Meta:
        ordering = ["alias", "id"]
        constraints = [models.UniqueConstraint(fields=["alias", "deployment"],
                                               name="alias_target_once")]

    def __str__(self) -> str:
        return f"{self.deployment_id} x{self.weight}"


class AliasFallback(models.Model):
    """A deployment tried, in `position` order, after every target failed or was
    unavailable."""

    alias = models.ForeignKey(ModelAlias, on_delete=models.CASCADE, related_name="fallbacks")
    deployment = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="+")
    position = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["alias", "position"]
        constraints = [
            models.UniqueConstraint(fields=["alias", "deployment"], name="alias_fallback_once"),
            models.UniqueConstraint(fields=["alias", "position"], name="alias_fallback_position"),
        ]

    def __str__(self) -> str:
        return f"{self.position}: {self.deployment_id}"
