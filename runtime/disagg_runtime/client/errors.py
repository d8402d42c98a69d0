"""How a request fails, as the client's caller sees it (a gateway maps each to a status)."""

from __future__ import annotations

from disagg_runtime.relay.errors import NeverFits, Overloaded

TOO_LARGE = "too_large"  # RequestFailed.error["reason"] of a payload no pool can hold


class RequestFailed(RuntimeError):
    """A role failed the request; `role` and `error` say where and why."""

    def __init__(self, message: str, *, role: str = "", error: dict[str, str] | None = None):
        super().__init__(message)
        self.role = role
        self.error = error or {}


class RequestTimeout(RequestFailed, TimeoutError):
    """No complete result before the request's deadline; the request was aborted."""


class RequestOverloaded(RequestFailed):
    """A role refused the request at once: too many requests were waiting for its workers
    (a gateway answers 429 or 503; retrying later may succeed)."""


class UploadExpired(RequestFailed):
    """An upload's bytes were not all in, or its request not started, by its deadline: it
    was cut and its slot freed. The source was too slow (a gateway answers 408), whichever
    side noticed first: the caller's deadline for the bytes, or the upload thread's own."""


def failed(what: str, exc: BaseException) -> RequestFailed:
    """A request that a relay could not submit; one that can never fit says so (reason
    `too_large`: a gateway answers 413, not a retryable 503), and one the entry role's
    ingress had no room to queue is RequestOverloaded (reason `overloaded`: 429)."""
    if isinstance(exc, Overloaded):
        return RequestOverloaded(f"{what}: {exc}", error={"reason": "overloaded"})
    error = {"reason": TOO_LARGE} if isinstance(exc, NeverFits) else None
    return RequestFailed(f"{what}: {exc}", error=error)


FAILURES = {"timeout": RequestTimeout, "overloaded": RequestOverloaded}  # by error reason
