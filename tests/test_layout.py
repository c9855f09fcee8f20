"""The layout rules that keep `platform/` from shadowing the standard library."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_platform_is_the_standard_library_module() -> None:
    import platform

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(platform.__file__).resolve().parent == stdlib
    assert callable(platform.python_version)


def test_platform_folder_is_not_a_package() -> None:
    assert not (REPO / "platform" / "__init__.py").exists()
    assert (REPO / "platform" / "sluice" / "__init__.py").exists()


def test_top_level_layout() -> None:
    for name in ("manage.py", "pyproject.toml", "README.md", "platform", "tenants",
                 "inference", "streaming", "governance", "frontend", "tests"):
        assert (REPO / name).exists(), name


def test_stdlib_platform_wins_even_from_the_repo_root() -> None:
    """From the repo root (the folder is on sys.path first), `platform` is still stdlib
    and Django, uuid and the settings import cleanly."""
    code = ("import platform, uuid, django; platform.system(); uuid.uuid4(); "
            "import sluice.settings.base; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_manage_py_check_passes() -> None:
    out = subprocess.run([sys.executable, "manage.py", "check", "--fail-level", "WARNING"],
                         cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_gateway_imports_no_model_code() -> None:
    """The gateway (its ASGI app, every API and the deployments API) runs no model:
    importing torch there would cost each gateway process seconds and hundreds of MB."""
    code = ("import os, sys; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
            "'sluice.settings.base'); import django; django.setup(); "
            "import sluice.root.asgi, inference.services, inference.api; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'platform'}"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=False, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False False"
