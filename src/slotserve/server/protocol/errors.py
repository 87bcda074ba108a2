"""OpenAI's error body and the APIError that carries it to the HTTP answer."""

from __future__ import annotations

from pydantic import BaseModel

from slotserve.sampling import SamplingParams


class APIError(Exception):
    """An error answered with OpenAI's error body: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo



def invalid_request(message: str, renames: dict[str, str] | None = None) -> APIError:
    """A 400 from a ValueError whose message starts with the field name (SamplingParams')."""
    first = message.split(" ", 1)[0].rstrip(":")
    known = set(SamplingParams.__dataclass_fields__) | {"prompt"}
    first = first if first in known else first.split(".", 1)[0]  # "structured_outputs.json"
    param = first if first in known else None
    if param is not None and renames and param in renames:
        param = renames[param]
        message = f"{param} {message.split(' ', 1)[1]}" if " " in message else message
    return APIError(message, param=param)

