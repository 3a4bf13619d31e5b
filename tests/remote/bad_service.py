"""A service that breaks the worker protocol on purpose, for the worker's
bad-answer tests (tests/it/remote.rs). Stdlib only; the job's input
``bad`` picks the fault:

- ``not_json``: HTTP 200 with an HTML body;
- ``wrong_schema``: a ``step`` op whose ``index`` is a string;
- ``unknown_op``: ``{"op": "teleport"}``;
- ``step_conflict``: records ``a#0`` = 1, then answers ``a#0`` = 2;
- ``too_large``: an answer over the worker's body limit;
- ``big_step``: a step whose answer fits the worker's 64 KiB body limit
  but whose journal entry, sent back with the job, would not;
- ``v2_only``: refuses protocol 1 (``unsupported_protocol``);
- ``record``: a correct run (a step, an effect whose first tool call
  times out so the worker asks ``find_existing``, the end) that prints
  every request as ``REQ <path> <json>`` and every answer as ``ANS <path>
  <json>``, for the schema test.

Prints ``listening on http://ADDR``; serves on ``LEASEHOLD_PORT`` (0: any).
"""

import json
import os
import threading
import time

TOOL_CALLS = [0]
LOCK = threading.Lock()
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, status, data, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def answer(self, out):
        data = json.dumps(out)
        print(f"ANS {self.path} {data}", flush=True)
        return self.send(200, data.encode())

    def record(self, body):
        print(f"REQ {self.path} {json.dumps(body)}", flush=True)
        if self.path == "/tools/t":
            with LOCK:
                TOOL_CALLS[0] += 1
                first = TOOL_CALLS[0] == 1
            if first:
                time.sleep(1.5)  # past the effect's timeout: outcome unknown
            return self.answer({"protocol": 1, "result": {"ok": True}})
        if self.path == "/tools/t/find_existing":
            return self.answer({"protocol": 1, "status": "not_found"})
        n = body["journal"]["total"]
        if n == 0:
            return self.answer({"protocol": 1, "op": "step", "index": 0, "id": "a#0", "result": {"n": 1}, "version": "1"})
        if n == 1:
            return self.answer({"protocol": 1, "op": "effect", "index": 1, "id": "effect:t#0", "tool": "t", "args": {"x": 1}, "business_key": "k-1", "timeout_ms": 500, "dedupes_by_key": True})
        return self.answer({"protocol": 1, "op": "complete", "output": {"ok": True}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if self.path.startswith("/tools/") or (body["job"].get("input") or {}).get("bad") == "record":
            return self.record(body)
        bad = (body["job"].get("input") or {}).get("bad")
        entries = body["journal"]["entries"]
        if bad == "not_json":
            return self.send(200, b"<html>502 Bad Gateway</html>", "text/html")
        if bad == "wrong_schema":
            return self.send(200, json.dumps({"protocol": 1, "op": "step", "index": "zero", "id": "a#0", "result": 1}).encode())
        if bad == "unknown_op":
            return self.send(200, json.dumps({"protocol": 1, "op": "teleport"}).encode())
        if bad == "step_conflict":
            result = 1 if not entries else 2
            return self.send(200, json.dumps({"protocol": 1, "op": "step", "index": 0, "id": "a#0", "result": result}).encode())
        if bad == "too_large":
            return self.send(200, json.dumps({"protocol": 1, "op": "complete", "output": "x" * (2 << 20)}).encode())
        if bad == "big_step":
            if not entries:
                return self.send(200, json.dumps({"protocol": 1, "op": "step", "index": 0, "id": "a#0", "result": "x" * (65536 - 130)}).encode())
            return self.send(200, json.dumps({"protocol": 1, "op": "complete", "output": {"ok": True}}).encode())
        if bad == "v2_only":
            return self.send(400, json.dumps({"protocol": 2, "error": {"code": "unsupported_protocol", "message": "this service speaks protocol 2 only", "supported": [2]}}).encode())
        return self.send(200, json.dumps({"protocol": 1, "op": "complete", "output": {"ok": True}}).encode())


if __name__ == "__main__":
    s = ThreadingHTTPServer(("127.0.0.1", int(os.environ.get("LEASEHOLD_PORT", "0"))), H)
    s.daemon_threads = True
    print(f"listening on http://{s.server_address[0]}:{s.server_address[1]}", flush=True)
    s.serve_forever()
