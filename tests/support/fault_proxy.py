"""A fault-injecting HTTP proxy on loopback, in front of a real server (moto's S3, `mlflow server`).

    with FaultProxy("http://127.0.0.1:9000") as proxy:      # clients talk to proxy.url
        proxy.fail_next(6, status=503)                       # the next 6 requests get a 503
        proxy.down(seconds=3.0)                              # every request answers 503 for 3 s
        proxy.slow(seconds=0.3, requests=4)                  # the next 4 answers each wait 0.3 s first
        proxy.trip("/model-versions/create", seconds=3.0)    # down for 3 s from the first such request
        proxy.lose_response("/model-versions/create", 1)     # forwarded, but the client gets a 503

Requests that are not failed are forwarded unchanged and their answers returned unchanged;
`proxy.log` records (method, path, status) of every request, answered or failed.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.config import free_port

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


class _Lost:
    status = 503

    def getheaders(self) -> list[tuple[str, str]]:
        return [("Connection", "close")]

    def getheader(self, name: str, default: str = "") -> str:
        return default


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._fail: list[int] = []
        self._down_until = 0.0
        self._slow: tuple[float, int] = (0.0, 0)
        self._trips: dict[str, float] = {}
        self._lose: dict[str, int] = {}
        self.log: list[tuple[str, str, int]] = []
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- faults
    def fail_next(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._fail += [status] * n

    def down(self, seconds: float) -> None:
        with self._lock:
            self._down_until = time.monotonic() + seconds

    def slow(self, seconds: float, requests: int) -> None:
        with self._lock:
            self._slow = (seconds, requests)

    def trip(self, match: str, seconds: float) -> None:
        with self._lock:
            self._trips[match] = seconds

    def lose_response(self, match: str, n: int) -> None:
        with self._lock:
            self._lose[match] = n

    def failed(self) -> int:
        """Requests answered with an injected error."""
        return sum(1 for *_, status in self.log if status < 0)

    def _fault(self, path: str) -> tuple[int | None, float]:
        with self._lock:
            for match, seconds in list(self._trips.items()):
                if match in path:
                    del self._trips[match]
                    self._down_until = time.monotonic() + seconds
            delay, left = self._slow
            self._slow = (delay, left - 1) if left > 0 else (0.0, 0)
            delay = delay if left > 0 else 0.0
            if time.monotonic() < self._down_until:
                return 503, delay
            if self._fail:
                return self._fail.pop(0), delay
            return None, delay

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                status, delay = proxy._fault(self.path)
                if delay:
                    time.sleep(delay)
                if status is not None:
                    proxy.log.append((self.command, self.path, -status))
                    payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(payload)
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                with proxy._lock:
                    lost = next((m for m, n in proxy._lose.items() if m in self.path and n > 0), None)
                    if lost is not None:
                        proxy._lose[lost] -= 1
                if lost is not None:  # the server did the work; its answer never arrives
                    response = _Lost()
                    data = b"lost"
                proxy.log.append((self.command, self.path, -503 if lost is not None else response.status))
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                if self.command != "HEAD" or data:
                    self.send_header("Content-Length", str(len(data)))
                else:
                    self.send_header("Content-Length", response.getheader("Content-Length", "0"))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = _any

        return Handler
