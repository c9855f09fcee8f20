"""Where services report admin actions for the audit log.

Apps below governance (tenants, inference) must not import it; they call
`admin_action(...)` here, and governance registers the sink when Django starts
(governance/apps.py). Without a sink (a bare script) actions go nowhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Sink = Callable[..., None]
_sink: Sink | None = None


def register(sink: Sink) -> None:
    global _sink
    _sink = sink


def admin_action(*, actor: Any, action: str, target: str = "", status: int = 200,
                 detail: dict[str, Any] | None = None) -> None:
    """Record an admin action once the surrounding transaction commits."""
    if _sink is not None:
        _sink(actor=actor, action=action, target=target, status=status, detail=detail or {})
