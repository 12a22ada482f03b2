"""The file-system side of evidence: a directory only the sidecar's user can write, temp
files nobody can redirect, and reads that take only regular files of a bounded size.

An evidence directory sits on a node beside a production engine, and it holds what an
operator opens at 3 a.m. Two ways that goes wrong, closed here:

* a writer that follows links: in a directory others can write, a symlink planted at the
  next ``anomaly-N.json.tmp`` made ``open(O_CREAT|O_TRUNC)`` overwrite its target. The
  sidecar now creates the directory itself (0700) or refuses one that is world-writable or
  owned by another user (:class:`EvidenceDirRefused`, exit 2), and every temp file is
  created with ``O_EXCL|O_NOFOLLOW``: a planted name is removed (``unlink`` removes the
  link, never its target) and the create retried once; a second plant is a write error.
* a reader that trusts names: a record that is a link to ``/dev/zero``, a FIFO, a 10 GiB
  sparse file or a link to a file outside the directory. :func:`read_regular` opens with
  ``O_NOFOLLOW|O_NONBLOCK``, takes only a regular file and checks its size with ``fstat``
  before reading a byte (and reads at most the cap, should it grow meanwhile).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sidecar.config.layers import ConfigError

MAX_RECORD_BYTES = 4 * 2**20  # a record's JSON; the writer's caps keep real ones ~10 KB
MAX_TENSOR_FILE_BYTES = 2 * 2**30  # the largest tensor file `evidence show` will open


class EvidenceDirRefused(ConfigError):
    """The evidence directory is not safe to write into (one problem line, exit code 2)."""

    def __init__(self, directory: Path, why: str) -> None:
        super().__init__([f"evidence_dir {str(directory)!r}: {why}"])


class NotARecordFile(OSError):
    """A name in the evidence directory that is not a regular file of a sane size; the
    message says what it is instead."""


def prepare_directory(directory: Path) -> None:
    """Create ``directory`` 0700 (parents as needed), or check an existing one: it must be
    a directory owned by this user and not writable by everybody."""
    try:
        directory.mkdir(parents=True, mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode passes through the umask
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise EvidenceDirRefused(directory, f"cannot create it: {exc.strerror}") from None
    try:
        link = os.lstat(directory)
        st = os.stat(directory)
    except OSError as exc:
        raise EvidenceDirRefused(directory, f"cannot read it: {exc.strerror}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        raise EvidenceDirRefused(
            directory, f"is a symbolic link owned by uid {link.st_uid}: another user chose "
                       "where the evidence goes")
    if not stat.S_ISDIR(st.st_mode):
        raise EvidenceDirRefused(directory, "exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise EvidenceDirRefused(
            directory, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                       "another user could plant files in it: use a directory of this "
                       "user's, or let the sidecar create one")
    if st.st_mode & stat.S_IWOTH:
        raise EvidenceDirRefused(
            directory, f"is world-writable (mode {stat.S_IMODE(st.st_mode):04o}): anyone "
                       f"could plant files in it; chmod 700 it, or let the sidecar create one")


def write_exclusive(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (0600, fsynced), never through a link: an
    existing entry (a leftover, or something planted) is unlinked and the create retried
    once with ``O_EXCL|O_NOFOLLOW``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)  # removes the entry itself: a link's target is untouched
        fd = os.open(path, flags, 0o600)  # a second plant raises: a counted write error
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: Path, limit: int) -> tuple[int, int]:
    """A descriptor open on ``path`` and its size, if it is a regular file (not a link,
    FIFO, device or directory) of at most ``limit`` bytes; :class:`NotARecordFile`
    otherwise, and the ordinary ``OSError`` (e.g. ``FileNotFoundError``) when it cannot be
    opened. The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotARecordFile(errno.ELOOP, "a symbolic link, not a file the sidecar "
                                              "wrote") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARecordFile(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise NotARecordFile(errno.EFBIG, f"{st.st_size} bytes, over the {limit}-byte "
                                              "limit for this kind of file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if :func:`open_regular` takes it (and it does not grow past
    ``limit`` while read)."""
    fd, _ = open_regular(path, limit)
    try:
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise NotARecordFile(errno.EFBIG, f"grew past the {limit}-byte limit while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_exact(fd: int, size: int) -> bytearray:
    """Exactly ``size`` bytes from ``fd`` into one buffer, the only copy (no chunks joined):
    :class:`NotARecordFile` when the file ends sooner or holds more."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.readv(fd, [view[got:got + (16 << 20)]])
        if n == 0:
            raise NotARecordFile(errno.EIO, f"ends at {got} bytes, {size} expected")
        got += n
    view.release()
    if os.read(fd, 1):
        raise NotARecordFile(errno.EFBIG, f"grew past {size} bytes while read")
    return buf


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"mode {mode:o}"
