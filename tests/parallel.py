"""What one pytest-xdist worker owns, so that parallel workers never touch each other's
data: its own Redis database (or Redis Cluster), its own Celery and Channels Redis
database, its own state dir (secret key, JWT keys, uploads). pytest-django gives each
worker its own PostgreSQL database (test_<name>_gw0, _gw1, ...) by itself.

`isolate(environ)` rewrites the environment of a worker process before Django's settings
are read (tests/settings.py calls it first), and the processes a test starts inherit it:

- SLUICE_TEST_REDIS_URLS, a space-separated list (the test command's cluster pass: one
  cluster per worker; a cluster URL has commas), gives worker i its item i as REDIS_URL;
- otherwise worker i takes REDIS_URL's database number less i (15, 14, ... for the test
  command's default 15; a database below 0 is an error, never a wrap onto a developer's
  database 0), and SLUICE_CELERY_REDIS_URL / SLUICE_CHANNELS_REDIS_URL, when set, the
  same way;
- SLUICE_STATE_DIR, when set, becomes its subfolder named for the worker.

A process that is not an xdist worker (PYTEST_XDIST_WORKER unset: `-n 0`, or a plain
pytest run) is left as it is. SLUICE_TEST_WORKER records the worker the environment was
made for; tests/conftest.py refuses to run a worker whose settings did not come through
here (a settings module named by hand), as its tests would erase another worker's keys.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from pathlib import Path

WORKER = "PYTEST_XDIST_WORKER"
MARK = "SLUICE_TEST_WORKER"
URLS = "SLUICE_TEST_REDIS_URLS"
_SIDE_URLS = ("SLUICE_CELERY_REDIS_URL", "SLUICE_CHANNELS_REDIS_URL")


def worker_index(worker: str) -> int:
    """gw0 -> 0, gw7 -> 7."""
    found = re.fullmatch(r"gw(\d+)", worker)
    if found is None:
        raise RuntimeError(f"{WORKER}={worker!r} is not an xdist worker id (gw<N>)")
    return int(found[1])


def shifted(url: str, index: int) -> str:
    """A single Redis URL with its database number lowered by `index`."""
    found = re.fullmatch(r"(rediss?://[^/]*)(?:/(\d*))?(\?.*)?", url)
    if found is None or "+cluster" in url:
        raise RuntimeError(f"{url!r}: a single Redis URL (redis://host:port/db) is needed "
                           f"to give each xdist worker a database of its own (or set {URLS})")
    database = int(found[2] or 0) - index
    if database < 0:
        raise RuntimeError(f"{url!r}: no Redis database left for xdist worker {index} "
                           "(each worker takes the database below the previous one's)")
    return f"{found[1]}/{database}{found[3] or ''}"


def isolate(environ: MutableMapping[str, str]) -> None:
    """Give this xdist worker process its own Redis databases and state dir (above)."""
    worker = environ.get(WORKER)
    if not worker or environ.get(MARK) == worker:
        return
    index = worker_index(worker)
    listed = environ.get(URLS, "").split()
    if listed:
        if index >= len(listed):
            raise RuntimeError(f"{URLS} names {len(listed)} Redis URLs: none for {worker}")
        environ["REDIS_URL"] = listed[index]
    else:
        environ["REDIS_URL"] = shifted(environ.get("REDIS_URL", ""), index)
    for name in _SIDE_URLS:
        if environ.get(name):
            environ[name] = shifted(environ[name], index)
    if environ.get("SLUICE_STATE_DIR"):
        state = Path(environ["SLUICE_STATE_DIR"]) / worker
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        environ["SLUICE_STATE_DIR"] = str(state)
    environ[MARK] = worker
