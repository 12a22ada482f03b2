"""Issue 21, tried from outside: the evidence directory given as a symbolic link. A link to
a safe directory of this user's works for the writer and the reader (records land in the
target, ``evidence list`` reads them); a link to a world-writable directory, a dangling
link, a link loop, a link to a file, a device or a FIFO are each one clear line and exit 2,
from both sides (the reader said "does not exist" for all of them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sidecar.cli.main import main
from sidecar.evidence.files import EvidenceDirRefused
from sidecar.evidence.record import EvidenceLog, tensor_key


def _record(log: EvidenceLog) -> None:
    log.add({"kind": "link-test"}, {tensor_key(0, 1, "cached", "key"): torch.zeros(2, 3)})


def test_a_link_to_a_safe_directory_is_written_through_and_read(tmp_path: Path,
                                                                 capsys) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    _record(EvidenceLog(capacity=10, directory=link))
    assert sorted(p.name for p in real.iterdir()) == ["anomaly-00000001.json",
                                                      "anomaly-00000001.safetensors"]
    assert main(["evidence", "list", "--dir", str(link), "--json"]) == 0
    assert '"link-test"' in capsys.readouterr().out


@pytest.fixture
def links(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for name, target in [("to_shared", shared), ("dangling", tmp_path / "nowhere"),
                         ("loop", tmp_path / "loop"), ("to_file", tmp_path / "file"),
                         ("to_device", Path("/dev/null")), ("to_fifo", tmp_path / "fifo")]:
        (tmp_path / name).symlink_to(target)
    return tmp_path


WRITER = {"to_shared": "world-writable", "dangling": "No such file",
          "loop": "symbolic links", "to_file": "not a directory",
          "to_device": "not a directory", "to_fifo": "not a directory"}
READER = {"dangling": "does not exist", "loop": "symbolic links",
          "to_file": "is not a directory", "to_device": "is not a directory",
          "to_fifo": "is not a directory"}


@pytest.mark.parametrize("name", sorted(WRITER))
def test_the_writer_refuses_an_unsafe_or_broken_link(links: Path, name: str) -> None:
    with pytest.raises(EvidenceDirRefused, match=WRITER[name]):
        EvidenceLog(capacity=10, directory=links / name)


@pytest.mark.parametrize("name", sorted(READER))
def test_the_reader_names_what_the_link_is(links: Path, name: str, capsys) -> None:
    assert main(["evidence", "list", "--dir", str(links / name)]) == 2
    err = capsys.readouterr().err
    assert READER[name] in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
