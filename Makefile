# robobus: the two commands are `make run` and `make test`; each sets up what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NODEV  := tests/contract/asyncapi-validate
DASH   := shared/tools/dashboard
MODELINA := tests/contract/modelina
MCAPCLI := .venv-mcapcli
TSEXAMPLE := examples/typescript
FOXCLIENT := tests/foxglove/wsclient
# The suite runs in four processes (pytest-xdist), each of tests/conftest.py's units (a module, the docker modules
# together, the realtime modules together, the conformance suite per service) whole in one; PYTEST_WORKERS=0 runs
# it in one process, in file order. The suite mostly waits (on brokers, stacks, deadlines), so four fit two cores;
# six fill them (the run is then CPU-bound) and put the tests that time a device's answers on a starved host: no
# faster on fresh clones, and less steady. The realtime processes of two units never run at once (one lock on the
# machine: tests/conftest.py).
PYTEST_WORKERS ?= 4
PYTEST_ARGS ?=

.PHONY: setup system-deps docker-deps run test lint pytest bench bench-quick perf-table schema schema-check chaos soak prove screenshots clean help

help:
	@echo "make run     start a local mosquitto and every service on simulators"
	@echo "make test    lint + the whole test suite"
	@echo "make lint    ruff + mypy"
	@echo "make bench   every benchmark, each writing bench/results/<bench>.json; BENCH_ARGS=--quick for short runs"
	@echo "make perf-table  render docs/performance.md and README.md's Performance table from bench/results/"
	@echo "make schema  write docs/asyncapi.yaml and docs/schemas/*.json (ROOT=site1/robobus: for that root)"
	@echo "make up      the whole system in containers (COMPOSE_PROFILES=sim|hand|epuck); make down stops it"
	@echo "make conformance  every service against the same fault script (table of health transitions)"
	@echo "make chaos   faults against the whole simulated system + a 3-minute soak (table of invariants)"
	@echo "make soak    the 30-minute soak of the whole simulated system (RSS, CPU, threads per process)"
	@echo "make prove  make test RUNS times beside stress-ng --cpu 1, then RUNS times quiet (default 3)"

setup: system-deps $(STAMP) $(NODEV)/node_modules/.installed $(DASH)/node_modules/.installed \
       $(MODELINA)/node_modules/.installed $(TSEXAMPLE)/node_modules/.installed $(MCAPCLI)/.installed \
       $(FOXCLIENT)/node_modules/.installed

# Debian packages: mosquitto (broker), its clients, iproute2 (netns/veth for the EtherCAT tests),
# rt-tests (cyclictest, the realtime anchor of bench/ethercat_cycle.py), nodejs/npm (AsyncAPI parser).
system-deps:
	@deploy/dev/system-deps.sh

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,dev]'
	@touch $@

$(NODEV)/node_modules/.installed: $(NODEV)/package.json $(NODEV)/package-lock.json
	cd $(NODEV) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The dashboard's browser library (Ajv), served as shipped by `robobus dashboard` (its MQTT client is its own).
$(DASH)/node_modules/.installed: $(DASH)/package.json $(DASH)/package-lock.json
	cd $(DASH) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The AsyncAPI model generator (Modelina) and tsc, for the generated-models tests (tests/contract).
$(MODELINA)/node_modules/.installed: $(MODELINA)/package.json $(MODELINA)/package-lock.json
	cd $(MODELINA) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The TypeScript example client (mqtt.js, tsc), run by tests/contract/test_example_typescript.py.
$(TSEXAMPLE)/node_modules/.installed: $(TSEXAMPLE)/package.json $(TSEXAMPLE)/package-lock.json
	cd $(TSEXAMPLE) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The Foxglove WebSocket protocol's own client (@foxglove/ws-protocol), run by tests/foxglove against `robobus foxglove`.
$(FOXCLIENT)/node_modules/.installed: $(FOXCLIENT)/package.json $(FOXCLIENT)/package-lock.json
	cd $(FOXCLIENT) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# pymcap-cli, an MCAP implementation independent of ours (its own reader, small-mcap), which
# tests/record/test_mcap_cli.py runs on our files; its own venv, since its dependencies are many.
# (The official `mcap` CLI is a Go program, and there is no Go toolchain here.)
$(MCAPCLI)/.installed: tests/record/mcapcli-requirements.txt
	@test -x $(MCAPCLI)/bin/python || $(PYTHON) -m venv $(MCAPCLI)
	$(MCAPCLI)/bin/python -m pip install -q -r tests/record/mcapcli-requirements.txt
	@touch $@

run: setup
	@deploy/dev/run-local.sh

lint: setup
	$(BIN)/ruff check shared services tests bench
	$(BIN)/mypy shared services $(wildcard bench/*.py)

pytest: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# pytest prints the slowest 15 tests and, from ROBOBUS_TEST_T0, the wall time of `make test` after setup. Lint runs
# beside the tests, niced (it is CPU for half a minute, the suite mostly waits); its output is printed after them, and
# either failing fails `make test`.
test: setup docker-deps
	@export ROBOBUS_TEST_T0=$$(date +%s.%N); lint_log=$$(mktemp); \
	( nice -n 10 $(MAKE) --no-print-directory lint > $$lint_log 2>&1; echo $$? > $$lint_log.rc ) & \
	$(MAKE) --no-print-directory pytest; rc=$$?; wait; \
	echo "== make lint (beside the tests)"; cat $$lint_log; lint_rc=$$(cat $$lint_log.rc); rm -f $$lint_log $$lint_log.rc; \
	if [ "$$lint_rc" != 0 ]; then echo "make test: lint failed"; fi; \
	[ "$$rc" = 0 ] && [ "$$lint_rc" = 0 ]

# The container tests' engine (docker.io, compose v2, dockerd, a base image: deploy/dev/ensure-docker.sh), installed
# or started when missing, as part of make test's setup (before its timer starts, like the apt packages of
# system-deps); not for `make run`, which needs no docker. Where docker cannot run, the container tests skip saying why.
docker-deps:
	@if [ "$$(id -u)" = 0 ] && [ -z "$${ROBOBUS_SKIP_DOCKER:-}" ]; then \
	  deploy/dev/ensure-docker.sh > /dev/null || echo "make test: docker cannot run here (the container tests say why)"; fi

# The busy-machine proof: the whole suite RUNS times with a CPU hog on one core, RUNS times quiet.
RUNS ?= 3
prove: setup
	@RUNS=$(RUNS) deploy/dev/prove-suite.sh

# ROOT=site1/robobus: the document for that topic root (written into every address), in OUT (default
# build/schema/<root>, so that the committed docs/ keep the generic one with its {root} parameter)
ROOT ?=
OUT ?= $(if $(ROOT),build/schema/$(ROOT),docs)
schema: setup
	$(BIN)/robobus schema --out $(OUT) $(if $(ROOT),--root $(ROOT))

schema-check: setup
	$(BIN)/robobus schema --out docs --check

# Every bench prints its figures against their targets and writes its result (bench/results.py) to
# bench/results/<bench>[-<variant>].json: the committed last run, which perf-table renders (a bench run by hand
# writes to build/bench/ unless ROBOBUS_BENCH_RESULTS says otherwise). BENCHES="epuck roi" runs only those.
# bench/suite.py (`make test` on a fresh clone, timed) is the whole suite, so not a default: BENCHES=suite.
# ethercat_cycle and deploy need root (deploy docker too): without them they say so and write nothing. A bench
# that fails does not stop the others; `make bench` names it at the end and fails.
BENCHES ?= rpc ethercat_cycle ethercat_model_idle flash epuck roi dexter stop record dashboard deploy footprint prometheus foxglove_bridge fleet
bench: setup
	@failed=""; for b in $(BENCHES); do echo "== bench/$$b.py $(BENCH_ARGS)"; \
	  ROBOBUS_BENCH_RESULTS=bench/results $(BIN)/python bench/$$b.py $(BENCH_ARGS) || failed="$$failed $$b"; done; \
	  $(MAKE) --no-print-directory perf-table; \
	  if [ -n "$$failed" ]; then echo "make bench: failed:$$failed"; exit 1; fi

perf-table: $(STAMP)
	$(BIN)/python bench/perf_table.py

# A virtual Shadow hand (bridge + 0220 palm) on a veth pair in namespace robobus-ec, for
# ROBOBUS_ETHERCAT_BACKEND=virtual (root). VHAND_ARGS="--protocol 0230"; tear down with
# `.venv/bin/python -m services.ethercat_loop.sim.netns down`.
ethercat-vhand:
	$(BIN)/python -m services.ethercat_loop.sim.netns up $(VHAND_ARGS)

# The conformance suite (tests/conformance): every registered service on its simulator against the same fault
# script; prints the table service x fault x (seen, time, verdict). It also runs in `make test`.
conformance: setup
	$(BIN)/python -m pytest tests/conformance -q -s -p no:cacheprovider

# Chaos and soak (tests/chaos): the suite runs the CI-sized version; these run the long ones.
chaos: setup
	$(BIN)/python -m tests.chaos --soak-minutes 3

soak: setup
	$(BIN)/python -m tests.chaos --only-soak --soak-minutes 30

bench-quick:
	@$(MAKE) --no-print-directory bench BENCH_ARGS=--quick

# The dashboard's pictures in its README (docs/dashboard/*.png), refreshed on purpose: the browser tests write
# their screenshots there only when asked; a plain test run writes them to a temporary directory.
screenshots: setup
	ROBOBUS_DASHBOARD_SHOTS=docs/dashboard $(BIN)/python -m pytest tests/dashboard/test_browser.py -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(MCAPCLI) $(NODEV)/node_modules $(DASH)/node_modules $(MODELINA)/node_modules $(TSEXAMPLE)/node_modules \
	       .pytest_cache .mypy_cache .ruff_cache

# -- containers (deploy/): the whole system on this host, from nothing -------------------------------------
# COMPOSE_PROFILES=sim (default: every service on its simulator), hand, epuck; ROBOBUS_ENV_FILE=a host's env.
.PHONY: up down
up:
	@deploy/up.sh

down:
	@deploy/down.sh
