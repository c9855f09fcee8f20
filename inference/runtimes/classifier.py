"""Text classifiers: one probability per label for each text (a deployment of kind
`classify`: guardrails' classifier guard and /v1/moderations read them).

A classifier folder is either
- a transformers sequence-classification model (config.json with `id2label`, such as
  Meta's Prompt Guard 2 or a moderation model an operator provides): softmax over the
  logits, or a sigmoid per label when the config says `multi_label_classification`;
- a Sluice head (`sluice_head.json`): a linear layer over a sentence encoder's
  normalised embeddings (`encoder`: a weights reference, e.g. the shipped MiniLM),
  `labels`, `weight` (one row per label) and `bias`, softmax over its logits; what
  `manage.py train_injection_guard` writes.

The vectors the engine sends back (EmbeddingRuntime.embed) are these probabilities,
in `labels` order; the worker names the labels in the event that carries them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from inference.runtimes.base import EmbeddingRuntime
from inference.runtimes.encoder import EncoderRuntime, TextBatchModel
from inference.weights import HEAD_FILE


class ClassifierRuntime(EmbeddingRuntime):
    labels: list[str]

    @staticmethod
    def from_folder(folder: Path, *, device: str, max_context: int) -> ClassifierRuntime:
        head = folder / HEAD_FILE
        if head.exists():
            return HeadClassifier.from_head(json.loads(head.read_text()), device=device,
                                            max_context=max_context)
        return SequenceClassifier.from_folder(folder, device=device, max_context=max_context)


class HeadClassifier(ClassifierRuntime):
    """A linear head over a sentence encoder."""

    def __init__(self, encoder: EncoderRuntime, labels: list[str], weight: torch.Tensor,
                 bias: torch.Tensor) -> None:
        if weight.shape != (len(labels), encoder.dimensions) or bias.shape != (len(labels),):
            raise ValueError(f"a head of {len(labels)} labels over {encoder.dimensions} "
                             f"dimensions has the wrong shape {tuple(weight.shape)}")
        self.encoder, self.labels = encoder, labels
        self.weight, self.bias = weight, bias
        self.max_context = encoder.max_context
        self.dimensions = len(labels)

    @classmethod
    def from_head(cls, head: dict[str, Any], *, device: str, max_context: int
                  ) -> HeadClassifier:
        from inference.weights import resolve

        encoder = EncoderRuntime.from_folder(resolve(str(head["encoder"])), device=device,
                                             max_context=max_context)
        return cls(encoder, [str(label) for label in head["labels"]],
                   torch.tensor(head["weight"], dtype=torch.float32),
                   torch.tensor(head["bias"], dtype=torch.float32))

    def count_tokens(self, text: str) -> int:
        return self.encoder.count_tokens(text)

    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        vectors, counts = self.encoder.embed(texts)
        if not vectors:
            return [], []
        logits = torch.tensor(vectors) @ self.weight.T + self.bias
        return torch.softmax(logits, dim=-1).tolist(), counts


class SequenceClassifier(TextBatchModel, ClassifierRuntime):
    """A transformers sequence-classification model."""

    AUTO = "AutoModelForSequenceClassification"

    def __init__(self, model: Any, tokenizer: Any, *, device: str, max_context: int) -> None:
        self._bind(model, tokenizer, device=device, max_context=max_context)
        config = model.config
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        self.dimensions = len(self.labels)
        self._multi = getattr(config, "problem_type", None) == "multi_label_classification"

    @classmethod
    def from_folder(cls, folder: Path, *, device: str, max_context: int
                    ) -> SequenceClassifier:
        model, tokenizer = cls._load(folder)
        return cls(model, tokenizer, device=device, max_context=max_context)

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        if not texts:
            return [], []
        batch, counts = self._batch(texts)
        logits = self.model(**batch).logits.float()
        probs = torch.sigmoid(logits) if self._multi else torch.softmax(logits, dim=-1)
        return probs.cpu().tolist(), counts
