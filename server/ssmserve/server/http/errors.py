"""Errors at the HTTP door, in the OpenAI API's shape.

Every refusal is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status OpenAI uses for it (the ``openai`` package turns each status into its own
exception class: 400 ``BadRequestError``, 401 ``AuthenticationError``, 403
``PermissionDeniedError``, 404 ``NotFoundError``, 413/422 ``APIStatusError``, 429
``RateLimitError``, 5xx ``InternalServerError``). A typed error from inside
(:class:`~ssmserve.server.errors.SsmserveError`) maps by its kind, its message kept (the
caller's tenant prefix taken out, as the gRPC edge does); a bug is a 500 that says no
more than that it happened.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ssmserve.server.errors import ErrorKind, SsmserveError

log = logging.getLogger(__name__)

#: An error kind's HTTP status and OpenAI error type.
HTTP_STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.ALREADY_EXISTS: (409, "invalid_request_error"),
    ErrorKind.FAILED_PRECONDITION: (400, "invalid_request_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DATA_LOSS: (500, "server_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


@dataclass
class HttpError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> str:
        return json.dumps(self.body())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param, code)


def from_error(error: SsmserveError, clean_text: str | None = None) -> HttpError:
    """The HTTP refusal of a typed error (``clean_text``: its message as the caller may
    read it)."""
    status, kind = HTTP_STATUS[error.kind]
    return HttpError(status, clean_text if clean_text is not None else str(error), kind, None,
                     error.reason.lower())  # fmt: skip


def internal(exc: BaseException) -> HttpError:
    """A bug: logged with its traceback; the client learns only that it happened."""
    log.error("http: internal error", exc_info=exc)
    return HttpError(500, f"internal error ({type(exc).__name__})", "server_error", None, None)
