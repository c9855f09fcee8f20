"""Sentence encoders (BERT-style, e.g. all-MiniLM-L6-v2): mean pooling, L2-normalised."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from inference.runtimes.base import EmbeddingRuntime, TorchModel


class EncoderRuntime(TorchModel, EmbeddingRuntime):
    def __init__(self, model: Any, tokenizer: Any, *, device: str, max_context: int) -> None:
        self._bind(model, tokenizer, device=device, max_context=max_context)
        self.dimensions = int(model.config.hidden_size)

    @classmethod
    def from_folder(cls, folder: Path, *, device: str, max_context: int) -> EncoderRuntime:
        from transformers import AutoModel, AutoTokenizer

        model = AutoModel.from_pretrained(str(folder), use_kernels=False)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return cls(model, tokenizer, device=device, max_context=max_context)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        if not texts:
            return [], []
        batch = self.tokenizer(list(texts), padding=True, truncation=True,
                               max_length=self.max_context, return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled.float(), dim=-1)
        counts = batch["attention_mask"].sum(1).tolist()
        return vectors.cpu().tolist(), [int(c) for c in counts]
