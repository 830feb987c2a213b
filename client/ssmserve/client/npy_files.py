"""Reading and writing the CLI's .npy files: no pickle, atomic writes, one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ssmserve.client.atomic_file import atomic_write
from ssmserve.client.errors import CliError


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


def check_writable(path: Path) -> None:
    """Fail before the work when ``path`` cannot be written (its directory is missing)."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"{path}: directory {parent} does not exist")


def save_npy(path: Path, arr: np.ndarray) -> None:
    check_writable(path)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a name
            np.save(f, arr, allow_pickle=False)

    atomic_write(path, write)
