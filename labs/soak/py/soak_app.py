"""The soak's Python remote kind (``leasehold-soak``, profile ``operators``).

Kind ``soak-py``: a step, a write through the worker's effects ledger to the
soak's accounting destination (``ctx.effect``, business key supplier +
number, ``find_existing`` by that key), then two approval gates, each a
``ctx.park`` that an operator of the soak answers with its own answer
(``leasehold review resume ID --answer '{"park": "approve-<n>", ...}'``).
The output names the answer each gate got, so the soak can tell a gate
passed with another gate's answer. An input ``{"hold_s": S, ...}`` holds
in a step for S seconds instead (the soak kills its worker there until the
job is poison); ``{"echo": X}`` answers X (the corrected replay of it).

Serve it: ``SOAK_ACCOUNTING_URL=http://127.0.0.1:P python -m leasehold serve
soak_app:app`` (``LEASEHOLD_PORT``), from this directory.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Optional, Tuple

from leasehold import App, Ctx, Found, NOT_FOUND, ToolCall, ToolError, Unavailable

app = App(version="1")

ACCOUNTING = os.environ.get("SOAK_ACCOUNTING_URL", "http://127.0.0.1:8089").rstrip("/")


def http(method: str, path: str, body: Optional[Any] = None, headers: Optional[Dict[str, str]] = None, timeout: float = 30) -> Tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(ACCOUNTING + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@app.kind("soak-py")
def soak_py(ctx: Ctx) -> Any:
    inp = ctx.input or {}
    if "echo" in inp:  # a corrected replay: its input is its output
        return inp["echo"]
    if "hold_s" in inp:  # held in a step until its worker is killed
        return ctx.step("hold", lambda: (time.sleep(float(inp["hold_s"])), {"held": True})[1])
    number = ctx.step("number", lambda: str(inp["number"]))
    args = {"supplier": str(inp.get("supplier", "Soak Py")), "number": number, "amount": float(inp.get("amount", 10))}
    key = f"invoice:{args['supplier']}:{number}"
    booked = ctx.effect("book_invoice", args, business_key=key, timeout_ms=3000)
    answers = []
    for gate in (1, 2):
        answers.append(ctx.park(f"approve-{gate}", f"gate {gate} of {ctx.job.id}: answer {{\"park\": \"approve-{gate}\"}}"))
        ctx.step(f"after-{gate}", lambda: gate)
    return {"invoice": booked.get("id") if isinstance(booked, dict) else booked, "answers": answers}


@app.tool("book_invoice")
def book_invoice(args: Any, call: ToolCall) -> Any:
    try:
        status, v = http("POST", "/accounting/invoices", args, {"Idempotency-Key": call.idempotency_key})
    except OSError as e:
        raise ToolError(f"accounting: {e}")
    if status in (200, 201):
        return v
    if status == 409:  # already there: that is the effect
        return v.get("invoice")
    if status == 429 or status >= 500:
        raise ToolError(f"accounting answered {status}")
    raise ToolError(f"accounting answered {status}: {v}", code="terminal")


@book_invoice.find_existing
def find_invoice(args: Any, call: ToolCall) -> Any:
    q = urllib.parse.urlencode({"supplier": args["supplier"], "number": args["number"]})
    try:
        status, v = http("GET", "/accounting/invoices?" + q, timeout=5)
    except OSError as e:
        return Unavailable(str(e))
    if status == 404:
        return NOT_FOUND
    if status != 200:
        return Unavailable(f"accounting answered {status}")
    return Found(v)
