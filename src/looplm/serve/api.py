"""The HTTP API's request bodies (pydantic, OpenAI's completion and chat shapes) and its errors in
OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

# --- errors in OpenAI's shape ----------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# A request body larger than this gets 413 (`looplm serve --max-body-bytes`). 1 MiB holds a prompt of any context the
# server allows (a 32k-token prompt is about 150 KB of text, or about 250 KB as a list of token ids).
MAX_BODY_BYTES = 1 << 20


def body_too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes; this server accepts at most {limit} bytes: send a shorter prompt "
        "(or fewer messages), or start the server with a larger --max-body-bytes",
        code="request_too_large",
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised while a request body is read once it passes the limit; the app answers with ``error``."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


# Union-typed fields give one pydantic error per alternative; say what is accepted instead.
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list with one string, or a list of token ids",
    "stop": "stop must be a string or a list of up to 4 strings",
    "content": 'message content must be a string or a list of {"type": "text", "text": ...} parts',
}


def validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('msg')})", code="invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {err.get('msg')}")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter {loc[-1]!r}", param=loc[-1], code="unsupported_parameter")
    # the first name in loc that is a field (not a union alternative like 'list[int]' or an index)
    field = next((x for x in reversed(loc) if x in _UNION_MESSAGES), None)
    if field:
        return APIError(400, _UNION_MESSAGES[field], param=field)
    param = loc[0] if len(loc) == 1 else ".".join(loc)
    return APIError(400, f"{param}: {err.get('msg')}", param=loc[0])


# --- request bodies ------------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "5" is not a number and 1.0 is not a whole number; extra="forbid": a misspelt or
    # unsupported parameter is an error rather than silently ignored
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # looplm extras (extra_body in the openai client)
    top_k: int = Field(0, ge=0, le=2**31)
    full_depth: bool = False  # run every loop for every token: no early exit for this request
    ignore_eos: bool = False  # keep going to max_tokens (load tests)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


def check_unsupported(body: _Body) -> None:
    """Parameters we accept only at their no-op value (clients often send the defaults)."""
    checks = [
        ("n", body.n == 1, "n > 1 is not supported; send one request per completion"),
        ("presence_penalty", body.presence_penalty == 0, "presence_penalty is not supported (use 0)"),
        ("frequency_penalty", body.frequency_penalty == 0, "frequency_penalty is not supported (use 0)"),
        ("logit_bias", not body.logit_bias, "logit_bias is not supported"),
    ]
    if isinstance(body, CompletionBody):
        checks += [
            ("echo", not body.echo, "echo is not supported"),
            ("logprobs", body.logprobs is None, "logprobs are not supported"),
            ("best_of", body.best_of in (None, 1), "best_of > 1 is not supported"),
            ("suffix", body.suffix is None, "suffix is not supported"),
        ]
    else:
        checks += [
            ("logprobs", not body.logprobs, "logprobs are not supported"),
            ("top_logprobs", body.top_logprobs is None, "top_logprobs are not supported"),
        ]
    for param, ok, msg in checks:
        if not ok:
            raise APIError(400, msg, param=param, code="unsupported_parameter")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise APIError(400, "stop takes at most 4 strings", param="stop")
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        extra = set(body.stream_options) - {"include_usage"}
        if extra or not isinstance(body.stream_options.get("include_usage", False), bool):
            raise APIError(400, "stream_options takes only include_usage (a boolean)", param="stream_options")
