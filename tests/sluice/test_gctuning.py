"""The gateway process tunes its garbage collector once it has started up
(sluice/gctuning.py): what start-up made is frozen, the young generation is collected
less often. Checked in a fresh interpreter that imports the ASGI app as a server does."""

from __future__ import annotations

import json
import subprocess
import sys

from sluice.gctuning import YOUNG_THRESHOLD
from tests.conftest import REPO, process_env


def test_the_asgi_app_freezes_start_up_and_raises_the_young_threshold() -> None:
    probe = ("import gc, json; before = gc.get_freeze_count(); import sluice.asgi; "
             "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=process_env(),
                         capture_output=True, text=True, check=True, timeout=120)
    before, frozen, threshold = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == 0
    assert frozen > 50_000  # Django, the apps, the pipeline's modules
    assert threshold[0] == YOUNG_THRESHOLD
