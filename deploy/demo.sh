#!/usr/bin/env bash
# `make demo`: run the offline demo from the built binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
exec target/debug/leasehold-demo "$@"
