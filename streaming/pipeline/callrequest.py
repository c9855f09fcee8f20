"""One chat call as the pipeline reads it, defined once: what a codec hands to the call.

Every codec (Chat Completions over REST, SSE, the WebSocket and the Batch API; legacy
Completions; Responses; Anthropic Messages; gRPC) validates its own public schema once,
at its edge, in its own words, and builds one `CallRequest` from it; `Call.chat`
(streaming/pipeline/call.py) takes nothing else, and the gateway
(streaming/pipeline/gateway.py) turns it into one job per attempt (inference/jobs.py
ChatJob). Nothing below a codec reads an API's wire schema. The defaults live here only:
a field a codec leaves out means OpenAI's sampling defaults (temperature 1, top_p 1, no
penalties), one choice, no stop, a reply of the deployment's default length
(`max_output_tokens` None), free text.

`check` is the one neutral validator of a request's ranges (a codec whose schema checks
them already, as every JSON API's does, never trips it; gRPC's protobuf types carry no
ranges). Errors raised below the codecs (this validator, the gateway, prompting,
structured outputs, the max-tokens policy, the grammar checker) name a NEUTRAL
parameter, the field names of this struct ("max_output_tokens",
"messages", "tools[0].parameters", "response_format.schema"); each API names them its
own way through its one `Params` table (`Call.params`), message and `param` alike
(`ParamError` quotes the parameter; any other ApiError has only its `param` renamed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inference.jobs import Keep, Message, ResponseFormat, ToolSpec
from sluice.errors import ApiError, BadRequest

MAX_CHOICES = 8  # `n`: each choice is a sequence in the running batch
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
TOOL_CHOICES = ("auto", "none", "required", "function")
_CHOICES = frozenset({None, *TOOL_CHOICES})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CONVERSATION = re.compile(r"^conv_[0-9a-f]{24}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class CallRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A chat call: built once by a codec, read by the call and the gateway.

    `messages` are native (inference/jobs.py Message: role, text, tool traffic as
    fields); `earlier` messages before them that the worker may drop, oldest first,
    until the prompt fits (Responses' truncation "auto"). `logprobs` asks for the
    tokens' log probabilities, `top_logprobs` how many alternatives each lists.
    `tool_choice` is "auto", "none", "required" or "function" (`tool_name` then names
    it); None is "auto", unasked (a choice asked for needs tools). `stream`: the
    caller reads the reply token by token (else the worker sends it in one piece);
    `include_usage` the stream's usage chunk. Options of the call: `conversation_id`
    (server-side history), `idempotency_key`, `timeout_s` (the caller's deadline),
    `raw_prompt` (a legacy completion: the last message's text is the prompt as it
    is, no chat template, no history), `keep` (inference/jobs.py Keep: the worker
    keeps the reply with its final event)."""

    model: str
    messages: list[Message]
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    n: int = 1
    stop: list[str] = []
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] = []
    tool_choice: str | None = None
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    conversation_id: str | None = None
    idempotency_key: str | None = None
    timeout_s: float | None = None
    raw_prompt: bool = False
    earlier: list[Message] = []
    keep: Keep | None = None

    def fingerprint(self) -> bytes:
        """What an idempotent retry must repeat: the request, without the options that
        may differ between two sends of it (its key, its deadline, what keeps it)."""
        return _encode(msgspec.structs.replace(self, idempotency_key=None, timeout_s=None,
                                               keep=None))


_encode = msgspec.json.Encoder(order="deterministic").encode


class ParamError(BadRequest):
    """A 400 about one parameter, raised below the codecs: `param` is neutral, and the
    message quotes it between `before` and `after` (Params.named words both the API's
    way)."""

    def __init__(self, before: str, param: str, after: str = "", *,
                 code: str | None = "invalid_value") -> None:
        super().__init__(before + param + after, param=param, code=code)
        self.before, self.after = before, after


_INDEX = re.compile(r"\[(\d+)\]")


@dataclass(frozen=True)
class Params:
    """An API's names for the neutral parameters: `names` maps a neutral name, or the
    start of one, with its list indices written `[]` ("tools[].parameters"), to the
    API's, whose `[]` take the indices in order; `dotted` writes an index `.0` (as
    Anthropic's API does) instead of `[0]`. A name not in `names` stays as it is."""

    names: dict[str, str] = field(default_factory=dict)
    dotted: bool = False

    def name(self, neutral: str) -> str:
        if not self.names and not self.dotted:
            return neutral
        indices = iter(_INDEX.findall(neutral))
        key = _INDEX.sub("[]", neutral)
        head = key
        while head and head not in self.names:
            head = head.rpartition(".")[0]
        named = self.names[head] + key[len(head):] if head else key
        return re.sub(r"\[\]", lambda _m: (".{}" if self.dotted else "[{}]").format(
            next(indices, "0")), named)

    def named(self, exc: ApiError) -> ApiError:
        """`exc` naming its parameter as this API does (the same object)."""
        if exc.param is None:
            return exc
        name = self.name(exc.param)
        if isinstance(exc, ParamError):
            exc.message = exc.before + name + exc.after
        exc.param = name
        return exc


NEUTRAL = Params()


def check(req: CallRequest) -> None:
    """The request's ranges, as every API's schema bounds them (a ParamError naming the
    first out of range)."""
    if not 1 <= len(req.model) <= 200 or _CONTROL.search(req.model):
        _invalid("model", "a model name of 1 to 200 printable characters")
    if not 1 <= len(req.messages) <= MAX_MESSAGES:
        _invalid("messages", f"1 to {MAX_MESSAGES} messages")
    for i, message in enumerate(req.messages):
        if message["role"] not in ROLES:
            _invalid(f"messages[{i}].role", "one of " + ", ".join(sorted(ROLES)))
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        _invalid("max_output_tokens", "at least 1")
    if not 0 <= req.temperature <= 2:
        _invalid("temperature", "between 0 and 2")
    if not 0 < req.top_p <= 1:
        _invalid("top_p", "greater than 0 and at most 1")
    if not -2 <= req.presence_penalty <= 2:
        _invalid("presence_penalty", "between -2 and 2")
    if not -2 <= req.frequency_penalty <= 2:
        _invalid("frequency_penalty", "between -2 and 2")
    if not 1 <= req.n <= MAX_CHOICES:
        _invalid("n", f"between 1 and {MAX_CHOICES}")
    if len(req.stop) > MAX_STOPS:
        _invalid("stop", f"at most {MAX_STOPS} stop sequences")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            _invalid("top_logprobs", f"between 0 and {MAX_TOP_LOGPROBS}")
        if not req.logprobs:
            raise ParamError("", "top_logprobs", " requires logprobs to be true.")
    if req.logit_bias and (len(req.logit_bias) > MAX_LOGIT_BIAS or any(
            not 0 <= token < 10**9 or not -100 <= bias <= 100
            for token, bias in req.logit_bias.items())):
        _invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, each biased by "
                               "-100 to 100")
    if len(req.tools) > MAX_TOOLS:
        _invalid("tools", f"at most {MAX_TOOLS} tools")
    for i, tool in enumerate(req.tools):
        if not _TOOL_NAME.match(tool.name):
            _invalid(f"tools[{i}].name", "1 to 64 letters, digits, '_' or '-'")
    if req.tool_choice not in _CHOICES or (req.tool_choice == "function") != bool(
            req.tool_name):
        _invalid("tool_choice", "auto, none, required, or a tool's name")
    if req.user is not None and len(req.user) > 256:
        _invalid("user", "at most 256 characters")
    if req.conversation_id is not None and not _CONVERSATION.match(req.conversation_id):
        _invalid("conversation_id", "a conversation's id (conv_ and 24 hex digits)")


def _invalid(param: str, what: str) -> None:
    raise ParamError("Invalid value for '", param, f"': it must be {what}.")


def json_schema(schema: dict[str, Any] | None, *, strict: bool) -> ResponseFormat:
    """A reply matching `schema` (none given: any JSON object)."""
    return ResponseFormat(schema=schema or {"type": "object", "properties": {}},
                          strict=strict)


def stops(stop: str | list[str] | None) -> list[str]:
    """A `stop` given as one string, several, or none, as the request's list."""
    return [stop] if isinstance(stop, str) else list(stop or ())


def args(**given: Any) -> dict[str, Any]:
    """`given` without the None values: a codec's optional fields, left to the
    request's defaults."""
    return {k: v for k, v in given.items() if v is not None}
