# leasehold: one image with the binaries `leasehold` (CLI), `leasehold-worker`,
# `leasehold-reaper`, `leasehold-console` and `leasehold-sim`. The default command is the worker;
# run another binary by naming it, e.g. `docker run IMAGE leasehold setup`.
#
#   docker build -t leasehold .
#
# On a machine without a registry (see deploy/image/build.sh), the `build`
# stage is replaced by host-built binaries with
# `podman build --build-context build=<dir>`: the final stage only needs
# /src/target/release/<bin> from it.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
        -p leasehold-cli -p leasehold-worker-bin -p leasehold-reaper -p leasehold-console -p leasehold-sim

FROM debian:bookworm-slim
# CA certificates for TLS to NATS and to model, search and webhook servers.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 leasehold \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin leasehold
COPY --from=build \
    /src/target/release/leasehold \
    /src/target/release/leasehold-worker \
    /src/target/release/leasehold-reaper \
    /src/target/release/leasehold-console \
    /src/target/release/leasehold-sim \
    /usr/local/bin/
USER 10001:10001
CMD ["leasehold-worker"]
