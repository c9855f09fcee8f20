"""The input processor: a queued job into what the engine runs (vLLM v1's
InputProcessor). Pure of I/O: it reads the job, the runtime's tokenizer and limits.

A chat job becomes a `Prepared`: the prompt's token ids, the sampling parameters and
the row that will collect its output (inference/engine/output.py). The prompt is the
job's `prompt` as it is when given (a legacy completion: no chat template, no history),
else its instructions (leading system messages), `history` and other `messages` through
the model's chat template, the oldest history dropped until the reply fits. A job with
tools or a response format gets its grammar (inference/structured/constraint.py). A `count_only`
job is prepared for its prompt's token count alone.

A text longer than the context could hold is cut before it is encoded (`_prompt`): the
worker never encodes megabytes only to refuse them.

Everything a request gets wrong is a `RequestError` with a 400 (malformed job, a prompt
longer than the context, a token of logit_bias outside the vocabulary, tools or
structured outputs on a model that cannot write them, a schema that cannot be enforced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from inference.engine.entries import Pending, RequestError, malformed
from inference.engine.output import Row
from inference.jobs import (
    ChatJob,
    EmbedJob,
    JobError,
    Message,
    conversation,
    default_max_tokens,
)
from inference.runtimes.base import ChatRuntime, SamplingParams, TorchModel

if TYPE_CHECKING:
    from inference.structured.constraint import Constraint, Vocabulary


@dataclass
class Prepared:
    row: Row
    prompt: list[int]
    params: SamplingParams
    count_only: bool = False  # answer with the prompt's token count, generate nothing


class InputProcessor:
    def __init__(self, runtime: ChatRuntime, *, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name  # named in refusals
        self._vocab: Vocabulary | None = None  # built on the first constrained request

    def prepare(self, pending: Pending) -> Prepared:
        """The sequence `pending` asks for; RequestError when it cannot run."""
        runtime = self.runtime
        try:
            job = pending.req.job()
            if not isinstance(job, ChatJob):
                raise JobError(f"a {pending.req.kind} request on a chat model")
            if job.prompt is None and not job.messages:
                raise JobError("a chat job needs messages or a prompt")
            max_tokens = job.max_tokens or default_max_tokens(runtime.max_context)
            params = SamplingParams(
                max_tokens=max_tokens, temperature=job.temperature, top_p=job.top_p,
                seed=job.seed, stop=tuple(job.stop), ignore_eos=job.ignore_eos,
                presence_penalty=job.presence_penalty,
                frequency_penalty=job.frequency_penalty,
                logit_bias=tuple(job.logit_bias.items()), logprobs=job.logprobs)
            prompt, cut = self._prompt(job, max_tokens)
        except (JobError, KeyError, TypeError, ValueError) as exc:
            raise malformed(exc) from None
        if job.count_only:
            # A token count (Anthropic's count_tokens): the prompt as this runtime
            # encodes it, template and all, whatever its length; nothing generated.
            return Prepared(Row(pending, prompt_tokens=len(prompt), max_new=0, stop=()),
                            prompt, params, count_only=True)
        if params.logit_bias and isinstance(runtime, TorchModel):
            size = int(runtime.model.config.vocab_size)
            unknown = [token for token, _ in params.logit_bias if not 0 <= token < size]
            if unknown:
                raise RequestError(400, "invalid_logit_bias",
                                   f"logit_bias names token {unknown[0]}, which is not in this "
                                   f"model's vocabulary (0 to {size - 1}).")
        room = runtime.max_context - len(prompt)
        if room <= 0:
            count = f"more than {runtime.max_context}" if cut else str(len(prompt))
            raise RequestError(400, "context_length_exceeded",
                               f"The prompt has {count} tokens; this model's context is "
                               f"{runtime.max_context}.")
        budget = min(params.max_tokens, room)
        row = Row(pending, prompt_tokens=len(prompt), max_new=budget, stop=params.stop,
                  ignore_eos=params.ignore_eos, constraint=self.constraint(job, budget),
                  logprobs=params.logprobs is not None, streamed=job.stream,
                  cache_salt=f"{pending.req.tenant}\x1f{job.cache_scope}")
        return Prepared(row, prompt, params)

    def _prompt(self, job: ChatJob, max_tokens: int) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether a text was cut before encoding.

        A text (the prompt, or one of this request's messages) longer than
        (max_context + 1) x the runtime's longest token in characters makes more tokens
        than the context holds: the prompt is refused either way, so only that much of
        it is encoded (a prompt of megabytes costs the shared worker no more than one
        that barely overflows). Should a cut prompt fit after all (a tokenizer whose
        tokens outgrow that bound), it is encoded whole. A count_only job is never cut
        (its count must be exact); neither is the history (it is trimmed to fit)."""
        runtime = self.runtime
        chars = runtime.token_chars()
        limit = None if chars is None or job.count_only else (runtime.max_context + 1) * chars
        if job.prompt is not None:
            if limit is not None and len(job.prompt) > limit:
                prompt = runtime.encode(job.prompt[:limit])
                if len(prompt) > runtime.max_context:
                    return prompt, True
            return runtime.encode(job.prompt), False
        messages = job.messages
        if limit is not None and any(len(m["content"]) > limit for m in messages):
            cut: list[Message] = [{**m, "content": m["content"][:limit]} for m in messages]
            prompt = conversation_prompt(runtime, cut, job.history, max_tokens)
            if len(prompt) > runtime.max_context:
                return prompt, True
        return conversation_prompt(runtime, messages, job.history, max_tokens), False

    def constraint(self, job: ChatJob, budget: int) -> Constraint | None:
        """The grammar of a request with tools or a response format (None without);
        a runtime without a tokenizer (echo) refuses them, except tools under "auto"
        (which lets a model answer in text, the only answer it has), as does a schema
        that cannot be enforced (the gateway checked it too: a worker's own guard)."""
        if not job.constrained:
            return None
        tools = bool(job.tools)
        # torch- and llguidance-side code, imported when a constraint is asked for.
        from inference.structured.constraint import Constraint, Vocabulary, plan_for

        code = "invalid_tool_schema" if tools else "invalid_response_format"
        runtime = self.runtime
        if not isinstance(runtime, TorchModel):
            if tools and job.tool_choice == "auto" and job.response_format is None:
                return None
            what = "call tools" if tools else "write structured outputs (response_format)"
            raise RequestError(400, "tools_not_supported" if tools else
                               "response_format_not_supported",
                               f"The model '{self.model_name}' cannot {what}.")
        try:
            plan = plan_for(job)
        except ValueError as exc:
            raise RequestError(400, code, f"Invalid request: {exc}") from None
        if plan is None:
            return None
        if self._vocab is None:
            self._vocab = Vocabulary(runtime.tokenizer, int(runtime.model.config.vocab_size),
                                     sorted(self.runtime.eos_token_ids))
        return Constraint(self._vocab, plan, budget=budget)


def conversation_prompt(runtime: ChatRuntime, messages: list[Message],
                        history: list[Message], max_tokens: int) -> list[int]:
    """The prompt for a conversation: `conversation(messages, history)` (this request's
    leading system messages, the history, the rest of its messages).

    Trimming policy: every message of this request stays; the fewest oldest history
    messages are dropped that leave room for max_tokens (or for at least a quarter of
    the context when max_tokens asks for more). Found by bisection, which presumes that
    dropping more does not lengthen the prompt (a template that adds a default system
    prompt when the first message is not one can break that by a few tokens: then one
    message more than needed may go): a few encodings of it, not one per message
    dropped (a long agent conversation has hundreds)."""
    budget = runtime.max_context - min(max_tokens, runtime.max_context // 4)

    def encoded(dropped: int) -> list[int]:
        # A Message is a plain dict: the chat template reads it as one.
        return runtime.encode_chat(cast("list[dict[str, Any]]",
                                        conversation(messages, history, dropped)))

    prompt = encoded(0)
    if len(prompt) <= budget or not history:
        return prompt
    fitting: dict[int, list[int]] = {}
    low, high = 1, len(history)  # the fewest to drop is in [low, high]
    while low < high:
        middle = (low + high) // 2
        prompt = encoded(middle)
        if len(prompt) <= budget:
            high, fitting[middle] = middle, prompt
        else:
            low = middle + 1
    return fitting.get(low) or encoded(low)


def embed_texts(pending: Pending) -> list[str]:
    """The texts of an embedding job; RequestError (400) when it is not one."""
    try:
        job = pending.req.job()
        if not isinstance(job, EmbedJob):
            raise JobError(f"a {pending.req.kind} request on an embedding model")
    except JobError as exc:
        raise malformed(exc) from None
    return job.input
