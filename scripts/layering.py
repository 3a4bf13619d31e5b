#!/usr/bin/env python3
"""The crate layering ARCHITECTURE.md states, checked against `cargo metadata`.

`make layering` (and `make lint`, `make verify`, CI) runs it; any broken rule
fails with the crate, the dependency and the rule's reason.

Rules (normal dependencies; dev- and build-dependencies are free):
  1. Floors: a crate depends only on crates of lower floors (no import runs
     upward, none runs sideways within a floor).
  2. Pure crates: `core`, `transcript` and `proto` do no I/O (no NATS, no
     runtime, no HTTP).
  3. A user's code touches only the SDK: the examples depend on `leasehold`
     alone among the project's crates.
  4. The product never depends on the labs (harness, sim, bench, soak, demo).
  5. Edges the floors allow but the design does not (FORBIDDEN, each with why),
     and crates whose project dependencies are a fixed list (ONLY: core on
     proto and time alone).
  6. The labs stand apart: sim, bench, soak and demo live under `labs/`, the
     product under `crates/` (the harness, test infrastructure, beside it).
  7. The integration tests see the engine through the testkit: `tests/`
     depends (normally or as dev-dependencies) on the public crates (the SDK
     `leasehold`, the protocol `leasehold-proto`), the harness and the
     testkit, and on no other crate of ours.

`--self-test` breaks each rule in a copy of the graph and fails unless every
break is reported, so a rule that cannot fire is noticed.
"""

import json
import subprocess
import sys

# Floor of each crate: a crate may depend on crates of strictly lower floors.
FLOORS = {
    "leasehold-proto": 0,
    "leasehold-time": 0,
    "leasehold-transcript": 0,
    "leasehold-telemetry": 0,
    "leasehold-harness": 0,
    "leasehold-core": 1,
    "leasehold-flow": 1,
    "leasehold-store": 2,
    "leasehold-model": 2,
    "leasehold-tools": 3,
    "leasehold-operate": 3,
    "leasehold-agent": 4,
    "leasehold-worker": 4,
    "leasehold-reaper": 4,
    "leasehold": 5,
    "leasehold-research": 6,
    "leasehold-cli": 6,
    "leasehold-console": 6,
    "leasehold-worker-bin": 7,
    "leasehold-sim": 6,
    "leasehold-demo": 6,
    "leasehold-bench": 6,
    "leasehold-soak": 6,
    "invoice-agent": 6,
    "leasehold-testkit": 8,
    "leasehold-tests": 9,
}
PURE = {"leasehold-core", "leasehold-transcript", "leasehold-proto", "leasehold-time"}
IO_CRATES = {"async-nats", "tokio", "tokio-util", "reqwest", "axum", "hyper"}
EXAMPLES = {"invoice-agent"}
LABS = {"leasehold-harness", "leasehold-testkit", "leasehold-sim", "leasehold-bench", "leasehold-soak", "leasehold-demo"}
# The labs that live under labs/ (the harness is the tests' infrastructure).
LABS_DIR = LABS - {"leasehold-harness", "leasehold-testkit"}
LAB_USERS = LABS | {"leasehold-tests"}
# Allowed by the floors, refused by the design.
FORBIDDEN = {
    ("leasehold-tools", "leasehold-model"): "the toolbox does not know the model; the agent crate adapts one to the other (AgentTools)",
    ("leasehold-reaper", "leasehold-tools"): "the reaper purges the ledger's data through store (store::effects::purge_job)",
    ("leasehold-model", "leasehold-core"): "the model client does not know the job protocol; what they share (time, backoff) is leasehold-time",
}
# What `tests/` may depend on among our crates, dev-dependencies included.
TESTS = "leasehold-tests"
TESTS_SEE = {"leasehold", "leasehold-proto", "leasehold-harness", "leasehold-testkit"}
# Crates whose project dependencies are exactly these (a superset is a break).
ONLY = {
    "leasehold-core": {"leasehold-proto", "leasehold-time"},
}


def graph_from_cargo():
    """The normal dependencies of each crate, the dependencies of every kind
    of `tests/`, and the folder each crate lives in (relative to the
    workspace root)."""
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    meta = json.loads(out)
    root = meta["workspace_root"].rstrip("/") + "/"
    graph = {
        p["name"]: sorted({d["name"] for d in p["dependencies"] if d["kind"] is None})
        for p in meta["packages"]
    }
    places = {
        p["name"]: p["manifest_path"].removeprefix(root).rsplit("/", 1)[0] for p in meta["packages"]
    }
    tests = sorted(
        {d["name"] for p in meta["packages"] if p["name"] == TESTS for d in p["dependencies"]}
    )
    return graph, tests, places


def tests_reach(tests, ours):
    """Rule 7: `tests/` reaches the engine through the testkit alone."""
    return [
        f"{TESTS} -> {d}: the tests see the engine through leasehold-testkit "
        f"(they may depend on {', '.join(sorted(TESTS_SEE))})"
        for d in tests
        if d in ours and d not in TESTS_SEE
    ]


def misplaced(places):
    """Rule 6: the labs under labs/, the product's crates not."""
    found = []
    for name, where in sorted(places.items()):
        if name in LABS_DIR and not where.startswith("labs/"):
            found.append(f"{name} at {where}: the labs live under labs/")
        if name not in LABS and where.startswith("labs/"):
            found.append(f"{name} at {where}: only the labs live under labs/")
    return found


def violations(graph):
    ours = set(graph)
    found = []
    for name, deps in sorted(graph.items()):
        if name not in FLOORS:
            found.append(f"{name}: not placed on a floor (add it to FLOORS in scripts/layering.py and ARCHITECTURE.md)")
            continue
        for d in deps:
            if d in ours and d in FLOORS and FLOORS[d] >= FLOORS[name]:
                found.append(
                    f"{name} -> {d}: runs upward or sideways (floor {FLOORS[name]} -> floor {FLOORS[d]})"
                )
            if name in PURE and d in IO_CRATES:
                found.append(f"{name} -> {d}: a pure crate does no I/O")
            if name in EXAMPLES and d in ours and d != "leasehold":
                found.append(f"{name} -> {d}: a user's code touches only the SDK (`leasehold`)")
            if d in LABS and name not in LAB_USERS:
                found.append(f"{name} -> {d}: the product never depends on the labs")
            if (name, d) in FORBIDDEN:
                found.append(f"{name} -> {d}: {FORBIDDEN[(name, d)]}")
            if name in ONLY and d in ours and d not in ONLY[name]:
                found.append(f"{name} -> {d}: {name} depends on {' and '.join(sorted(ONLY[name]))} alone")
    return found


def self_test(graph, tests, places):
    breaks = {
        "upward": ("leasehold-core", "leasehold-store"),
        "sideways": ("leasehold-store", "leasehold-model"),
        "pure": ("leasehold-core", "tokio"),
        "sdk only": ("invoice-agent", "leasehold-core"),
        "labs": ("leasehold-console", "leasehold-sim"),
        "forbidden": ("leasehold-reaper", "leasehold-tools"),
        "model knows core": ("leasehold-model", "leasehold-core"),
        "core alone": ("leasehold-core", "leasehold-telemetry"),
    }
    failed = False
    for rule, (name, dep) in breaks.items():
        g = {k: list(v) for k, v in graph.items()}
        g[name] = g[name] + [dep]
        if not any(v.startswith(f"{name} -> {dep}:") for v in violations(g)):
            print(f"layering self-test: breaking `{rule}` ({name} -> {dep}) was not reported")
            failed = True
    g = dict(graph)
    g["leasehold-unplaced"] = []
    if not any("not placed" in v for v in violations(g)):
        print("layering self-test: an unplaced crate was not reported")
        failed = True
    if not tests_reach(tests + ["leasehold-store"], set(graph)):
        print(f"layering self-test: {TESTS} -> leasehold-store was not reported")
        failed = True
    for name, where in [("leasehold-sim", "crates/sim"), ("leasehold-core", "labs/core")]:
        if not misplaced({**places, name: where}):
            print(f"layering self-test: {name} at {where} was not reported")
            failed = True
    return failed


def main():
    graph, tests, places = graph_from_cargo()
    if "--self-test" in sys.argv[1:] and self_test(graph, tests, places):
        return 1
    found = violations(graph) + misplaced(places) + tests_reach(tests, set(graph))
    for v in found:
        print(f"layering: {v}")
    if found:
        print(f"layering: {len(found)} rule(s) broken; the rules are in scripts/layering.py")
        return 1
    print(f"layering: {len(graph)} crates, every rule holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
