"""The gateway process tunes its garbage collector once it has started up
(sluice/gctuning.py): what start-up made is frozen, the young generation is collected
less often. Checked in a fresh interpreter that imports the ASGI app as a server does."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys

from sluice import gctuning
from tests.conftest import REPO, process_env


def test_the_asgi_app_freezes_start_up_and_raises_the_young_threshold() -> None:
    probe = ("import gc, json; before = gc.get_freeze_count(); import sluice.root.asgi; "
             "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=process_env(),
                         capture_output=True, text=True, check=True, timeout=120)
    before, frozen, threshold = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == 0
    assert frozen > 50_000  # Django, the apps, the pipeline's modules
    assert threshold[0] == gctuning.YOUNG_THRESHOLD


def test_holding_the_collector_covers_the_block_and_what_it_scheduled_and_no_more() -> None:
    """Inside the block the collector is off, and so it stays for what the loop had
    scheduled by the block's end (a wave of token sends); what comes after runs with it
    on again. A collector that someone else turned off stays off."""

    async def go() -> tuple[list[bool], list[bool]]:
        loop = asyncio.get_running_loop()
        seen: list[bool] = []
        with gctuning.held(loop):
            seen.append(gc.isenabled())
            for _ in range(3):
                loop.call_soon(lambda: seen.append(gc.isenabled()))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        after = [gc.isenabled()]
        gc.disable()
        try:
            with gctuning.held(loop):
                pass
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            after.append(gc.isenabled())
        finally:
            gc.enable()
        return seen, after

    assert gc.isenabled()
    assert asyncio.run(go()) == ([False, False, False, False], [True, False])
