"""The HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``, served in a daemon thread.

It answers from whatever it is given (``Scrapeable``: the exporter in
``nodeagent.metrics``) and does nothing else: a probe is never the way to
reload or act. It is hardened against slow, many and fat clients (below).

What the endpoint can hold, whatever any mix of clients does:

- ``MAX_CONNECTIONS`` (32) connections, each with one thread, one request and one
  ``REQUEST_DEADLINE_S`` (5 s) deadline for reading it and writing the answer; past the
  cap the oldest connection still sending its request is closed.
- Per request: its bytes are read through ``_DeadlineReader``, which takes at most
  ``MAX_REQUEST_BYTES`` (16 KiB: request line, headers, blank line) from the socket, a
  line of at most ``MAX_LINE_BYTES`` (4 KiB, CRLF included) and at most ``MAX_HEADERS``
  (32) header lines; past any of them the answer is ``414`` (request line) or ``431``
  (headers) and the connection is closed. ``http.server``'s own limits (100 lines of
  64 KiB: 6.4 MB a request, 205 MB for 32) are never reached. A scrape's request is a
  few hundred bytes.
- Per connection the kernel buffers at most ``2 * MAX_REQUEST_BYTES`` (32 KiB, its
  overhead included) of unread input (``SO_RCVBUF`` on the listening socket, inherited
  by each accepted one; socket memory counts against the pod's memory cgroup).
- So the requests cost at most 32 x (16 KiB read + its parsed copy, ~3 x 16 KiB, + 32 KiB
  in the kernel) ~ 3 MiB in all. The answer is generated per request and held until
  written: ``/metrics`` is 7 KiB on the healthy simulated node (59 samples, ~0.12 KiB
  each; it grows with guards and SR-IOV PFs, a histogram's ~15 samples per PF), a probe
  a line; at most 32 answers are held at once (~0.25 MiB at 7 KiB).

Measured (``tests/test_endpoint_bounds.py``, ``bench/endpoint.py``): 32 clients each
sending 99 header lines of 65,000 bytes took a process serving the endpoint from 29 to
213 MiB before these bounds (OOM-killed in the DaemonSet's 128 MiB); with them it stays
within a few MiB of idle, and inside a real 128 MiB memory cgroup
(``tests/realkernel/test_endpoint_memcg_real.py``) the agent lives and keeps its gate.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
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
# What one request may be: a scrape or a probe is a request line and a handful of short
# headers (curl ~100 bytes, Prometheus a few hundred; a bearer token is one ~1 KiB line).
MAX_LINE_BYTES = 4096  # the request line or one header line, CRLF included
MAX_HEADERS = 32
MAX_REQUEST_BYTES = 16384  # request line, headers and the blank line
_RECV = 4096


class RequestTooLarge(Exception):
    """A request past one of the byte caps: answered with ``status`` and closed."""

    def __init__(self, status: HTTPStatus, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


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

    def server_bind(self) -> None:
        # A client that sends and never stops fills the kernel's receive buffer of its
        # connection (128 KiB and more by default, charged to the agent's memory cgroup);
        # the request can be no longer than MAX_REQUEST_BYTES, so neither need the buffer.
        # Accepted connections inherit it (the kernel doubles the value for overhead).
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_REQUEST_BYTES)
        super().server_bind()

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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets, vanishes or stalls mid-request is not an error of the
        agent's (a flood of them would be a traceback each on stderr); anything else is."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DeadlineReader:
    """The request's bytes under one deadline for all of them (a per-read timeout lets a
    client that sends a byte every few seconds keep its thread for ever: slowloris) and
    within the byte caps: it never takes more than ``MAX_REQUEST_BYTES`` from the socket,
    and raises ``RequestTooLarge`` for a line over ``MAX_LINE_BYTES``, a header past
    ``MAX_HEADERS`` or a request past the total, so ``http.server`` (which would keep 100
    lines of 64 KiB) never holds more than the caps."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray()
        self.received = 0  # bytes taken from the socket for this request
        self.lines = 0  # lines handed out: the request line, then header lines
        self.closed = False

    def _too_large(self, why: str) -> RequestTooLarge:
        if self.lines == 0:
            return RequestTooLarge(HTTPStatus.REQUEST_URI_TOO_LONG, why)
        return RequestTooLarge(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, why)

    def _fill(self) -> bool:
        room = MAX_REQUEST_BYTES - self.received
        if room <= 0:
            raise self._too_large(f"request over {MAX_REQUEST_BYTES} bytes")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received within its deadline")
        self.sock.settimeout(left)
        chunk = self.sock.recv(min(_RECV, room))
        self.received += len(chunk)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n", 0, MAX_LINE_BYTES)
            if i >= 0:
                end = i + 1
                break
            if len(self.buf) >= MAX_LINE_BYTES:
                what = "request line" if self.lines == 0 else "header line"
                raise self._too_large(f"{what} over {MAX_LINE_BYTES} bytes")
            if not self._fill():
                end = len(self.buf)  # the client stopped sending: what there is
                break
        if 0 <= limit < end:
            end = limit
        line = bytes(self.buf[:end])
        del self.buf[:end]
        if self.lines > MAX_HEADERS and line not in (b"\r\n", b"\n", b""):
            raise self._too_large(f"more than {MAX_HEADERS} header lines")
        self.lines += 1
        return line

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        end = len(self.buf) if n < 0 else n
        data = bytes(self.buf[:end])
        del self.buf[:end]
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

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except RequestTooLarge as exc:
            self.close_connection = True
            # The request was not parsed (or only its line): answer as HTTP/1.0.
            self.request_version, self.command = "HTTP/1.0", ""
            self.requestline = getattr(self, "requestline", "")
            self._reply(exc.status, f"{exc.why}\n".encode(), close=True)

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

    def _reply(
        self,
        code: int,
        body: bytes,
        ctype: str = "text/plain; charset=utf-8",
        close: bool = False,
    ) -> None:
        # The answer is written within what is left of the request's deadline.
        self.connection.settimeout(max(0.05, self._deadline - time.monotonic()))
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
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
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, name="nodeagent-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """``serve_forever`` without its poll: it wakes every 0.5 s to look for a
        ``shutdown()`` (twice a second on every node, idle); this waits for a connection
        or ``close``'s byte on a pipe, and sleeps otherwise."""
        # SIGTERM/SIGINT belong to the agent's loop (host/events.StopOnSignal); this
        # thread and the request threads it starts (they inherit the mask) never take them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        listening = self._httpd.socket
        listening.setblocking(False)  # a connection gone before accept is EAGAIN, no block
        with selectors.DefaultSelector() as waiting:
            waiting.register(listening, selectors.EVENT_READ)
            waiting.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = waiting.select()
                if any(key.fd == self._wake_r for key, _events in ready):
                    return
                self._accept()

    def _accept(self) -> None:
        """What ``serve_forever`` does for a readable socket, through the documented
        hooks: accept (a connection gone meanwhile is ignored), verify, process (a thread
        per connection; the cap is ``_Server.process_request``'s)."""
        httpd = self._httpd
        try:
            request, client_address = httpd.get_request()
        except OSError:
            return
        if not httpd.verify_request(request, client_address):
            httpd.shutdown_request(request)
            return
        try:
            httpd.process_request(request, client_address)
        except Exception:
            httpd.handle_error(request, client_address)
            httpd.shutdown_request(request)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._httpd.server_close()
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
