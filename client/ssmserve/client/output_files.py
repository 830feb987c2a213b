"""The files the CLI writes: checked before any work, written whole, never lost.

A command that writes a file (``--output``) calls :func:`check_output` before it asks a
worker for anything, so a path that cannot be written costs nothing: no step applied,
no export streamed. The file is then written atomically (a temp file beside it, renamed
over it), so a reader sees the old content or the new. When the write still fails after
the work was done (the disk filled, the directory vanished), :func:`write_or_keep` puts
the result in the temp directory and says where, so that no answered work is thrown
away.

An existing target that is not a regular file (``/dev/null``, a FIFO) is written in
place: renaming over it would replace the device node.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ssmserve.client.atomic_file import atomic_write
from ssmserve.client.cli_errors import CliError


def check_output(path: Path, flag: str = "--output") -> None:
    """Raise :class:`CliError` (saying which path and why, in one line) unless ``path``
    can be written: its directory exists and takes new files, and it is no directory."""
    parent = path.parent if str(path.parent) else Path(".")
    where = f"{flag} {path}"
    if path.is_dir():
        raise CliError(f"{where}: is a directory; give a file name")
    if not parent.exists():
        raise CliError(f"{where}: directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise CliError(f"{where}: {parent} is not a directory")
    if path.exists() and not path.is_file():
        if not os.access(path, os.W_OK):
            raise CliError(f"{where}: not writable")
        return  # a device or FIFO: written in place
    try:  # the only sure test: create a file there (permissions, read-only mounts, ACLs)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise CliError(
            f"{where}: cannot create files in {parent} ({exc.strerror or exc}); "
            "choose a writable directory"
        ) from None
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise CliError(f"{where}: the file is read-only")


def write_output(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into ``path``: atomically for a regular file, in place for a
    device. Raises OSError."""
    if path.exists() and not path.is_file():
        with open(path, "wb") as f:
            write(f)
        return

    def to_temp(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)

    atomic_write(path, to_temp)


def save_elsewhere(stem: str, suffix: str, write: Callable[[BinaryIO], object]) -> Path:
    """``write(file)`` into a new file in the temp directory named after ``stem``; its
    path. Raises OSError."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:80]
    fd, name = tempfile.mkstemp(prefix=f"ssmserve-{safe}-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        write(f)
    return Path(name)


def write_or_keep(
    path: Path, write: Callable[[BinaryIO], object], stem: str, suffix: str, done: str
) -> Path:
    """Write ``path``; when that fails after the work was done, keep the result in the
    temp directory and raise CliError saying where (``done``: what the work was)."""
    try:
        write_output(path, write)
        return path
    except OSError as exc:
        cause = exc.strerror or str(exc)
    try:
        kept = save_elsewhere(stem, suffix, write)
    except OSError as exc:
        raise CliError(
            f"cannot write {path} ({cause}) nor a temp file ({exc.strerror}); {done}"
        ) from None
    raise CliError(f"cannot write {path} ({cause}); {done}: the result is in {kept}")
