"""HTTP errors in OpenAI's shape, and the node's failure kinds as HTTP statuses."""

from __future__ import annotations

from statebridge.errors import FailureKind

__all__ = ["ApiError", "bad", "node_error", "KIND_STATUS"]


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, outcome: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.retry_after = retry_after
        self.outcome = outcome or {400: "invalid_request", 401: "unauthorized",
                                   404: "invalid_request", 408: "timeout",
                                   413: "too_large", 429: "rate_limited"}.get(
            status, "unavailable" if status in (503, 504) else "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse

        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


#: A failed request's kind at the node -> (HTTP status, error type, Retry-After seconds).
KIND_STATUS = {
    FailureKind.INVALID_REQUEST: (400, "invalid_request_error", None),
    FailureKind.NOT_READY: (503, "service_unavailable_error", 2.0),
    FailureKind.BUSY: (429, "rate_limit_error", 1.0),
    FailureKind.CACHE_FULL: (429, "rate_limit_error", 1.0),
    FailureKind.TIMEOUT: (504, "timeout_error", None),
    FailureKind.PEER_LOST: (503, "service_unavailable_error", 1.0),
    FailureKind.TRANSFER_ERROR: (503, "service_unavailable_error", 1.0),
    FailureKind.ABORTED: (503, "service_unavailable_error", 1.0),
    FailureKind.CLOSED: (503, "service_unavailable_error", 1.0),
    FailureKind.INTERNAL: (500, "server_error", None),
}


def node_error(kind: str, message: str) -> ApiError:
    try:
        status, type_, retry = KIND_STATUS[FailureKind.parse(kind)]
    except Exception:
        status, type_, retry = 503, "service_unavailable_error", 1.0
    return ApiError(status, message, type_, code=str(kind), retry_after=retry)
