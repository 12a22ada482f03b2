"""scripts/engine-venv.sh: before an engine venv is built, room is made by removing the
other engine venvs, never the dev venv, and a build that cannot fit stops with the numbers
(a CI run once died of "No space left on device" building the third venv)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "scripts" / "engine-venv.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _room(tmp_path: Path, need_mib: int, env: str = "",
          venv: str = ".venv-sglang") -> subprocess.CompletedProcess[str]:
    for name in (".venv", ".venv-vllm", ".venv-lmcache", ".venv-sglang"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (tmp_path / name / "marker").write_text("x")
    script = (f'{env} source "{LIB}"; engine_venv_room test-x {venv} {need_mib}; '
              'echo "built, cache=$PIP_NO_CACHE_DIR"')
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def test_enough_room_keeps_the_other_venvs_and_clears_its_own(tmp_path: Path) -> None:
    done = _room(tmp_path, 1)
    assert done.returncode == 0, done.stderr
    assert "built, cache=1" in done.stdout
    assert "MiB free here" in done.stdout
    assert (tmp_path / ".venv-vllm" / "marker").exists()
    assert (tmp_path / ".venv-lmcache" / "marker").exists()
    assert not (tmp_path / ".venv-sglang").exists()  # a half-built venv never survives
    assert (tmp_path / ".venv" / "marker").exists()


def test_no_room_removes_other_engine_venvs_then_stops_with_the_numbers(
        tmp_path: Path) -> None:
    done = _room(tmp_path, 999_999_999)  # more than any disk has
    assert done.returncode == 1
    assert "built" not in done.stdout
    assert "removing '.venv-vllm'" in done.stdout and "removing '.venv-lmcache'" in done.stdout
    assert not (tmp_path / ".venv-vllm").exists()
    assert not (tmp_path / ".venv-lmcache").exists()
    assert (tmp_path / ".venv" / "marker").exists()  # the dev venv is never touched
    assert "needs ~" in done.stderr and "Free some disk" in done.stderr


def test_only_venvs_are_ever_removed_whatever_the_variables_name(tmp_path: Path) -> None:
    """VENV_* may name any path: a directory that is not a venv, a link, the dev venv or
    the checkout itself is never removed to make room, nor replaced by a build."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / ".venv-vllm")
    done = _room(tmp_path, 999_999_999, env="export VENV_VLLM=data VENV_LMCACHE=.venv;")
    assert done.returncode == 1
    assert (tmp_path / "data" / "keep").exists() and (tmp_path / ".venv" / "marker").exists()
    for bad in (".", "data", "link", ".venv"):
        done = _room(tmp_path, 1, venv=bad)
        assert done.returncode == 1 and "is not a venv this script may replace" in done.stderr
        assert "built" not in done.stdout
    assert (tmp_path / "data" / "keep").exists() and (tmp_path / ".venv" / "marker").exists()
    assert (tmp_path / ".venv-vllm" / "marker").exists()  # the link's target too


def test_hostile_names_and_values_delete_nothing_they_should_not(tmp_path: Path) -> None:
    """An outside check's finds: a venv holding the checkout, CDPATH, names trimmed or
    split by `read`, a leading dash, a NEED that is no number, a df that fails."""
    outer = tmp_path / "outer"
    root = outer / "root"
    root.mkdir(parents=True)
    (outer / "pyvenv.cfg").write_text("x")  # the checkout lives inside a venv directory
    (root / "env").mkdir()
    (root / "env" / "pyvenv.cfg").write_text("x")
    for env in (f'export VENV_LMCACHE="{outer}";', "export VENV_LMCACHE=..;",
                'export CDPATH=.; export VENV_LMCACHE="$PWD/.venv";',
                "export VENV_LMCACHE=' env';", "export VENV_LMCACHE=$'nope\\nenv';",
                "export VENV_LMCACHE=-d;"):
        done = _room(root, 999_999_999, env=env)
        assert done.returncode == 1, env
        assert (outer / "pyvenv.cfg").exists() and (root / ".venv" / "marker").exists(), env
        assert (root / "env" / "pyvenv.cfg").exists(), env
    (root / "-").mkdir()  # "-" is a name, not $OLDPWD: it holds the dev venv here
    (root / "-" / "pyvenv.cfg").write_text("x")
    (root / "-" / "dev").mkdir()
    done = _room(root, 999_999_999, env='export DEV_VENV=./-/dev VENV_LMCACHE=-;')
    assert done.returncode == 1 and (root / "-" / "pyvenv.cfg").exists()
    assert "not removing '-'" in done.stdout
    (root / "lnk").symlink_to(root / "env")
    done = _room(root, 999_999_999, env="export VENV_VLLM=lnk/;")
    assert (root / "env" / "pyvenv.cfg").exists()  # a link, with or without its slash
    done = _room(root, 1, venv="-rf")
    assert done.returncode == 0 and "built" in done.stdout  # '-rf' is a name, not a flag
    for need in ("abc", "", "2.5", "-3", "9" * 19):
        done = subprocess.run(
            ["bash", "-c", f'source "{LIB}"; engine_venv_room test-x .venv-sglang "{need}"'],
            cwd=root, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "NEED_MIB" in done.stderr, need
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "df").write_text("#!/bin/sh\nexit 1\n")
    (fake / "df").chmod(0o755)
    (root / ".venv-sglang" / "pyvenv.cfg").write_text("x")
    done = _room(root, 1, env=f'export PATH="{fake}:$PATH";')
    assert done.returncode == 1 and "df failed" in done.stderr
    assert (root / ".venv-sglang" / "marker").exists()  # nothing removed before it knew
