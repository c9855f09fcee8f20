"""Instructions per audit event in the writer's database step, counted by callgrind.

`write_events` (dedupe, chain hashes, the INSERT) plus `from_wire`, over batches of 100
events like the gateway's, on the run command's embedded SQLite in a temporary state
dir: the part of the audit writer's CPU per call that does not depend on how the
stream is read. Re-runs itself under valgrind's callgrind with instrumentation switched
on only around the measured batches (start-up, migrations and the first batch
uncounted); the count is the same from run to run within ~0.5%, where time on these VMs
swings by 30%. Needs valgrind (`apt-get install valgrind`).

    .venv/bin/python tests/bench/bench_audit_write.py [--batches 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BATCH = 100


def measure(batches: int, out: Path) -> None:
    """In the process under callgrind: set up, then count `batches` batches."""
    os.environ.update(SLUICE_STATE_DIR=tempfile.mkdtemp(prefix="sluice-bench-"),
                      DJANGO_SETTINGS_MODULE="sluice.settings.base")
    os.environ.pop("DATABASE_URL", None)
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    import django
    django.setup()
    from django.core.management import call_command
    from django.utils import timezone

    from governance import audit
    call_command("migrate", verbosity=0)

    def wires(k: int) -> list[str]:
        return [audit.to_wire({
            "chain": "demo", "at": timezone.now(), "tenant_id": None, "actor": "key:abc",
            "role": "developer", "key_prefix": "sk-abc", "action": "chat.completions",
            "target": "", "model": "echo", "protocol": "rest", "status": 200,
            "latency_ms": 3.25, "prompt_tokens": 12, "completion_tokens": 5,
            "request_id": f"r{k}-{i}", "trace_id": "0" * 32, "request_excerpt": "hello",
            "response_excerpt": "hello", "detail": {"finish": "stop", "probe": False},
            "source": f"s{k}-{i}"}) for i in range(BATCH)]

    prepared = [wires(k) for k in range(batches + 1)]
    audit.write_events([audit.from_wire(w) for w in prepared[0]])  # warm, uncounted
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
    for batch in prepared[1:]:
        audit.write_events([audit.from_wire(w) for w in batch])
    subprocess.run(["callgrind_control", "--dump=batches", pid], check=True,
                   capture_output=True)
    total = sum(int(line.split()[1]) for dump in out.parent.glob(f"{out.name}.*")
                for line in dump.read_text(errors="replace").splitlines()
                if line.startswith("summary:"))
    print(f"audit writer, from_wire + write_events, batches of {BATCH} on SQLite: "
          f"{total / (batches * BATCH):,.0f} instructions per event")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # set when under valgrind
    args = parser.parse_args()
    if args.measure:
        measure(args.batches, Path(args.measure))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is needed: apt-get install valgrind")
    out = Path(tempfile.mkdtemp(prefix="sluice-bench-")) / "writer"
    subprocess.run(["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={out}.%p", sys.executable, __file__,
                    "--batches", str(args.batches), "--measure", str(out)], check=True)


if __name__ == "__main__":
    main()
