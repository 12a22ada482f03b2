"""Commands whose optional dependencies are missing name the extra to install (exit 2).

Each case runs the real CLI in a fresh interpreter where the extra's modules cannot be
imported (``sys.modules[name] = None`` makes ``import name`` fail exactly as an absent
package does). ``scripts/test-lean-install.sh`` proves the same against a real
``pip install .``; this keeps the message and exit code under unit test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.core.extras import EXTRAS, MissingExtra, missing_modules, require

RUN_WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from sidecar.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _cli_without(modules: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT, modules, *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("hidden", "argv", "extra"), [
    ("transformers", ["demo", "--fault", "zero-block"], "demo"),
    ("transformers", ["faults"], "demo"),
    ("transformers", ["bench", "detection"], "demo"),
    ("zmq,msgpack", ["vllm", "--help"], "events"),
])
def test_a_missing_extra_is_named_with_exit_2_and_no_traceback(hidden, argv, extra):
    proc = _cli_without(hidden, *argv)
    assert proc.returncode == 2, proc.stderr
    assert f"pip install 'kv-sidecar[{extra}]'" in proc.stderr
    assert hidden.split(",")[0] in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_and_signals_need_no_extra():
    proc = _cli_without("transformers,zmq,msgpack,grafanalib,yaml,pytest", "--help")
    assert proc.returncode == 0 and "demo" in proc.stdout, proc.stderr
    proc = _cli_without("transformers,zmq,msgpack,grafanalib,yaml,pytest", "signals")
    assert proc.returncode == 0 and "kvsidecar_" in proc.stdout, proc.stderr


def test_require_passes_when_installed_and_names_what_is_missing(monkeypatch):
    require("demo")  # the dev venv has every extra
    assert missing_modules(("torch", "kvsidecar_no_such_module")) == ["kvsidecar_no_such_module"]
    monkeypatch.setitem(EXTRAS, "demo", ("demo", ("kvsidecar_no_such_module",)))
    with pytest.raises(MissingExtra, match=r"kvsidecar_no_such_module.*kv-sidecar\[demo\]"):
        require("demo")
