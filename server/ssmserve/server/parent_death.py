"""Child processes that end with their parent: no orphan outlives a killed owner.

A worker's redis-server and the ``--workers`` supervisor's workers are started with
:func:`terminate_with_parent` as their ``preexec_fn``: on Linux the kernel sends the
child SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``), also when
the parent is killed with SIGKILL. Start such children from a thread that lives as long
as the process (the event loop's), never from a helper thread that may end first.
Elsewhere nothing is set up and a killed parent leaves its children running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def terminate_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (None where it cannot work). It runs
    between fork and exec: one prctl call through a function looked up beforehand and a
    check that the parent still lives, nothing that could wait on a lock."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sigterm = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: go with it
            os.kill(os.getpid(), sigterm)

    return preexec
