"""The OpenAI API's refusals: APIError (an HTTP status and OpenAI's error body), and the mapping of
the engine's own refusals (RequestError) and failures onto it."""

from paged_jax.core.errors import RequestError
from paged_jax.serving.loop_commands import EngineStepError
from paged_jax.serving.openai_protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An answer other than 200: the HTTP status and OpenAI's error body. `cause` names the reason in the
    rejected-requests metric (None: not counted as a rejection)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, cause: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.cause, self.headers = cause, headers or {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.response().model_dump()


def bad_request(message: str, param: str | None = None, *, cause: str = "bad_params",
                code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code, cause=cause)


def refused(error: RequestError) -> APIError:
    """The 400 for a request the engine's checks refused."""
    too_long = error.code == "context_length_exceeded"
    return bad_request(str(error), error.param, cause="too_long" if too_long else "bad_params", code=error.code)


def engine_error(error: EngineStepError) -> APIError:
    return APIError(500, str(error), type="server_error", code="engine_error")
