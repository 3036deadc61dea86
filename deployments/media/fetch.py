"""Media URLs -> bytes for the router, under the server's media-access rules (docs/security.md#media-access):
`data:` URIs always; local files beneath `limits.local_media_dir` (`local_files`) with
`limits.allow_local_media`; http(s) with `limits.allow_http_media`, to `limits.http_media_allowlist`
only, each redirect hop checked, every address public unless the host is listed exactly, the connection
to the checked address (no second lookup), bodies under a byte cap. Refusals decided from the client's
URL alone and the byte limit name the problem; every other failure is the one message `FETCH_FAILED`
(the reason is logged with the request id), so answers cannot map what listens behind the server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from urllib.parse import urljoin, urlsplit

from deployments.config import LimitArgs
from deployments.media.allowlist import allowlist_match, host_match, parse_allowlist_entry
from deployments.media.local_files import read_local_media
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import decode_data_uri

log = logging.getLogger("ray.serve")

FETCH_FAILED = "media URL could not be fetched"
HTTP_TIMEOUT_S = 10.0  # connect / each read; the request's deadline bounds the whole
MAX_CONCURRENT_FETCHES = 8
MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
_READ_CHUNK = 1 << 20


class _Unfetchable(Exception):
    """A fetch failed for a reason the client is not told (it goes to the log)."""


class MediaFetcher:
    """Loads one request's media URLs: all of them share one byte budget and one deadline
    (starting at the first `load` / `load_all`), at most `MAX_CONCURRENT_FETCHES` at a time."""

    def __init__(self, limits: LimitArgs, request_id: str = "-"):
        self.limits = limits
        self.request_id = request_id
        self._budget = limits.max_request_bytes
        self._deadline: float | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)

    async def load(self, url: str) -> bytes:
        """The bytes `url` names; InvalidRequest (a 400) for anything unusable or not allowed."""
        return (await self.load_all([url]))[0]

    async def load_all(self, urls: Sequence[str]) -> list[bytes]:
        """The bytes of every URL, in order, fetched concurrently; the first failure cancels
        the rest and is raised."""
        if not urls:
            return []
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self.limits.media_fetch_timeout_s
        tasks = [asyncio.ensure_future(self._load_one(url)) for url in urls]
        try:
            done, _ = await asyncio.wait(
                tasks, timeout=max(0.0, self._deadline - loop.time()), return_when=asyncio.FIRST_EXCEPTION
            )
            if failed := [t for t in tasks if t in done and t.exception() is not None]:
                raise failed[0].exception()
            if len(done) < len(tasks):
                timeout = self.limits.media_fetch_timeout_s
                log.warning("request %s: media not fetched within %g s", self.request_id, timeout)
                raise InvalidRequest(f"media took longer than {timeout:g} s to fetch")
            return [t.result() for t in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _load_one(self, url: str) -> bytes:
        scheme = "" if url.startswith("/") else urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_data_uri(url, self.limits.max_request_bytes)
        if scheme in ("http", "https"):
            if not self.limits.allow_http_media:
                raise InvalidRequest("http(s) media URLs are disabled on this server; send a data: URI")
            async with self._slots:
                return await self._fetch_http(url)
        if scheme not in ("", "file"):
            raise InvalidRequest(f"unsupported media URL scheme {scheme!r}; use data:, http(s): or file:")
        if not self.limits.allow_local_media:
            raise InvalidRequest("local file media are disabled on this server; send a data: URI")
        async with self._slots:
            data = await asyncio.to_thread(read_local_media, url, self.limits.local_media_dir, self._budget)
        limit = self.limits.max_request_bytes
        self._take(len(data), InvalidRequest(f"media of this request exceed the limit of {limit} bytes"))
        return data

    def _take(self, num_bytes: int, too_big: InvalidRequest) -> None:
        if num_bytes > self._budget:
            raise too_big
        self._budget -= num_bytes

    async def _fetch_http(self, url: str) -> bytes:
        try:
            return await self._follow(url)
        except _Unfetchable as e:
            log.warning("request %s: media URL %r could not be fetched: %s", self.request_id, url, e)
            raise InvalidRequest(FETCH_FAILED) from None

    async def _follow(self, url: str) -> bytes:
        import httpx

        requested = url
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=HTTP_TIMEOUT_S) as client:
            for hop in range(MAX_REDIRECTS + 1):
                try:
                    target = await check_http_url(url, self.limits.http_media_allowlist)
                except InvalidRequest as e:
                    if hop == 0:
                        raise  # decided from the client's own URL: it may know why
                    raise _Unfetchable(f"redirected to {url!r}: {e}") from None
                try:
                    async with client.stream(
                        "GET", target.address_url, headers={"Host": target.host_header},
                        extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
                    ) as resp:
                        if resp.status_code in _REDIRECTS and "location" in resp.headers:
                            url = urljoin(url, resp.headers["location"])
                            continue
                        if resp.status_code != 200:
                            raise _Unfetchable(f"{url!r} answered HTTP {resp.status_code}")
                        return await self._read_capped(resp, requested)
                except (InvalidRequest, _Unfetchable):
                    raise
                except Exception as e:  # noqa: BLE001 (whatever the upstream did, the client hears one thing)
                    raise _Unfetchable(f"{url!r}: {type(e).__name__}: {e}") from None
        raise _Unfetchable(f"redirected more than {MAX_REDIRECTS} times")

    async def _read_capped(self, resp, url: str) -> bytes:
        too_big = InvalidRequest(f"media at {url!r} exceeds the limit of {self.limits.max_request_bytes} bytes")
        length = resp.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self._budget:
            raise too_big
        chunks = []
        async for chunk in resp.aiter_bytes(_READ_CHUNK):
            self._take(len(chunk), too_big)  # as it arrives: concurrent fetches share the budget
            chunks.append(chunk)
        return b"".join(chunks)


# -- http(s) ------------------------------------------------------------------------------------------
class HttpTarget:
    """A checked http(s) URL and the address to connect to."""

    def __init__(self, scheme: str, host: str, port: int, address: str, path: str):
        self.scheme, self.host, self.port = scheme, host, port
        literal = f"[{address}]" if ":" in address else address
        self.address_url = f"{scheme}://{literal}:{port}{path}"
        default = 443 if scheme == "https" else 80
        host_literal = f"[{host}]" if ":" in host else host
        self.host_header = host_literal if port == default else f"{host_literal}:{port}"


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def check_http_url(url: str, allowlist: Sequence[str]) -> HttpTarget:
    """Where to connect for `url` if the rules allow it (see the module docstring). InvalidRequest
    for what the URL alone decides; _Unfetchable for what the lookup found (not told to the client)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"malformed media URL {url!r}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https"):
        raise InvalidRequest(f"media URL {url!r}: only http(s) redirects are followed")
    if parts.username or parts.password:
        raise InvalidRequest("media URLs with credentials are not allowed")
    port = port or (443 if scheme == "https" else 80)
    match = allowlist_match(host, port, allowlist) if host else None
    if match is None:
        other_port = host and host_match(host, [parse_allowlist_entry(e) for e in allowlist])
        raise InvalidRequest(f"media host {host!r} is not in the allowlist" + (" for this port" if other_port else ""))
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise _Unfetchable(f"cannot resolve {host!r}: {e}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses or not (match == "exact" or all(_public(a) for a in addresses)):
        raise _Unfetchable(
            f"{host!r} resolves to {', '.join(addresses)}: a private, loopback or link-local address is fetched "
            "only from a host listed exactly (with this port) in http_media_allowlist"
        )
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return HttpTarget(scheme, host, port, addresses[0], path)
