"""Tenants, their members and API keys.

Every object that belongs to a tenant carries a `tenant` foreign key, and every query on
it is filtered by the caller's tenant (selectors do this; nothing reads a global tenant).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from tenants import apikeys
from tenants.roles import Role

SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
MAX_RETENTION_DAYS = 3650  # ten years: a bound, so a cutoff date never overflows


class HostedTools(models.TextChoices):
    """What a call does with a hosted tool it cannot run (streaming/apis/hosted.py)."""

    DROP = "drop"  # not offered to the model; named in a header and the audit event
    REFUSE = "refuse"  # a 400 naming the tool


class Tenant(models.Model):
    slug = models.CharField(max_length=63, unique=True, validators=[RegexValidator(SLUG_PATTERN)])
    name = models.CharField(max_length=200)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    # The tenant's data-protection policy (tenants/privacy.py; docs/AUDIT.md, "Data
    # protection"). None: the platform default (SLUICE_REDACT_STORED,
    # SLUICE_RETENTION_DAYS). Only tenant_privacy_update writes them, audited.
    redact_stored = models.BooleanField(null=True, blank=True, default=None)
    retention_days = models.PositiveIntegerField(
        null=True, blank=True, default=None,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_RETENTION_DAYS)])
    # Hosted tools in a request (web_search, code_interpreter...): tenants/tool_policy.py.
    # Only tenant_tool_policy_update writes it, audited.
    hosted_tools = models.CharField(max_length=8, choices=HostedTools.choices,
                                    default=HostedTools.DROP)
    # An IANA zone name: where the tenant's budgets' calendar days, weeks and months
    # begin (governance/quota.py). Only platform admins write it, audited.
    # The model prefix cache's sharing: False, among the tenant's calls (never across
    # tenants); True, only among one API key's calls (tenants/privacy.py).
    prefix_cache_per_key = models.BooleanField(default=False)
    time_zone = models.CharField(max_length=64, default="UTC")

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.slug


class Member(models.Model):
    """A person's membership of a tenant, with exactly one role there."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="members")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="memberships"
    )
    role = models.CharField(max_length=32, choices=Role.choices)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "user"], name="member_unique_per_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.tenant_id}:{self.role}"

    @property
    def subject(self) -> str:
        return f"member:{self.pk}"


class ApiKey(models.Model):
    """A tenant-scoped secret. Only a SHA-256 of the full key is stored; `prefix` finds
    the row without scanning, and is safe to show (it is not enough to authenticate)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    role = models.CharField(max_length=32, choices=Role.choices)
    # Who created it: "member:<id>" or "oidc:<issuer>|<sub>". Developers manage their own.
    created_by = models.CharField(max_length=300)
    member = models.ForeignKey(
        Member, null=True, blank=True, on_delete=models.PROTECT, related_name="api_keys"
    )
    # None: every model the tenant may use; otherwise only these deployment names.
    allowed_models = models.JSONField(null=True, blank=True)
    # 0: normal traffic; 1..9: priority traffic (queued ahead, keeps a reserved share of
    # the room when a deployment sheds load). Only tenant admins may hand it out.
    priority = models.PositiveSmallIntegerField(default=0, validators=[MaxValueValidator(9)])
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["tenant", "created_by"])]

    def __str__(self) -> str:
        return f"{self.prefix} ({self.name})"

    @property
    def display(self) -> str:
        return apikeys.display(self.prefix)

    def is_usable(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class Conversation(models.Model):
    """Server-side chat history (a Sluice extension: `conversation_id` on a request)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="conversations")
    public_id = models.CharField(max_length=40, unique=True)
    title = models.CharField(max_length=200, blank=True, default="")
    created_by = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["tenant", "created_by"])]

    def __str__(self) -> str:
        return self.public_id


class ConversationMessage(models.Model):
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE,
                                     related_name="messages")
    role = models.CharField(max_length=16)
    content = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.conversation_id}:{self.role}"
