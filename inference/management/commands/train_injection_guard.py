"""Train the shipped prompt-injection classifier and measure it.

    manage.py train_injection_guard [--out DIR] [--check]

Reads the labelled corpus in inference/classifiers/injection/corpus.jsonl (`text`,
`label` injection or benign, `family`), embeds every text with the shipped MiniLM
(normalised mean pooling, inference/runtimes/encoder.py), and fits a logistic-
regression head (a linear layer and softmax, L2-regularised, full-batch L-BFGS from a
fixed seed: the same corpus gives the same head) on the training part. The held-out
part is every text whose SHA-256 is 0 mod 5 (about a fifth, fixed by the text alone);
its precision, recall and F1 for `injection` are printed and written into the head's
file (`sluice_head.json`, which inference/runtimes/classifier.py loads). `--check`
trains and prints without writing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from django.core.management.base import BaseCommand, CommandParser

from inference.runtimes.encoder import EncoderRuntime
from inference.weights import HEAD_FILE, INJECTION_GUARD_DIR, MINILM, resolve

LABELS = ["benign", "injection"]


def held_out(text: str) -> bool:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 5 == 0


def fit(x: torch.Tensor, y: torch.Tensor, *, l2: float = 1e-3) -> torch.nn.Linear:
    torch.manual_seed(0)
    head = torch.nn.Linear(x.shape[1], len(LABELS))
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=500, line_search_fn="strong_wolfe")
    loss_fn = torch.nn.CrossEntropyLoss()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(head(x), y) + l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return head


def scores(predicted: list[int], truth: list[int]) -> dict[str, Any]:
    tp = sum(p == t == 1 for p, t in zip(predicted, truth, strict=True))
    fp = sum(p == 1 and t == 0 for p, t in zip(predicted, truth, strict=True))
    fn = sum(p == 0 and t == 1 for p, t in zip(predicted, truth, strict=True))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"texts": len(truth), "precision": round(precision, 4), "recall": round(recall, 4),
            "f1": round(f1, 4), "false_positives": fp, "false_negatives": fn}


class Command(BaseCommand):
    help = "Train the shipped prompt-injection classifier; print its held-out precision/recall."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", type=Path, default=INJECTION_GUARD_DIR)
        parser.add_argument("--check", action="store_true", help="train and print only")

    def handle(self, *args: Any, **options: Any) -> None:
        corpus = INJECTION_GUARD_DIR / "corpus.jsonl"
        raw = corpus.read_bytes()
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        encoder = EncoderRuntime.from_folder(resolve(MINILM), device="cpu", max_context=256)
        vectors, _ = encoder.embed([r["text"] for r in rows])
        x = torch.tensor(vectors)
        y = torch.tensor([LABELS.index(r["label"]) for r in rows])
        test = torch.tensor([held_out(r["text"]) for r in rows])
        head = fit(x[~test], y[~test])
        with torch.no_grad():
            predicted = head(x[test]).argmax(-1).tolist()
        result = scores(predicted, y[test].tolist())
        result["trained_on"] = int((~test).sum())
        self.stdout.write(json.dumps(result))
        if options["check"]:
            return
        out: Path = options["out"]
        out.mkdir(parents=True, exist_ok=True)
        (out / HEAD_FILE).write_text(json.dumps({
            "encoder": MINILM, "labels": LABELS,
            "weight": [[round(w, 7) for w in row] for row in head.weight.tolist()],
            "bias": [round(b, 7) for b in head.bias.tolist()],
            "corpus_sha256": hashlib.sha256(raw).hexdigest(), "held_out": result,
        }, indent=1) + "\n")
