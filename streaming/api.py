"""The OpenAI Files and Batch APIs, and reading stored responses of the Responses API
(Django + ninja: these are not the hot path; POST /v1/responses is streaming/apis)."""

# No `from __future__ import annotations`: ninja reads File/Form parameters' types.

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from ninja import File, Form, Router, Schema, UploadedFile
from pydantic import Field, StringConstraints

from sluice.schemas import Line, StrictSchema, Text
from streaming.apis.responses import store as responses_store
from streaming.batches import files
from streaming.batches import services as batches
from streaming.models import Batch, StoredFile
from tenants.api import actor_of

router = Router(tags=["batch"])


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def _file(row: StoredFile) -> dict[str, Any]:
    return {"id": row.public_id, "object": "file", "bytes": row.bytes,
            "created_at": _ts(row.created_at), "filename": row.filename,
            "purpose": row.purpose, "status": "processed", "status_details": None,
            "expires_at": _ts(files.expires_at(row))}


def _batch(row: Batch) -> dict[str, Any]:
    return {
        "id": row.public_id, "object": "batch", "endpoint": row.endpoint,
        "errors": row.errors, "input_file_id": row.input_file.public_id,
        "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file.public_id if row.output_file else None,
        "error_file_id": row.error_file.public_id if row.error_file else None,
        "created_at": _ts(row.created_at), "in_progress_at": _ts(row.in_progress_at),
        "expires_at": _ts(row.expires_at), "finalizing_at": _ts(row.finalizing_at),
        "completed_at": _ts(row.completed_at), "failed_at": _ts(row.failed_at),
        "expired_at": None, "cancelling_at": _ts(row.cancelling_at),
        "cancelled_at": _ts(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": row.completed,
                           "failed": row.failed},
        "metadata": row.metadata,
    }


class ListOut(Schema):
    object: str = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


def _page(rows: QuerySet[Any], after: str | None, limit: int,
          render: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's cursor list: newest first, `after` an object id, `has_more`."""
    if after:
        anchor = rows.filter(public_id=after).first()
        rows = rows.filter(id__lt=anchor.pk) if anchor else rows.none()
    page = list(rows[:limit + 1])
    data = [render(r) for r in page[:limit]]
    return {"object": "list", "data": data, "has_more": len(page) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.post("/files", response={200: dict[str, Any]})
def file_create(request: HttpRequest, file: File[UploadedFile],
                purpose: Form[Line]) -> dict[str, Any]:
    row = files.file_create(actor=actor_of(request), filename=file.name or "upload",
                              purpose=purpose, content=file.chunks())
    return _file(row)


@router.get("/files", response=ListOut)
def file_list(request: HttpRequest, limit: Annotated[int, Field(ge=1, le=100)] = 100,
              after: str | None = None) -> dict[str, Any]:
    return _page(files.file_list(actor=actor_of(request)), after, limit, _file)


@router.get("/files/{file_id}", response=dict[str, Any])
def file_get(request: HttpRequest, file_id: str) -> dict[str, Any]:
    return _file(files.file_get(actor=actor_of(request), file_id=file_id))


@router.get("/files/{file_id}/content")
def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    return HttpResponse(files.file_content(actor=actor_of(request), file_id=file_id),
                        content_type="application/jsonl")


@router.delete("/files/{file_id}", response=dict[str, Any])
def file_delete(request: HttpRequest, file_id: str) -> dict[str, Any]:
    row = files.file_delete(actor=actor_of(request), file_id=file_id)
    return {"id": row.public_id, "object": "file", "deleted": True}


class BatchIn(StrictSchema):
    input_file_id: Annotated[Line, StringConstraints(max_length=64)]
    endpoint: Annotated[Line, StringConstraints(max_length=64)]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[Line, Annotated[Text, StringConstraints(max_length=512)]] | None = None


@router.post("/batches", response=dict[str, Any])
def batch_create(request: HttpRequest, data: BatchIn) -> dict[str, Any]:
    return _batch(batches.batch_create(actor=actor_of(request), input_file_id=data.input_file_id,
                                       endpoint=data.endpoint,
                                       completion_window=data.completion_window,
                                       metadata=data.metadata))


@router.get("/batches", response=ListOut)
def batch_list(request: HttpRequest, limit: Annotated[int, Field(ge=1, le=100)] = 20,
               after: str | None = None) -> dict[str, Any]:
    return _page(batches.batch_list(actor=actor_of(request)), after, limit, _batch)


@router.get("/batches/{batch_id}", response=dict[str, Any])
def batch_get(request: HttpRequest, batch_id: str) -> dict[str, Any]:
    return _batch(batches.batch_get(actor=actor_of(request), batch_id=batch_id))


@router.post("/batches/{batch_id}/cancel", response=dict[str, Any])
def batch_cancel(request: HttpRequest, batch_id: str) -> dict[str, Any]:
    return _batch(batches.batch_cancel(actor=actor_of(request), batch_id=batch_id))


@router.get("/responses/{response_id}", response=dict[str, Any], tags=["responses"])
def response_get(request: HttpRequest, response_id: str) -> dict[str, Any]:
    return responses_store.response_body(
        responses_store.response_get(actor=actor_of(request), response_id=response_id))


@router.delete("/responses/{response_id}", response=dict[str, Any], tags=["responses"])
def response_delete(request: HttpRequest, response_id: str) -> dict[str, Any]:
    deleted = responses_store.response_delete(actor=actor_of(request), response_id=response_id)
    return {"id": deleted, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items", response=ListOut, tags=["responses"])
def response_input_items(request: HttpRequest, response_id: str,
                         limit: Annotated[int, Field(ge=1, le=100)] = 20,
                         order: Literal["asc", "desc"] = "desc",
                         after: Annotated[Line, StringConstraints(max_length=64)] | None = None
                         ) -> dict[str, Any]:
    """OpenAI's cursor list of the response's own input items (`order` desc: the last
    given first; `after`: an item id)."""
    items = responses_store.response_input_items(actor=actor_of(request),
                                                 response_id=response_id)
    if order == "desc":
        items.reverse()
    if after:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
