# Shared by build.sh and test.sh (sourced, not run): podman on a machine
# without a container registry.
#
# - podman runs with runc, cgroupfs and host networking, from a settings file
#   passed as CONTAINERS_CONF (crun and the default rlimits fail on VMs with
#   hybrid cgroups and low hard limits).
# - The base image debian:bookworm-slim is imported from a debootstrap rootfs
#   when no registry can provide it, once: later runs find it cached.
#
# Variables: IMAGE (default localhost/leasehold:dev), LH_IMAGE_STATE (scratch
# directory, default target/image).

IMAGE="${IMAGE:-localhost/leasehold:dev}"
BASE_IMAGE="docker.io/library/debian:bookworm-slim"
LH_IMAGE_STATE="${LH_IMAGE_STATE:-target/image}"
BINS=(leasehold leasehold-worker leasehold-reaper leasehold-console leasehold-sim)

log() { echo "image: $*" >&2; }

# Installs podman, runc and debootstrap when they are missing and apt can
# (root only). Returns non-zero with a reason on stderr when podman cannot
# be had.
ensure_podman() {
    if command -v podman >/dev/null && command -v runc >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "podman is missing and cannot be installed here (needs root and apt-get)"
        return 1
    fi
    log "installing podman, runc and debootstrap (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap; } >"$LH_IMAGE_STATE/apt.log" 2>&1; then
        log "apt-get could not install podman (see $LH_IMAGE_STATE/apt.log)"
        return 1
    fi
    command -v podman >/dev/null && command -v runc >/dev/null
}

# Writes the engine settings and exports CONTAINERS_CONF.
podman_conf() {
    local hard
    hard="$(ulimit -Hn)"
    [ "$hard" = unlimited ] && hard=65536
    local nofile=$((hard < 16384 ? hard : 16384))
    cat >"$LH_IMAGE_STATE/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=4096:4096"]
netns = "host"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
    CONTAINERS_CONF="$(cd "$LH_IMAGE_STATE" && pwd)/containers.conf"
    export CONTAINERS_CONF
}

# The first Debian mirror apt on this machine uses (never a built-in one).
apt_mirror() {
    local m=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        m="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
        m="$(awk '$1 == "deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list)"
    fi
    echo "$m"
}

# Makes sure $BASE_IMAGE exists locally: cached (a pulled one counts: with a
# registry, `podman pull debian:bookworm-slim` first, or simply `docker build
# .`), else imported from a minimal debootstrap rootfs trimmed like the slim
# image (no docs, man pages or locales). Nothing here contacts a registry.
ensure_base_image() {
    if podman image exists "$BASE_IMAGE"; then
        return 0
    fi
    command -v debootstrap >/dev/null || {
        log "$BASE_IMAGE is not here and debootstrap is missing: cannot make it"
        return 1
    }
    local mirror rootfs
    mirror="$(apt_mirror)"
    [ -n "$mirror" ] || {
        log "no Debian mirror in /etc/apt/sources.list*: cannot debootstrap $BASE_IMAGE"
        return 1
    }
    rootfs="$LH_IMAGE_STATE/rootfs"
    rm -rf "$rootfs"
    log "making $BASE_IMAGE with debootstrap from $mirror (about a minute, once; cached after)"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$LH_IMAGE_STATE/debootstrap.log" 2>&1 || {
        log "debootstrap failed (see $LH_IMAGE_STATE/debootstrap.log)"
        return 1
    }
    # As the slim image: packages installed later leave no docs either.
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
    # Nor do they leave downloaded packages or apt's binary caches behind.
    cat >"$rootfs/etc/apt/apt.conf.d/90slim" <<'EOF'
APT::Keep-Downloaded-Packages "false";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
    rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
}
