"""``ssmserve-server``: runs one worker.

The gRPC worker (sessions, Redis checkpoints, rollback) is built by the service issue;
until then this entry point says so and exits with code 2 rather than pretending to serve.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    print(
        "ssmserve-server: the gRPC worker is not built yet (it lands with the service issue); "
        "use 'ssmserve model run' to step a model offline",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
