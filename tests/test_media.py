"""Image URLs under the server's media policy: downloads, redirects, and the private-address rule applied to the
address actually connected to."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading

import numpy as np
import pytest
from conftest import jpeg_bytes, random_image
from serving import drip_host

from fovea.multimodal.image import load_image
from fovea.server.media import MediaPolicy
from fovea.server.media import fetch_media as fetch_media_async


def fetch_media(*args, **kwargs):
    return asyncio.run(fetch_media_async(*args, **kwargs))


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
    return [
        {
            "role": "user",
            "content": [
                *({"type": "image_url", "image_url": {"url": u}} for u in urls),
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]


def test_load_image_fetches_http_urls(image_host):
    url = f"http://127.0.0.1:{image_host}"
    assert np.array_equal(np.asarray(load_image(url + "/cat.jpg")), np.asarray(load_image(PICTURE)))
    assert np.array_equal(np.asarray(load_image(url + "/again")), np.asarray(load_image(PICTURE)))
    with pytest.raises(ValueError, match="HTTP 404"):
        load_image(url + "/missing.jpg")


def test_private_addresses_are_refused_where_the_connection_goes(image_host, names_resolve_to_loopback):
    with pytest.raises(ValueError, match="non-public address"):
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
        fetch_media(chat(data_url, data_url), policy, {"image": 1})


@pytest.mark.parametrize(
    "address,public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("2002:808:808::", True),
        ("64:ff9b::808:808", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("100.100.100.200", False),
        ("198.18.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:7f00:1::", False),
        ("2002:a00:1::", False),
        ("64:ff9b::a9fe:a9fe", False),
        ("fc00::1", False),
        ("fe80::1", False),
        ("::a00:1", False),
        ("64:ff9b:1::a00:1", False),
        ("64:ff9b:1::808:808", False),
        ("::ffff:0:a00:1", False),
        ("::ffff:0:808:808", True),
        ("::808:808", True),
        ("fec0::1", False),
        ("::", False),
        ("2001::1", False),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),
        ("2001:db8::1", False),
        ("3fff::1", False),
        ("ff02::1", False),
        ("ff0e::1", False),
        ("2002:c0a8:101::", False),
        ("64:ff9b::7f00:1", False),
        ("2001:4860:4860::8888", True),
        ("2a00:1450:4001:82a::200e", True),
        ("192.168.1.1", False),
        ("172.16.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),
        ("1.1.1.1", True),
        ("::ffff:192.168.0.1", False),
    ],
)
def test_only_public_addresses_pass(address, public):
    """Carrier-grade NAT (Alibaba Cloud's metadata service sits at 100.100.100.200) and IPv6 forms that carry a
    private IPv4 address (mapped, SIIT, IPv4-compatible, NAT64, 6to4) are refused like the private ranges
    themselves; so are local-use NAT64, site-local and IPv6 blocks without internet hosts (Teredo,
    documentation). The rules do not depend on the Python version's address tables."""
    import ipaddress

    from fovea.server.media import check_address

    if public:
        check_address(ipaddress.ip_address(address))
    else:
        with pytest.raises(ValueError, match="non-public address"):
            check_address(ipaddress.ip_address(address))


@pytest.fixture
def slow_host():
    with drip_host(0.2) as (url, closed):
        yield int(url.rsplit(":", 1)[1]), closed


@pytest.mark.parametrize("kind", ["image", "video"])
def test_the_deadline_bounds_headers_too(kind, monkeypatch):
    """A host that sends its status line and then drips header bytes forever: the download still ends at the
    deadline (every read on its own would wait a second at most), for images and videos alike."""
    import time

    from fovea.multimodal.fetch import fetch_url

    monkeypatch.setenv(f"FOVEA_{kind.upper()}_FETCH_TIMEOUT", "1.5")
    with drip_host(0.2, headers=True) as (url, closed):
        start = time.monotonic()
        with pytest.raises(ValueError, match="timed out"):
            fetch_url(url + "/a", kind=kind)
        assert time.monotonic() - start < 3
        assert closed.wait(5)  # the connection was shut, not left dripping


def test_downloads_have_one_deadline_and_stop_when_cancelled(slow_host, monkeypatch):
    import time

    port, closed = slow_host
    monkeypatch.setenv("FOVEA_IMAGE_FETCH_TIMEOUT", "1")
    policy = MediaPolicy(allowed_media_domains=["127.0.0.1"])
    start = time.monotonic()
    with pytest.raises(ValueError, match="could not fetch image"):  # bytes keep coming: no read ever times out
        fetch_media(chat(f"http://127.0.0.1:{port}/a.jpg", f"http://127.0.0.1:{port}/b.jpg"), policy)
    assert time.monotonic() - start < 3  # one deadline for all of them, not 1 s per read or per image

    monkeypatch.setenv("FOVEA_IMAGE_FETCH_TIMEOUT", "60")
    closed.clear()

    async def client_leaves():
        task = asyncio.ensure_future(fetch_media_async(chat(f"http://127.0.0.1:{port}/c.jpg"), policy))
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    start = time.monotonic()
    asyncio.run(client_leaves())
    assert closed.wait(5) and time.monotonic() - start < 5  # the download was cut, not left to run 60 s


def test_upstream_failures_all_read_the_same(image_host):
    """The server's messages do not tell a missing file from a closed port (or any other upstream state)."""
    policy = MediaPolicy(allowed_media_domains=["127.0.0.1"])
    closed_port = socket.socket()
    closed_port.bind(("127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{image_host}/missing.jpg", f"http://127.0.0.1:{closed_port.getsockname()[1]}/a.jpg"]
    messages = []
    for url in urls:
        with pytest.raises(ValueError) as error:
            fetch_media(chat(url), policy)
        messages.append(str(error.value).replace(url, "URL"))
    closed_port.close()
    assert messages == ["could not fetch image URL"] * 2


def test_local_files_cannot_escape_by_swapping_a_path(tmp_path, monkeypatch):
    """The path is checked, then a directory on it is swapped for a symlink to outside before the open: the
    check on the opened descriptor refuses it (the old check-then-open read the outside file)."""
    import os

    from fovea.multimodal.fetch import read_local_file

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "dir").mkdir(parents=True)
    outside.mkdir()
    (root / "dir" / "cat.jpg").write_bytes(PICTURE)
    (outside / "cat.jpg").write_bytes(b"secret")
    assert read_local_file(root / "dir" / "cat.jpg", root) == PICTURE
    real_open = os.open

    def swapped_open(path, *args, **kwargs):
        (root / "dir").rename(root / "old")
        (root / "dir").symlink_to(outside)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapped_open)
    with pytest.raises(ValueError, match="outside the folder the server allows"):
        read_local_file(root / "dir" / "cat.jpg", root)
    monkeypatch.undo()
    fifo = root / "pipe.jpg"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):  # opening it does not block
        read_local_file(fifo, root)
