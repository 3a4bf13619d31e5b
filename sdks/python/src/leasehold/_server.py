"""The HTTP side: a stdlib threading server speaking the worker protocol."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

from ._app import PROTOCOL, App, error

#: Requests older or newer than this (by their signature's time) are refused.
SIGNATURE_TOLERANCE_S = 300


def signed_message(t: int, nonce: str, method: str, path: str, body: bytes) -> bytes:
    """What the worker signs: ``<t>.<nonce>.<METHOD>.<path>.<body>``, so a
    signature binds the endpoint (a signed call to one tool is not one to
    another) and, with its nonce, one request."""
    return f"{t}.{nonce}.{method}.{path}.".encode() + body


class Replays:
    """The nonces of signatures accepted within the tolerance window: a
    request signed once is served once (one process's memory; entries leave
    when their time is out of the window)."""

    def __init__(self, tolerance_s: int = SIGNATURE_TOLERANCE_S) -> None:
        self.tolerance_s = tolerance_s
        self._seen: "OrderedDict[str, float]" = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, nonce: str, t: int, now: float) -> bool:
        """Records ``nonce``; False when it was seen already."""
        with self._lock:
            while self._seen:
                oldest = next(iter(self._seen))
                if self._seen[oldest] >= now:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                return False
            self._seen[nonce] = t + self.tolerance_s
            return True


def check_signature(
    secret: str,
    header: Optional[str],
    body: bytes,
    method: str = "POST",
    path: str = "/invoke",
    now: Optional[float] = None,
    seen: Optional[Replays] = None,
) -> Optional[str]:
    """Why the ``X-Leasehold-Signature`` header (``t=<unix>,n=<nonce>,v2=<hex>``)
    does not sign this request, or None when it does: HMAC-SHA256 of
    :func:`signed_message`, ``t`` within 5 min, and (with ``seen``) a nonce
    not served before."""
    if not header:
        return "no X-Leasehold-Signature header"
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts.get("t", ""))
    except ValueError:
        return "the signature has no time"
    now = now if now is not None else time.time()
    if abs(now - t) > SIGNATURE_TOLERANCE_S:
        return "the signature is too old or too new"
    nonce = parts.get("n", "")
    if not nonce or "v2" not in parts:
        return "the signature does not bind the request (no n= and v2=): the worker is older than this service"
    want = hmac.new(secret.encode(), signed_message(t, nonce, method, path, body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, parts["v2"]):
        return "the signature does not match the request (method, path and body)"
    if seen is not None and not seen.first_time(nonce, t, now):
        return "the signature was used before (a replayed request)"
    return None


class _Handler(BaseHTTPRequestHandler):
    server_version = "leasehold-python/1"
    protocol_version = "HTTP/1.1"
    # Small answers on a kept-alive connection: Nagle's algorithm with the
    # peer's delayed ACK would add ~40 ms to every call.
    disable_nagle_algorithm = True
    app: App
    token: Optional[str]
    secret: Optional[str]
    max_body: int
    replays: "Replays"

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        if os.environ.get("LEASEHOLD_LOG_REQUESTS"):
            sys.stderr.write("%s - %s\n" % (self.address_string(), format % args))

    def _send(self, status: int, body: Dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.server.stopping.is_set():  # type: ignore[attr-defined]
            # Stopping: this connection takes no further request.
            self.close_connection = True
            self.send_header("Connection", "close")
        # Headers and body in one write (one segment for small answers).
        self._headers_buffer.append(b"\r\n")
        self._headers_buffer.append(data)
        self.flush_headers()

    def handle_one_request(self) -> None:
        # Counted from the request line's arrival to the answer's last byte:
        # what a stop waits for. An idle kept-alive connection is not.
        try:
            first = self.rfile.peek(1)
        except OSError:
            first = b""
        if not first:
            self.close_connection = True
            return
        with self.server.inflight:  # type: ignore[attr-defined]
            self.server.requests += 1  # type: ignore[attr-defined]
        try:
            super().handle_one_request()
        finally:
            with self.server.inflight:  # type: ignore[attr-defined]
                self.server.requests -= 1  # type: ignore[attr-defined]
                self.server.inflight.notify_all()  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, {"protocol": PROTOCOL, "kinds": sorted(self.app.kinds), "tools": sorted(self.app.tools)})
        else:
            self._send(404, error("not_found", self.path))

    def do_POST(self) -> None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            self._send(400, error("bad_request", "Content-Length must be a byte count"))
            return
        if n > self.max_body:
            self.close_connection = True
            self._send(413, error("request_too_large", f"{n} bytes, the limit is {self.max_body}"))
            return
        raw = self.rfile.read(n)
        got = self.headers.get("Authorization") or ""
        if self.token is not None and not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            self._send(401, error("unauthorized", "a bearer token is required"))
            return
        if self.secret is not None:
            why = check_signature(
                self.secret,
                self.headers.get("X-Leasehold-Signature"),
                raw,
                method="POST",
                path=self.path,
                seen=self.replays,
            )
            if why is not None:
                self._send(401, error("unauthorized", why))
                return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            self._send(400, error("bad_request", f"not JSON: {e}"))
            return
        if body.get("protocol") != PROTOCOL:
            out = error("unsupported_protocol", f"this service speaks protocol {PROTOCOL}, the request {body.get('protocol')!r}")
            out["error"]["supported"] = [PROTOCOL]
            self._send(400, out)
            return
        status, out = self._route(body)
        self._send(status, out)

    def _route(self, body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        path = self.path.rstrip("/")
        if path == "/invoke":
            return self.app.invoke(body)
        if path.startswith("/tools/"):
            rest = path[len("/tools/"):]
            if rest.endswith("/find_existing"):
                return self.app.find_existing(rest[: -len("/find_existing")], body)
            return self.app.run_tool(rest, body)
        return 404, error("not_found", self.path)


#: Default of ``serve``'s ``drain_timeout`` (the worker's --remote-timeout
#: bounds one call to 30 s by default).
DRAIN_TIMEOUT_S = 30.0

#: Exit code of a stop cut short: the drain timeout passed with requests in
#: flight. A second signal exits with 128 + its number.
EXIT_DRAIN_TIMEOUT = 1


class _HTTPServer(ThreadingHTTPServer):
    """The SDK's server: what a stop waits for (the requests in flight) is
    counted here, so every server of the SDK's handler has it."""

    daemon_threads = True

    def __init__(self, address: "tuple[str, int]", handler: type) -> None:
        super().__init__(address, handler)
        self.stopping = threading.Event()
        self.inflight = threading.Condition()
        self.requests = 0


def serve(
    app: App,
    host: str = "127.0.0.1",
    port: int = 9000,
    token: Optional[str] = None,
    hmac_secret: Optional[str] = None,
    max_body: int = 1 << 20,
    processes: int = 1,
    drain_timeout: float = DRAIN_TIMEOUT_S,
) -> None:
    """Serves ``app`` until SIGTERM or SIGINT. Prints ``listening on
    http://ADDR`` once it accepts calls. ``processes`` > 1 forks that many
    processes accepting on the one socket (the GIL bounds one process); each
    keeps its own journal cache, which is only a cache.

    A stop: the first SIGTERM or SIGINT stops accepting and lets the
    requests in flight finish for up to ``drain_timeout`` seconds, then
    returns (or, if some are still running, exits with code 1); a second
    signal exits at once (128 + its number). Signals are handled only when
    ``serve`` runs in the main thread."""
    handler = type(
        "Handler",
        (_Handler,),
        {"app": app, "token": token, "secret": hmac_secret, "max_body": max_body, "replays": Replays()},
    )
    httpd = _HTTPServer((host, port), handler)
    addr = f"{httpd.server_address[0]}:{httpd.server_address[1]}"
    parent = os.getpid()
    children = []
    for _ in range(max(1, processes) - 1):
        pid = os.fork()
        if pid == 0:
            # A child ends with its parent (even a parent killed with -9).
            def watch() -> None:
                while os.getppid() == parent:
                    time.sleep(0.2)
                os._exit(0)

            threading.Thread(target=watch, daemon=True).start()
            code = 0
            try:
                code = _serve_until_stopped(httpd, drain_timeout)
            finally:
                os._exit(code)
        children.append(pid)
    print(f"listening on http://{addr}", flush=True)
    code = _serve_until_stopped(httpd, drain_timeout, children)
    if code:
        raise SystemExit(code)


def _serve_until_stopped(httpd: _HTTPServer, drain_timeout: float, children: "list[int] | None" = None) -> int:
    """Serves until the first signal, drains, and says with what exit code
    the process ends (0: every request finished)."""
    children = children or []
    stopped_by: list = []

    def on_signal(signum: int, _frame: Any) -> None:
        if stopped_by:
            # The second signal: at once (the children get it too).
            for pid in children:
                _kill(pid, signal.SIGKILL)
            os._exit(128 + signum)
        stopped_by.append(signum)
        httpd.stopping.set()  # type: ignore[attr-defined]
        for pid in children:
            _kill(pid, signal.SIGTERM)
        # shutdown() waits for serve_forever's loop: not from its own thread.
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    # No new connection from here on; the requests in flight may finish.
    httpd.server_close()
    deadline = time.monotonic() + drain_timeout
    with httpd.inflight:  # type: ignore[attr-defined]
        while httpd.requests > 0:  # type: ignore[attr-defined]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            httpd.inflight.wait(left)  # type: ignore[attr-defined]
        unfinished = httpd.requests  # type: ignore[attr-defined]
    code = 0
    for pid in children:
        if _wait_child(pid, deadline) != 0:
            code = EXIT_DRAIN_TIMEOUT
    if unfinished:
        sys.stderr.write(
            f"leasehold: shutdown: {unfinished} request(s) still running after the drain timeout "
            f"({drain_timeout:g}s); exiting (the worker retries them)\n"
        )
        sys.stderr.flush()
        code = EXIT_DRAIN_TIMEOUT
    return code


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _wait_child(pid: int, deadline: float) -> int:
    """A forked child's exit code, killed once ``deadline`` (monotonic) passed."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline + 1:
            _kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return EXIT_DRAIN_TIMEOUT
        time.sleep(0.05)
