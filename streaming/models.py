"""The OpenAI Files and Batch APIs: uploaded JSONL files and batches that run each line
through the gateway pipeline (quotas and limits apply) in a Celery job; and the stored
responses of the Responses API (streaming/apis/responses/store.py)."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from tenants.models import Tenant


class StoredFile(models.Model):
    """A file a tenant uploaded (`purpose: batch`) or a batch produced (`batch_output`).
    Its bytes live under <state dir>/files/<tenant id>/<public id>."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    public_id = models.CharField(max_length=40, unique=True)  # file-<hex>
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32)
    bytes = models.PositiveBigIntegerField()
    path = models.CharField(max_length=500)
    created_by = models.CharField(max_length=300)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.public_id


class BatchStatus(models.TextChoices):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class Batch(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    public_id = models.CharField(max_length=40, unique=True)  # batch_<hex>
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8, default="24h")
    input_file = models.ForeignKey(StoredFile, on_delete=models.PROTECT, related_name="+")
    output_file = models.ForeignKey(StoredFile, null=True, blank=True,
                                    on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(StoredFile, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    status = models.CharField(max_length=16, choices=BatchStatus.choices,
                              default=BatchStatus.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # validation errors (OpenAI shape)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    metadata = models.JSONField(null=True, blank=True)
    # Who runs it: the creator's principal, frozen (the job has no credential to replay).
    principal = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.public_id


class StoredResponse(models.Model):
    """A Responses API reply kept for `GET /v1/responses/{id}` and for the next call's
    `previous_response_id` (what its input and output were). Text is stored redacted
    per the tenant's policy; read by its creator and the tenant's admins only, within
    the tenant's retention (streaming/apis/responses/store.py)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="responses")
    public_id = models.CharField(max_length=40, unique=True)  # resp_<hex>
    created_by = models.CharField(max_length=300)  # the caller's subject
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=16)
    previous_response_id = models.CharField(max_length=40, blank=True, default="")
    input_items = models.JSONField(default=list)  # this call's own input, as items
    output_items = models.JSONField(default=list)
    usage = models.JSONField(null=True, blank=True)
    # The rest of the response object (instructions, tools, text, sampling, metadata,
    # incomplete_details, error): what GET returns besides the above.
    details = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "created_by"]),
                   models.Index(fields=["created_at"])]

    def __str__(self) -> str:
        return self.public_id
