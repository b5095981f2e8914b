"""Image URLs under the server's media policy: downloads, redirects, and the private-address rule applied to the
address actually connected to."""

from __future__ import annotations

import http.server
import socket
import threading

import numpy as np
import pytest

from conftest import jpeg_bytes, random_image
from fovea.multimodal.image import load_image
from fovea.server.media import MediaPolicy, fetch_media

PICTURE = jpeg_bytes(random_image(90, 60, 3))


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /cat.jpg, /again (redirects to /cat.jpg), /away (redirects to another host)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            port = self.server.server_address[1]
            targets = {"/again": "/cat.jpg", "/away": f"http://elsewhere.test:{port}/cat.jpg"}
            if self.path in targets:
                self.send_response(302)
                self.send_header("Location", targets[self.path])
                self.end_headers()
            elif self.path == "/cat.jpg":
                self.send_response(200)
                self.send_header("Content-Length", str(len(PICTURE)))
                self.end_headers()
                self.wfile.write(PICTURE)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def names_resolve_to_loopback(monkeypatch):
    """Every *.test name resolves to 127.0.0.1, as a rebinding attacker's DNS would answer at fetch time."""
    real = socket.getaddrinfo

    def fake(host, *args, **kwargs):
        return real("127.0.0.1" if str(host).endswith(".test") else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def chat(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": "What is it?"}]}]


def test_load_image_fetches_http_urls(image_host):
    url = f"http://127.0.0.1:{image_host}"
    assert np.array_equal(np.asarray(load_image(url + "/cat.jpg")), np.asarray(load_image(PICTURE)))
    assert np.array_equal(np.asarray(load_image(url + "/again")), np.asarray(load_image(PICTURE)))
    with pytest.raises(ValueError, match="HTTP 404"):
        load_image(url + "/missing.jpg")


def test_private_addresses_are_refused_where_the_connection_goes(image_host, names_resolve_to_loopback):
    with pytest.raises(ValueError, match=r"non-public address \(127.0.0.1\)"):
        fetch_media(chat(f"http://images.test:{image_host}/cat.jpg"), MediaPolicy())
    with pytest.raises(ValueError, match="non-public address"):
        fetch_media(chat(f"http://[::1]:{image_host}/cat.jpg"), MediaPolicy())


def test_allowed_domains_may_be_private_and_bind_redirects_too(image_host, names_resolve_to_loopback):
    policy = MediaPolicy(allowed_media_domains=["images.test"])
    data_url = "data:image/jpeg;base64,AAAA"
    messages = chat(f"http://images.test:{image_host}/again", data_url)
    fetched = fetch_media(messages, policy)
    assert fetched[0]["content"][0] == {"type": "image", "image": PICTURE}
    assert fetched[0]["content"][1:] == messages[0]["content"][1:]  # data URLs and text untouched
    with pytest.raises(ValueError, match="elsewhere.test is not in --allowed-media-domains"):
        fetch_media(chat(f"http://images.test:{image_host}/away"), policy)
    with pytest.raises(ValueError, match="limit_mm_per_prompt allows 1"):
        fetch_media(chat(data_url, data_url), policy, max_images=1)
