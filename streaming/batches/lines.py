"""A batch's lines: reading them from the input file, checking the file once, sending
one line through the gateway pipeline, and the lines written to the output files.

Lines are the input file's bytes split on "\\n" (never str.splitlines: JSON strings may
hold U+2028 and other characters it splits on), numbered from 1, blank ones skipped.

A line that cannot be read (not JSON, nested past MAX_LINE_DEPTH, or any fault of the
parser: a line nested thousands deep raises RecursionError) fails that line alone: an
error line naming its number (`custom_id` null) in the error file. A file whose
readable lines do not fit a batch (not an object with a custom_id and a body, another
endpoint, a custom_id twice, too many lines, nothing at all) fails validation as a
whole, as OpenAI's does; its `errors` then list the unreadable lines too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex
from typing import Any

from governance.privacy import Redactor, redact_json
from sluice.errors import ApiError, BadRequest, QuotaExceeded
from streaming.apis import bodies, chat_request
from streaming.pipeline.call import Call
from streaming.pipeline.gateway import Gateway
from streaming.pipeline.nesting import MAX_JSON_DEPTH, json_depth
from streaming.pipeline.schemas import EmbeddingRequest, parse
from tenants.principal import Principal

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
MAX_LINES = 50_000
# A line wraps its body in one object: one level more than a request may nest.
MAX_LINE_DEPTH = MAX_JSON_DEPTH + 1
RETRY_MAX_WAIT_S = 60.0  # a refusal that says to come back later than this fails its line


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    end: int  # byte offset just past this line in the input file
    item: Any  # the parsed JSON; None when unreadable
    problem: str | None = None  # the code of why it cannot be read


def read_lines(path: Path, *, start: int = 0, first_number: int = 1) -> Iterator[Line]:
    """The input file's non-blank lines from byte offset `start` (whose line number is
    `first_number`), each parsed or with the code of why it cannot be."""
    number = first_number - 1
    offset = start
    with path.open("rb") as f:
        f.seek(start)
        for raw in f:
            number += 1
            offset += len(raw)
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            item, problem = _parse(text)
            yield Line(number=number, end=offset, item=item, problem=problem)


def _parse(text: str) -> tuple[Any, str | None]:
    try:
        value = json.loads(text)
    except RecursionError:
        return None, "json_too_deep"
    except Exception:  # any parser fault fails this line, not the batch
        return None, "invalid_json_line"
    if json_depth(value, stop_after=MAX_LINE_DEPTH) > MAX_LINE_DEPTH:
        return None, "json_too_deep"
    return value, None


PROBLEMS = {
    "invalid_json_line": "This line is not valid JSON.",
    "json_too_deep": f"This line nests JSON more than {MAX_LINE_DEPTH} levels deep.",
}


def validate(path: Path, endpoint: str) -> tuple[int, list[Line], list[dict[str, Any]]]:
    """(requests, unreadable lines, errors) of the input file, errors in OpenAI's shape
    (see the module's doc); the batch runs only when `errors` is empty."""
    errors: list[dict[str, Any]] = []
    unreadable: list[Line] = []
    seen: set[str] = set()
    requests = 0
    for line in read_lines(path):
        item = line.item
        if line.problem is not None:
            unreadable.append(line)
            errors.append({"code": line.problem, "line": line.number,
                           "message": PROBLEMS[line.problem or "invalid_json_line"]})
        elif not is_request(item):
            errors.append({"code": "invalid_request", "line": line.number,
                           "message": "Each line needs a custom_id and a body object."})
        elif item.get("method", "POST") != "POST" or item.get("url") != endpoint:
            errors.append({"code": "mismatched_endpoint", "line": line.number,
                           "message": f"url must be {endpoint} and method POST."})
        elif item["custom_id"] in seen:
            errors.append({"code": "duplicate_custom_id", "line": line.number,
                           "message": "custom_id values must be unique."})
        else:
            seen.add(item["custom_id"])
            requests += 1
    if not requests and not errors:
        errors.append({"code": "empty_file", "line": None, "message": "The file is empty."})
    if requests + len(unreadable) > MAX_LINES:
        errors.append({"code": "too_many_requests", "line": None,
                       "message": f"A batch holds at most {MAX_LINES} requests."})
    if len(unreadable) == len(errors) and requests:
        errors = []  # only unreadable lines: they fail alone, the rest runs
    return requests, unreadable, errors


def is_request(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("custom_id"), str) \
        and isinstance(item.get("body"), dict)


# -- lines written ---------------------------------------------------------------------
def answer_line(custom_id: str, status: int, body: dict[str, Any], rid: str,
                clean: Redactor) -> str:
    """A request's result, redacted: an output line (200) or an error line."""
    return json.dumps({"id": f"batch_req_{token_hex(12)}", "custom_id": clean(custom_id),
                       "response": {"status_code": status, "request_id": rid,
                                    "body": redact_json(body, clean)},
                       "error": None})


def unreadable_line(line: Line) -> str:
    """The error line of a line that cannot be read: its number, no custom_id."""
    code = line.problem or "invalid_json_line"
    return json.dumps({"id": f"batch_req_{token_hex(12)}", "custom_id": None,
                       "response": None,
                       "error": {"code": code, "message": PROBLEMS[code],
                                 "line": line.number}})


def unreadable_mark(number: int) -> str:
    """How `done_marks` names an unreadable line that has its error line."""
    return f"#line:{number}"


def done_marks(path: Path, start: int = 0) -> set[str]:
    """The custom_ids (and unreadable_mark()s) of the lines written to `path` from byte
    offset `start`; a line cut by a crash is not counted (it runs again)."""
    done: set[str] = set()
    if not path.exists():
        return done
    with path.open("rb") as f:
        f.seek(start)
        for raw in f:
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            if isinstance(row.get("custom_id"), str):
                done.add(row["custom_id"])
            elif isinstance(row.get("error"), dict) and isinstance(row["error"].get("line"),
                                                                    int):
                done.add(unreadable_mark(row["error"]["line"]))
    return done


# -- sending a line --------------------------------------------------------------------
def retry_in(exc: ApiError) -> float | None:
    """Seconds to wait before sending a refused line again, or None when the refusal
    is final: not a 429 or 503, a used-up quota (a budget, not a pace), an error marked
    certain to fail again, or one that says to come back after RETRY_MAX_WAIT_S."""
    if exc.status not in (429, 503) or isinstance(exc, QuotaExceeded) \
            or exc.headers.get("x-should-retry") == "false":
        return None
    retry = exc.headers.get("Retry-After", "")
    seconds = float(retry) if retry.isdigit() else 1.0
    return seconds if seconds <= RETRY_MAX_WAIT_S else None


async def call(gateway: Gateway, principal: Principal, endpoint: str,
               body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    """One line through the pipeline: (200, OpenAI body, request id); a refusal or an
    error raises its ApiError."""
    embedding = endpoint == "/v1/embeddings"
    async with Call(gateway, principal, protocol="batch", params=chat_request.PARAMS,
                    action="embeddings" if embedding else "chat.completions") as live:
        if embedding:
            emb = parse(EmbeddingRequest, body)
            sub = await live.embed(emb)
            return 200, await bodies.embeddings(sub, emb), sub.handle.rid
        req = chat_request.parsed(body)
        if req.stream:
            raise BadRequest("stream is not supported in a batch.", param="stream")
        sub = await live.chat(chat_request.call_request(req))
        return 200, await bodies.chat_completion(sub, req), sub.handle.rid
