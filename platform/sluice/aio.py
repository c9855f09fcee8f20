"""asyncio helpers shared by the long-lived async components."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any


async def finish_or_cancel(tasks: Collection[asyncio.Future[Any]], grace_s: float) -> None:
    """Shutdown of work in flight: let `tasks` finish for up to `grace_s`, then cancel
    the late ones and wait until they have ended (their errors are theirs)."""
    if not tasks:
        return
    _, late = await asyncio.wait(list(tasks), timeout=grace_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
