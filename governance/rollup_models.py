"""Spend and usage history rows (governance/rollups.py writes them; every chart and
report reads only these). Imported by governance/models.py, so Django knows them."""

from __future__ import annotations

from django.db import models

from tenants.models import Tenant


class Rollup(models.Model):
    """The calls of one (tenant, member, key, model) in one period starting at `start`.
    `member_id` is not a foreign key: history outlives a removed member. `latency_hist`
    counts the calls per latency bucket (governance/signals.py bucket_of), so that any
    grouping of rows has exact-to-the-bucket percentiles."""

    start = models.DateTimeField()
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    member_id = models.BigIntegerField(null=True, blank=True)
    key_prefix = models.CharField(max_length=16, blank=True, default="")
    model = models.CharField(max_length=100, blank=True, default="")
    calls = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)  # status 400 and above, refusals included
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    cost_nanousd = models.BigIntegerField(default=0)
    latency_hist = models.JSONField(default=dict)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.member_id}/{self.key_prefix}/{self.model}@{self.start}"


class UsageHour(Rollup):
    """One UTC hour."""

    class Meta:
        indexes = [models.Index(fields=["tenant", "start"]), models.Index(fields=["start"])]


class UsageDay(Rollup):
    """One calendar day in the tenant's time zone (`start`: its local midnight)."""

    class Meta:
        indexes = [models.Index(fields=["tenant", "start"])]
