"""How the ``ssmserve`` CLI tells a failure: one line, the gRPC code, what to do.

``CliError`` is a failure of the command itself (a bad file, a flag, an output path that
cannot be written); its message is printed as it is. An error a worker answered is
printed as ``CODE (REASON): message``, with a hint when the message alone does not say
what to do next. Anything else is a bug, still told in one line. Imports nothing heavy
at module level: the CLI loads it before it knows whether a command needs gRPC.
"""

from __future__ import annotations


class CliError(Exception):
    """A user-facing failure of the CLI itself (bad file, bad flag, refused overwrite)."""


def describe(exc: BaseException) -> str:
    """The one line (without the ``ssmserve: error:`` prefix) that tells ``exc``."""
    if isinstance(exc, CliError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    from ssmserve.client.tls import TlsConfigError

    if isinstance(exc, TlsConfigError):
        return str(exc)
    import grpc

    from ssmserve.client.errors import SsmserveClientError, from_rpc_error

    if isinstance(exc, grpc.RpcError):
        exc = from_rpc_error(exc)
    if isinstance(exc, SsmserveClientError):
        return rpc_failure(exc)
    return (
        f"unexpected {type(exc).__name__}: {exc} (a bug in ssmserve; please report it with "
        "the output of the same command run with SSMSERVE_DEBUG=1)"
    )


def rpc_failure(exc: BaseException) -> str:
    """``CODE (REASON): message`` of a worker's error, plus what to do when the message
    does not say."""
    import grpc

    from ssmserve.client.errors import ServerUnreachable, SsmserveClientError

    assert isinstance(exc, SsmserveClientError)
    reason = f" ({exc.reason})" if exc.reason else ""
    hint = ""
    code = exc.code
    if isinstance(exc, ServerUnreachable):
        hint = " (the server comes from --server HOST[:PORT] or SSMSERVE_SERVER)"
    elif code == grpc.StatusCode.NOT_FOUND and exc.reason == "SESSION_MISSING":
        hint = "; `ssmserve session list` shows the sessions there are"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = "; give the CLI a token: --token TOKEN or SSMSERVE_TOKEN"
    elif code == grpc.StatusCode.PERMISSION_DENIED:
        hint = "; use a token whose role allows it (ssmserve auth token --role ...)"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        hint = "; the worker did not answer in time: retry, or look at it with `ssmserve workers`"
    elif code == grpc.StatusCode.UNAVAILABLE and not exc.reason:
        hint = "; no worker answered in time: retry once one is back (`ssmserve workers`)"
    return f"{code.name}{reason}: {exc}{hint}"
