"""Which images a server request may use, and fetching the remote ones under those rules.

data: URLs always; file:// only below --allowed-local-media-path; http(s) only from --allowed-media-domains when
given, and never from loopback/private/link-local addresses unless the host is named there. The address rule is
applied to the address each connection actually goes to (redirects included), so a name that resolves to a
public address when checked and to a private one when fetched (DNS rebinding) is still refused.
Runs in the front end's worker threads: the engine only ever sees downloaded bytes.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from fovea.multimodal.image import fetch_url, file_url_path


@dataclass
class MediaPolicy:
    allowed_local_media_path: Path | None = None
    allowed_media_domains: list[str] = field(default_factory=list)  # when set, the only hosts; may be private


def image_urls(messages: list[dict]) -> list[tuple[dict, str]]:
    """(part, url) of every image_url part; other unknown part types are refused here."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                found.append((part, url.get("url") if isinstance(url, dict) else url))
            elif isinstance(part, dict) and part.get("type") not in ("text", None):
                raise ValueError(f"unsupported content part type {part.get('type')!r}; use text or image_url")
    return found


def fetch_media(messages: list[dict], policy: MediaPolicy, max_images: int | None = None) -> list[dict]:
    """`messages` with every http(s) image downloaded (as bytes); raises ValueError for a refused URL."""
    found = image_urls(messages)
    if max_images is not None and len(found) > max_images:
        raise ValueError(f"the prompt has {len(found)} images but limit_mm_per_prompt allows {max_images}")
    for _, url in found:
        check_url(url, policy)
    downloaded = {id(part): fetch_url(url, functools.partial(check_url, policy=policy),
                                      None if explicitly_allowed(url, policy) else check_address)
                  for part, url in found if url.startswith(("http://", "https://"))}
    if not downloaded:
        return messages
    return [{**message, "content": [{"type": "image", "image": downloaded[id(part)]} if id(part) in downloaded
                                    else part for part in message["content"]]}
            if isinstance(message.get("content"), list) else message for message in messages]


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
        if not file_url_path(url).resolve().is_relative_to(root.resolve()):
            raise ValueError(f"file:// image URLs must be under {root}")
        return
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("image_url.url must be a data:, http(s):// or file:// URL")
    host = parsed.hostname.lower()
    if policy.allowed_media_domains and host not in policy.allowed_media_domains:
        raise ValueError(f"image host {host} is not in --allowed-media-domains")


def explicitly_allowed(url: str, policy: MediaPolicy) -> bool:
    """A host named in --allowed-media-domains may be on a private network (an internal image store)."""
    return (urlparse(url).hostname or "").lower() in policy.allowed_media_domains


def check_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_reserved or ip.is_unspecified \
            or ip.is_multicast:
        raise ValueError(f"image URL leads to a non-public address ({ip}); refused (name the host in "
                         "--allowed-media-domains to allow it)")
