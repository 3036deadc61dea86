"""Media access rules (deployments/media_fetch.py): local files, schemes, http(s) against a real
HTTP server on 127.0.0.1 started here. Which files were opened is observed with an audit hook."""

import asyncio
import http.server
import os
import socket
import sys
import threading

import pytest

from deployments.config import LimitArgs
from deployments.media_fetch import MediaFetcher
from mmserve.errors import InvalidRequest
from tests.media_factory import data_uri, image_bytes

PNG = image_bytes(16, 16, seed=3)

# -- which paths get opened (an audit hook cannot be removed: it records only while armed) ----------
_opened: list[str] | None = None


def _audit(event: str, args) -> None:
    if _opened is not None and event == "open" and args and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _load(limits: LimitArgs, url: str) -> tuple[bytes | None, str | None, list[str]]:
    """(bytes, None) or (None, error message), and the paths opened meanwhile."""
    global _opened
    _opened = []
    try:
        return asyncio.run(MediaFetcher(limits).load(url)), None, _opened
    except InvalidRequest as e:
        return None, str(e), _opened
    finally:
        _opened = None


def _message_without_path(message: str, path: str) -> str:
    return message.replace(path, "PATH")


@pytest.fixture
def dirs(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "outside"
    media.mkdir(), outside.mkdir()
    (media / "a.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    return media, outside


def test_local_paths_are_refused_by_default_without_opening_anything(dirs):
    _, outside = dirs
    assert not LimitArgs().allow_local_media
    existing, missing = str(outside / "secret.png"), str(outside / "missing.png")
    results = [_load(LimitArgs(), url) for url in (existing, missing, f"file://{existing}", "/etc/passwd")]
    for data, error, opened in results:
        assert data is None and "disabled" in error and opened == []
    assert len({error for _, error, _ in results}) == 1  # nothing tells an existing file from a missing one


def test_local_media_are_confined_to_local_media_dir(dirs):
    media, outside = dirs
    limits = LimitArgs(allow_local_media=True, local_media_dir=str(media))
    for url in (str(media / "a.png"), "a.png", f"file://{media / 'a.png'}"):
        assert _load(limits, url)[0] == PNG
    (media / "escape.png").symlink_to(outside / "secret.png")
    (media / "sub").mkdir()
    refused = {
        "missing inside": str(media / "missing.png"),
        "existing outside": str(outside / "secret.png"),
        "missing outside": str(outside / "missing.png"),
        "dot-dot": "../outside/secret.png",
        "symlink out": str(media / "escape.png"),
        "directory": str(media / "sub"),
        "system file": "/etc/passwd",
    }
    messages = set()
    for name, url in refused.items():
        data, error, opened = _load(limits, url)
        assert data is None and error is not None, name
        assert not any(str(outside) in p or p == "/etc/passwd" for p in opened), (name, opened)
        messages.add(_message_without_path(error, url.removeprefix("file://")))
    assert len(messages) == 1, messages  # missing, forbidden and outside all read the same


def test_allow_local_media_needs_a_directory():
    with pytest.raises(ValueError, match="local_media_dir"):
        LimitArgs(allow_local_media=True)


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://example.com/1", "javascript:alert(1)",
                                 "smb://host/share/a.png"])
def test_unknown_schemes_are_refused_as_such(url):
    data, error, opened = _load(LimitArgs(allow_http_media=True, http_media_allowlist=("example.com",)), url)
    assert data is None and "unsupported media URL scheme" in error and opened == []


def test_truncated_base64_is_refused():
    uri = data_uri(PNG)
    assert _load(LimitArgs(), uri[:-3])[1].startswith("invalid base64")


# -- http(s) against a local server ---------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        _Handler.hits.append(self.path)
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {}, PNG),
            "/big": (200, {}, b"x" * 50_000),
            "/redirect-in": (302, {"Location": "/img.png"}, b""),
            "/redirect-out": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
            "/redirect-ftp": (302, {"Location": "ftp://127.0.0.1/img.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _http_limits(*allowlist: str, **kw) -> LimitArgs:
    return LimitArgs(allow_http_media=True, http_media_allowlist=allowlist, **kw)


def test_http_media_are_off_by_default(http_port):
    assert "disabled" in _load(LimitArgs(), f"http://127.0.0.1:{http_port}/img.png")[1]


def test_redirects_are_followed_only_inside_the_allowlist(http_port):
    base = f"http://127.0.0.1:{http_port}"
    limits = _http_limits("127.0.0.1")  # loopback: allowed only because it is listed exactly
    assert _load(limits, f"{base}/img.png")[0] == PNG
    assert _load(limits, f"{base}/redirect-in")[0] == PNG
    _Handler.hits.clear()
    data, error, _ = _load(limits, f"{base}/redirect-out")
    assert data is None and "'localhost' is not in the allowlist" in error
    assert _Handler.hits == ["/redirect-out"]  # the target was never requested
    assert "only http(s)" in _load(limits, f"{base}/redirect-ftp")[1]
    assert "redirected more than" in _load(limits, f"{base}/loop")[1]
    assert "HTTP 404" in _load(limits, f"{base}/nothing")[1]


def test_http_bodies_are_capped(http_port):
    limits = _http_limits("127.0.0.1", max_request_bytes=20_000)
    assert "exceeds the limit of 20000 bytes" in _load(limits, f"http://127.0.0.1:{http_port}/big")[1]


def test_private_addresses_need_an_exact_allowlist_entry(http_port, monkeypatch):
    real = socket.getaddrinfo

    def fake_dns(host, *args, **kw):  # media.example -> loopback (what a rebinding DNS would do)
        return real("127.0.0.1" if host == "media.example" else host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake_dns)
    url = f"http://media.example:{http_port}/img.png"
    data, error, _ = _load(_http_limits("example"), url)  # a parent domain admits public addresses only
    assert data is None and "private, loopback or link-local" in error
    assert _load(_http_limits("media.example"), url)[0] == PNG  # listed exactly: the operator said so
    assert "not in the allowlist" in _load(_http_limits("127.0.0.2"), f"http://127.0.0.1:{http_port}/img.png")[1]


def test_item_count_is_checked_before_anything_is_fetched(http_port):
    from deployments import openai_api

    url = f"http://127.0.0.1:{http_port}/img.png"
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(1000)]
    body = openai_api.parse_body(
        __import__("json").dumps({"messages": [{"role": "user", "content": parts}]}).encode(), LimitArgs()
    )
    _Handler.hits.clear()
    with pytest.raises(InvalidRequest, match="1000 media items; the limit is 16"):
        asyncio.run(openai_api.messages(body, _http_limits("127.0.0.1")))
    assert _Handler.hits == []
