"""Which images and videos a server request may use, and getting the remote and local ones under those rules.

data: URLs always; file:// only below --allowed-local-media-path; http(s) only from --allowed-media-domains when
given, and never from non-public addresses (loopback, private, link-local, carrier-grade NAT, reserved, and
IPv6 forms that embed such an IPv4 address) unless the host is named there. The address rule is applied to the
address each connection actually goes to (redirects included), so a name that resolves to a public address when
checked and to a private one when fetched (DNS rebinding) is still refused.

Downloads and file reads run in their own bounded thread pool (a slow image host cannot hold up templating or
tokenizing for anyone), a request's images and videos in parallel under one deadline per kind
(FOVEA_IMAGE_FETCH_TIMEOUT, 5 s; FOVEA_VIDEO_FETCH_TIMEOUT, 30 s), and they are cancelled as soon as the request
fails or its client leaves. Upstream failures all read the same. The engine only ever sees the bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import ipaddress
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from fovea.multimodal.fetch import Cancellation, fetch_timeout, fetch_url, file_url_path, read_local_file

logger = logging.getLogger("fovea")
DOWNLOADS = concurrent.futures.ThreadPoolExecutor(int(os.environ.get("FOVEA_MEDIA_THREADS", "16")), "fovea-media")
IPV6_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
# inside 2000::/3 but not a host on the internet: IETF protocol assignments (Teredo among them), documentation
IPV6_NOT_HOSTS = [ipaddress.ip_network(n) for n in ("2001::/23", "2001:db8::/32", "3fff::/20")]
# IPv6 forms that carry an IPv4 address in their last 32 bits (6to4 carries it in bits 16-48: ip.sixtofour)
IPV4_CARRIERS = [
    ipaddress.ip_network(n)
    for n in (
        "::ffff:0:0/96",  # IPv4-mapped
        "::ffff:0:0:0/96",  # SIIT (RFC 6052's IPv4-translated)
        "::/96",  # IPv4-compatible (deprecated), :: and ::1 included
        "64:ff9b::/96",
    )
]  # well-known NAT64 (the local-use 64:ff9b:1::/48 is a site's own: outside 2000::/3, refused)


@dataclass
class MediaPolicy:
    allowed_local_media_path: Path | None = None
    allowed_media_domains: list[str] = field(default_factory=list)  # when set, the only hosts; may be private


def media_urls(messages: list[dict]) -> list[tuple[dict, str, str]]:
    """(part, url, "image" | "video") of every image_url and video_url part; types other than these, text and
    image_embeds are refused here."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "video_url"):
                url = part.get(kind)
                found.append((part, url.get("url") if isinstance(url, dict) else url, kind[:-4]))
            elif kind not in ("text", "image_embeds", None):  # embeddings: read by the front end (--enable-mm-embeds)
                raise ValueError(
                    f"unsupported content part type {kind!r}; use text, image_url, video_url or image_embeds"
                )
    return found


def media_to_fetch(
    messages: list[dict], policy: MediaPolicy, limits: dict[str, int] | None = None
) -> list[tuple[dict, str, str]]:
    """The http(s) and file:// images and videos of `messages` (part, url, kind), after the checks that need no
    download: ValueError for a refused URL or too many items (`limits`: limit_mm_per_prompt)."""
    found = media_urls(messages)
    for kind, limit in (limits or {}).items():
        count = sum(found_kind == kind for _, _, found_kind in found)
        if count > limit:
            raise ValueError(f"the prompt has {count} {kind}s but limit_mm_per_prompt allows {limit}")
    for _, url, kind in found:
        check_url(url, policy, kind)
    return [(part, url, kind) for part, url, kind in found if not url.startswith("data:")]


async def fetch_media(messages: list[dict], policy: MediaPolicy, limits: dict[str, int] | None = None) -> list[dict]:
    """`messages` with every http(s) and file:// image or video replaced by its bytes; raises ValueError as
    media_to_fetch does, or for a failed download (the request's other downloads are then cancelled)."""
    remote = media_to_fetch(messages, policy, limits)
    if not remote:
        return messages
    cancel, now = Cancellation(), time.monotonic()
    loop = asyncio.get_running_loop()
    jobs = [
        loop.run_in_executor(DOWNLOADS, _get, url, policy, now + fetch_timeout(kind), cancel, kind)
        for _, url, kind in remote
    ]
    try:
        contents = await asyncio.gather(*jobs)
    finally:
        cancel.cancel()  # a failure, or the client left: whatever still runs stops now
        await asyncio.gather(*jobs, return_exceptions=True)
    replaced = {id(part): (kind, data) for (part, _, kind), data in zip(remote, contents)}
    return [
        {
            **message,
            "content": [
                {"type": replaced[id(part)][0], replaced[id(part)][0]: replaced[id(part)][1]}
                if id(part) in replaced
                else part
                for part in message["content"]
            ],
        }
        if isinstance(message.get("content"), list)
        else message
        for message in messages
    ]


def _get(url: str, policy: MediaPolicy, deadline: float, cancel: Cancellation, kind: str) -> bytes:
    if cancel.cancelled:
        raise ValueError(f"could not fetch {kind} {url}")
    if url.startswith("file://"):
        return read_local_file(file_url_path(url), policy.allowed_local_media_path, kind)
    try:
        return fetch_url(
            url,
            functools.partial(check_url, policy=policy, kind=kind),
            None if explicitly_allowed(url, policy) else check_address,
            deadline=deadline,
            cancel=cancel,
            explain=False,
            kind=kind,
        )
    except ValueError as error:
        logger.info("%s fetch failed: %s (%s)", kind, url, error.__cause__ or error)
        raise


def check_url(url, policy: MediaPolicy, kind: str = "image") -> None:
    if not isinstance(url, str) or not url:
        raise ValueError(f"{kind}_url.url must be a non-empty string")
    if url.startswith("data:"):
        return
    parsed = urlparse(url)
    if parsed.scheme == "file":
        root = policy.allowed_local_media_path
        if root is None:
            raise ValueError(f"file:// {kind} URLs are disabled; start the server with --allowed-local-media-path")
        if not file_url_path(url).resolve().is_relative_to(root.resolve()):
            raise ValueError(f"file:// {kind} URL is outside the folder the server allows (--allowed-local-media-path)")
        return
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{kind}_url.url must be a data:, http(s):// or file:// URL")
    host = parsed.hostname.lower()
    if policy.allowed_media_domains and host not in policy.allowed_media_domains:
        raise ValueError(f"{kind} host {host} is not in --allowed-media-domains")


def explicitly_allowed(url: str, policy: MediaPolicy) -> bool:
    """A host named in --allowed-media-domains may be on a private network (an internal image store)."""
    return (urlparse(url).hostname or "").lower() in policy.allowed_media_domains


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable unicast host. IPv6 forms that carry an IPv4 address (mapped, translated, compatible,
    NAT64, 6to4) are judged by that address alone; any other IPv6 address must be global unicast (2000::/3)
    outside the blocks that hold no internet hosts. Spelled out rather than left to `ipaddress.is_global`, whose
    IPv6 tables differ between Python versions."""
    if ip.version == 4:
        return ip.is_global and not ip.is_multicast and not ip.is_reserved
    if ip.sixtofour is not None:
        return is_public(ip.sixtofour)
    if any(ip in network for network in IPV4_CARRIERS):
        return is_public(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return ip in IPV6_GLOBAL_UNICAST and not any(ip in network for network in IPV6_NOT_HOSTS)


def check_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if not is_public(ip):
        raise ValueError(
            "image URL leads to a non-public address; refused (name the host in --allowed-media-domains to allow it)"
        )
