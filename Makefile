# Two commands do everything on a fresh machine:
#   make serve   set up .venv and start the server (LMDB in ./expbuf-data, 127.0.0.1:50051)
#   make test    set up .venv and run the test suite
# An active virtualenv (VIRTUAL_ENV) is used instead of .venv; a torch that is already
# importable there (a GPU build, say) is left alone.

VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python
PYTHON ?= python3
# The CPU build; on these machines pip takes it from a local wheel. TORCH_INDEX picks
# another wheel index (the container image uses the CPU or a CUDA one).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= test,ray
STAMP := $(VENV)/.expbuf-installed

.PHONY: setup serve test compose-tool clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e "$(if $(EXTRAS),.[$(EXTRAS)],.)"
	touch $@

serve: setup
	$(VENV)/bin/expbuf serve $(ARGS)

# Debian's docker-compose validates docker/compose.yaml without a Docker engine; where it
# cannot be installed, that one test says so and is skipped.
compose-tool:
	@command -v docker-compose >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1; } \
		|| echo "docker-compose not available: the compose validation test will be skipped"

test: setup compose-tool
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
