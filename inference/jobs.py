"""What crosses the queue, defined once: the job a gateway enqueues and the events a
worker sends back. Both ends import these; nothing else builds or parses them.

Jobs are msgspec Structs. The gateway builds a `ChatJob` or an `EmbedJob`;
`encode_job` writes it into the queue entry's `body` field and the worker's
`decode_job` reads it back typed and checked: a body that does not match (an older or
newer gateway, a hand-written entry) is a `JobError`, which the worker answers with a
400, never a KeyError. The defaults live here only: a field a gateway leaves out means
the same thing on both ends (OpenAI's sampling defaults: temperature 1, top_p 1; the
reply's length `default_max_tokens` of the model's context).

Events are TypedDicts, tagged by `t`: a worker emits one per token per request, so they
stay plain dicts on the hot path (built by the worker, encoded with `encode_event`, read
by the gateway's router with one orjson parse per worker step), and mypy checks both
ends against these definitions. `t` is the first key of an encoded event: FINALS_LUA
finds a request's final event by `"t":"done"` / `"t":"error"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

import msgspec

from sluice import wirejson

if TYPE_CHECKING:
    from typing_extensions import TypeIs

# -- jobs ------------------------------------------------------------------------------


class ToolSpec(msgspec.Struct, frozen=True):
    """A tool the reply may call; `description` what it is for (an upstream server shows
    it to its model; our own models read it in the tool prompt the gateway writes).

    `kind` "function": `parameters` is its JSON schema (key order kept: the grammar
    writes properties in that order); a call's `arguments` is JSON text.
    `kind` "custom" (the Responses API's free-form tools): `parameters` is unused; its
    input is any text (`syntax` ""), or matches `definition`, a Lark grammar (`syntax`
    "lark") or a regex (`syntax` "regex"); a call's `arguments` is the raw input."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool = False
    description: str = ""
    kind: str = "function"  # "function" | "custom" (free-form input, its `arguments`)
    syntax: str = ""  # a custom tool's grammar: "" (any text), "lark", "regex"
    definition: str = ""


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(TypedDict):
    """A call an earlier assistant message made, in OpenAI's chat shape."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(TypedDict):
    """One chat message: its role and its text (content parts joined; "" when it has
    none); an assistant's calls in `tool_calls`, a tool result's call in
    `tool_call_id`, a participant's `name`. A key that is absent means none. The
    gateway writes tool traffic into the text for our own models (streaming/
    prompting.py), so only an upstream deployment's jobs carry the last three keys."""

    role: str
    content: str
    tool_calls: NotRequired[list[MessageToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


class ResponseFormat(msgspec.Struct, frozen=True):
    """The reply's structure: any JSON object, or one matching `schema`."""

    type: Literal["json_object", "json_schema"] = "json_schema"
    schema: dict[str, Any] | None = None
    strict: bool = False


class Continuation(msgspec.Struct, frozen=True):
    """The start of a reply already streamed to the caller, which a later attempt
    continues: its text, the sequence number the next event takes, and the completion
    tokens billed for the text. An upstream worker builds one for a takeover; a model
    alias's call (streaming/pipeline/routed.py) sends one in `ChatJob.resume` to the next
    deployment, an upstream one that can continue the job only
    (inference/upstream/body.py `can_continue`)."""

    text: str
    seq: int
    completion_tokens: int


class Keep(msgspec.Struct, frozen=True):
    """Keep the reply past its request, with its final event: what the Responses API
    stores (streaming/apis/responses/copy.py), written by the worker in the write that ends
    the request, so the gateway adds no write of its own (inference/queue.py KEEP_LUA).

    The kept copy is a hash at `key` + the request's id holding `by`, `draft` (opaque
    to the worker: what the reply completes) and the reply's events; it is not written
    when the set at `deletions` + the request's id names `by` or "*" (a DELETE came
    first), and it lasts `ttl_s`. The copy also goes to the stream `stream` (at most
    about `maxlen` entries) for a writer. The worker keeps only a whole reply it made
    from the first event to a `done` one (not a cancelled one); the final event then
    says so (`DoneEvent.kept_at`), else the gateway stores the reply itself."""

    key: str
    deletions: str
    stream: str
    by: str
    draft: str
    ttl_s: int
    forget_s: int
    maxlen: int


class ChatJob(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind",
              tag="chat"):
    """One sequence to generate. The prompt is `prompt` as it is when given (a legacy
    completion: no chat template, no history), else `conversation(messages, history)`
    (the instructions, the history, the rest of the messages) through the model's chat
    template, the oldest history dropped until it fits.

    `max_tokens` None means `default_max_tokens` of the model's context; `logprobs` is
    how many alternatives each token's entry lists (None: no log probabilities);
    `stream` False asks for the reply in one piece at the end (no per-token events);
    `count_only` asks for the prompt's token count and nothing generated.

    Wire compatibility: a body with a message key or a `ToolSpec` field the other end
    does not know is refused (`messages`) or ignored (tools' `description`), so a
    gateway and its workers upgrade together."""

    messages: list[Message] = []
    history: list[Message] = []  # older turns of the conversation (role and text)
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None
    stream: bool = True
    count_only: bool = False
    # Structured generation (inference/structured/grammar.py), checked by the gateway.
    tools: list[ToolSpec] = []
    tool_choice: str = "auto"  # "auto", "required", or a function's name
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Continue the reply after what another deployment already streamed (upstream
    # deployments only; the events' sequence numbers go on from its `seq`).
    resume: Continuation | None = None
    keep: Keep | None = None  # the reply kept with its final event (never with `resume`)
    # Narrows the prefix cache's sharing below the tenant (the queue entry's tenant
    # always salts it): the API key's id when the tenant shares per key, else "".
    cache_scope: str = ""

    @property
    def constrained(self) -> bool:
        return bool(self.tools) or self.response_format is not None


class EmbedJob(msgspec.Struct, kw_only=True, tag_field="kind", tag="embedding"):
    """Texts to embed, one vector each, in order."""

    input: list[str]


Job = ChatJob | EmbedJob


class JobError(ValueError):
    """A queued body that is not a job of its kind (its message names what is wrong)."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Job)
_MAX_TOKENS_CAP = 1024


def default_max_tokens(max_context: int) -> int:
    """How long a reply may be when the caller does not say: half the context, at most
    1,024 tokens (what the gateway reserves quota for)."""
    return max(1, min(_MAX_TOKENS_CAP, max_context // 2))


_INSTRUCTIONS = ("system", "developer")


def conversation(messages: list[Message], history: list[Message],
                 dropped: int = 0) -> list[Message]:
    """What a chat job's prompt is made of, in order: the leading system (and developer)
    messages of `messages` (its instructions: first, wherever the history puts the
    conversation's start), then `history` but its `dropped` oldest, then the rest of
    `messages`."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in _INSTRUCTIONS:
        lead += 1
    return [*messages[:lead], *history[dropped:], *messages[lead:]]


def encode_job(job: Job) -> bytes:
    """The job as the queue entry's `body` (compact JSON, tagged with its kind)."""
    return _encoder.encode(job)


def decode_job(body: bytes | str) -> Job:
    """The job of a queue entry's `body`; JobError when it is not one."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise JobError(str(exc)) from None


# -- events ----------------------------------------------------------------------------


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    # The request's share of the model's step time, in microseconds (a step's time split
    # evenly among its sequences, a prefill's by prompt length): device time on a GPU,
    # wall time on a CPU. A self-hosted chat model's only; priced by `gpu_second_usd`.
    device_us: NotRequired[int]
    # How many of the prompt tokens the model did not compute for this request: a hit
    # in the model's prefix cache, or a prompt shared with another choice of its call
    # (priced as cached input; the APIs' cached_tokens / cache_read_input_tokens).
    cached_tokens: NotRequired[int]


class ToolCall(TypedDict):
    id: str
    name: str
    # A function's: JSON text, valid against its parameters; a custom tool's: its raw
    # input (valid against its grammar).
    arguments: str


class ToolDelta(TypedDict):
    """A piece of a tool call as it is written: the call's `index` among the reply's
    calls, its `id` and `name` on its first piece, then the next text of its
    `arguments` (the pieces of a call join into its final `arguments`)."""

    index: int
    id: NotRequired[str]
    name: NotRequired[str]
    arguments: str


class DeltaEvent(TypedDict):
    """New text of a reply: `text` (possibly empty when held back: a stop string's
    start, a character split across tokens) for the token ids `ids`; `lp` their
    log-probability entries when the job asked for them. The first delta of a request
    (seq 0) carries `prompt_tokens`, the prompt's count, when the worker knows it then
    (Anthropic's `message_start` reports it before any text), and `cached_tokens`. A
    reply that calls tools streams the calls as `tools` pieces (its `text` stays empty);
    the final event still has every call whole."""

    t: Literal["delta"]
    seq: int
    text: str
    ids: list[int]
    lp: NotRequired[list[dict[str, Any]]]
    prompt_tokens: NotRequired[int]
    cached_tokens: NotRequired[int]  # with prompt_tokens: Usage's, when not 0
    tools: NotRequired[list[ToolDelta]]
    i: NotRequired[int]  # the choice's index, set by the gateway's fan-out (n > 1)


class DoneEvent(TypedDict):
    """A request's end: why it stopped (`finish`: stop, length, tool_calls; the stop
    string in `stop_sequence` when one ended it), what it cost, its tool calls."""

    t: Literal["done"]
    seq: int
    finish: str
    usage: Usage
    tool_calls: NotRequired[list[ToolCall]]
    stop_sequence: NotRequired[str]
    kept_at: NotRequired[int]  # the epoch second the worker kept the reply (ChatJob.keep)
    i: NotRequired[int]


class ErrorEvent(TypedDict):
    """A request's end in failure: an HTTP status and code, a message safe to show the
    caller, what it cost so far; `retry` False when the same request would fail again."""

    t: Literal["error"]
    seq: int
    status: int
    code: str
    message: str
    usage: Usage
    retry: NotRequired[bool]
    i: NotRequired[int]


class EmbeddingEvent(TypedDict):
    """An embedding request's vectors, one per input; a classifier's are probabilities,
    one per label, in `labels` order."""

    t: Literal["embedding"]
    seq: int
    data: list[list[float]]
    labels: NotRequired[list[str]]
    i: NotRequired[int]


Event = DeltaEvent | DoneEvent | ErrorEvent | EmbeddingEvent
FinalEvent = DoneEvent | ErrorEvent
FINAL_EVENTS = ("done", "error")  # the tags of the events that end a request


# Outside inference/, events' tags are read through these and the gateway's one fold
# over a call's events (streaming/pipeline/fold.py), nowhere else.
def is_delta(event: Event) -> TypeIs[DeltaEvent]:
    return event["t"] == "delta"


def is_done(event: Event) -> TypeIs[DoneEvent]:
    return event["t"] == "done"


def is_error(event: Event) -> TypeIs[ErrorEvent]:
    return event["t"] == "error"


def is_final(event: Event) -> TypeIs[FinalEvent]:
    """Whether `event` ends its request (done or error)."""
    return event["t"] == "done" or event["t"] == "error"


def usage(prompt_tokens: int, completion_tokens: int, device_us: int = 0,
          cached_tokens: int = 0) -> Usage:
    counted: Usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    if device_us:
        counted["device_us"] = device_us
    if cached_tokens:
        counted["cached_tokens"] = cached_tokens
    return counted


def summed(finals: Sequence[FinalEvent] | Sequence[DoneEvent]) -> Usage:
    """The usage of final events (one call's, or its choices') summed."""
    prompt = completion = device = cached = 0
    for final in finals:
        prompt += final["usage"]["prompt_tokens"]
        completion += final["usage"]["completion_tokens"]
        device += final["usage"].get("device_us", 0)
        cached += final["usage"].get("cached_tokens", 0)
    return usage(prompt, completion, device, cached)


def encode_event(event: Event) -> str:
    """Compact JSON, `t` first (what FINALS_LUA looks for), UTF-8 as it is."""
    return wirejson.dumps(event)
