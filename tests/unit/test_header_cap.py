"""The request cap (`mmserve serve`'s HAProxy in front of Serve's proxy, on every interface), run for
real in front of a small HTTP server: one source address cannot hold more than its connections, while
another still gets through (4,200 unfinished connections from one client used to stop `/health`); a
trickled body waits in the cap, not in the server (70 trickled bodies starved every other request);
a body over the limit and Serve's route table are answered by the cap."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time

from deployments.cli.ingress_modes import HeaderCap, free_loopback_port, header_cap_config

REQUEST = b"GET /health HTTP/1.1\r\nHost: mmserve\r\nConnection: close\r\n\r\n"


class _Health(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []  # the requests that reached the server (their headers, at least)

    def do_GET(self):
        self.seen.append(f"GET {self.path}")
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self):
        self.seen.append(f"POST {self.path}")
        self.rfile.read(int(self.headers["content-length"]))
        self.do_GET()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _capped(**cap_args):
    """(the cap's port, what reached the server behind it)."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    _Health.seen = []
    port = free_loopback_port()
    cap = HeaderCap("127.0.0.1", port, upstream.server_address[1], **cap_args)
    cap.start()
    try:
        yield port, _Health.seen
    finally:
        cap.stop()
        upstream.shutdown()


def _get(port: int, source: str) -> bytes:
    """The response to one request sent from `source` (b"" when the cap closed the connection)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
            s.sendall(REQUEST)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data
    except OSError:  # reset before or while sending
        return b""


def test_one_client_holds_at_most_its_connections_and_others_still_get_through():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_loopback_port()
    cap = HeaderCap("127.0.0.1", port, upstream.server_address[1], per_client=8)
    cap.start()
    held: list[socket.socket] = []
    try:
        assert _get(port, "127.0.0.1").startswith(b"HTTP/1.0 200")
        for _ in range(8):  # unfinished requests: headers that never end
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.1", 0))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: mmserve\r\n")
            held.append(s)
        time.sleep(0.3)
        assert _get(port, "127.0.0.1") == b""  # the ninth connection of this address is closed
        assert _get(port, "127.0.0.2").startswith(b"HTTP/1.0 200")  # another client is served
        for s in held:
            s.close()
        held.clear()
        deadline = time.monotonic() + 5
        while not _get(port, "127.0.0.1").startswith(b"HTTP/1.0 200"):  # its places come back
            assert time.monotonic() < deadline, "the client's closed connections still count"
            time.sleep(0.1)
    finally:
        for s in held:
            s.close()
        cap.stop()
        upstream.shutdown()


def test_no_per_client_limit_when_asked_for_none():
    assert "sc0_conn_cur gt 256" in header_cap_config("0.0.0.0", 8000, 8001)
    assert "track-sc0" not in header_cap_config("0.0.0.0", 8000, 8001, per_client=0)


def test_a_trickled_body_waits_in_the_cap_while_others_get_through():
    """The cap holds a request until its body came (up to its 16 KiB buffer), within its 10 s deadline:
    a body sent a byte a second never reaches the server (where it would hold one of the Router's
    places), and another request of the same client is served meanwhile."""
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    with _capped() as (port, seen):
        with socket.create_connection(("127.0.0.1", port), timeout=15) as slow:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmserve\r\nContent-Length: %d\r\n\r\n"
                         % len(body))
            for byte in body[:3]:
                slow.sendall(bytes([byte]))
                time.sleep(1)
            assert _get(port, "127.0.0.1").startswith(b"HTTP/1.0 200")
            assert seen == ["GET /health"]  # the trickled request has not reached the server
            slow.settimeout(15)
            assert slow.recv(64).startswith(b"HTTP/1.1 408")  # the deadline answers it


def test_a_body_over_the_limit_and_the_route_table_are_answered_by_the_cap():
    with _capped(max_body_bytes=1024) as (port, seen):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmserve\r\nContent-Length: 4096\r\n\r\n")
            too_large = s.recv(4096)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /-/routes HTTP/1.1\r\nHost: mmserve\r\nConnection: close\r\n\r\n")
            routes = s.recv(4096)
        assert too_large.startswith(b"HTTP/1.1 413") and b"exceeds the limit of 1024 bytes" in too_large
        assert routes.startswith(b"HTTP/1.1 404")
        assert seen == []
