"""RequestError: the one error a refused request raises, wherever the check that refused it lives."""


class RequestError(ValueError):
    """A request the engine will not run, and why.

    param: the request's field at fault, as OpenAI's error body names it ("prompt", "temperature");
    code: OpenAI's error code ("invalid_value", or "context_length_exceeded" for a prompt too long).
    A ValueError, so callers that caught the engine's ValueErrors still do.
    """

    def __init__(self, message: str, param: str | None = None, *, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code
