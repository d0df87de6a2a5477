"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

from mlxformer.server.protocol import ErrorDetail, ErrorResponse


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self, message: str, status: int = 400, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as a plain dict."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(message, 400, "invalid_request_error", param, code)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter from pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = location[0] if location else None  # the request field (not the path inside it)
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    message = first.get("msg", "invalid value")
    where = ".".join(location)
    return (f"{where}: {message}" if where else message), param
