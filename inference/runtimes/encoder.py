"""Sentence encoders (BERT-style, e.g. all-MiniLM-L6-v2): mean pooling, L2-normalised."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from inference.runtimes.base import EmbeddingRuntime, TorchModel


class TextBatchModel(TorchModel):
    """A transformers model that reads whole texts in padded batches (a sentence
    encoder, a sequence classifier); `AUTO` is the transformers class its folder loads
    with."""

    AUTO: ClassVar[str] = "AutoModel"

    @classmethod
    def _load(cls, folder: Path) -> tuple[Any, Any]:
        import transformers

        model = getattr(transformers, cls.AUTO).from_pretrained(str(folder),
                                                                use_kernels=False)
        return model, transformers.AutoTokenizer.from_pretrained(str(folder))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def _batch(self, texts: Sequence[str]) -> tuple[Any, list[int]]:
        """`texts` as one padded batch on the model's device (each cut to the context),
        and each one's token count."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True,
                               max_length=self.max_context, return_tensors="pt").to(self.device)
        return batch, [int(c) for c in batch["attention_mask"].sum(1).tolist()]


class EncoderRuntime(TextBatchModel, EmbeddingRuntime):
    def __init__(self, model: Any, tokenizer: Any, *, device: str, max_context: int) -> None:
        self._bind(model, tokenizer, device=device, max_context=max_context)
        self.dimensions = int(model.config.hidden_size)

    @classmethod
    def from_folder(cls, folder: Path, *, device: str, max_context: int) -> EncoderRuntime:
        model, tokenizer = cls._load(folder)
        return cls(model, tokenizer, device=device, max_context=max_context)

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        if not texts:
            return [], []
        batch, counts = self._batch(texts)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled.float(), dim=-1)
        return vectors.cpu().tolist(), counts
