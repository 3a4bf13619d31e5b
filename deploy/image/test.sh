#!/usr/bin/env bash
# `make image-test`: the image as an operator runs it. Builds it (build.sh),
# starts a nats-server on a free loopback port with its own storage, runs
# `leasehold setup`, the worker and the reaper FROM THE IMAGE (host network),
# submits a job with the host-built CLI and checks it completes; then checks
# the image's user, the refusal of test kinds without the dev switch, and a
# graceful SIGTERM. Prints `image-test: N passed, N failed`; exit 1 on any
# failure. Where podman cannot be installed it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
source deploy/image/lib.sh
mkdir -p "$LH_IMAGE_STATE"

if ! ensure_podman; then
    echo "image-test: SKIPPED: podman is not available and cannot be installed on this machine (needs root and apt-get); nothing was tested"
    exit 0
fi
podman_conf

passed=0
failed=0
ok() { passed=$((passed + 1)); echo "image-test: ok   $*"; }
bad() { failed=$((failed + 1)); echo "image-test: FAIL $*"; }

run_id="lh-image-test-$$"
tmp="$(mktemp -d /tmp/lh-image-test.XXXXXX)"
nats_pid=""
cleanup() {
    podman rm -f "$run_id-worker" "$run_id-reaper" >/dev/null 2>&1
    [ -n "$nats_pid" ] && kill "$nats_pid" 2>/dev/null && wait "$nats_pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

if ! deploy/image/build.sh; then
    bad "the image builds (deploy/image/build.sh)"
    echo "image-test: $passed passed, $failed failed"
    exit 1
fi
ok "the image builds: $IMAGE ($(($(podman image inspect --format '{{.Size}}' "$IMAGE") / 1000000)) MB)"

# A server of our own, as the test harness does: free port, own storage.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
url="nats://127.0.0.1:$port"
nats-server -js -a 127.0.0.1 -p "$port" -sd "$tmp/js" >"$tmp/nats.log" 2>&1 &
nats_pid=$!
for _ in $(seq 100); do
    grep -q "Server is ready" "$tmp/nats.log" && break
    sleep 0.1
done
grep -q "Server is ready" "$tmp/nats.log" || { cat "$tmp/nats.log"; bad "nats-server starts"; }

# As Kubernetes runs it (deploy/k8s): read-only root, no capabilities, no
# privilege escalation.
hardened=(--network host --read-only --cap-drop ALL --security-opt no-new-privileges)
in_image() { podman run --rm "${hardened[@]}" -e "NATS_URL=$url" "$@"; }

# 1. Setup from the image (twice: it is idempotent).
if in_image "$IMAGE" leasehold setup --kinds echo >"$tmp/setup.log" 2>&1 &&
    in_image "$IMAGE" leasehold setup --kinds echo >>"$tmp/setup.log" 2>&1; then
    ok "leasehold setup runs from the image (twice)"
else
    cat "$tmp/setup.log"
    bad "leasehold setup runs from the image"
fi

# 2. The image's user is the numeric non-root one Kubernetes can verify.
user="$(podman image inspect --format '{{.Config.User}}' "$IMAGE")"
uid="$(in_image "$IMAGE" id -u 2>&1)"
if [ "$user" = "10001:10001" ] && [ "$uid" = 10001 ]; then
    ok "runs as uid 10001 (USER $user)"
else
    bad "runs as uid 10001 (USER '$user', id -u '$uid')"
fi

# 3. Test kinds are refused without the dev switch (exit 2, before connecting).
code=0
out="$(in_image -e LH_KINDS=echo "$IMAGE" 2>&1)" || code=$?
if [ "$code" = 2 ] && grep -q -- "--dev-kinds" <<<"$out"; then
    ok "the worker refuses test kinds without LH_DEV_KINDS (exit 2)"
else
    bad "the worker refuses test kinds without LH_DEV_KINDS (exit $code: $out)"
fi

# 4. Worker and reaper from the image (the default command is the worker).
podman run -d --name "$run_id-worker" "${hardened[@]}" -e "NATS_URL=$url" \
    -e LH_KINDS=echo -e LH_DEV_KINDS=1 -e LH_WORKER_ID=image-worker "$IMAGE" >/dev/null
podman run -d --name "$run_id-reaper" "${hardened[@]}" -e "NATS_URL=$url" \
    -e LH_INTERVAL=1s "$IMAGE" leasehold-reaper >/dev/null
wait_log() { # container, needle
    for _ in $(seq 100); do
        # Read whole, then grep: `podman logs | grep -q` under pipefail
        # fails when grep quits early and podman gets SIGPIPE.
        grep -q "$2" <<<"$(podman logs "$1" 2>&1)" && return 0
        sleep 0.1
    done
    podman logs "$1" 2>&1 | tail -n 20
    return 1
}
if wait_log "$run_id-worker" "worker starting" && wait_log "$run_id-reaper" "reaper starting"; then
    ok "worker and reaper start from the image"
else
    bad "worker and reaper start from the image"
fi

# 5. A job submitted with the host's CLI completes on the image's worker.
cli=target/release/leasehold
out="$(NATS_URL="$url" "$cli" submit echo '{"input":{"hello":"image"}}' --id image-1 --wait --timeout 30s 2>&1)"
code=$?
result="$(NATS_URL="$url" "$cli" result image-1 2>&1)"
if [ "$code" = 0 ] && grep -q '"completed"' <<<"$out" && [ "$result" = '{"hello":"image"}' ]; then
    ok "a submitted echo job completes with its result"
else
    bad "a submitted echo job completes (exit $code: $out; result: $result)"
fi
if grep -q "image-worker" <<<"$(podman logs "$run_id-worker" 2>&1)"; then
    ok "the job ran on the image's worker"
else
    bad "the job ran on the image's worker"
fi

# 6. SIGTERM drains and exits 0 (what Kubernetes sends at scale-in).
podman stop -t 20 "$run_id-worker" >/dev/null 2>&1
code="$(podman inspect --format '{{.State.ExitCode}}' "$run_id-worker")"
if [ "$code" = 0 ] && grep -q "SIGTERM" <<<"$(podman logs "$run_id-worker" 2>&1)"; then
    ok "the worker stops on SIGTERM with exit 0"
else
    podman logs "$run_id-worker" 2>&1 | tail -n 10
    bad "the worker stops on SIGTERM with exit 0 (exit $code)"
fi

echo "image-test: $passed passed, $failed failed"
[ "$failed" = 0 ]
