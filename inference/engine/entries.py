"""What a worker holds of a queue entry, and how a request fails.

A `Pending` is one entry of a tenant's stream that this worker has read (or taken
over) and not yet acknowledged: which stream, its entry id, the request it carries and
how many times Redis has delivered it. Every part speaks of requests through it.

A `RequestError` is a request's error event before it is written: an HTTP status and
code, a message safe to show the caller, and whether the same request may succeed if
sent again. The parts raise or return it; the output processor turns it into the
`ErrorEvent` of inference/jobs.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from inference import queue as q

logger = logging.getLogger("sluice.worker")


@dataclass
class Pending:
    stream: str  # the stream suffix ("<tenant>:<priority>")
    msg_id: str
    req: q.QueuedRequest
    deliveries: int = 1

    @property
    def tenant(self) -> str:
        return self.req.tenant

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def deadline_ms(self) -> int:
        return self.req.deadline_ms


class RequestError(Exception):
    """A request's error event. `retry=False`: the same request would fail the same way
    again (the gateway tells clients not to retry it: `x-should-retry: false`)."""

    def __init__(self, status: int, code: str, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry = status, code, message, retry


def not_finite(rid: str, output: str) -> RequestError:
    """A model's numerical fault on one request's input (its `output`, logits or
    embeddings, held NaN or infinity). Deterministic for that input: the request would
    fail again anywhere, so it is answered now with a 500, neither retried nor allowed
    to stop the worker and the rest of its batch."""
    logger.error("request %s: the model's %s were not finite", rid, output)
    return RequestError(500, "model_error", f"The model's output for this request was "
                        f"not a number (NaN or infinite {output}).", retry=False)


def dead_lettered() -> RequestError:
    """The answer of a request set aside after `max_deliveries` failed deliveries."""
    return RequestError(500, "dead_lettered",
                        "The request failed repeatedly on the model workers and was set aside.",
                        retry=False)


def expired_in_queue() -> RequestError:
    return RequestError(504, "deadline_exceeded",
                        "The request's deadline passed while it was queued.")


def expired_in_generation() -> RequestError:
    return RequestError(504, "deadline_exceeded",
                        "The request's deadline passed during generation.")


def malformed(exc: Exception) -> RequestError:
    return RequestError(400, "invalid_request", f"Malformed request: {exc}")
