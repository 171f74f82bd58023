"""The HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``, served in a daemon thread.

It answers from whatever it is given (``Scrapeable``: the exporter in
``nodeagent.metrics``) and does nothing else: a probe is never the way to
reload or act. It is hardened against slow and many clients (below).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from nodeagent.config import parse_address
from nodeagent.errors import NodeagentError


class Scrapeable(Protocol):
    """What the endpoint reads: the exposition and the two probes' answers."""

    def scrape(self, accept: str | None) -> tuple[bytes, str]: ...

    def live(self) -> tuple[bool, str]: ...

    def ready(self) -> tuple[bool, str]: ...


# The endpoint is bounded: a scraper, the kubelet's probes and a person's curl need a
# handful of connections; a flood of slow clients (1000 held 1028 threads and +28 MB,
# never given back) must cost neither memory nor the loop. Past the cap a connection is
# closed unread; each request has one deadline for reading it and writing the answer.
MAX_CONNECTIONS = 32
REQUEST_DEADLINE_S = 5.0


class _Server(ThreadingHTTPServer):
    """At the connection cap, the oldest connection still sending its request is closed to
    make room: a slow client loses its place, a scraper or probe (its request sent at
    once) gets one, and a flood of slow clients starves neither."""

    daemon_threads = True
    exporter: Scrapeable

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reading: dict[Any, float] = {}  # connection -> when it came, until its request is in
        self._lock = threading.Lock()
        self.evicted = 0  # slow connections closed to make room

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._evict_oldest_reader()
            if not self._slots.acquire(timeout=1.0):
                self.shutdown_request(request)  # every slot busy answering: no thread
                return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def request_read(self, request: Any) -> None:
        """The handler has its whole request: it is no longer a candidate to close."""
        with self._lock:
            self._reading.pop(request, None)

    def _evict_oldest_reader(self) -> None:
        with self._lock:
            if not self._reading:
                return
            oldest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[oldest]
        self.evicted += 1
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its handler's read ends; its slot comes back

    def _done(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)
        self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DeadlineReader:
    """The request's bytes under one deadline for all of them: a per-read timeout lets a
    client that sends a byte every few seconds keep its thread for ever (slowloris)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""
        self.closed = False

    def _fill(self) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received within its deadline")
        self.sock.settimeout(left)
        chunk = self.sock.recv(4096)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0 or 0 <= limit <= len(self.buf) or not self._fill():
                end = i + 1 if i >= 0 else len(self.buf)
                if limit >= 0:
                    end = min(end, limit)
                line, self.buf = self.buf[:end], self.buf[end:]
                return line

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        end = len(self.buf) if n < 0 else n
        data, self.buf = self.buf[:end], self.buf[end:]
        return data

    def close(self) -> None:
        self.closed = True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        self._deadline = time.monotonic() + REQUEST_DEADLINE_S
        self.rfile = _DeadlineReader(self.connection, self._deadline)  # type: ignore[assignment]

    def do_GET(self) -> None:
        self.server.request_read(self.connection)
        exporter = self.server.exporter
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = exporter.scrape(self.headers.get("Accept"))
            self._reply(200, body, ctype)
            return
        probe = {"/healthz": exporter.live, "/readyz": exporter.ready}.get(path)
        if probe is None:
            self._reply(404, b"not found: /metrics, /healthz, /readyz\n")
            return
        ok, text = probe()
        self._reply(200 if ok else 503, text.encode())

    def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        # The answer is written within what is left of the request's deadline.
        self.connection.settimeout(max(0.05, self._deadline - time.monotonic()))
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""


class MetricsServer:
    """The HTTP endpoint in a daemon thread; ``close()`` stops it."""

    def __init__(self, exporter: Scrapeable, address: str) -> None:
        host, port = parse_address(address)
        server = _Server6 if ":" in host else _Server
        try:
            self._httpd = server((host, port), _Handler)
        except OSError as exc:
            raise NodeagentError(f"metrics address {address}: {exc.strerror or exc}") from None
        self._httpd.exporter = exporter
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._serve, name="nodeagent-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # SIGTERM/SIGINT belong to the agent's loop (host/events.StopOnSignal); this
        # thread and the request threads it starts (they inherit the mask) never take them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
