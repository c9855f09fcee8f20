"""How many HTTP processes the run command starts (sluice/servers.py)."""

from __future__ import annotations

import pytest

from sluice import servers


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (3, 3), (16, 4), (None, 1)])
def test_one_http_process_per_core_up_to_the_cap(monkeypatch: pytest.MonkeyPatch,
                                                 cores: int | None, expected: int) -> None:
    monkeypatch.delenv("SLUICE_HTTP_WORKERS", raising=False)
    monkeypatch.setattr(servers.os, "cpu_count", lambda: cores)
    assert servers.default_workers() == expected
    assert servers.default_workers("granian") == expected


def test_daphne_runs_one_and_the_setting_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_HTTP_WORKERS", raising=False)
    monkeypatch.setattr(servers.os, "cpu_count", lambda: 8)
    assert servers.default_workers("daphne") == 1
    command = servers.http_command("daphne", "app:app", host="127.0.0.1", port=1,
                                   workers=servers.default_workers("daphne"))
    assert "daphne" in " ".join(command)
    monkeypatch.setenv("SLUICE_HTTP_WORKERS", "3")
    assert servers.default_workers() == 3
