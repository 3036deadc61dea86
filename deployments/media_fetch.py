"""Media URL loading for the router: data: URIs, local files, and allowlisted http(s) URLs."""

from __future__ import annotations

import asyncio
import urllib.request
from urllib.parse import urlparse

from deployments.config import LimitArgs
from mmserve.errors import InvalidRequest
from mmserve.media import load_media_bytes

_HTTP_TIMEOUT_S = 10


def _host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    return any(host == allowed or host.endswith("." + allowed) for allowed in allowlist)


def _fetch_http(url: str, limits: LimitArgs) -> bytes:
    host = urlparse(url).hostname or ""
    if not _host_allowed(host, limits.http_media_allowlist):
        raise InvalidRequest(f"media host {host!r} is not in the allowlist")
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as resp:
            data = resp.read(limits.max_request_bytes + 1)
    except OSError as e:
        raise InvalidRequest(f"cannot fetch media URL {url!r}: {e}") from None
    if len(data) > limits.max_request_bytes:
        raise InvalidRequest(f"media at {url!r} exceeds the limit of {limits.max_request_bytes} bytes")
    return data


async def load_url(url: str, limits: LimitArgs) -> bytes:
    """The bytes a media URL names; InvalidRequest (a 400) for anything unusable or not allowed."""
    if url.startswith(("http://", "https://")):
        if not limits.allow_http_media:
            raise InvalidRequest("http(s) media URLs are disabled on this server; send a data: URI")
        return await asyncio.to_thread(_fetch_http, url, limits)
    if url.startswith("data:"):
        return load_media_bytes(url, allow_local_files=False, allow_http=False, max_bytes=limits.max_request_bytes)
    return await asyncio.to_thread(
        load_media_bytes, url, allow_local_files=limits.allow_local_media, allow_http=False,
        max_bytes=limits.max_request_bytes,
    )
