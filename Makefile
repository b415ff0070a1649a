# Make targets for the course and kernel_lib. `make help` lists them.
#
# Which Python: by default a project virtualenv in .venv, created and filled on first use. To use another
# interpreter, e.g. a GPU machine's own PyTorch, pass PYTHON:   make test-gpu PYTHON=python3
# (or make a venv that sees it: python3 -m venv --system-site-packages .venv, then the defaults work).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
BASE_PYTHON ?= python3
ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
OWN_VENV := 1
endif

# On a machine without nvidia-smi, pin the CPU build of torch and its triton (see constraints-cpu.txt).
# Elsewhere pip's own choice stands. Off-PyPI CPU wheels: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,constraints-cpu.txt)
TORCH_INDEX ?=
PIP_INSTALL = $(PYTHON) -m pip install $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

# Wheels for an offline GPU machine (`make wheelhouse PY=3.12`). There, WHEELHOUSE=wheelhouse installs from
# them whatever of the Jupyter packages its Python lacks (pip keeps what is already installed).
PY ?= 3.12
WHEELHOUSE ?=
JUPYTER_PACKAGES := nbval nbclient nbformat ipykernel ipywidgets tqdm pydantic openai

# Inductor's on-disk graph cache is keyed by the traced graph, not by the custom ops' schemas: a cache left by an
# older checkout can replay a graph that calls an op with its old arguments. Each checkout keeps its own.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/_build/torchinductor

NOTEBOOKS ?= $(sort $(wildcard notebooks/*.ipynb))
SANITIZE := tests/nbval_sanitize.cfg
NBVAL = --nbval --nbval-current-env --nbval-sanitize-with $(SANITIZE) --nbval-cell-timeout 1800 -p no:cacheprovider
RUN = PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"
JUPYTER_BOOK = $(PYTHON) -c 'import sys; from jupyter_book.cli.main import main; sys.exit(main())'
PORT ?= 8000

ifdef OWN_VENV
BOOK_ENV := $(VENV)/.installed-book
DEV_ENV := $(VENV)/.installed-dev
else
BOOK_ENV := install-book-active
DEV_ENV := install-dev-active
endif

.PHONY: help setup book serve test test-gpu execute bench lint format wheelhouse clean \
        book-strict check-gpu jupyter-from-wheelhouse install-book-active install-dev-active

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST) \
	  | sed -e 's/\$$(PORT)/$(PORT)/g' -e 's/\$$(PY)/$(PY)/g'  # show the values, not the variable names
	@echo "  Variables: PYTHON=python3 (use that interpreter, no venv), WHEELHOUSE=wheelhouse (offline GPU machine)"

# ------------------------------------------------------------------------------------------------ environments
$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV)

$(VENV)/.installed-book: pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP_INSTALL) -e ".[book]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP_INSTALL) -e ".[dev]"
	touch $@ $(VENV)/.installed-book

install-book-active:
	$(PIP_INSTALL) -e ".[book]"

install-dev-active:
	$(PIP_INSTALL) -e ".[dev]"

setup: $(DEV_ENV) ## Create the environment (.venv unless PYTHON is given) with the dev extras
	@$(PYTHON) -c 'import torch, triton; print(f"ready: torch {torch.__version__}, triton {triton.__version__}")'

# ------------------------------------------------------------------------------------------------ the book
book: $(BOOK_ENV) ## Build the HTML book from the notebooks' stored outputs (no GPU, no execution)
	$(RUN) $(JUPYTER_BOOK) build .
	@echo "Open $(CURDIR)/_build/html/index.html (or run: make serve)"

serve: ## Serve the built book on http://127.0.0.1:$(PORT)
	@test -f _build/html/index.html || { echo "no book built yet: run make book"; exit 1; }
	$(PYTHON) -m http.server --directory _build/html --bind 127.0.0.1 $(PORT)

book-strict: $(DEV_ENV)
	rm -rf _build/html
	$(RUN) $(JUPYTER_BOOK) build . --all -W -n --keep-going
	$(PYTHON) tools/check_book.py

# ------------------------------------------------------------------------------------------------ tests
test: $(DEV_ENV) ## CPU suite: pytest, nbval over every notebook (Triton interpreted), strict book build
	$(RUN) TRITON_INTERPRET=1 $(PYTHON) -m pytest tests
	$(RUN) TRITON_INTERPRET=1 $(PYTHON) -m pytest $(NBVAL) $(NOTEBOOKS)
	$(MAKE) book-strict

check-gpu:
	@$(RUN) $(PYTHON) -c 'import torch, sys; ok = torch.cuda.is_available(); print(f"torch {torch.__version__}, GPU: {torch.cuda.get_device_name() if ok else None}"); sys.exit(0 if ok else "no CUDA GPU visible to $(PYTHON): use make test on a CPU machine")'

jupyter-from-wheelhouse:
ifneq ($(WHEELHOUSE),)
	$(PYTHON) -m pip install -q --no-index --find-links $(WHEELHOUSE) $(JUPYTER_PACKAGES)
endif

test-gpu: check-gpu jupyter-from-wheelhouse ## GPU suite with this machine's PyTorch: pytest (GPU tests too), strict nbval over every notebook
	$(RUN) $(PYTHON) -m pytest tests
	$(RUN) $(PYTHON) -m pytest $(NBVAL) $(NOTEBOOKS)

execute: check-gpu jupyter-from-wheelhouse ## Re-execute every notebook in place on this GPU and record device and versions in its metadata
	$(RUN) $(PYTHON) tools/execute_notebooks.py $(NOTEBOOKS)

bench: check-gpu ## Run benchmarks/bench_*.py; CSVs with GPU name, versions and timestamp go to results/
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(RUN) $(PYTHON) $$script --out results; done

# ------------------------------------------------------------------------------------------------ code quality
lint: ## Check style and common bugs (changes nothing)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format: ## Rewrite code to the project's style
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

# ------------------------------------------------------------------------------------------------ misc
wheelhouse: ## Download Jupyter and search wheels (nbval, ipykernel, ipywidgets, pydantic, openai + deps) for an offline GPU machine, Python $(PY)
	rm -rf wheelhouse
	$(BASE_PYTHON) -m pip download --only-binary=:all: --python-version $(PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d wheelhouse $(JUPYTER_PACKAGES)
	@du -sh wheelhouse
	@echo "On the GPU machine: make test-gpu PYTHON=python3 WHEELHOUSE=wheelhouse"

clean: ## Remove build outputs and caches (keeps .venv)
	rm -rf _build results .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
