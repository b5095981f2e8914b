"""Which image URLs a server request may use: data URLs always; http(s) only to public addresses (and only the
--allowed-media-domains when given); file:// only below --allowed-local-media-path. Checked before any fetch."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


@dataclass
class MediaPolicy:
    allowed_local_media_path: Path | None = None
    allowed_media_domains: list[str] = field(default_factory=list)
    allow_private_addresses: bool = False  # loopback/private/link-local hosts: refused unless set


def check_media(messages: list[dict], policy: MediaPolicy) -> None:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                check_url(url, policy)
            elif isinstance(part, dict) and part.get("type") not in ("text", None):
                raise ValueError(f"unsupported content part type {part.get('type')!r}; use text or image_url")


def check_url(url, policy: MediaPolicy) -> None:
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        return
    parsed = urlparse(url)
    if parsed.scheme == "file":
        root = policy.allowed_local_media_path
        if root is None:
            raise ValueError("file:// image URLs are disabled; start the server with --allowed-local-media-path")
        path = Path(parsed.path).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"file:// image URLs must be under {root}")
        return
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("image_url.url must be a data:, http(s):// or file:// URL")
    host = parsed.hostname.lower()
    if policy.allowed_media_domains and host not in policy.allowed_media_domains:
        raise ValueError(f"image host {host} is not in --allowed-media-domains")
    if policy.allow_private_addresses:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise ValueError(f"cannot resolve image host {host}") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_reserved or ip.is_unspecified:
            raise ValueError(f"image host {host} resolves to a non-public address ({ip}); refused")
