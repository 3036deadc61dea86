"""Media access rules (deployments/media/fetch.py): local files, schemes, http(s) against a real
HTTP server on 127.0.0.1 started here. Which files were opened is observed with an audit hook."""

import asyncio
import json
import http.server
import logging
import os
import socket
import sys
import threading
import time

import pytest

from deployments.config import LimitArgs
from deployments.media import local_files as local_media
from deployments.media.fetch import FETCH_FAILED, MAX_CONCURRENT_FETCHES, MediaFetcher
from mmserve.errors import InvalidRequest
from tests.support.media_factory import data_uri, image_bytes

PNG = image_bytes(16, 16, seed=3)
SECRET = b"bytes from outside the media directory"

# -- which paths get opened (an audit hook cannot be removed: it records only while armed) ----------
_opened: list[str] | None = None
_before_open = None  # called with each path about to be opened, while set


def _audit(event: str, args) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        if _opened is not None:
            _opened.append(os.fsdecode(args[0]))
        if _before_open is not None:
            _before_open(os.fsdecode(args[0]))


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


@pytest.fixture(params=["openat2", "walk"])
def local_open(request, monkeypatch, tmp_path):
    """Local media opened with openat2 (where this kernel has it) or by the component walk."""
    if request.param == "walk":
        monkeypatch.setattr(local_media, "_openat2", lambda *args: None)
    else:
        (tmp_path / "probe").write_bytes(b"")
        root = os.open(tmp_path, os.O_RDONLY)
        try:
            fd = local_media._openat2(root, "probe", os.O_RDONLY)
        finally:
            os.close(root)
        if fd is None:
            pytest.skip("no openat2 here")
        os.close(fd)
    return request.param


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


def test_local_media_are_confined_to_local_media_dir(dirs, local_open):
    media, outside = dirs
    limits = LimitArgs(allow_local_media=True, local_media_dir=str(media))
    (media / "sub").mkdir()
    (media / "sub" / "b.png").write_bytes(PNG)
    for url in (str(media / "a.png"), "a.png", "./sub//b.png", f"file://{media / 'a.png'}"):
        assert _load(limits, url)[0] == PNG
    (media / "escape.png").symlink_to(outside / "secret.png")
    (media / "alias.png").symlink_to(media / "a.png")
    (media / "linked").symlink_to(outside)
    refused = {
        "missing inside": str(media / "missing.png"),
        "existing outside": str(outside / "secret.png"),
        "missing outside": str(outside / "missing.png"),
        "dot-dot": "../outside/secret.png",
        "symlink out": str(media / "escape.png"),
        "symlink inside": str(media / "alias.png"),  # no symlink is followed: none can be swapped mid-open
        "symlinked parent out": "linked/secret.png",
        "dot-dot inside": "sub/../a.png",
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


def _swap_dir_for_symlink(media, outside):
    (media / "sub").rename(media / "sub.real")
    (media / "sub").symlink_to(outside / "sub")


def _dirs_with_a_twin_outside(media, outside):
    (media / "sub").mkdir()
    (media / "sub" / "x.png").write_bytes(PNG)
    (outside / "sub").mkdir()
    (outside / "sub" / "x.png").write_bytes(SECRET)


@pytest.mark.parametrize("swap_before_open", [1, 2, 3])
def test_a_parent_swapped_for_a_symlink_while_opening_never_leads_outside(dirs, local_open, swap_before_open):
    """`sub` becomes a symlink to outside just before the n-th open under the media directory."""
    global _before_open
    media, outside = dirs
    _dirs_with_a_twin_outside(media, outside)
    opens = 0

    def swap(path):
        nonlocal opens
        if os.path.isabs(path) and not path.startswith(str(media)):
            return
        opens += 1
        if opens == swap_before_open:
            _swap_dir_for_symlink(media, outside)

    _before_open = swap
    try:
        data, error, _ = _load(LimitArgs(allow_local_media=True, local_media_dir=str(media)), "sub/x.png")
    finally:
        _before_open = None
    assert data != SECRET
    assert data == PNG or "is not available" in error


def test_a_parent_swapped_back_and_forth_during_reads_never_leads_outside(dirs, local_open):
    media, outside = dirs
    _dirs_with_a_twin_outside(media, outside)
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            _swap_dir_for_symlink(media, outside)
            (media / "sub").unlink()
            (media / "sub.real").rename(media / "sub")

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    results = []
    try:
        for _ in range(200):
            try:
                results.append(local_media.read_local_media("sub/x.png", str(media), 1 << 20))
            except InvalidRequest:
                results.append(None)
    finally:
        stop.set()
        thread.join()
    assert SECRET not in results
    assert set(results) <= {PNG, None}


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
    in_flight = max_in_flight = 0
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 (http.server's name)
        _Handler.hits.append(self.path)
        if self.path.startswith("/slow/"):
            return self._slow(int(self.path.removeprefix("/slow/")))
        if self.path == "/trickle":
            return self._trickle()
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {}, PNG),
            "/big": (200, {}, b"x" * 50_000),
            "/unauthorized": (401, {}, b""),
            "/redirect-in": (302, {"Location": "/img.png"}, b""),
            "/redirect-out": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
            "/redirect-ftp": (302, {"Location": "ftp://127.0.0.1/img.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        self._answer(*routes.get(self.path, (404, {}, b"")))

    def _answer(self, status, headers, body):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _slow(self, n: int):
        """Body b"slow-<n>" after 0.5 s; the later n, the sooner (so results come out of order)."""
        with _Handler.lock:
            _Handler.in_flight += 1
            _Handler.max_in_flight = max(_Handler.max_in_flight, _Handler.in_flight)
        time.sleep(0.5 - 0.02 * (n % 10))
        with _Handler.lock:
            _Handler.in_flight -= 1
        self._answer(200, {}, f"slow-{n}".encode())

    def _trickle(self):
        """One byte every 0.5 s: never idle long enough for a read timeout."""
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            for _ in range(60):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass  # the client hung up

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fetch_log():
    """Messages logged to "ray.serve" meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _http_limits(*allowlist: str, **kw) -> LimitArgs:
    return LimitArgs(allow_http_media=True, http_media_allowlist=allowlist, **kw)


def _load_all(limits: LimitArgs, urls: list[str]) -> tuple[list[bytes] | None, str | None, float]:
    """(results, None) or (None, error message), and the seconds it took."""
    start = time.monotonic()
    try:
        return asyncio.run(MediaFetcher(limits).load_all(urls)), None, time.monotonic() - start
    except InvalidRequest as e:
        return None, str(e), time.monotonic() - start


def test_http_media_are_off_by_default(http_port):
    assert "disabled" in _load(LimitArgs(), f"http://127.0.0.1:{http_port}/img.png")[1]


def test_an_entry_without_a_port_admits_only_80_and_443(http_port, closed_port):
    """A port scan through `["127.0.0.1"]`: open or closed, 200, 401 or 404, all read the same."""
    limits = _http_limits("127.0.0.1")
    urls = [f"http://127.0.0.1:{http_port}/img.png", f"http://127.0.0.1:{http_port}/unauthorized",
            f"http://127.0.0.1:{http_port}/nothing", f"http://127.0.0.1:{closed_port}/"]
    _Handler.hits.clear()
    errors = {_load(limits, url)[1] for url in urls}
    assert errors == {"media host '127.0.0.1' is not in the allowlist for this port"}
    assert _Handler.hits == []


def test_a_host_port_entry_admits_that_port_only(http_port, closed_port):
    limits = _http_limits(f"127.0.0.1:{http_port}")
    assert _load(limits, f"http://127.0.0.1:{http_port}/img.png")[0] == PNG
    assert "not in the allowlist for this port" in _load(limits, f"http://127.0.0.1:{closed_port}/")[1]
    assert "not in the allowlist for this port" in _load(limits, "http://127.0.0.1/img.png")[1]


@pytest.mark.parametrize("entry", ["host:notaport", "host:0", "host:70000", "host:", "[::1]x", "[127.0.0.1]:80",
                                   "http://host", "a b", ""])
def test_malformed_allowlist_entries_are_config_errors(entry):
    with pytest.raises(ValueError, match="http_media_allowlist"):
        _http_limits(entry)


def test_well_formed_allowlist_entries_are_accepted():
    entries = ("example.com", "Example.COM.:8443", "127.0.0.1:8080", "[::1]:8080", "[::1]", "::1")
    assert _http_limits(*entries).http_media_allowlist == entries


def test_every_failure_to_fetch_reads_the_same(http_port, closed_port, fetch_log):
    """Status, refused connection, refused redirect, redirect loop: one message; the reason is logged."""
    limits = _http_limits(f"127.0.0.1:{http_port}", f"127.0.0.1:{closed_port}")
    base = f"http://127.0.0.1:{http_port}"
    urls = [f"{base}/unauthorized", f"{base}/nothing", f"http://127.0.0.1:{closed_port}/", f"{base}/redirect-ftp",
            f"{base}/redirect-out", f"{base}/loop"]
    for url in urls:
        with pytest.raises(InvalidRequest) as failure:
            asyncio.run(MediaFetcher(limits, request_id="req-7").load(url))
        assert str(failure.value) == FETCH_FAILED
    logged = [r.getMessage() for r in fetch_log]
    assert len(logged) == len(urls) and all(m.startswith("request req-7: media URL ") for m in logged)
    for reason in ("HTTP 401", "HTTP 404", "ConnectError", "only http(s) redirects", "'localhost' is not in the",
                   "redirected more than"):
        assert any(reason in m for m in logged), reason


def test_redirects_are_followed_only_inside_the_allowlist(http_port):
    base = f"http://127.0.0.1:{http_port}"
    limits = _http_limits(f"127.0.0.1:{http_port}")  # loopback: allowed only because it is listed exactly
    assert _load(limits, f"{base}/img.png")[0] == PNG
    assert _load(limits, f"{base}/redirect-in")[0] == PNG
    _Handler.hits.clear()
    data, error, _ = _load(limits, f"{base}/redirect-out")
    assert data is None and error == FETCH_FAILED  # where it redirected to is the upstream's answer: not told
    assert _Handler.hits == ["/redirect-out"]  # the target was never requested
    assert _load(limits, f"{base}/redirect-ftp")[1] == FETCH_FAILED
    assert _load(limits, f"{base}/loop")[1] == FETCH_FAILED
    assert _load(limits, f"{base}/nothing")[1] == FETCH_FAILED


def test_http_bodies_are_capped(http_port):
    limits = _http_limits(f"127.0.0.1:{http_port}", max_request_bytes=20_000)
    assert "exceeds the limit of 20000 bytes" in _load(limits, f"http://127.0.0.1:{http_port}/big")[1]


def test_concurrent_fetches_share_the_byte_budget(http_port):
    limits = _http_limits(f"127.0.0.1:{http_port}", max_request_bytes=80_000)  # one /big fits, two do not
    url = f"http://127.0.0.1:{http_port}/big"
    assert _load_all(limits, [url])[0] == [b"x" * 50_000]
    assert "exceeds the limit of 80000 bytes" in _load_all(limits, [url, url])[1]


def test_private_addresses_need_an_exact_allowlist_entry(http_port, monkeypatch, fetch_log):
    real = socket.getaddrinfo

    def fake_dns(host, *args, **kw):  # media.example -> loopback (what a rebinding DNS would do)
        return real("127.0.0.1" if host == "media.example" else host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake_dns)
    url = f"http://media.example:{http_port}/img.png"
    data, error, _ = _load(_http_limits(f"example:{http_port}"), url)  # a parent domain: public addresses only
    assert data is None and error == FETCH_FAILED  # what a name resolves to is not told either
    assert "private, loopback or link-local" in fetch_log[-1].getMessage()
    assert _load(_http_limits(f"media.example:{http_port}"), url)[0] == PNG  # listed exactly: the operator said so
    assert "not in the allowlist" in _load(_http_limits("127.0.0.2"), f"http://127.0.0.1:{http_port}/img.png")[1]


def test_one_deadline_bounds_all_of_a_requests_media(http_port):
    """Four servers trickling a byte every 0.5 s: refused at the request's deadline, not 4 x anything."""
    limits = _http_limits(f"127.0.0.1:{http_port}", media_fetch_timeout_s=2)
    results, error, took = _load_all(limits, [f"http://127.0.0.1:{http_port}/trickle"] * 4)
    assert results is None and error == "media took longer than 2 s to fetch"
    assert 1.9 < took < 3.5


def test_load_keeps_the_deadline(http_port):
    limits = _http_limits(f"127.0.0.1:{http_port}", media_fetch_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="longer than 1 s"):
        asyncio.run(MediaFetcher(limits).load(f"http://127.0.0.1:{http_port}/trickle"))
    assert time.monotonic() - start < 2.5


def test_load_all_fetches_concurrently_and_keeps_the_order(http_port):
    urls = [f"http://127.0.0.1:{http_port}/slow/{n}" for n in range(4)]
    results, error, took = _load_all(_http_limits(f"127.0.0.1:{http_port}"), urls)
    assert error is None and results == [f"slow-{n}".encode() for n in range(4)]
    assert took < 1.5  # 4 x 0.5 s one after the other would be 2 s


def test_load_all_runs_at_most_max_concurrent_fetches_at_once(http_port):
    _Handler.max_in_flight = 0
    urls = [f"http://127.0.0.1:{http_port}/slow/{n}" for n in range(MAX_CONCURRENT_FETCHES + 4)]
    results, error, _ = _load_all(_http_limits(f"127.0.0.1:{http_port}"), urls)
    assert error is None and len(results) == len(urls)
    assert 1 < _Handler.max_in_flight <= MAX_CONCURRENT_FETCHES


def test_the_first_failure_cancels_the_rest(http_port):
    base = f"http://127.0.0.1:{http_port}"
    results, error, took = _load_all(_http_limits(f"127.0.0.1:{http_port}"), [f"{base}/trickle"] * 3 + [f"{base}/x"])
    assert error == FETCH_FAILED and took < 1.5  # not the 30 s deadline the trickles would run into


def test_item_count_is_checked_before_anything_is_fetched(http_port, tiny_models):
    from deployments.api import openai_api
    from tests.support.core_fakes import make_core, reader

    url = f"http://127.0.0.1:{http_port}/img.png"
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(1000)]
    body = openai_api.parse_body(json.dumps({"messages": [{"role": "user", "content": parts}]}).encode())
    core = make_core(tiny_models["qwen2_vl"], limits=_http_limits(f"127.0.0.1:{http_port}"))
    _Handler.hits.clear()
    with pytest.raises(InvalidRequest, match="1000 media items; the limit is 16"):
        asyncio.run(core.generate(None, reader(openai_api.chat_request(body)), "r"))
    assert _Handler.hits == []


def test_trickling_media_take_no_place_from_ready_requests(http_port, tiny_models):
    """As many trickling image URLs as the router's `max_pending_requests` do not turn a plain
    request away (no 429): fetching holds a place of its own bound; they end at the deadline."""
    from deployments.core.generation import GenerationOptions
    from deployments.core.request_core import ChatRequest
    from mmserve.inputs.media import MediaKind, MediaSource
    from mmserve.request.prompt_plan import Message
    from tests.support.core_fakes import make_core, reader

    limits = _http_limits(f"127.0.0.1:{http_port}", media_fetch_timeout_s=3)
    core = make_core(tiny_models["qwen2_vl"], limits=limits, max_pending_requests=16)
    image = MediaSource(MediaKind.IMAGE, (f"http://127.0.0.1:{http_port}/trickle",))
    trickling = ChatRequest((Message("user", (image, "what is this?")),), GenerationOptions(max_tokens=2))
    plain = ChatRequest((Message("user", ("hi",)),), GenerationOptions(max_tokens=2))

    async def main():
        slow = [asyncio.create_task(core.generate(None, reader(trickling), f"slow{i}")) for i in range(16)]
        await asyncio.sleep(0.5)
        fetching, pending = core.receiving.held, core.pending.held
        gen = await core.generate(None, reader(plain), "plain")
        tokens = [d.token_id async for d in gen.deltas() if d.token_id is not None]
        return fetching, pending, tokens, await asyncio.gather(*slow, return_exceptions=True)

    fetching, pending, tokens, slow = asyncio.run(main())
    assert (fetching, pending) == (16, 0)
    assert len(tokens) == 2  # the plain request was served while all 16 trickled
    assert all(isinstance(r, InvalidRequest) and "took longer than 3 s" in str(r) for r in slow), slow
    assert core.receiving.held == core.pending.held == 0
