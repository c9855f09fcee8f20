"""Conversations: reads and writes, scoped like keys (admins see the tenant's, others
their own). The hot path loads history and appends turns through these functions.

What is past the tenant's retention (tenants/privacy.py) is gone for readers at once:
a conversation untouched for that long is NotFound, older messages are not loaded; the
retention task deletes both. The turns arrive here already redacted per the tenant's
policy (governance.privacy.stored_messages, called by the gateway)."""

from __future__ import annotations

from secrets import token_hex
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from sluice.errors import NotFound
from tenants.models import Conversation, ConversationMessage
from tenants.principal import Principal
from tenants.privacy import effective, policy_of
from tenants.roles import Action
from tenants.selectors import owned, require

HISTORY_LIMIT = 500  # messages loaded per request at most (the newest)


def _scoped(actor: Principal) -> QuerySet[Conversation]:
    return owned(actor, Conversation.objects.all(), manage_all=Action.CONVERSATION_MANAGE_ALL,
                 manage_own=Action.MODEL_USE)


def conversation_list(*, actor: Principal) -> QuerySet[Conversation]:
    cutoff = policy_of(actor.tenant_id).cutoff()
    return _scoped(actor).filter(updated_at__gte=cutoff)


def conversation_get(*, actor: Principal, public_id: str) -> Conversation:
    # The tenant comes in the same query: its retention decides without another.
    found = _scoped(actor).select_related("tenant").filter(public_id=public_id).first()
    if found is None or found.updated_at < effective(found.tenant).cutoff():
        raise NotFound("No such conversation.", code="conversation_not_found",
                       param="conversation_id")
    return found


def conversation_messages(conversation: Conversation) -> QuerySet[ConversationMessage]:
    """A conversation's messages within its tenant's retention, oldest first."""
    cutoff = effective(conversation.tenant).cutoff()
    return conversation.messages.filter(created_at__gte=cutoff).order_by("id")


def conversation_history(*, actor: Principal, public_id: str) -> list[dict[str, str]]:
    conversation = conversation_get(actor=actor, public_id=public_id)
    newest = conversation_messages(conversation).order_by("-id")[:HISTORY_LIMIT]
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
    """Add a request's messages and the reply, in order (called after the response). A
    NUL character, which a chat message may carry but PostgreSQL text cannot, is kept
    as U+FFFD (as the audit log keeps it)."""
    conversation = conversation_get(actor=actor, public_id=public_id)
    ConversationMessage.objects.bulk_create([
        ConversationMessage(conversation=conversation, role=str(m["role"]),
                            content=str(m.get("content") or "").replace("\x00", "\ufffd"))
        for m in messages])
    Conversation.objects.filter(pk=conversation.pk).update(updated_at=timezone.now())
