#!/usr/bin/env bash
# leasehold's five NATS users (submitter, worker, reaper, operator, console) for a
# server in operator (JWT) mode, made with `nsc` from permissions.conf.
#
# permissions.conf is the one list of what each role may publish and
# subscribe to; this script reads it, so both ways of running NATS grant
# exactly the same (tests/it/perms.rs checks the commands printed by
# --dry-run against the file). It creates, in the current nsc store:
#
#   - the operator (with a system account) unless it exists;
#   - the account, with JetStream enabled (no limits: set them with
#     `nsc edit account ... --js-disk-storage ...` to taste);
#   - the users lh-submitter, lh-worker, lh-reaper, lh-operator and
#     lh-console with the permissions of their role;
#   - a creds file per user in the creds folder: point the role's binaries
#     at it with NATS_CREDS, and set LH_INBOX_PREFIX to the role's inbox
#     prefix (_INBOX_submitter, _INBOX_worker, _INBOX_reaper,
#     _INBOX_operator, _INBOX_console).
#
# Run it once per nsc store (`nsc add user` refuses a user that exists; to
# change a role's permissions later, `nsc delete user` it and run again).
# Then give the server the resolver configuration and push the account:
#
#   nsc generate config --nats-resolver --sys-account SYS > resolver.conf
#   # include resolver.conf in the server's configuration, with jetstream {}
#   nsc push --all
#
# Usage: deploy/nats/nsc.sh [--dry-run] [--operator NAME] [--account NAME]
#                           [--creds DIR] [--conf FILE]
#   --dry-run   print the nsc commands instead of running them
#   defaults:   --operator leasehold --account LEASEHOLD --creds ./creds
#               --conf permissions.conf beside this script
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
conf="$here/permissions.conf"
operator=leasehold
account=LEASEHOLD
creds=./creds
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
    --dry-run) dry=1 ;;
    --operator) operator="$2"; shift ;;
    --account) account="$2"; shift ;;
    --creds) creds="$2"; shift ;;
    --conf) conf="$2"; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "nsc.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -r "$conf" ] || { echo "nsc.sh: cannot read $conf" >&2; exit 2; }

# The subjects of one list of permissions.conf, comma-separated: ROLE is
# submitter|worker|reaper|operator|console, DIR publish|subscribe, KIND allow|deny.
# The file's layout: a block `LH_<ROLE>_PERMISSIONS = {` holding
# `publish = {` and `subscribe = {`, each with `allow = [` / `deny = [`
# lists of double-quoted subjects (several may share a line), closed by `]`.
subjects() {
    awk -v role="LH_$(echo "$1" | tr a-z A-Z)_PERMISSIONS" -v dir="$2" -v kind="$3" '
        { sub(/#.*/, "") }
        $1 ~ /^LH_[A-Z]+_PERMISSIONS$/ && $2 == "=" { inrole = ($1 == role); section = ""; list = 0; next }
        inrole && ($1 == "publish" || $1 == "subscribe") && $2 == "=" { section = $1; next }
        inrole && ($1 == "allow" || $1 == "deny") && $2 == "=" { list = (section == dir && $1 == kind); next }
        inrole && $1 == "]" { list = 0; next }
        inrole && list {
            line = $0
            while (match(line, /"[^"]*"/)) {
                out = out (out == "" ? "" : ",") substr(line, RSTART + 1, RLENGTH - 2)
                line = substr(line, RSTART + RLENGTH)
            }
        }
        END { print out }
    ' "$conf"
}

# Whether ROLE may answer requests (allow_responses = true).
responds() {
    awk -v role="LH_$(echo "$1" | tr a-z A-Z)_PERMISSIONS" '
        { sub(/#.*/, "") }
        $1 ~ /^LH_[A-Z]+_PERMISSIONS$/ && $2 == "=" { inrole = ($1 == role); next }
        inrole && $1 == "allow_responses" && $3 == "true" { found = 1 }
        END { exit !found }
    ' "$conf"
}

# Runs nsc, or prints the command with every argument single-quoted.
run() {
    if [ "$dry" = 1 ]; then
        local out="nsc" a
        for a in "$@"; do out="$out '$a'"; done
        echo "$out"
    else
        nsc "$@"
    fi
}

if [ "$dry" = 0 ]; then
    command -v nsc >/dev/null || { echo "nsc.sh: nsc is not on PATH (https://github.com/nats-io/nsc)" >&2; exit 1; }
    mkdir -p "$creds"
fi

if [ "$dry" = 1 ] || ! nsc describe operator --name "$operator" >/dev/null 2>&1; then
    run add operator --name "$operator" --sys --generate-signing-key
fi
if [ "$dry" = 1 ] || ! nsc describe account --name "$account" >/dev/null 2>&1; then
    run add account --name "$account"
fi
run edit account --name "$account" --js-mem-storage -1 --js-disk-storage -1 --js-streams -1 --js-consumer -1

for role in submitter worker reaper operator console; do
    args=(add user --account "$account" --name "lh-$role")
    for dir in publish subscribe; do
        for kind in allow deny; do
            list="$(subjects "$role" "$dir" "$kind")"
            [ -n "$list" ] || continue
            flag="--$kind-$([ "$dir" = publish ] && echo pub || echo sub)"
            args+=("$flag" "$list")
        done
    done
    if responds "$role"; then
        args+=(--allow-pub-response)
    fi
    if [ -z "$(subjects "$role" publish allow)" ]; then
        echo "nsc.sh: no permissions for $role in $conf" >&2
        exit 1
    fi
    run "${args[@]}"
    run generate creds --account "$account" --name "lh-$role" --output-file "$creds/lh-$role.creds"
done
