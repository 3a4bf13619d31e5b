"""Write leasehold kinds in Python.

A *kind* is a function of a :class:`Ctx` registered on an :class:`App`. A
leasehold worker holds the job and does every write; this process only
answers the worker protocol (v1, ``docs/protocol.md``): each call replays
the function against the job's journal (recorded steps return their
memoized results) until it reaches something new, and answers with that one
thing (a step result to record, an effect to run, a park, or the end).

.. code-block:: python

    from leasehold import App, Ctx

    app = App()

    @app.kind("greet")
    def greet(ctx: Ctx) -> dict:
        name = ctx.step("name", lambda: "world")
        return {"greeting": f"hello, {name}"}

Serve it with ``python -m leasehold serve mymodule:app --port 9000`` and run
a worker with ``--remote-kind greet=http://127.0.0.1:9000/``.

Rules the replay relies on (the protocol's "never"):

- code outside ``ctx.step``/``ctx.effect``/``ctx.park`` runs on every call:
  keep it deterministic and free of side effects;
- a step's result must be JSON (it is recorded as JSON and replayed as such);
- an external write belongs in ``ctx.effect`` (run by the worker through its
  ledger, at most once), never in a step.
"""

from __future__ import annotations

from ._app import (
    App,
    Ctx,
    Fail,
    Found,
    Job,
    NotFound,
    Retry,
    Tool,
    ToolCall,
    ToolError,
    Unavailable,
    Unknowable,
    NOT_FOUND,
    PROTOCOL,
)
from ._server import serve

__all__ = [
    "App",
    "Ctx",
    "Fail",
    "Found",
    "Job",
    "NotFound",
    "NOT_FOUND",
    "PROTOCOL",
    "Retry",
    "Tool",
    "ToolCall",
    "ToolError",
    "Unavailable",
    "Unknowable",
    "serve",
]
