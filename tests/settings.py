"""The settings of a test process: sluice.settings.test, read after tests/parallel.py has
given this pytest-xdist worker its own Redis databases and state dir."""

from __future__ import annotations

import os

from tests.parallel import isolate

isolate(os.environ)

from sluice.settings.test import *  # noqa: E402, F403
