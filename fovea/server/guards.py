"""Checks made before a request reaches its route, as plain ASGI middleware (Starlette's BaseHTTPMiddleware would
hide client disconnects from the routes): the API key, and the body's limits."""

from __future__ import annotations

import hmac
import json
import os

from fovea.server.protocol import error_body


class BodyTooLarge(Exception):
    pass


async def send_error(send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


# /tokenize fetches images and runs the template too; the playground's settings are the server's sampling defaults
PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize", "/playground/settings")


class APIKeyCheck:
    """With a key set, every /v1 route and /tokenize, /detokenize, /playground/settings want `Authorization: Bearer KEY` (401
    otherwise). The key is compared in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if (
            self.expected
            and scope["type"] == "http"
            and scope["path"].startswith(PROTECTED_PATHS)
            and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected)
        ):
            return await send_error(send, 401, "invalid or missing API key", "AuthenticationError")
        return await self.app(scope, receive, send)


# JSON parsing holds the GIL whichever thread runs it: a 60 MB body of two million small objects kept every
# other client waiting 1.6 s. Objects and arrays are counted by their opening characters as the body arrives
# (ones inside strings count too: an upper bound); 100,000 parse in about 0.1 s.
MAX_BODY_OBJECTS = int(os.environ.get("FOVEA_MAX_BODY_OBJECTS", "100000"))


class BodyLimit:
    """ASGI middleware: at most `max_bytes` bytes and `max_objects` JSON objects and arrays. Once a chunked body
    crosses a limit, whatever the app answers is replaced by the 413."""

    def __init__(self, app, max_bytes: int, max_objects: int = MAX_BODY_OBJECTS):
        self.app = app
        self.max_bytes, self.max_objects = max_bytes, max_objects

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, f"the request body is larger than {self.max_bytes} bytes")
        received = objects = 0
        over = None  # why the body was refused
        more = True

        async def counting_receive():
            nonlocal received, objects, over, more
            message = await receive()
            if message["type"] == "http.request":
                more = message.get("more_body", False)
                chunk = message.get("body", b"")
                received += len(chunk)
                objects += chunk.count(b"{") + chunk.count(b"[")
                if received > self.max_bytes:
                    over = f"the request body is larger than {self.max_bytes} bytes"
                elif objects > self.max_objects:
                    over = (
                        f"the request body holds more than {self.max_objects} JSON objects and arrays "
                        "(FOVEA_MAX_BODY_OBJECTS; '{' and '[' inside strings count too)"
                    )
                if over:
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
            # a body within the byte limit is read to its end (not parsed), so that the client hears the 413
            # instead of a connection reset mid-upload
            while more and received <= self.max_bytes:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
                received += len(message.get("body", b""))
            await self._refuse(send, over)

    async def _refuse(self, send, why: str) -> None:
        await send_error(send, 413, why, "RequestEntityTooLargeError")
