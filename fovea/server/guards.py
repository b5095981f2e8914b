"""Checks made before a request reaches its route, as plain ASGI middleware (Starlette's BaseHTTPMiddleware would
hide client disconnects from the routes): the API key, and the body size limit."""

from __future__ import annotations

import hmac
import json

from fovea.server.protocol import error_body


class BodyTooLarge(Exception):
    pass


async def send_error(send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize")  # /tokenize fetches images and runs the template too


class APIKeyCheck:
    """With a key set, every /v1 route and /tokenize, /detokenize want `Authorization: Bearer KEY` (401
    otherwise). The key is compared in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected and scope["type"] == "http" and scope["path"].startswith(PROTECTED_PATHS) \
                and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected):
            return await send_error(send, 401, "invalid or missing API key", "AuthenticationError")
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware. Once a chunked body crosses the limit, whatever the app answers is replaced by the 413."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received = 0
        over = False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            if not over:
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            pass
        if over:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                         "RequestEntityTooLargeError")
