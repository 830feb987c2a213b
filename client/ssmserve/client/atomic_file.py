"""Write a file so that readers see the old content or the new, never a partial write."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(target: Path, write: Callable[[str], object]) -> None:
    """Call ``write(tmp_path)`` on a temp file beside ``target``, then rename it over.

    The temp file is removed if ``write`` (or the rename) fails, so a failed command
    leaves nothing behind.
    """
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
