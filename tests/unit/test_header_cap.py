"""The header cap (`mmserve serve`'s HAProxy in front of Serve's proxy beyond loopback), run for real
in front of a small HTTP server: one source address cannot hold more than its connections, while
another still gets through (4,200 unfinished connections from one client used to stop `/health`)."""

from __future__ import annotations

import http.server
import socket
import threading
import time

from deployments.cli.ingress_modes import HeaderCap, free_loopback_port, header_cap_config

REQUEST = b"GET /health HTTP/1.1\r\nHost: mmserve\r\nConnection: close\r\n\r\n"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


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
