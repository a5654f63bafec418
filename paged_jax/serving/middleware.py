"""The server's ASGI middleware, which answers before a request reaches FastAPI: the API key's check
and the request body's size limit."""

import hmac

from fastapi.responses import JSONResponse

from paged_jax.serving.openai_serving import APIError


class ApiKey:
    """Refuses requests without `Authorization: Bearer <key>` with 401, except on the open paths."""

    OPEN = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                      "/redoc"})

    def __init__(self, app, key: str, on_reject, passed: frozenset = frozenset()):
        """passed: more paths let through, which check the key themselves (the dashboard takes it from
        a query parameter or cookie too: a browser's EventSource cannot send the header)."""
        self.app, self.key, self.on_reject = app, key.encode(), on_reject
        self.passed = self.OPEN | passed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.passed:
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        self.on_reject()
        error = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


class BodyLimit:
    """Refuses bodies over max_bytes with 413, before anything parses them (a declared Content-Length
    is refused unread; a chunked body is read up to the limit)."""

    def __init__(self, app, max_bytes: int, on_reject):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        self.on_reject()
        error = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                         code="request_too_large")
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)
