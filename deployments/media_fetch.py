"""Media URLs -> bytes for the router, under the server's media-access rules.

- `data:` URIs: always.
- Local files (a path or `file://`): only with `limits.allow_local_media`, and only inside
  `limits.local_media_dir` (real path, symlinks resolved). Any failure, whether the file is
  missing, unreadable, not a regular file or outside the directory, gets the same message, and
  nothing outside the directory is ever opened.
- http(s): only with `limits.allow_http_media`, to hosts on `limits.http_media_allowlist` (an
  entry also admits its subdomains). Redirects are followed by hand, each hop checked the same
  way. Hosts are resolved here and every address must be public; a private, loopback or
  link-local address is admitted only for a host listed exactly (an IP literal or full name).
  The connection goes to the checked address (no second lookup). Bodies are streamed under a
  byte cap.
- Any other scheme is refused as such.

`MediaFetcher` is per request: it counts the bytes fetched against `limits.max_request_bytes`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import stat
from urllib.parse import urljoin, urlsplit

from deployments.config import LimitArgs
from mmserve.errors import InvalidRequest
from mmserve.media import decode_data_uri

HTTP_TIMEOUT_S = 10.0  # connect / each read
HTTP_TOTAL_TIMEOUT_S = 30.0  # one URL, redirects included
MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
_READ_CHUNK = 1 << 20


class MediaFetcher:
    """Loads one request's media URLs; the bytes of all of them count against one budget."""

    def __init__(self, limits: LimitArgs):
        self.limits = limits
        self._budget = limits.max_request_bytes

    async def load(self, url: str) -> bytes:
        """The bytes `url` names; InvalidRequest (a 400) for anything unusable or not allowed."""
        scheme = _scheme(url)
        if scheme == "data":
            return decode_data_uri(url, self.limits.max_request_bytes)
        if scheme in ("http", "https"):
            if not self.limits.allow_http_media:
                raise InvalidRequest("http(s) media URLs are disabled on this server; send a data: URI")
            data = await self._fetch_http(url)
        elif scheme in ("", "file"):
            if not self.limits.allow_local_media:
                raise InvalidRequest("local file media are disabled on this server; send a data: URI")
            data = await asyncio.to_thread(read_local_media, url, self.limits.local_media_dir, self._budget)
        else:
            raise InvalidRequest(f"unsupported media URL scheme {scheme!r}; use data:, http(s): or file:")
        self._take(len(data))
        return data

    def _take(self, num_bytes: int) -> None:
        if num_bytes > self._budget:
            raise InvalidRequest(f"media of this request exceed the limit of {self.limits.max_request_bytes} bytes")
        self._budget -= num_bytes

    async def _fetch_http(self, url: str) -> bytes:
        try:
            return await asyncio.wait_for(self._follow(url), HTTP_TOTAL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise InvalidRequest(f"fetching media URL {url!r} took longer than {HTTP_TOTAL_TIMEOUT_S:g} s") from None

    async def _follow(self, url: str) -> bytes:
        import httpx

        timeout = httpx.Timeout(HTTP_TIMEOUT_S)
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=timeout) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target = await check_http_url(url, self.limits.http_media_allowlist)
                try:
                    async with client.stream(
                        "GET", target.address_url, headers={"Host": target.host_header},
                        extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
                    ) as resp:
                        if resp.status_code in _REDIRECTS and "location" in resp.headers:
                            url = urljoin(url, resp.headers["location"])
                            continue
                        if resp.status_code != 200:
                            raise InvalidRequest(f"media URL {url!r} answered HTTP {resp.status_code}")
                        return await self._read_capped(resp, url)
                except httpx.HTTPError as e:
                    raise InvalidRequest(f"cannot fetch media URL {url!r}: {type(e).__name__}") from None
        raise InvalidRequest(f"media URL redirected more than {MAX_REDIRECTS} times")

    async def _read_capped(self, resp, url: str) -> bytes:
        cap = self._budget
        too_big = InvalidRequest(f"media at {url!r} exceeds the limit of {self.limits.max_request_bytes} bytes")
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise too_big
        chunks, size = [], 0
        async for chunk in resp.aiter_bytes(_READ_CHUNK):
            size += len(chunk)
            if size > cap:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def _scheme(url: str) -> str:
    if url.startswith("/"):
        return ""
    return urlsplit(url).scheme.lower()


# -- local files ------------------------------------------------------------------------------------
def read_local_media(url: str, media_dir: str | None, max_bytes: int) -> bytes:
    """Bytes of a local file inside `media_dir` (a relative path is taken from there)."""
    path = url[len("file://"):] if url.startswith("file://") else url
    unavailable = InvalidRequest(f"local media {path!r} is not available: name a readable file inside the media directory")
    if not media_dir or "\0" in path:
        raise unavailable
    root = os.path.realpath(media_dir)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise unavailable  # outside the directory (also through a symlink): never opened
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise unavailable from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unavailable
        if info.st_size > max_bytes:
            raise InvalidRequest(f"media item larger than the limit of {max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise unavailable from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise InvalidRequest(f"media item larger than the limit of {max_bytes} bytes")
    return data


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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    """`host` is an entry of `allowlist` or (for names, not IP addresses) a subdomain of one."""
    host = host.lower().rstrip(".")
    entries = [a.lower().rstrip(".") for a in allowlist]
    return host in entries or (not _is_ip(host) and any(host.endswith("." + a) for a in entries))


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def check_http_url(url: str, allowlist: tuple[str, ...]) -> HttpTarget:
    """Where to connect for `url` if the rules allow it (see the module docstring), else InvalidRequest."""
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
    if not host or not host_allowed(host, allowlist):
        raise InvalidRequest(f"media host {host!r} is not in the allowlist")
    port = port or (443 if scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InvalidRequest(f"cannot resolve media host {host!r}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    explicit = host.lower() in (a.lower().rstrip(".") for a in allowlist)
    if not addresses or not (explicit or all(_public(a) for a in addresses)):
        raise InvalidRequest(
            f"media host {host!r} resolves to a private, loopback or link-local address; "
            "list it exactly in http_media_allowlist to allow that"
        )
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return HttpTarget(scheme, host, port, addresses[0], path)
