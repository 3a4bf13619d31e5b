"""The invoice agent of examples/invoice, in Python, as a remote kind.

It parses a supplier's email (a step), looks the supplier up (a step: a
read), asks a person when the amount is above ``approval_over``
(``ctx.park``), and creates the invoice in the accounting system through
the worker's effects ledger (``ctx.effect``, business key supplier +
number, ``find_existing`` by that key): exactly one invoice, whatever
crashes, timeouts, retries or repeated calls happen on the way.

Serve it: ``INVOICE_ACCOUNTING_URL=http://127.0.0.1:8089 python -m leasehold
serve app:app --port 9000`` (from this directory), then run a worker with
``--remote-kind invoice=http://127.0.0.1:9000/``.

It also serves ``conformance``, the kind of the conformance suite
(``tests/it/remote.rs``; any SDK implements it to run the suite).

Test hooks (environment): ``INVOICE_AMOUNT_BIAS`` adds to every amount and
``CONFORMANCE_CODE_VERSION=2`` renames a step: code changes between two
attempts of one job.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Optional, Tuple

from leasehold import (
    App,
    Ctx,
    Fail,
    Found,
    NOT_FOUND,
    Retry,
    ToolCall,
    ToolError,
    Unavailable,
    Unknowable,
)

app = App(version=os.environ.get("CONFORMANCE_CODE_VERSION", "1"))

ACCOUNTING = os.environ.get("INVOICE_ACCOUNTING_URL", "http://127.0.0.1:8089").rstrip("/")
BIAS = float(os.environ.get("INVOICE_AMOUNT_BIAS", "0"))


def say(line: str) -> None:
    """A line on stdout the tests wait for."""
    print(line, flush=True)


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


def parse(body: str) -> Dict[str, Any]:
    """Reads "Invoice <number> from <supplier>: <amount> EUR"."""
    _, sep, rest = body.partition("Invoice ")
    if not sep:
        raise Fail('no "Invoice <number> from <supplier>: <amount>" in the email')
    number, sep, rest = rest.partition(" from ")
    supplier, sep2, rest = rest.partition(":")
    if not sep or not sep2:
        raise Fail('no "from <supplier>: <amount>"')
    try:
        amount = float(rest.split()[0].replace(",", ""))
    except (IndexError, ValueError):
        raise Fail("the amount is not a number")
    return {"supplier": supplier.strip(), "number": number.strip(), "amount": amount}


@app.kind("invoice")
def invoice(ctx: Ctx) -> Any:
    inp = ctx.input

    def parse_step() -> Dict[str, Any]:
        if inp.get("slow_parse_s") and ctx.job.epoch == 1:
            say(f"parsing {ctx.job.id} epoch {ctx.job.epoch}")
            time.sleep(float(inp["slow_parse_s"]))
        return parse(inp["email"]["body"])

    parsed = ctx.step("parse", parse_step)

    def lookup() -> Any:
        status, v = http("GET", "/accounting/suppliers?" + urllib.parse.urlencode({"name": parsed["supplier"]}))
        if status != 200:
            raise RuntimeError(f"supplier lookup answered {status}")
        return v

    supplier = ctx.step("lookup_supplier", lookup)
    over = inp.get("approval_over")
    if over is not None and parsed["amount"] > over:
        answer = ctx.park(
            "approval",
            f"create invoice {parsed['number']} of {parsed['supplier']} for {parsed['amount']:.2f} EUR? "
            'answer {"approve": true} or false',
        )
        if not (isinstance(answer, dict) and answer.get("approve") is True):
            raise Fail(f"invoice {parsed['number']} refused by the reviewer")
    args = {
        "supplier": parsed["supplier"],
        "supplier_id": supplier["id"],
        "number": parsed["number"],
        "amount": parsed["amount"] + BIAS,
    }
    key = f"invoice:{parsed['supplier']}:{parsed['number']}"
    inv = ctx.effect("create_invoice", args, business_key=key, timeout_ms=3000)
    note = ctx.step("note", lambda: f"invoice {inv['id']} booked")
    out: Dict[str, Any] = {"invoice": inv, "note": note}
    if inp.get("ask_again"):
        ctx.step("pause", lambda: 1)
        out["again"] = ctx.effect("create_invoice", args, business_key=key, timeout_ms=3000)
    return out


@app.tool("create_invoice")
def create_invoice(args: Any, call: ToolCall) -> Any:
    status, v = http("POST", "/accounting/invoices", args, {"Idempotency-Key": call.idempotency_key})
    if status in (200, 201):
        return v
    if status == 409:  # already there: that is the effect
        return v.get("invoice")
    if status == 429 or status >= 500:
        raise ToolError(f"accounting answered {status}")
    raise ToolError(f"accounting answered {status}: {v}", code="terminal")


@create_invoice.find_existing
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
    if isinstance(v, dict) and v.get("status") == "ambiguous":
        return Unknowable(f"the accounting system cannot tell whether invoice {args['number']} exists: {v.get('message')}")
    return Found(v)


@app.kind("echo")
@app.kind("echo-remote")
def echo(ctx: Ctx) -> Any:
    """The input as the output (the bench's remote echo)."""
    return ctx.input


@app.kind("writer")
def writer(ctx: Ctx) -> Any:
    """One model call through the worker's agent runtime (``ctx.generate``)."""
    topic = ctx.step("topic", lambda: ctx.input.get("topic", "leases"))
    out = ctx.generate(f"Write one sentence about {topic}.", system="You write short answers.")
    return {"text": out["text"], "model_calls": out["model_calls"]}


SIM_WEB = os.environ.get("SCOUT_WEB_URL", ACCOUNTING).rstrip("/")
ARCHIVE = os.environ.get("SCOUT_ARCHIVE_FILE", "")


@app.tool(
    "search",
    read=True,
    description="Search the web; returns results with title, url and content.",
    schema={"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}},
)
def search(args: Any, call: ToolCall) -> Any:
    """A read: called directly by the worker, as often as the model asks."""
    say(f"tool search {args.get('q')!r}")
    q = urllib.parse.urlencode({"q": args.get("q", ""), "format": "json"})
    with urllib.request.urlopen(f"{SIM_WEB}/search?{q}", timeout=10) as r:
        results = json.loads(r.read())["results"][:3]
    return {"results": [{"title": x["title"], "url": x["url"], "content": x["content"]} for x in results]}


@app.tool(
    "fetch",
    description="Fetch a page and file a copy in the archive; returns its url and length.",
    schema={"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}},
)
def fetch(args: Any, call: ToolCall) -> Any:
    """A write (the archive's copy): run by the worker through its ledger,
    once ever, with the idempotency key recorded beside the copy."""
    url = str(args.get("url", ""))
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8", "replace")
    result = {"url": url, "chars": len(text), "text": text[:2000]}
    if ARCHIVE:
        with open(ARCHIVE, "a") as f:
            f.write(json.dumps({"key": call.idempotency_key, "result": result}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    say(f"tool fetch {url} key {call.idempotency_key}")
    return result


@fetch.find_existing
def find_fetched(args: Any, call: ToolCall) -> Any:
    if not ARCHIVE:
        return Unknowable("no archive to look in")
    try:
        with open(ARCHIVE) as f:
            for line in f:
                rec = json.loads(line)
                if rec["key"] == call.idempotency_key:
                    return Found(rec["result"])
    except FileNotFoundError:
        pass
    return NOT_FOUND


@app.kind("scout")
def scout(ctx: Ctx) -> Any:
    """A model conversation offered the service's tools: ``search`` (a
    read) and ``fetch`` (a write through the worker's ledger)."""
    topic = ctx.step("topic", lambda: (ctx.input or {}).get("topic", "lease renewal"))
    out = ctx.generate(f"Research {topic} and write one section citing your source.", system="You research.", tools=["search", "fetch"])
    return {"text": out["text"], "model_calls": out["model_calls"]}


@app.kind("conformance")
def conformance(ctx: Ctx) -> Any:
    """The conformance suite's kind. Input: ``steps`` (n, default 2),
    ``slow_step`` (index of a step that announces itself on stdout with
    ``step <i> of <job> epoch <e>`` and sleeps ``slow_s``, in epoch
    ``slow_epoch`` only when given), ``pad`` (bytes
    of padding in each step's result), ``fail`` (a message: fail terminal
    at the end), ``retry_ms`` (the first attempt ends with a retry asking
    for that delay, after the steps), ``sleep_ms`` (a durable sleep after
    the steps), ``signal`` (then waits for that signal, twice, at most
    ``signal_timeout_ms`` each; the output's ``signals`` lists what each
    took), ``children`` (then spawns that many ``echo`` children with
    input ``{"i": k}`` and joins them; the output's ``children`` lists
    their outcomes)."""
    inp = ctx.input or {}
    n = int(inp.get("steps", 2))
    total = 0
    for i in range(n):
        name = "count" if not (app.version == "2" and i == 1) else "tally"

        def work(i: int = i) -> Any:
            slow_epoch = inp.get("slow_epoch")
            if inp.get("slow_step") == i and (slow_epoch is None or slow_epoch == ctx.job.epoch):
                say(f"step {i} of {ctx.job.id} epoch {ctx.job.epoch}")
                time.sleep(float(inp.get("slow_s", 5)))
            r: Dict[str, Any] = {"i": i}
            if inp.get("pad"):
                r["pad"] = "x" * int(inp["pad"])
            return r

        total += ctx.step(name, work)["i"]
    if inp.get("sleep_ms") is not None:
        ctx.sleep(int(inp["sleep_ms"]) / 1000)
    signals = []
    if inp.get("signal"):
        t = inp.get("signal_timeout_ms")
        for _ in range(2):
            signals.append(ctx.wait_for(str(inp["signal"]), None if t is None else int(t) / 1000))
    outcomes = None
    if inp.get("children"):
        kids = ctx.spawn_many("echo", [{"i": k} for k in range(int(inp["children"]))])
        outcomes = ctx.join(kids)
    if inp.get("fail"):
        raise Fail(str(inp["fail"]))
    if inp.get("retry_ms") is not None and ctx.job.attempt == 1:
        raise Retry("the conformance kind asks for a retry", delay_ms=int(inp["retry_ms"]))
    out: Dict[str, Any] = {"sum": total, "steps": n}
    if inp.get("signal"):
        out["signals"] = signals
    if outcomes is not None:
        out["children"] = outcomes
    return out


if __name__ == "__main__":
    sys.exit("serve with: python -m leasehold serve app:app")
