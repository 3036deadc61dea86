"""`http_media_allowlist` entries: `host[:port]`, and whether a URL's host and port match one.

An entry without a port admits ports 80 and 443; `host:port` (`[v6addr]:port`) that port only.
A name also admits its subdomains; an IP address only itself.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import NamedTuple


class AllowEntry(NamedTuple):
    """One `http_media_allowlist` entry: a host and its port (None: 80 and 443)."""

    host: str
    port: int | None


_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    host = host.lower().rstrip(".")
    ip = _ip(host)
    return str(ip) if ip is not None else host


def parse_allowlist_entry(entry: str) -> AllowEntry:
    """`host`, `host:port`, `[v6addr]`, `[v6addr]:port` or a bare IPv6 address; ValueError if malformed."""
    text, port_text = entry.strip().lower(), None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not isinstance(_ip(host), ipaddress.IPv6Address) or (rest and not rest.startswith(":")):
            raise ValueError(f"http_media_allowlist entry {entry!r}: expected [IPv6 address] or [IPv6 address]:port")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        host = text  # a bare IPv6 address: no port (write [addr]:port for one)
        if _ip(host) is None:
            raise ValueError(f"http_media_allowlist entry {entry!r}: not an IPv6 address; write [addr]:port")
    else:
        host, sep, port_text = text.partition(":")
        port_text = port_text if sep else None
        host = host.rstrip(".")
        if _ip(host) is None and not _NAME.fullmatch(host):
            raise ValueError(f"http_media_allowlist entry {entry!r}: not a host name or IP address")
    port = None
    if port_text is not None:
        if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"http_media_allowlist entry {entry!r}: the port must be a number from 1 to 65535")
        port = int(port_text)
    return AllowEntry(_normal_host(host), port)


def allowlist_match(host: str, port: int, allowlist: Sequence[str]) -> str | None:
    """'exact' if an entry names `host` itself for `port`, 'subdomain' if only a parent domain
    does (names only, never IP addresses), else None."""
    entries = [parse_allowlist_entry(e) for e in allowlist]
    return host_match(host, [e for e in entries if (port in (80, 443) if e.port is None else port == e.port)])


def host_match(host: str, entries: Sequence[AllowEntry]) -> str | None:
    host = _normal_host(host)
    if any(e.host == host for e in entries):
        return "exact"
    if _ip(host) is None and any(_ip(e.host) is None and host.endswith("." + e.host) for e in entries):
        return "subdomain"
    return None
