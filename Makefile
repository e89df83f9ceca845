# Two commands do everything on a fresh machine:
#   make serve   set up .venv and start the server (LMDB in ./expbuf-data, 127.0.0.1:50051)
#   make test    set up .venv and run the test suite
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
EXTRAS ?= test
STAMP := $(VENV)/.expbuf-installed

.PHONY: setup serve test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e "$(if $(EXTRAS),.[$(EXTRAS)],.)"
	touch $@

serve: setup
	$(VENV)/bin/expbuf serve $(ARGS)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
