"""Finding promtool/amtool for the tests, with one clear reason when they are missing.

Developers without the Debian packages get a skip that says how to install them; CI sets
``KVSIDECAR_REQUIRE_PROMETHEUS=1`` (scripts/test-e2e.sh does, after installing them) so a
missing binary fails instead of silently skipping the checks that matter.
"""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL_HINT = ("apt-get install prometheus prometheus-alertmanager "
                "(or run scripts/test-e2e.sh as root, which installs them)")


def require(*names: str) -> str:
    """The first of ``names`` on PATH, else skip (or fail when CI requires them)."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    reason = f"{' / '.join(names)} not on PATH: {INSTALL_HINT}"
    if os.environ.get("KVSIDECAR_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
