"""Getting image and video bytes from where a URL points: http(s) downloads bounded in size and total time, with
the address each connection goes to vetted by the caller, cancellable from another thread; and local files read
through one descriptor that is checked after opening, so a path swapped between check and read cannot escape.
`kind` ("image" or "video") picks the limits: 64 MiB and FOVEA_IMAGE_FETCH_TIMEOUT (5 s, vLLM's default) for
images, FOVEA_MAX_VIDEO_BYTES (256 MiB) and FOVEA_VIDEO_FETCH_TIMEOUT (30 s, vLLM's default) for videos.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import threading
import time
from pathlib import Path

MAX_FETCH_BYTES = {"image": 64 << 20, "video": int(os.environ.get("FOVEA_MAX_VIDEO_BYTES", 256 << 20))}


class ImageTooLarge(ValueError):
    """An image or video over the size limits (bytes or pixels); the server answers 413."""


def fetch_timeout(kind: str) -> float:
    return float(os.environ.get(f"FOVEA_{kind.upper()}_FETCH_TIMEOUT", "30" if kind == "video" else "5"))


def file_url_path(url: str) -> Path:
    """The path a file:// URL names, percent-decoded as Path.as_uri() encodes it (%20 for a space). The server's
    media policy checks this same path, so an encoded `..` cannot slip past it."""
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(url).path))


class Cancellation:
    """Set when nobody wants the downloads any more (the request failed or its client left): callbacks run then,
    such as shutting down a socket that a download is blocked on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: list = []
        self.cancelled = False

    def on_cancel(self, callback) -> None:
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return
        callback()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled, callbacks, self._callbacks = True, self._callbacks, []
        for callback in callbacks:
            callback()


def fetch_url(
    url: str,
    check_url=None,
    check_address=None,
    max_redirects: int = 3,
    deadline: float | None = None,
    cancel: Cancellation | None = None,
    explain: bool = True,
    kind: str = "image",
) -> bytes:
    """Downloads an image (or video), bounded in size and in total time: fetch_timeout(kind) for everything,
    redirects included, unless `deadline` (time.monotonic()) says otherwise. `check_url(url)`
    vets every URL including redirects; `check_address(ip)` vets the address actually connected to, so a host
    that resolves differently the second time (DNS rebinding) is still caught. `explain=False` (the server)
    gives every upstream failure the same message, so that errors cannot be used to probe other hosts."""
    import http.client
    import socket
    from urllib.parse import urljoin, urlparse

    deadline = deadline or time.monotonic() + fetch_timeout(kind)
    cancel = cancel or Cancellation()
    max_bytes = MAX_FETCH_BYTES[kind]

    def failed(why: str) -> ValueError:
        return ValueError(f"could not fetch {kind} {url}" + (f": {why}" if explain else ""))

    for _ in range(max_redirects + 1):
        if check_url is not None:
            check_url(url)
        parsed = urlparse(url)
        connection_class = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        try:
            connection = connection_class(parsed.hostname, parsed.port, timeout=max(deadline - time.monotonic(), 0.001))
        except (ValueError, http.client.HTTPException) as exc:
            raise failed(str(exc)) from None
        # Socket timeouts bound each wait, not the whole: a host that sends a byte a second would hold a download
        # forever. At the deadline a timer shuts the socket, whatever it is doing (connecting, TLS, status line,
        # headers, body); a cancellation does the same.
        sockets: list = []
        connection._create_connection = _guarded_connect(check_address, sockets)
        shut_all = lambda: [_shut(sock, socket) for sock in sockets]  # noqa: E731
        timer = threading.Timer(max(deadline - time.monotonic(), 0.0), shut_all)
        timer.daemon = True
        timer.start()
        cancel.on_cancel(shut_all)
        try:
            connection.request(
                "GET",
                (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else ""),
                headers={"User-Agent": "fovea", "Accept": f"{kind}/*"},
            )
            sock = connection.sock  # the response reads from it; the connection may drop its own reference
            response = connection.getresponse()
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise failed(f"HTTP {response.status}")
            data = bytearray()
            while len(data) <= max_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or cancel.cancelled:
                    raise failed("cancelled" if cancel.cancelled else "timed out")
                sock.settimeout(left)  # each read waits at most until the deadline
                chunk = response.read1(1 << 16)
                if not chunk:
                    if cancel.cancelled or time.monotonic() >= deadline:  # the timer shut it: not the end
                        raise failed("cancelled" if cancel.cancelled else "timed out")
                    if response.length:  # the host closed before the Content-Length it announced
                        raise failed("the connection closed early")
                    break
                data += chunk
        except (OSError, http.client.HTTPException) as exc:
            why = "cancelled" if cancel.cancelled else "timed out" if time.monotonic() >= deadline else str(exc)
            raise failed(why) from None
        finally:
            timer.cancel()
            connection.close()
        if len(data) > max_bytes:
            raise ImageTooLarge(f"{kind} at {url} is larger than {max_bytes >> 20} MiB")
        return bytes(data)
    raise failed(f"more than {max_redirects} redirects")


def _shut(sock, socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it in another thread
    except OSError:
        pass


def _guarded_connect(check_address, sockets: list):
    """http.client's connect, with each address vetted by `check_address` (when given) before connecting, and
    each socket made put in `sockets` (so that a timer can shut it)."""
    import socket

    def connect(address, timeout, source_address=None):
        host, port = address
        last_error: OSError = OSError(f"cannot resolve {host}")
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            if check_address is not None:
                check_address(ipaddress.ip_address(sockaddr[0].split("%")[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                return sock
            except OSError as error:
                sock.close()
                last_error = error
        raise last_error

    return connect


def read_local_file(path: Path, root: Path, kind: str = "image") -> bytes:
    """The bytes of `path`, which must be a regular file below `root`, checked on the opened descriptor (a
    symlink or directory swapped in after a path check cannot lead outside `root`; a FIFO cannot block)."""
    root = root.resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"file:// {kind} URL is outside the folder the server allows (--allowed-local-media-path)")
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise ValueError(f"{kind} file not found or not readable: {path}") from None
    try:
        info = os.fstat(fd)
        link = f"/proc/self/fd/{fd}"  # Linux names the file the descriptor really is
        opened = Path(os.readlink(link)) if os.path.exists(link) else resolved
        if not opened.is_relative_to(root):
            raise ValueError(f"file:// {kind} URL is outside the folder the server allows (--allowed-local-media-path)")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{kind} file is not a regular file: {path}")
        if info.st_size > MAX_FETCH_BYTES[kind]:
            raise ImageTooLarge(f"{kind} file {path} is larger than {MAX_FETCH_BYTES[kind] >> 20} MiB")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(MAX_FETCH_BYTES[kind] + 1)
    finally:
        os.close(fd)
