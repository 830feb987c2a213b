"""What a session id may be (:func:`check_session_id`): as a client gives it, and as
stored."""

from __future__ import annotations

import re

from ssmserve.server.errors import SsmserveError, clip

#: A session id as a client gives it: safe in key names (no braces, which would break the
#: hash tag) and URLs.
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A stored id: the client's id, behind its tenant and '~' when it has one
#: (``api.tenancy``), so tenants' ids never meet.
STORED_ID_PATTERN = re.compile(
    r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,63}~)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
)


class BadSessionIdError(SsmserveError):
    """A session id that is not 1-128 letters, digits, '.', '_' or '-'."""


def check_session_id(session_id: str, stored: bool = False) -> str:
    """``session_id`` if it is a valid client id (``stored``: a valid stored id)."""
    if not (STORED_ID_PATTERN if stored else SESSION_ID_PATTERN).fullmatch(session_id):
        raise BadSessionIdError(
            f"session id {clip(session_id)} is invalid: use 1-128 letters, digits, '.', "
            f"'_' or '-', starting with a letter or digit"
        )
    return session_id
