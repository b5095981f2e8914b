"""Checks made before a request reaches its route, as plain ASGI middleware (Starlette's BaseHTTPMiddleware would
hide client disconnects from the routes): where a browser's request comes from, the API key, and the body's
limits."""

from __future__ import annotations

import hmac
import json
import os
import uuid

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


def _host_name(host: str) -> str:
    """A Host header's name, without its port ([::1]:8000 -> [::1])."""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") and "]:" in host else host


class SiteCheck:
    """What keeps a web page the operator opens from driving the server (it can send requests a browser makes
    without asking: form posts, text/plain bodies, pages that rebind their name to 127.0.0.1):
    - a request with an `Origin` other than the server's own is refused (403) unless `allowed_origins` holds it
      (--allowed-origins; "*" allows any, vLLM's default);
    - a body is JSON only (415 otherwise): a text/plain POST needs no CORS preflight;
    - `local_names`: the server listens on a loopback address, so a Host of another name is a page that rebound
      its name to this machine (403)."""

    def __init__(self, app, allowed_origins: frozenset[str] = frozenset(), local_names: frozenset[str] | None = None):
        self.app = app
        self.allowed_origins, self.local_names = allowed_origins, local_names

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if self.local_names is not None and _host_name(host) not in self.local_names:
            why = f"Host {host!r} is not this machine: the server listens on a loopback address (--host)"
            return await send_error(send, 403, why, "PermissionDeniedError")
        origin = headers.get(b"origin", b"").decode("latin-1").lower()
        if origin and origin.split("://", 1)[-1] != host and not {"*", origin} & self.allowed_origins:
            why = f"requests from web pages of {origin} are refused (--allowed-origins lists those allowed)"
            return await send_error(send, 403, why, "PermissionDeniedError")
        declared = headers.get(b"content-length", b"0")
        has_body = declared not in (b"", b"0") or b"transfer-encoding" in headers
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if has_body and media_type != b"application/json" and not media_type.endswith(b"+json"):
            why = "request bodies must be JSON, sent with Content-Type: application/json"
            return await send_error(send, 415, why, "UnsupportedMediaTypeError")
        return await self.app(scope, receive, send)


def route_path(scope) -> str:
    """The path the router matches, as Starlette finds it: uvicorn puts --root-path into scope["path"], and the
    router takes it off again (a path outside the root path is matched whole)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class APIKeyCheck:
    """With a key set, every route but the `public` ones (health, version, metrics, the playground's page and
    files) wants `Authorization: Bearer KEY` (401 otherwise): a route added later is protected unless named here.
    Decided on the path the router will match, whatever the root path. The key is compared in constant time."""

    def __init__(self, app, api_key: str | None, public: frozenset[str] = frozenset()):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.public = public

    async def __call__(self, scope, receive, send):
        if (
            self.expected
            and scope["type"] in ("http", "websocket")
            and route_path(scope) not in self.public
            and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected)
        ):
            return await send_error(send, 401, "invalid or missing API key", "AuthenticationError")
        return await self.app(scope, receive, send)


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own (a header value
    already, so no CR or LF) or a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        return await self.app(scope, receive, send_with_id)


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
