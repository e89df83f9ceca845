# Two commands do everything on a fresh machine:
#   make serve   set up .venv with what serving needs and start the server (LMDB in ./expbuf-data, 127.0.0.1:50051)
#   make test    set up .venv with everything the tests need and run them (the docs site's strict build among them)
# `make setup-serve` and `make setup` set up without running; `make check-extras` imports each framework
# adapter in a virtualenv holding only its own extra.
# An active virtualenv (VIRTUAL_ENV) is used instead of .venv; a torch that is already
# importable there (a GPU build, say) is left alone.

VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python
PYTHON ?= python3
# The pinned version. From the public index (PyPI) it is the CUDA build on Linux, several GB;
# `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU build instead,
# and a machine whose pip is configured with a local CPU wheel gets that one.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# What `make serve` installs: expbuf, with mypyc to compile its hot modules (the native extra).
SERVE_EXTRAS ?= native
# What `make setup` (and so `make test`) adds: the tests' tools, every adapter's extra, the docs.
EXTRAS ?= test,trinity,ray,areal,verl,transferqueue,trl,torchrl,docs
# Trinity-RFT for the plugin and its tests, installed with the trinity extra (which brings
# what its buffer modules import) but without its own dependencies (they pull vLLM and CUDA
# packages). A Trinity that is already importable is left alone; TRINITY_SPEC= skips it.
TRINITY_SPEC ?= trinity-rft==0.6.0
# verl, whose functions Trinity-RFT's verl-style advantage functions call and whose V1 trainer
# expbuf.client.verl plugs into (with the trinity or the verl extra); VERL_SPEC= skips it.
# No transformers satisfies both: verl 0.9.1 declares <5.11, trinity-rft 0.6.0 >=5.12.1. verl's
# pin is kept (its functions run in the tests; the Trinity modules used here run with it), and
# the installs after trinity-rft and verl pass --no-warn-conflicts, so pip prints no ERROR block
# for the requirements left unmet on purpose; `pip check` still lists them (docs/getting-started.md says which and why).
# Nor does a tensordict satisfy both verl 0.9.1 (<=0.10) and torchrl 0.14 (the torchrl extra: >=0.14.3,
# <0.15): torchrl's range is taken, since the verl code the tests run works with it (they pass with it).
VERL_SPEC ?= verl==0.9.1
VERL_NEEDS := 'tensordict>=0.14.3,<0.15' 'transformers>=5.5.3,<5.11'
QUIET_CONFLICTS := --no-warn-conflicts
# TRL for expbuf.client.trl and its tests comes with the trl extra, with its own dependencies: they
# are all met beside the frameworks above (transformers within verl's range), so no --no-deps.
# AReaL for expbuf.client.areal and its tests, installed with the areal extra (what its modules
# import) but without its own dependencies (they pull CUDA packages); AREAL_SPEC= skips it.
AREAL_SPEC ?= areal==1.0.4
SERVE_STAMP := $(VENV)/.expbuf-serve
STAMP := $(VENV)/.expbuf-installed
# The hot modules compiled with mypyc (client/native_build.py, with the C compiler the machine has),
# rebuilt whenever one of them or the build changes. Without a compiler, or if the build fails,
# it says so in one line and expbuf runs as pure Python. A compiled module is used only while it
# matches its source (expbuf.client.native checks at import), so a stale one never shadows an edit.
NATIVE_SOURCES := client/native_build.py client/trxp/codec/build.py client/trxp/codec/canonical.py \
	client/trxp/codec/checks.py client/trxp/codec/common.py client/trxp/codec/measure.py \
	client/trxp/codec/parse.py client/trxp/codec/pickles.py client/trxp/codec/shown.py \
	client/trxp/stored/columns.py client/trxp/stored/entries.py client/trxp/stored/pieces.py \
	client/trxp/stored/splice.py
NATIVE_STAMP := $(VENV)/.expbuf-native
# What `make test` runs a second time as pure Python (EXPBUF_PURE_PYTHON=1) where the compiled
# modules are in use: what the compiled modules decide (the parse, check and fuzz tests, hostile
# and fuzzed payloads at a live server), the store's, which parses every push, and the splice of
# stored payloads into replies and columns; not the rest of
# the fault suite, whose crashes and restarts take the codec's verdicts as given
# (PURE_TESTS=tests: everything; PURE_TESTS= : no second run).
PURE_TESTS ?= tests/faults/test_fault_hostile.py tests/faults/test_fault_fuzz.py tests/test_trxp*.py \
	tests/test_decode_hardening.py tests/test_hardening.py \
	tests/test_store*.py tests/test_datadir*.py tests/test_native.py \
	tests/test_splice_runs.py tests/test_columns_reply_bytes.py tests/test_join.py
# pytest's workers (pytest-xdist): each module's tests run on one worker, the Ray tests and the
# Trinity plugin's on one too (tests/conftest.py groups them). Four on two cores: the suite mostly
# waits (on the servers and trainers it starts and kills, leases, fsyncs), and more workers fill
# those waits (three: 496 s on 2 cores against 601-640 s with two). Four against three, the same
# clean clone's main pass back to back: 515 s against 603 s, and 525 s against 646 s (earlier
# sessions' pairs were mixed: 543 against 621 s, 616 against 581 s). PYTEST_WORKERS=0 runs the
# suite in this process, PYTEST_WORKERS=auto on as many workers as the machine has cores.
PYTEST_WORKERS ?= 4
# mermaid, which draws the docs' diagrams, shipped with the site: its npm package (pinned, and
# checked against this digest of its script) unpacked by `make docs-js` with the machine's npm.
MERMAID_SPEC ?= mermaid@11.17.2
MERMAID_SHA256 ?= 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_JS := build/docs-js/mermaid.min.js
# Python's bytecode of expbuf's modules, written beside them (__pycache__, ignored by git) where it
# is stale or missing, even where PYTHONDONTWRITEBYTECODE is set, as containers and CI images often
# set it: the variable stops Python writing bytecode, not reading it, and without it every process
# compiles each module it imports, at every start (a server's start: 0.98 s of CPU, 0.56 with it;
# the suite starts hundreds of servers and commands).
BYTECODE := $(PY) -m compileall -q -j 0 client server proto
# pytest keeps its rewritten test modules only where Python writes bytecode, so its runs clear
# PYTHONDONTWRITEBYTECODE: with it set, each worker rewrote every test module at every run (its
# collection: 30 s of CPU, 13 with them kept).
PYTEST_RUN := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)
COMPILED_IN_USE := import sys; import expbuf.client.trxp; from expbuf.client.native import compiled; \
	sys.exit(not compiled('expbuf.client.trxp.codec.parse'))

.PHONY: setup setup-serve serve test check-extras clean docs-js docs-look

setup-serve: $(SERVE_STAMP) $(NATIVE_STAMP)

setup: setup-serve $(if $(findstring docs,$(EXTRAS)),$(MERMAID_JS)) $(STAMP)

$(NATIVE_STAMP): $(SERVE_STAMP) $(NATIVE_SOURCES)
	$(PY) client/native_build.py
	touch $@

# Serving's install: the virtualenv, torch and expbuf with SERVE_EXTRAS; none of the frameworks.
$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install $(QUIET_CONFLICTS) -e "$(if $(SERVE_EXTRAS),.[$(SERVE_EXTRAS)],.)"
	touch $@

# The rest of the tests' install, into the virtualenv above (one `make serve` made, say): the extras
# and the frameworks the adapters are tested with. Its own stamp, so `make test` completes a
# virtualenv that `make serve` set up.
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install $(QUIET_CONFLICTS) -e "$(if $(EXTRAS),.[$(EXTRAS)],.)"
	$(if $(and $(TRINITY_SPEC),$(findstring trinity,$(EXTRAS))),$(PY) -c "import trinity" 2>/dev/null || { echo "Installing $(TRINITY_SPEC) with --no-deps (the plugin's tests need it)"; \
		$(PY) -m pip install $(QUIET_CONFLICTS) --no-deps "$(TRINITY_SPEC)"; })
	$(if $(and $(VERL_SPEC),$(or $(findstring trinity,$(EXTRAS)),$(findstring verl,$(EXTRAS)))),$(PY) -c "import verl; import tensordict; import transformers" 2>/dev/null || { echo "Installing $(VERL_SPEC) with --no-deps and then tensordict and transformers (Trinity-RFT's verl-style advantage functions call verl; the estimator tests compare with them)"; \
		$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-pin.txt && \
		$(PY) -m pip install --no-deps "$(VERL_SPEC)" && \
		$(PY) -m pip install $(QUIET_CONFLICTS) -c $(VENV)/torch-pin.txt $(VERL_NEEDS); })
	$(if $(and $(AREAL_SPEC),$(findstring areal,$(EXTRAS))),$(PY) -c "import areal" 2>/dev/null || { echo "Installing $(AREAL_SPEC) with --no-deps (expbuf.client.areal's tests need it)"; \
		$(PY) -m pip install $(QUIET_CONFLICTS) --no-deps "$(AREAL_SPEC)"; })
	touch $@

docs-js: $(MERMAID_JS)

$(MERMAID_JS): Makefile
	@command -v npm >/dev/null || { echo "the docs' diagrams need mermaid from the npm registry: install Node.js and npm (Debian's package npm)"; exit 1; }
	rm -rf build/docs-js && mkdir -p build/docs-js
	cd build/docs-js && npm pack --silent $(MERMAID_SPEC) > pack.txt
	tar -xzOf build/docs-js/$$(cat build/docs-js/pack.txt) package/dist/mermaid.min.js > $@.part
	echo "$(MERMAID_SHA256)  $@.part" | sha256sum --check --quiet
	mv $@.part $@ && rm build/docs-js/$$(cat build/docs-js/pack.txt)

# The built site drawn by a real headless browser (Debian's chromium), for whoever has one: PNGs of
# the home page and the pages with diagrams in build/docs-look (docs/look.py). Not part of `make test`.
docs-look: setup $(MERMAID_JS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(PY) docs/look.py $(PAGES)

serve: setup-serve
	$(BYTECODE)
	$(VENV)/bin/expbuf serve $(ARGS)

# No build of the docs site here: tests/test_site.py builds it with --strict, and a second build
# before pytest added 8.5 s to every run. The main pass lists its 25 slowest tests: the suite's
# time is held to 10 minutes on 2 cores, and every run's log says where it goes.
test: setup
	$(BYTECODE)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tests/typecheck.py
	$(PYTEST_RUN) --durations=25 $(PYTEST_ARGS)
	$(if $(PURE_TESTS),if $(PY) -c "$(COMPILED_IN_USE)"; then EXPBUF_PURE_PYTHON=1 $(PYTEST_RUN) $(PYTEST_ARGS) $(PURE_TESTS); fi)

# Each adapter in a virtualenv of its own (under EXTRAS_DIR) holding expbuf with only that adapter's
# extra and its framework, installed as `make setup` installs them, as a user of that one framework
# has it; every module of the adapter is imported there (tests/import_adapter.py). Not part of
# `make test`: each virtualenv takes minutes and a torch. tests/test_extras.py checks the same in the
# test run, with the other frameworks' imports refused.
ADAPTERS ?= trinity verl areal trl torchrl transferqueue
EXTRAS_DIR ?= build/extras
check-extras:
	@for adapter in $(ADAPTERS); do \
		echo "== expbuf[$$adapter] in $(EXTRAS_DIR)/$$adapter"; \
		$(MAKE) --no-print-directory VENV=$(EXTRAS_DIR)/$$adapter SERVE_EXTRAS= EXTRAS=$$adapter \
			$(EXTRAS_DIR)/$$adapter/.expbuf-installed || exit 1; \
		$(EXTRAS_DIR)/$$adapter/bin/python tests/import_adapter.py expbuf.client.$$adapter || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info client/trxp/codec/_native client/trxp/stored/_native
