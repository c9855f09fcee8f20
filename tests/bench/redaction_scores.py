"""Recall and precision of the redaction engine on the labelled corpus
(tests/sluice/redaction_corpus.py): per recognizer, per form issue #28 found missed,
per category of negatives (how many texts it left untouched), and the time to redact a
megabyte. `-v` lists every miss and false positive.

    .venv/bin/python tests/bench/redaction_scores.py [-v]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")

import django  # noqa: E402

django.setup()

from sluice.pii.redaction import RECOGNIZERS, find, redact  # noqa: E402
from tests.sluice.redaction_corpus import negatives, positives, score  # noqa: E402


def main() -> None:
    s = score(find)
    print(f"corpus: {sum(s.tp.values()) + sum(s.fn.values())} positives, "
          f"{sum(s.negatives.values())} negatives")
    print(f"\n{'recognizer':10} {'TP':>5} {'FN':>4} {'FP':>4} {'precision':>10} {'recall':>8}")
    for label, _ in RECOGNIZERS:
        print(f"{label:10} {s.tp[label]:5} {s.fn[label]:4} {s.fp[label]:4} "
              f"{s.precision(label):10.1%} {s.recall(label):8.1%}")
    print(f"{'all':10} {sum(s.tp.values()):5} {sum(s.fn.values()):4} "
          f"{sum(s.fp.values()):4} {s.precision():10.1%} {s.recall():8.1%}")
    print(f"\n{'positive form (issue #28)':32} {'found':>9} {'recall':>8}")
    for form, total in s.forms.items():
        print(f"{form:32} {s.forms_hit[form]:>4}/{total:<4} {s.forms_hit[form] / total:8.1%}")
    print(f"\n{'negative category':20} {'flagged':>11} {'untouched':>10}")
    for category, total in s.negatives.items():
        flagged = s.negatives_flagged[category]
        print(f"{category:20} {flagged:>5}/{total:<5} {1 - flagged / total:10.1%}")
    if "-v" in sys.argv:
        print("\nmissed:", *[f"  {m.label}: {m.text!r}" for m in s.misses], sep="\n")
        print("false positives:", *[f"  {f}" for f in s.flagged], sep="\n")
    texts = [p.text for p in positives()] + [t for ts in negatives().values() for t in ts]
    mixed = " ".join(texts)
    text = (mixed * (1_048_576 // len(mixed) + 1))[:1_048_576]
    started = time.perf_counter()
    redact(text)
    print(f"\n1 MB of corpus text: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
