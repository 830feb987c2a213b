"""Reading and writing the CLI's .npy files: no pickle, atomic writes, one-line errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ssmserve.client.cli_errors import CliError
from ssmserve.client.output_files import check_output, write_output


def load_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError) as exc:
        raise CliError(f"{path}: not a readable .npy array: {exc}") from None
    if not isinstance(arr, np.ndarray):
        raise CliError(f"{path}: holds several arrays (.npz); give one .npy array")
    return arr


def npy_writer(arr: np.ndarray) -> Callable[[BinaryIO], None]:
    """What writes ``arr`` as .npy into an open file (np.save on a name would add
    ".npy" to it)."""

    def write(f: BinaryIO) -> None:
        np.save(f, arr, allow_pickle=False)

    return write


def save_npy(path: Path, arr: np.ndarray) -> None:
    """``arr`` into ``path`` as .npy, atomically; CliError (one line) if it cannot be."""
    check_output(path)
    try:
        write_output(path, npy_writer(arr))
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None
