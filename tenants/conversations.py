"""Conversations: reads and writes, scoped like keys (admins see the tenant's, others
their own). The hot path loads history and appends turns through these functions."""

from __future__ import annotations

from secrets import token_hex
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from sluice.errors import NotFound
from tenants.models import Conversation, ConversationMessage
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import owned, require

HISTORY_LIMIT = 500  # messages loaded per request at most (the newest)


def conversation_list(*, actor: Principal) -> QuerySet[Conversation]:
    return owned(actor, Conversation.objects.all(), manage_all=Action.CONVERSATION_MANAGE_ALL,
                 manage_own=Action.MODEL_USE)


def conversation_get(*, actor: Principal, public_id: str) -> Conversation:
    found = conversation_list(actor=actor).filter(public_id=public_id).first()
    if found is None:
        raise NotFound("No such conversation.", code="conversation_not_found",
                       param="conversation_id")
    return found


def conversation_history(*, actor: Principal, public_id: str) -> list[dict[str, str]]:
    conversation = conversation_get(actor=actor, public_id=public_id)
    newest = conversation.messages.order_by("-id")[:HISTORY_LIMIT]
    return [{"role": m.role, "content": m.content} for m in reversed(list(newest))]


@transaction.atomic
def conversation_create(*, actor: Principal, title: str = "") -> Conversation:
    require(actor, Action.MODEL_USE)
    return Conversation.objects.create(tenant_id=actor.tenant_id, title=title,
                                       public_id=f"conv_{token_hex(12)}",
                                       created_by=actor.subject)


@transaction.atomic
def conversation_delete(*, actor: Principal, public_id: str) -> None:
    conversation_get(actor=actor, public_id=public_id).delete()


@transaction.atomic
def conversation_append(*, actor: Principal, public_id: str,
                        messages: list[dict[str, Any]]) -> None:
    """Add a request's messages and the reply, in order (called after the response)."""
    conversation = conversation_get(actor=actor, public_id=public_id)
    ConversationMessage.objects.bulk_create([
        ConversationMessage(conversation=conversation, role=str(m["role"]),
                            content=str(m.get("content") or "")) for m in messages])
    Conversation.objects.filter(pk=conversation.pk).update(updated_at=timezone.now())
