"""Where numba keeps the engine's compiled kernels: one directory per engine source.

Why this module exists. numba's on-disk cache (``cache=True``) checks only the file that
defines a function: a kernel that calls into another module keeps its cached machine code
when only that other module changes. ``kernels.mamba_mixer`` inlines ``products``' micro-
kernel, so after a change to ``products.py`` alone (a checkout, a patch) a worker would
run the old product code against panels packed the new way and answer wrong numbers, with
no error. (It happened once in development: panels of 48 columns, a cached 24-column
mixer.) Keying the cache directory by a hash of every engine source makes any change to
any of them start from a cold cache.

:func:`key_numba_cache` must run before the kernels' modules are imported (numba picks a
cache directory when a function is decorated); ``engine/__init__.py`` calls it first.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

#: Engine sources whose code decides the bits of a step (a change to any of them may
#: change outputs, so workers running different versions must not share a session, and
#: their compiled kernels must not be reused).
ENGINE_SOURCES = (
    "kernels.py", "mamba.py", "mamba1.py", "mamba2.py", "numerics.py", "prefill.py",
    "products.py", "weights.py",
)  # fmt: skip


def engine_source_digest() -> str:
    """sha256 of the engine sources, hex."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in ENGINE_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def key_numba_cache() -> Path:
    """Point numba's cache at ``BASE/ssmserve-engine-<digest>`` and return that path.

    BASE is ``$NUMBA_CACHE_DIR`` when set (the Dockerfile sets it; tests set it to get a
    cold cache), else the package's own ``__pycache__``, numba's default place. Where that
    cannot be written numba falls back to its own locations, as before.
    """
    base = os.environ.get("NUMBA_CACHE_DIR") or str(Path(__file__).parent / "__pycache__")
    path = Path(base) / f"ssmserve-engine-{engine_source_digest()[:16]}"
    # numba reads config.CACHE_DIR when a function is decorated; a later reload of its
    # config from the environment does not move caches already chosen.
    numba.config.CACHE_DIR = str(path)
    return path
