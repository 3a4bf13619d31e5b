"""``python -m leasehold serve module:app [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ._app import App
from ._server import serve


def load(target: str) -> App:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    app = getattr(mod, attr or "app")
    if not isinstance(app, App):
        raise SystemExit(f"{target} is not a leasehold.App")
    return app


def main(argv: "list[str] | None" = None) -> None:
    p = argparse.ArgumentParser(prog="python -m leasehold", description="Serve leasehold kinds over the worker protocol v1.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve module:app")
    s.add_argument("target", help="module:attribute of a leasehold.App")
    s.add_argument("--host", default=os.environ.get("LEASEHOLD_HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=int(os.environ.get("LEASEHOLD_PORT", "9000")))
    s.add_argument("--processes", type=int, default=int(os.environ.get("LEASEHOLD_PROCESSES", "1")), help="processes accepting on the socket (default 1)")
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=float(os.environ.get("LEASEHOLD_DRAIN_TIMEOUT", "30")),
        help="seconds the requests in flight may finish in at SIGTERM/SIGINT (default 30)",
    )
    s.add_argument("--max-body", type=int, default=int(os.environ.get("LEASEHOLD_MAX_BODY", str(1 << 20))))
    a = p.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    app = load(a.target)
    serve(
        app,
        host=a.host,
        port=a.port,
        token=os.environ.get("LEASEHOLD_TOKEN") or None,
        hmac_secret=os.environ.get("LEASEHOLD_HMAC_SECRET") or None,
        max_body=a.max_body,
        processes=a.processes,
        drain_timeout=a.drain_timeout,
    )


if __name__ == "__main__":
    main()
