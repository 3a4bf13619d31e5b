"""A service of the Python SDK for the worker's "every door keeps the
promise" tests (tests/it/remote.rs). Serve it with ``python -m leasehold
serve doors_service:app`` (this directory on ``PYTHONPATH``).

- ``append``: one effect through the worker's ledger, the tool ``append``,
  which appends ``<idempotency key> <line>`` to the file ``APPEND_FILE``
  (flushed and synced). On its first call ever (no ``APPEND_FILE.died``
  yet) the process dies with ``os._exit(9)`` right after the line is
  written and before it answers: the effect happened, the worker's
  connection closes after its request was sent. Its ``find_existing``
  looks the key up in the file.
- ``bka``, ``bkb``: one effect each through ``append`` with the same
  business key (``invoice-1``): two kinds of one service, each its own.
- ``gates``: two approval gates with a step between them
  (``ctx.park("approve-1")``, a step, ``ctx.park("approve-2")``); the
  output is both answers.
"""

from __future__ import annotations

import os
import sys

from leasehold import NOT_FOUND, App, Ctx, Found, ToolCall

app = App(version="1")

FILE = os.environ.get("APPEND_FILE", "/tmp/append.txt")


@app.kind("append")
def append_kind(ctx: Ctx):
    line = ctx.step("line", lambda: str(ctx.input.get("line", "hello")))
    r = ctx.effect("append", {"line": line})
    return {"appended": r}


@app.tool("append")
def append(args, call: ToolCall):
    with open(FILE, "a") as f:
        f.write(f"{call.idempotency_key} {args['line']}\n")
        f.flush()
        os.fsync(f.fileno())
    marker = FILE + ".died"
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("appended, dying before the answer", flush=True)
        sys.stdout.flush()
        os._exit(9)
    return {"line": args["line"]}


@append.find_existing
def append_find(args, call: ToolCall):
    try:
        with open(FILE) as f:
            for line in f:
                if line.split(" ", 1)[0] == call.idempotency_key:
                    return Found({"line": args["line"]})
    except FileNotFoundError:
        pass
    return NOT_FOUND


def business_keyed(ctx: Ctx):
    return ctx.effect("append", {"line": ctx.job.kind}, business_key="invoice-1")


app.kind("bka")(business_keyed)
app.kind("bkb")(business_keyed)


@app.kind("gates")
def gates(ctx: Ctx):
    first = ctx.park("approve-1", "First approval?")
    between = ctx.step("between", lambda: 1)
    second = ctx.park("approve-2", "Second approval?")
    return {"first": first, "second": second, "between": between}
