"""OpenAI-shaped errors: every failure the client sees is
{"error": {"message", "type", "param", "code"}} with a fitting status, never a
stack trace."""

from __future__ import annotations

from starlette.responses import JSONResponse

from pagoda.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into an error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unsupported(feature: str, param: str | None = None) -> APIError:
    """What Pagoda cannot do yet is refused, never silently ignored."""
    return APIError(f"{feature} is not supported by Pagoda yet", param=param, code="unsupported")


def from_validation_error(exc) -> APIError:
    """A pydantic ValidationError as a 400 naming the first offending field."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return unsupported(f"the field {loc!r}", param=loc)
    message = err.get("msg", "invalid value")
    # pydantic wraps ValueErrors raised by our validators: keep only our text.
    message = message.removeprefix("Value error, ")
    return APIError(f"{loc}: {message}" if loc else message, param=loc or None)
