#!/usr/bin/env bash
# `cargo deny` for `make lint` and .ci/run (policy in deny.toml).
#
# Bans, licenses and sources need nothing but the lock file and must pass.
# Advisories need the RustSec database, fetched from its git repository: when
# that fetch fails (a machine without that network), a database fetched
# earlier is used as it is, with its date; with none, the advisory check is
# skipped with a message saying so. A real finding always fails.
#
# Installs cargo-deny with `cargo install --locked` when it is missing (a few
# minutes once; ~/.cargo/bin keeps it, so later runs start at once).
set -euo pipefail
cd "$(dirname "$0")/.."

# The version deny.toml was written for; any later one reads it too.
CARGO_DENY_VERSION="${CARGO_DENY_VERSION:-0.20.2}"
if ! cargo deny --version >/dev/null 2>&1; then
    echo "deny: installing cargo-deny $CARGO_DENY_VERSION (cargo install --locked; once, a few minutes)"
    cargo install --locked --quiet cargo-deny --version "$CARGO_DENY_VERSION"
fi

# Duplicate versions are warnings (deny.toml says why); the graphs that
# explain them are left to `cargo deny check bans` run by hand.
cargo deny --color never check --hide-inclusion-graph bans licenses sources

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
if cargo deny --color never check advisories >"$out" 2>&1; then
    # cargo-deny goes on with an earlier copy when the fetch fails: say so.
    db="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/advisory-dbs/advisory-db-*/ 2>/dev/null | head -n 1 || true)"
    if grep -q "failed to fetch advisory database" "$out" && [ -n "$db" ]; then
        echo "deny: the advisory database could not be fetched (offline?); checked against the copy from $(git -C "$db" show -s --format=%cs HEAD 2>/dev/null || echo 'an unknown date')"
    fi
    tail -n 1 "$out"
    exit 0
fi
if ! grep -q "failed to fetch advisory database" "$out"; then
    cat "$out"
    exit 1
fi
db="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/advisory-dbs/advisory-db-*/ 2>/dev/null | head -n 1 || true)"
if [ -n "$db" ] && git -C "$db" rev-parse HEAD >/dev/null 2>&1; then
    echo "deny: the advisory database could not be fetched (offline?); using the copy from $(git -C "$db" show -s --format=%cs HEAD)"
    cargo deny --offline --color never check advisories
else
    echo "deny: advisories SKIPPED: the RustSec advisory database could not be fetched (no network to its repository) and no earlier copy exists; bans, licenses and sources were checked"
fi
