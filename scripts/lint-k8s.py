#!/usr/bin/env python3
"""`make lint`'s Kubernetes check: deploy/k8s/*.yaml against the schemas and
against the binaries they run.

1. Built-in kinds: `kubernetes-validate --strict` (offline schemas; unknown
   fields are errors). KEDA's ScaledObject, a CRD those schemas lack:
   deploy/k8s/schemas/keda-scaledobject.json.
2. Every environment variable a container sets is one its binary reads. The
   names come from the built binary's `--help` (clap's `[env: NAME=]`, plus
   the indented `NAME  description` lines of the sections listing the
   variables that are not flags), so the check follows the code: a flag that
   is renamed or removed makes a manifest that still sets it fail here.
3. The deployment rules the manifests promise: non-root numeric user,
   read-only root file system, no capabilities or privilege escalation,
   RuntimeDefault seccomp, requests and limits, probes, disruption budgets,
   no `replicas` on a Deployment KEDA scales, explicit worker kinds without
   test kinds, a grace period of at least the stop's documented bound
   (docs/reference.md, "Stopping": the worker's drain + hand-back + 1s, the
   reaper's and the console's drain + 1s), the model key
   and NATS passwords from Secrets, each NATS user of
   deploy/nats/permissions.conf with its role's inbox prefix, a setup Job
   that cleans up after itself.

Usage: scripts/lint-k8s.py [--bin-dir target/debug] [deploy/k8s]
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import jsonschema
import yaml

# Variables a manifest may set before the binary reads them, each with why.
# Remove an entry once the binary's --help lists the variable.
PENDING: dict[str, set[str]] = {}

# What the image runs when a container sets no command (Dockerfile CMD).
IMAGE_CMD = ["leasehold-worker"]

# Test kinds: never in a production manifest.
DEV_KINDS = {"echo", "sleep", "fail", "crash", "deliver"}

POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}

# The timeouts a stop (SIGTERM) goes through, with their defaults; a
# process exits within their sum + 1s (docs/reference.md, "Stopping").
STOP_PHASES = {
    "leasehold-worker": [("LH_DRAIN_TIMEOUT", "30s"), ("LH_HAND_BACK_TIMEOUT", "15s")],
    "leasehold-reaper": [("LH_DRAIN_TIMEOUT", "10s")],
    "leasehold-console": [("LH_CONSOLE_DRAIN_TIMEOUT", "5s")],
}

errors = []
notes = []
checks = 0


def check(ok, msg):
    global checks
    checks += 1
    if not ok:
        errors.append(msg)
    return ok


def load(dirpath):
    docs = []
    for path in sorted(glob.glob(os.path.join(dirpath, "*.yaml"))):
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    docs.append((path, d))
    return docs


def validate_schemas(dirpath, docs, schema_dir):
    builtin_by_file = {}
    for path, d in docs:
        if d.get("apiVersion", "").startswith("keda.sh/"):
            schema_path = os.path.join(schema_dir, "keda-%s.json" % d["kind"].lower())
            if not check(os.path.exists(schema_path), "%s: no schema for %s" % (path, d["kind"])):
                continue
            with open(schema_path) as f:
                schema = json.load(f)
            validator = jsonschema.validators.validator_for(schema)(schema)
            errs = sorted(validator.iter_errors(d), key=lambda e: list(e.absolute_path))
            check(not errs, "; ".join("%s: %s/%s: %s at %s" % (
                path, d["kind"], d["metadata"].get("name"), e.message,
                "/".join(str(p) for p in e.absolute_path)) for e in errs))
        else:
            builtin_by_file.setdefault(path, []).append(d)
    for path, ds in builtin_by_file.items():
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as t:
            yaml.safe_dump_all(ds, t)
        try:
            r = subprocess.run(["kubernetes-validate", "--strict", "--quiet", t.name],
                               capture_output=True, text=True)
        finally:
            os.unlink(t.name)
        out = (r.stdout + r.stderr).replace(t.name, path).strip()
        check(r.returncode == 0 and "ERROR" not in out,
              "%s: kubernetes-validate --strict:\n%s" % (path, out))


HELP_CACHE = {}


def help_vars(bin_dir, argv):
    """The variables `argv --help` lists, or None when the binary is missing."""
    key = tuple(argv)
    if key in HELP_CACHE:
        return HELP_CACHE[key]
    exe = os.path.join(bin_dir, argv[0])
    if not os.path.exists(exe):
        HELP_CACHE[key] = None
        return None
    # An empty environment: clap would print the values of variables set.
    r = subprocess.run([exe] + list(argv[1:]) + ["--help"], capture_output=True,
                       text=True, env={})
    text = r.stdout + r.stderr
    names = set(re.findall(r"\[env: ([A-Z][A-Z0-9_]*)[=\]]", text))
    names |= set(re.findall(r"^  ([A-Z][A-Z0-9]*_[A-Z0-9_]+) +\S", text, re.M))
    HELP_CACHE[key] = names
    return names


def duration_s(v):
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", v.strip())
    if not m:
        return None
    n, unit = int(m.group(1)), m.group(2)
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def env_map(container):
    return {e["name"]: e for e in container.get("env", [])}


def check_pods(path, docs, bin_dir):
    scaled = {d["spec"]["scaleTargetRef"]["name"] for _, d in docs if d.get("kind") == "ScaledObject"}
    pdbs = [d for _, d in docs if d.get("kind") == "PodDisruptionBudget"]
    for p, d in docs:
        kind = d.get("kind")
        if kind not in POD_KINDS:
            continue
        name = "%s %s/%s" % (p, kind, d["metadata"]["name"])
        spec = d["spec"]
        tmpl = spec["template"]
        pod = tmpl["spec"]
        labels = tmpl.get("metadata", {}).get("labels", {})
        psc = pod.get("securityContext", {})
        check(psc.get("runAsNonRoot") is True, "%s: pod securityContext.runAsNonRoot must be true" % name)
        check(isinstance(psc.get("runAsUser"), int) and psc.get("runAsUser") > 0,
              "%s: pod securityContext.runAsUser must be a numeric non-root uid" % name)
        check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
              "%s: pod seccompProfile must be RuntimeDefault" % name)
        if kind == "Job":
            check("ttlSecondsAfterFinished" in spec,
                  "%s: a setup Job needs ttlSecondsAfterFinished so it can be applied again" % name)
        if kind == "Deployment":
            if d["metadata"]["name"] in scaled:
                check("replicas" not in spec,
                      "%s: KEDA scales this Deployment; remove spec.replicas" % name)
            check(any(all(labels.get(k) == v for k, v in
                          pdb["spec"]["selector"].get("matchLabels", {}).items())
                      for pdb in pdbs),
                  "%s: no PodDisruptionBudget selects its pods" % name)
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            cname = "%s container %s" % (name, c["name"])
            csc = c.get("securityContext", {})
            check(csc.get("allowPrivilegeEscalation") is False,
                  "%s: allowPrivilegeEscalation must be false" % cname)
            check(csc.get("readOnlyRootFilesystem") is True,
                  "%s: readOnlyRootFilesystem must be true" % cname)
            check("ALL" in csc.get("capabilities", {}).get("drop", []),
                  "%s: capabilities must drop ALL" % cname)
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    check(r in res.get(part, {}), "%s: resources.%s.%s is missing" % (cname, part, r))
            if kind == "Deployment":
                for probe in ("readinessProbe", "livenessProbe"):
                    check(probe in c, "%s: %s is missing" % (cname, probe))
            argv = c.get("command") or IMAGE_CMD
            argv = argv + c.get("args", [])
            binary = os.path.basename(argv[0])
            help_argv = [binary] + ([argv[1]] if binary == "leasehold" and len(argv) > 1 else [])
            env = env_map(c)
            if "LH_API_KEY" in env:
                check("secretKeyRef" in env["LH_API_KEY"].get("valueFrom", {}),
                      "%s: LH_API_KEY must come from a Secret (valueFrom.secretKeyRef)" % cname)
            for secret in ("NATS_PASSWORD", "NATS_TOKEN"):
                if secret in env:
                    check("secretKeyRef" in env[secret].get("valueFrom", {}),
                          "%s: %s must come from a Secret (valueFrom.secretKeyRef)" % (cname, secret))
            # A NATS user of deploy/nats/permissions.conf gets its answers only
            # on its role's inbox prefix (lh-worker: _INBOX_worker).
            user = env.get("NATS_USER", {}).get("value", "")
            if user.startswith("lh-"):
                check(env.get("LH_INBOX_PREFIX", {}).get("value") == "_INBOX_" + user[3:],
                      "%s: NATS_USER %s needs LH_INBOX_PREFIX=_INBOX_%s" % (cname, user, user[3:]))
            if binary == "leasehold-worker":
                kinds = env.get("LH_KINDS", {}).get("value")
                if check(kinds is not None, "%s: set LH_KINDS explicitly" % cname):
                    dev = DEV_KINDS & {k.strip() for k in kinds.split(",")}
                    check(not dev, "%s: test kinds %s in LH_KINDS" % (cname, sorted(dev)))
                check("LH_DEV_KINDS" not in env, "%s: LH_DEV_KINDS is for tests only" % cname)
            # The stop's bound: the phases' timeouts (each variable's default
            # when unset) + 1s for the exit.
            phases = STOP_PHASES.get(binary)
            if phases is not None:
                parts = [duration_s(env.get(var, {}).get("value", default)) for var, default in phases]
                grace = pod.get("terminationGracePeriodSeconds", 30)
                if check(None not in parts, "%s: unreadable %s" % (cname, ", ".join(v for v, _ in phases))):
                    bound = sum(parts) + 1
                    check(grace >= bound,
                          "%s: terminationGracePeriodSeconds (%s) is below the stop's bound "
                          "%s + 1s = %ss" % (cname, grace, " + ".join(v for v, _ in phases), bound))
            known = help_vars(bin_dir, help_argv)
            if not check(known is not None,
                         "%s: %s/%s is not built (cargo build --bins)" % (cname, bin_dir, binary)):
                continue
            check(bool(known), "%s: `%s --help` lists no variables" % (cname, " ".join(help_argv)))
            for var in env:
                if var in known:
                    check(True, "")
                    if binary in PENDING.get(var, ()):
                        notes.append("%s now lists %s: drop it from PENDING in %s"
                                     % (binary, var, os.path.relpath(__file__)))
                elif binary in PENDING.get(var, ()):
                    notes.append("%s: %s is allow-listed until %s reads it" % (cname, var, binary))
                else:
                    check(False, "%s: sets %s, which `%s --help` does not list (not read)"
                          % (cname, var, " ".join(help_argv)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="target/debug")
    ap.add_argument("dir", nargs="?", default="deploy/k8s")
    a = ap.parse_args()
    docs = load(a.dir)
    if not docs:
        print("k8s: no manifests in %s" % a.dir)
        return 1
    validate_schemas(a.dir, docs, os.path.join(a.dir, "schemas"))
    check_pods(a.dir, docs, a.bin_dir)
    for n in notes:
        print("k8s: note: %s" % n)
    for e in errors:
        print("k8s: FAIL %s" % e)
    print("k8s: %d manifests, %d checks, %d failed" % (len(docs), checks, len(errors)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
