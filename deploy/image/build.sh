#!/usr/bin/env bash
# `make image`: builds the repository's Dockerfile with podman on this machine,
# without a registry.
#
# The Dockerfile is the conventional one (`docker build .` works anywhere a
# registry is reachable). Here the release binaries are built on the host
# (same glibc as bookworm) and handed to the Dockerfile's `build` stage with
# `--build-context build=DIR`, where DIR/src/target/release/<bin> holds them;
# the final stage starts from debian:bookworm-slim, imported once from a
# debootstrap rootfs (deploy/image/lib.sh).
#
# Usage: deploy/image/build.sh            # IMAGE=localhost/leasehold:dev
#        LH_IMAGE_NO_CARGO=1 deploy/image/build.sh   # reuse target/release
# Exit codes: 0 built, 1 failed, 3 podman cannot be had here.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/image/lib.sh
mkdir -p "$LH_IMAGE_STATE"

ensure_podman || exit 3
podman_conf
ensure_base_image

if [ "${LH_IMAGE_NO_CARGO:-}" != 1 ]; then
    log "cargo build --release --bins --locked"
    cargo build --release --bins --locked
fi

# The build context stands in for the Dockerfile's `build` stage: the same
# paths, hard links to the host's binaries (copies across file systems).
ctx="$LH_IMAGE_STATE/build-stage"
rm -rf "$ctx"
mkdir -p "$ctx/src/target/release"
for b in "${BINS[@]}"; do
    [ -x "target/release/$b" ] || { log "target/release/$b is missing"; exit 1; }
    ln -f "target/release/$b" "$ctx/src/target/release/$b" 2>/dev/null ||
        cp -f "target/release/$b" "$ctx/src/target/release/$b"
done

log "podman build $IMAGE"
if ! podman build --pull=never --build-context "build=$ctx" -t "$IMAGE" -f Dockerfile . \
    >"$LH_IMAGE_STATE/build.log" 2>&1; then
    tail -n 30 "$LH_IMAGE_STATE/build.log" >&2
    log "podman build failed (whole log: $LH_IMAGE_STATE/build.log)"
    exit 1
fi
size="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE ($((size / 1000000)) MB; base $BASE_IMAGE $(($(podman image inspect --format '{{.Size}}' "$BASE_IMAGE") / 1000000)) MB)"
