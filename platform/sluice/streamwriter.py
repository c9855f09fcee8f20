"""A Redis stream's entries into the database, in batches, at least once: the loop that
the audit writer (governance/audit.py) and the stored responses' writer
(streaming/apis/responses/writer.py) share.

- A consumer group (GROUP) hands each entry to one writer; several writers may run.
- A batch is at most `batch` entries: this writer's own unacknowledged entries after a
  failed batch (or at start, what its name took before a restart), then other writers'
  entries idle for `claim_idle_ms` (a dead writer's), then new ones.
- `write(entries)` stores a batch (one transaction, the subclass's); only after it
  returns are the entries acknowledged and deleted from the stream, with the Redis keys
  it returned, in one pipeline. A failed batch raises, nothing is acknowledged and the
  next batch takes the same entries again, so `write` must be idempotent.
- `serve` lingers LINGER_S after a partial batch, so a busy stream is written in a few
  large transactions rather than many small ones (each costs a commit).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, ClassVar

from django.db import close_old_connections
from redis import exceptions as redis_errors

from sluice import gctuning
from sluice.processes import set_on_signals
from sluice.redis import sync_redis

logger = logging.getLogger(__name__)
GROUP = "writers"
BATCH = 500  # entries a batch takes at most
LINGER_S = 0.1  # the wait after a partial batch: entries land within ~100 ms
CLAIM_IDLE_MS = 60_000

# The streams a writer process moves into the database, by the name their metrics
# carry (sluice_<name>_backlog): the audit log's and the stored responses'.
STREAMS = {"audit": "sluice:audit:events", "responses": "sluice:responses:stored"}

Entry = tuple[Any, dict[bytes, bytes]]


class StreamWriter:
    """Moves `STREAM`'s entries into the database (see the module docstring).
    Subclasses set STREAM and WHAT (the logs' name) and implement `write`."""

    STREAM: ClassVar[str]
    WHAT: ClassVar[str]

    def __init__(self, name: str | None = None, batch: int = BATCH,
                 claim_idle_ms: int = CLAIM_IDLE_MS) -> None:
        self.redis = sync_redis()
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.batch, self.claim_idle_ms = batch, claim_idle_ms
        self._own_pending = True  # at start: what this name took before a restart
        try:
            self.redis.xgroup_create(self.STREAM, GROUP, id="0", mkstream=True)
        except redis_errors.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def write(self, entries: list[Entry]) -> list[str]:
        """Store `entries` (none empty) in the database, idempotently; returns the Redis
        keys to delete once they are acknowledged. Raises to fail the batch."""
        raise NotImplementedError

    def _entries(self, block_ms: int | None) -> list[Entry]:
        entries: list[Entry] = []
        if self._own_pending:
            for _stream, items in self.redis.xreadgroup(
                    GROUP, self.name, {self.STREAM: "0"}, count=self.batch) or []:
                entries += items
            self._own_pending = len(entries) == self.batch
        if len(entries) < self.batch:
            _, stale, _ = self.redis.xautoclaim(self.STREAM, GROUP, self.name,
                                                self.claim_idle_ms,
                                                count=self.batch - len(entries))
            entries += stale
        if not entries:
            for _stream, items in self.redis.xreadgroup(
                    GROUP, self.name, {self.STREAM: ">"}, count=self.batch,
                    block=block_ms) or []:
                entries += items
        return entries

    def run_once(self, block_ms: int | None = None) -> int:
        """One batch. Returns the entries done (written, or dropped by `write`)."""
        entries = self._entries(block_ms)
        ids = [entry_id for entry_id, _ in entries]
        entries = [(i, f) for i, f in entries if f]  # a deleted entry comes back empty
        if not ids:
            return 0
        try:
            done = self.write(entries) if entries else []
        except BaseException:
            self._own_pending = True  # retried by this writer's next batch
            raise
        with self.redis.pipeline(transaction=False) as pipe:
            for key in done:
                pipe.delete(key)
            pipe.xack(self.STREAM, GROUP, *ids)
            pipe.xdel(self.STREAM, *ids)
            pipe.execute()
        return len(ids)

    def serve(self, stop: threading.Event, block_ms: int = 1000,
              linger_s: float = LINGER_S) -> None:
        """Write batches until `stop` is set; a failed batch is logged and retried."""
        while not stop.is_set():
            try:
                done = self.run_once(block_ms)
            except Exception:
                logger.exception("%s: batch failed; retrying", self.WHAT)
                close_old_connections()
                stop.wait(1.0)
                continue
            close_old_connections()  # CONN_MAX_AGE, as a request's connection
            if 0 < done < self.batch:
                stop.wait(linger_s)

    def drain(self, settle_s: float = 0.3, timeout_s: float = 30.0) -> int:
        """Write everything in the stream now, until it stays empty for `settle_s` (tests,
        and operators before a maintenance). Returns the entries done."""
        done, quiet_since = 0, time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.run_once(block_ms=50)
            done += n
            if n:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle_s:
                break
        return done

    @classmethod
    def run_process(cls) -> None:
        """A writer process's body (its management command): serve until SIGTERM/SIGINT."""
        stop = threading.Event()
        set_on_signals(stop)
        writer = cls()
        gctuning.tune()  # what start-up made lives as long as the process
        writer.serve(stop)
