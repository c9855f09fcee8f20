"""Precision and recall of each redaction recognizer on the labelled corpus
(tests/governance/redaction_corpus.py), and the time to redact a megabyte.

    .venv/bin/python tests/bench/redaction_scores.py
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")

import django  # noqa: E402

django.setup()

from governance.redaction import RECOGNIZERS, find, redact  # noqa: E402
from tests.governance.redaction_corpus import NEGATIVES, positives  # noqa: E402


def main() -> None:
    tp, fn, fp = Counter[str](), Counter[str](), Counter[str]()
    samples = positives()
    for sample in samples:
        spans = find(sample.text)
        hit = [s for s in spans if sample.text[s.start:s.end].endswith(sample.secret)
               or sample.secret in sample.text[s.start:s.end]]
        if any(s.label == sample.label for s in hit):
            tp[sample.label] += 1
        else:
            fn[sample.label] += 1
        for s in spans:
            if s not in hit:
                fp[s.label] += 1
    for text in NEGATIVES:
        for s in find(text):
            fp[s.label] += 1
    print(f"corpus: {len(samples)} positives, {len(NEGATIVES)} near-miss negatives")
    print(f"{'recognizer':10} {'TP':>5} {'FN':>4} {'FP':>4} {'precision':>10} {'recall':>8}")
    for label, _ in RECOGNIZERS:
        t, f, p = tp[label], fn[label], fp[label]
        precision = t / (t + p) if t + p else 1.0
        recall = t / (t + f) if t + f else 1.0
        print(f"{label:10} {t:5} {f:4} {p:4} {precision:10.1%} {recall:8.1%}")
    mixed = " ".join(s.text for s in samples) + " " + " ".join(NEGATIVES)
    text = (mixed * (1_048_576 // len(mixed) + 1))[:1_048_576]
    started = time.perf_counter()
    redact(text)
    print(f"1 MB of corpus text: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
