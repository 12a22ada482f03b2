"""Reading a small file the operator points at (a TOML config, a bearer-token file, a
calibration profile) without
trusting it: only a regular file (``/dev/zero`` or a FIFO would hang or grow the read for
ever), at most a size cap, UTF-8, and for TOML no input that makes ``tomllib`` recurse past
the interpreter's limit or go quadratic (a key of 20,000 dotted parts takes > 30 s).

Every problem is one :class:`FileProblem` whose message is one line naming the file and
what is wrong; callers turn it into their own error (exit 2).
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 256 * 1024  # a sidecar config is a few KB; this is far past any real one
MAX_TOKEN_BYTES = 4096
MAX_DOTS_PER_LINE = 64  # dotted key parts (and floats) on one line: tomllib is O(parts**2)
MAX_DOTS = 4096  # in the whole text: 2,000 lines of 64-part keys still took ~10 s


class FileProblem(ValueError):
    """A file that cannot be used; ``str()`` is one line naming the file."""


class FileMissing(FileProblem):
    """The path names nothing (a caller may say how to make the file)."""


def read_small_text(path: str | os.PathLike[str], what: str, max_bytes: int) -> str:
    """The text of ``path``, a regular UTF-8 file of at most ``max_bytes``; else
    :class:`FileProblem` (``what`` names it in the message: "config file")."""
    data = read_small_file(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} "
                          f"at offset {exc.start})") from None


def read_small_file(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file (a link to one is fine: an operator's path) of
    at most ``max_bytes``; else :class:`FileProblem`, before reading a byte of a device,
    FIFO, socket or directory."""
    name = str(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat decides below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise FileMissing(f"{what} {name} does not exist") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise FileProblem(f"{what} {name}: {_why(exc)}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileProblem(f"{what} {name} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"{what} {name} is not a regular file (a device, FIFO or "
                              "socket)")
        if st.st_size > max_bytes:
            raise FileProblem(f"{what} {name} is {st.st_size} bytes; at most {max_bytes} "
                              "allowed")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise FileProblem(f"{what} {name}: {_why(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileProblem(f"{what} {name} grew past {max_bytes} bytes while read")
    return data


def json_object_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` for files and settings read from outside: a
    key given twice is a ValueError (json keeps the last silently: a second ``"entries":
    []`` emptied a whole calibration profile)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            shown = repr(key)
            raise ValueError(f"key {shown if len(shown) <= 60 else shown[:57] + '...'} "
                             "given twice")
        out[key] = value
    return out


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads(text)`` for hostile text; :class:`FileProblem` ("<where> is not valid
    TOML: ...") for anything it refuses, however it refuses it."""
    if text.count(".") > MAX_DOTS:
        raise FileProblem(f"{where} has {text.count('.')} dots; at most {MAX_DOTS} (dotted "
                          "key parts and decimals) in a config")
    for number, line in enumerate(text.splitlines(), 1):
        if line.count(".") > MAX_DOTS_PER_LINE:
            raise FileProblem(f"{where}: line {number} has {line.count('.')} dots; at most "
                              f"{MAX_DOTS_PER_LINE} (dotted key parts) per line")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FileProblem(f"{where} is not valid TOML: {exc}") from None
    except RecursionError:
        raise FileProblem(f"{where} is nested too deeply (not a config TOML)") from None
    except (ValueError, OverflowError, MemoryError) as exc:  # e.g. a 5,000-digit integer
        raise FileProblem(f"{where} has a value TOML cannot hold: "
                          f"{str(exc).split(';')[0]}") from None


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables, or :class:`FileProblem`."""
    return parse_toml(read_small_text(path, "config file", MAX_CONFIG_BYTES),
                      f"config file {path}")
