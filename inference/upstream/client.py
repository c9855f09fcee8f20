"""The client of one OpenAI-compatible upstream: a job in, the worker's typed events out.

`UpstreamClient(spec).stream(job, tenant=...)` sends the job (inference/upstream/body.py
says what is sent) and yields what a worker emits for it: DeltaEvents (`ids` is [] —
an upstream's token ids are not ours), then exactly one DoneEvent or ErrorEvent, the
last event. Sequence numbers start at 0, or at a continuation's `seq`. HTTP goes
through the asyncio-native connections of inference/upstream/network.py, whose
`NetworkError`s are typed here.

Contract
- Cancellation: closing the iterator (`aclose()`, or cancelling the task that reads it)
  closes the upstream HTTP request; the upstream sees the client go and stops
  generating (vLLM aborts the request; Sluice cancels its worker's job).
- Usage is the upstream's (`stream_options.include_usage`); a continuation's usage adds
  the tokens already billed, and counts them out of the prompt the upstream reports
  (which held them), so the sum is what the upstream processed. An upstream that sends
  no usage is billed one token per delta event and no prompt tokens.
- `stream=False` jobs ask the upstream for one JSON reply (no per-token work on either
  side); its text comes in one delta event just before the final one. Its read waits
  until the deadline (read_timeout_s bounds the silence between chunks of a stream).
- Failures end the stream with an ErrorEvent; `retry` says whether the same request to
  the same deployment may succeed later: connection failures and refused connects
  (503 upstream_unavailable), timeouts (504 upstream_timeout), a connection cut
  mid-reply (502 upstream_disconnected), the upstream's 5xx (502/503/504) and 429 are
  retriable; the upstream refusing the request itself (400 upstream_bad_request, its
  message quoted), refusing Sluice's credentials (502 upstream_auth_failed), not
  knowing the model (502 upstream_not_found), an address the SSRF guard refuses (502
  upstream_address_refused) are final. A status >= 500 or 429 is worth a fallback;
  a 4xx other than 429 is the caller's and is not.
- The API key is opened (inference/upstream/secrets.py) when the client is built and
  lives only in the HTTP client's headers; no event, exception message or log line of
  this module carries it (upstream messages are scrubbed of it before they are quoted).
- At most `concurrency` requests are in flight per client; more wait for a slot.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import orjson

from inference.jobs import (
    ChatJob,
    Continuation,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    default_max_tokens,
    usage,
)
from inference.spec import DeploymentSpec
from inference.upstream.body import ChunkReader, can_continue, path_of, request_body
from inference.upstream.network import (
    ConnectFailed,
    NetworkError,
    Pool,
    ReadTimeout,
    Reply,
    Timeouts,
)
from inference.upstream.secrets import Secret, SecretUnavailable, unseal
from inference.upstream.urls import UpstreamURLError, allow_private

logger = logging.getLogger("sluice.upstream")
Event = DeltaEvent | DoneEvent | ErrorEvent
_ERROR_BODY_MAX = 64 * 1024  # of an error reply, read to quote its message
_REPLY_MAX = 256 * 1024 * 1024  # a reply in one piece (logprobs make it large)
_QUOTE_MAX = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class UpstreamFailure(Exception):
    """One way a call to the upstream failed, as the ErrorEvent that reports it."""

    def __init__(self, status: int, code: str, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry = status, code, message, retry


def status_failure(status: int, quoted: str = "") -> UpstreamFailure:
    """The failure an upstream's HTTP status means (`quoted`: its message, scrubbed)."""
    said = f" ({quoted})" if quoted else ""
    if status == 429:
        return UpstreamFailure(429, "upstream_rate_limited",
                               "The model's upstream server is rate limiting; retry later.",
                               retry=True)
    if status in (408, 504):
        return UpstreamFailure(504, "upstream_timeout", "The model's upstream server timed "
                               "out.", retry=True)
    if status == 503:
        return UpstreamFailure(503, "upstream_unavailable", "The model's upstream server is "
                               "unavailable.", retry=True)
    if status >= 500:
        return UpstreamFailure(502, "upstream_error", f"The model's upstream server failed "
                               f"with HTTP {status}.", retry=True)
    if status in (401, 403):
        return UpstreamFailure(502, "upstream_auth_failed", "The model's upstream server "
                               "refused Sluice's credentials.", retry=False)
    if status == 404:
        return UpstreamFailure(502, "upstream_not_found", "The model's upstream server does "
                               f"not serve the configured model{said}.", retry=False)
    if status in (400, 413, 422):
        return UpstreamFailure(400, "upstream_bad_request", "The model's upstream server "
                               f"refused the request{said}.", retry=False)
    return UpstreamFailure(502, "upstream_refused", f"The model's upstream server answered "
                           f"HTTP {status}.", retry=False)


def exception_failure(exc: BaseException) -> UpstreamFailure:
    """The failure a transport exception means."""
    if isinstance(exc, UpstreamURLError):
        return UpstreamFailure(502, "upstream_address_refused", "The model's upstream "
                               "address is refused by the SSRF guard.", retry=False)
    if isinstance(exc, ConnectFailed):
        return UpstreamFailure(503, "upstream_unavailable", "The model's upstream server "
                               "cannot be reached.", retry=True)
    if isinstance(exc, ReadTimeout):
        return UpstreamFailure(504, "upstream_timeout", "The model's upstream server "
                               "stopped answering.", retry=True)
    if isinstance(exc, orjson.JSONDecodeError):
        return UpstreamFailure(502, "upstream_bad_reply", "The model's upstream server "
                               "sent a reply that is not JSON.", retry=False)
    return UpstreamFailure(502, "upstream_disconnected", "The connection to the model's "
                           "upstream server broke.", retry=True)


class UpstreamClient:
    """One per worker process and upstream deployment (its connection pool is shared
    by the calls it runs). Build and use it inside one event loop."""

    def __init__(self, spec: DeploymentSpec, *, private_ok: bool | None = None) -> None:
        if spec.upstream is None:
            raise ValueError(f"{spec.name} is not an upstream deployment")
        self.spec, self.upstream = spec, spec.upstream
        self._secret = Secret("")
        self._secret_failure: UpstreamFailure | None = None
        try:
            self._secret = unseal(self.upstream.secret_sealed)
        except SecretUnavailable as exc:
            self._secret_failure = UpstreamFailure(502, "upstream_secret_unavailable",
                                                   str(exc), retry=False)
        up = self.upstream
        self._headers = [(b"Accept", b"text/event-stream, application/json"),
                         (b"Content-Type", b"application/json"),
                         (b"User-Agent", b"sluice-upstream")]
        if self._secret:
            self._headers.append((b"Authorization", f"Bearer {self._secret.reveal()}".encode()))
        self._path = urlsplit(up.base_url).path.rstrip("/")
        self._pool = Pool(up.base_url, private_ok=allow_private() if private_ok is None
                          else private_ok, max_connections=up.concurrency)
        self._slots = asyncio.Semaphore(up.concurrency)

    async def aclose(self) -> None:
        await self._pool.aclose()

    def _scrub(self, text: str) -> str:
        """An upstream's message made safe to quote: without our key (a server may
        echo the credentials it refused), control characters or excess length."""
        secret = self._secret.reveal()
        if secret:
            text = text.replace(secret, "[redacted]")
        return _CONTROL.sub(" ", text)[:_QUOTE_MAX].strip()

    def _timeout(self, deadline: float | None, *, whole: bool = False) -> Timeouts:
        """`whole`: the reply comes in one piece, after the whole generation: its read
        waits until the deadline, not read_timeout_s (silence between chunks)."""
        up = self.upstream
        connect, read = up.connect_timeout_s, up.read_timeout_s
        if deadline is not None:
            left = max(0.001, deadline - time.monotonic())
            connect, read = min(connect, left), left if whole else min(read, left)
        return Timeouts(connect=connect, read=read)

    async def stream(self, job: ChatJob, *, tenant: str,
                     continuation: Continuation | None = None,
                     deadline: float | None = None) -> AsyncGenerator[Event, None]:
        """The events of `job` for `tenant` (whose cache salt is sent), resumed after
        `continuation` when given; `deadline` (time.monotonic()) bounds the call."""
        seq = continuation.seq if continuation is not None else 0
        prior = continuation.completion_tokens if continuation is not None else 0
        deltas = 0
        failure = self._precheck(job, continuation)
        max_tokens = job.max_tokens or default_max_tokens(self.spec.max_context)
        if failure is None and prior >= max_tokens:
            yield {"t": "done", "seq": seq, "finish": "length", "usage": usage(0, prior)}
            return
        reader = ChunkReader()
        held: list[str] = []
        held_lp: list[dict[str, Any]] = []
        try:
            if failure is not None:
                raise failure
            body = request_body(job, self.upstream, tenant=tenant, max_tokens=max_tokens,
                                continuation=continuation)
            async with self._slots, self._pool.request(
                    "POST", self._path + path_of(job), headers=self._headers,
                    body=orjson.dumps(body),
                    timeouts=self._timeout(deadline, whole=not job.stream)) as response:
                if response.status != 200:
                    raise status_failure(response.status, await self._quoted(response))
                if not body["stream"]:  # one JSON reply, read as one chunk
                    text, lp = reader.read(orjson.loads(await _whole(response)))
                    if reader.error is not None:
                        raise self._stream_error(reader.error)
                    held.append(text)
                    held_lp += lp
                    deltas += bool(text or lp)
                finished = not body["stream"]
                async for data in _sse_data(response) if body["stream"] else _nothing():
                    if data == "[DONE]":
                        finished = True
                        break
                    text, lp = reader.read(orjson.loads(data))
                    if reader.error is not None:
                        raise self._stream_error(reader.error)
                    if deadline is not None and time.monotonic() > deadline:
                        raise UpstreamFailure(504, "deadline_exceeded", "The request's "
                                              "deadline passed.", retry=False)
                    pieces = reader.pieces if job.stream else []
                    if not (text or lp or pieces):
                        continue
                    deltas += 1
                    if not job.stream:
                        held.append(text)
                        held_lp += lp
                        continue
                    event: DeltaEvent = {"t": "delta", "seq": seq, "text": text, "ids": []}
                    if lp:
                        event["lp"] = lp
                    if pieces:  # tool calls as the upstream writes them
                        event["tools"] = pieces
                    yield event
                    seq += 1
                if not finished and reader.finish is None:
                    raise UpstreamFailure(502, "upstream_disconnected", "The model's "
                                          "upstream server ended the reply early.",
                                          retry=True)
        except (UpstreamFailure, UpstreamURLError, NetworkError, orjson.JSONDecodeError,
                UnicodeDecodeError) as exc:
            failed = exc if isinstance(exc, UpstreamFailure) else exception_failure(exc)
            logger.warning("upstream %s: %s (%s)", self.spec.name, failed.code,
                           type(exc).__name__)
            error: ErrorEvent = {"t": "error", "seq": seq, "status": failed.status,
                                 "code": failed.code, "message": failed.message,
                                 "usage": usage(0, prior + deltas), "retry": failed.retry}
            yield error
            return
        if held or held_lp:
            whole: DeltaEvent = {"t": "delta", "seq": seq, "text": "".join(held), "ids": []}
            if held_lp:
                whole["lp"] = held_lp
            yield whole
            seq += 1
        yield self._done(reader, seq, prior, deltas)

    def _precheck(self, job: ChatJob, continuation: Continuation | None
                  ) -> UpstreamFailure | None:
        if self._secret_failure is not None:
            return self._secret_failure
        if job.count_only:
            return UpstreamFailure(400, "unsupported_by_upstream", "Counting tokens is not "
                                   "available for this model.", retry=False)
        if continuation is not None and not can_continue(job, self.upstream.dialect):
            return UpstreamFailure(502, "upstream_cannot_resume", "The reply was cut off and "
                                   "this model's upstream server cannot continue it; send "
                                   "the request again.", retry=True)
        return None

    async def _quoted(self, response: Reply) -> str:
        raw = b""
        async for part in response.parts():
            raw += part
            if len(raw) >= _ERROR_BODY_MAX:
                break
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return ""
        found: Any = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(found, dict):
            found = found.get("message") or found.get("detail")
        return self._scrub(found) if isinstance(found, str) else ""

    def _stream_error(self, error: dict[str, Any]) -> UpstreamFailure:
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        message = error.get("message")
        return status_failure(status, self._scrub(message) if isinstance(message, str) else "")

    @staticmethod
    def _done(reader: ChunkReader, seq: int, prior: int, deltas: int) -> DoneEvent:
        got = reader.usage
        prompt = max(0, got["prompt_tokens"] - prior) if got is not None else 0
        billed = usage(prompt, prior + got["completion_tokens"],
                       cached_tokens=min(got.get("cached_tokens", 0), prompt)) \
            if got is not None else usage(0, prior + deltas)
        calls = reader.tool_calls()
        done: DoneEvent = {"t": "done", "seq": seq,
                           # A call cut by max_tokens stays "length", as the upstream said.
                           "finish": "tool_calls" if calls and reader.finish != "length"
                           else (reader.finish or "stop"),
                           "usage": billed}
        if calls:
            done["tool_calls"] = calls
        if reader.stop_sequence:
            done["stop_sequence"] = reader.stop_sequence
        return done


async def _whole(response: Reply) -> bytes:
    """A reply's whole body, up to _REPLY_MAX bytes."""
    parts, size = [], 0
    async for part in response.parts():
        size += len(part)
        if size > _REPLY_MAX:
            raise UpstreamFailure(502, "upstream_bad_reply", "The model's upstream server "
                                  "sent a reply too large to read.", retry=False)
        parts.append(part)
    return b"".join(parts)


async def _nothing() -> AsyncIterator[str]:
    return
    yield  # an async generator that yields nothing


async def _lines(response: Reply) -> AsyncIterator[str]:
    """The body's lines (LF or CRLF; UTF-8), as they arrive."""
    pending = b""
    async for part in response.parts():
        pending += part
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode()
    if pending:
        yield pending.removesuffix(b"\r").decode()


async def _sse_data(response: Reply) -> AsyncIterator[str]:
    """The `data` of each server-sent event (its data lines joined)."""
    lines: list[str] = []
    async for line in _lines(response):
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
    if lines:
        yield "\n".join(lines)
