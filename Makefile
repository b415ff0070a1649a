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
# pytest below 9.2, as pyproject.toml asks: 9.2 drops pytest-xdist's xdist_group (pytest-dev/pytest-xdist#1386)
JUPYTER_PACKAGES := nbval nbclient nbformat ipykernel ipywidgets tqdm pydantic openai pytest-xdist 'pytest<9.2'

# Inductor's on-disk graph cache is keyed by the traced graph, not by the custom ops' schemas: a cache left by an
# older checkout can replay a graph that calls an op with its old arguments. Each checkout keeps its own.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/_build/torchinductor

NOTEBOOKS ?= $(sort $(wildcard notebooks/*.ipynb))
SANITIZE := tests/nbval_sanitize.cfg
NBVAL = --nbval --nbval-current-env --nbval-sanitize-with $(SANITIZE) --nbval-cell-timeout 1800 -p no:cacheprovider
RUN = PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"
JUPYTER_BOOK = $(PYTHON) -c 'import sys; from jupyter_book.cli.main import main; sys.exit(main())'
PORT ?= 8000

# Third-party JavaScript the built book needs (MathJax 3 for the formulas; RequireJS and the ipywidgets 8 HTML
# manager for stored widgets), downloaded at build time from the npm registry at these exact versions, checked
# against each tarball's sha512 (the registry's `dist.integrity`, in hex) and unpacked under _build/vendor/, which
# is never committed. _config.yml's html_extra_path copies _build/vendor/html into the book as _static/vendor/, and
# mathjax_path and nb_ipywidgets_js point there: the built book loads nothing from a CDN (make check-html proves it).
NPM_REGISTRY ?= https://registry.npmjs.org
VENDOR_DIR := _build/vendor
VENDOR_OUT := $(VENDOR_DIR)/html/_static/vendor
MATHJAX_VERSION := 3.2.2
MATHJAX_SHA512 := 06df9249553c7811b6ef30a155ec0e89c62ced7b1db78d2a9b8f94a47c97ee4d3f3bd36588f73ec7bee4d7f144b0fb2328f64626fb5164cd6f3be81e5b43a11b
HTML_MANAGER_VERSION := 1.0.15
HTML_MANAGER_SHA512 := e6d841215eb298d8263d5387bf3c7e806cbc6522a649ace1b46c38fdce312435734611bd3d3790b118c5dc5513a29bc58bffd200178dcf5ca9e3b6c2ac9dc240
REQUIREJS_VERSION := 2.3.7
REQUIREJS_SHA512 := 0e8b931bc4f559a9c6a24e908e0d925ee08ccecccea34787787f610d9e58e31f097bef49077f077532d3e3f540f0e6948416b424f547274a72064335cfea43b3
VENDOR_STAMP := $(VENDOR_DIR)/.mathjax-$(MATHJAX_VERSION)_html-manager-$(HTML_MANAGER_VERSION)_requirejs-$(REQUIREJS_VERSION)
# fetch NAME VERSION SHA512: the npm tarball of NAME@VERSION, into $(VENDOR_DIR)/npm/ (kept there as a cache)
define fetch_npm
tgz=$(VENDOR_DIR)/npm/$(notdir $(1))-$(2).tgz; \
if ! echo "$(3)  $$tgz" | sha512sum -c --status 2>/dev/null; then \
  echo "vendor: downloading $(NPM_REGISTRY)/$(1)/-/$(notdir $(1))-$(2).tgz"; \
  $(BASE_PYTHON) -c 'import sys, urllib.request; urllib.request.urlretrieve(*sys.argv[1:])' \
    "$(NPM_REGISTRY)/$(1)/-/$(notdir $(1))-$(2).tgz" "$$tgz"; \
  echo "$(3)  $$tgz" | sha512sum -c --quiet || { echo "vendor: $$tgz does not have the expected sha512"; rm -f "$$tgz"; exit 1; }; \
fi
endef

ifdef OWN_VENV
BOOK_ENV := $(VENV)/.installed-book
DEV_ENV := $(VENV)/.installed-dev
else
BOOK_ENV := install-book-active
DEV_ENV := install-dev-active
endif

.PHONY: help setup book serve test test-gpu execute bench lint format wheelhouse clean \
        book-strict check-html chromium vendor check-gpu jupyter-from-wheelhouse install-book-active install-dev-active

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
book: $(BOOK_ENV) $(VENDOR_STAMP) ## Build the HTML book from the notebooks' stored outputs (no GPU, no execution)
	$(RUN) $(JUPYTER_BOOK) build .
	@echo "Open $(CURDIR)/_build/html/index.html (or run: make serve)"

serve: ## Serve the built book on http://127.0.0.1:$(PORT)
	@test -f _build/html/index.html || { echo "no book built yet: run make book"; exit 1; }
	$(PYTHON) -m http.server --directory _build/html --bind 127.0.0.1 $(PORT)

book-strict: $(DEV_ENV) $(VENDOR_STAMP)
	rm -rf _build/html
	$(RUN) $(JUPYTER_BOOK) build . --all -W -n --keep-going
	$(PYTHON) tools/check_book.py

vendor: $(VENDOR_STAMP) ## Download MathJax and the ipywidgets HTML manager (exact versions, sha512-checked) into _build/vendor

$(VENDOR_STAMP): Makefile
	rm -rf $(VENDOR_DIR)/html $(VENDOR_DIR)/unpack $(VENDOR_DIR)/.mathjax-*
	mkdir -p $(VENDOR_DIR)/npm $(VENDOR_DIR)/unpack $(VENDOR_OUT)/mathjax $(VENDOR_OUT)/jupyter-widgets/html-manager $(VENDOR_OUT)/requirejs
	@$(call fetch_npm,mathjax,$(MATHJAX_VERSION),$(MATHJAX_SHA512))
	@$(call fetch_npm,@jupyter-widgets/html-manager,$(HTML_MANAGER_VERSION),$(HTML_MANAGER_SHA512))
	@$(call fetch_npm,requirejs,$(REQUIREJS_VERSION),$(REQUIREJS_SHA512))
	tar -xzf $(VENDOR_DIR)/npm/mathjax-$(MATHJAX_VERSION).tgz -C $(VENDOR_DIR)/unpack package/es5 package/LICENSE package/package.json
	cp -R $(VENDOR_DIR)/unpack/package/es5/. $(VENDOR_DIR)/unpack/package/LICENSE $(VENDOR_DIR)/unpack/package/package.json $(VENDOR_OUT)/mathjax/
	rm -rf $(VENDOR_DIR)/unpack/package
	tar -xzf $(VENDOR_DIR)/npm/html-manager-$(HTML_MANAGER_VERSION).tgz -C $(VENDOR_DIR)/unpack package/dist package/package.json
	cd $(VENDOR_DIR)/unpack/package/dist && rm -f *.map embed.js libembed-amd.js  # the page loads embed-amd.js only
	cp -R $(VENDOR_DIR)/unpack/package/dist/. $(VENDOR_DIR)/unpack/package/package.json $(VENDOR_OUT)/jupyter-widgets/html-manager/
	rm -rf $(VENDOR_DIR)/unpack/package
	tar -xzf $(VENDOR_DIR)/npm/requirejs-$(REQUIREJS_VERSION).tgz -C $(VENDOR_DIR)/unpack package/require.js package/package.json
	cp $(VENDOR_DIR)/unpack/package/require.js $(VENDOR_DIR)/unpack/package/package.json $(VENDOR_OUT)/requirejs/
	rm -rf $(VENDOR_DIR)/unpack
	@du -sh $(VENDOR_OUT)
	touch $@

# Headless Chromium: Debian's package is installed when no Chromium or Chrome is found (apt-get, as root or with sudo).
CHROMIUM_NAMES := chromium chromium-browser google-chrome google-chrome-stable

chromium:
	@found=$${CHROMIUM:-}; for name in $(CHROMIUM_NAMES); do command -v $$name >/dev/null 2>&1 && found=$$name; done; \
	if [ -z "$$found" ]; then \
	  echo "check-html: no Chromium found; installing Debian's chromium package (apt-get install -y chromium)"; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium; \
	fi

check-html: $(BOOK_ENV) chromium ## Open every page of the built book in headless Chromium (offline): math, widgets, images, errors; screenshots in _build/screens
	@if [ "$(FRESH_BOOK)" != 1 ]; then $(MAKE) --no-print-directory book; fi
	$(PYTHON) tools/check_html.py --html _build/html --screens _build/screens

# ------------------------------------------------------------------------------------------------ tests
# The CPU suite runs CPU_WORKERS pytest processes (the interpreter keeps one core busy each): tests go to workers one
# at a time, except those marked with one xdist_group (--dist loadgroup); a notebook stays on one worker (--dist
# loadfile). Each pass ends with its ten slowest tests, or each notebook's time (conftest.py).
CPU_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n > 4 ? 4 : n )))

test: $(DEV_ENV) chromium ## CPU suite: pytest, nbval over every notebook (Triton interpreted), strict book build, check-html
	$(RUN) TRITON_INTERPRET=1 $(PYTHON) -m pytest -n $(CPU_WORKERS) --dist loadgroup --durations=10 tests
	$(RUN) TRITON_INTERPRET=1 $(PYTHON) -m pytest -n $(CPU_WORKERS) --dist loadfile $(NBVAL) $(NOTEBOOKS)
	$(MAKE) book-strict
	$(MAKE) check-html FRESH_BOOK=1

check-gpu:
	@$(RUN) $(PYTHON) -c 'import torch, sys; ok = torch.cuda.is_available(); print(f"torch {torch.__version__}, GPU: {torch.cuda.get_device_name() if ok else None}"); sys.exit(0 if ok else "no CUDA GPU visible to $(PYTHON): use make test on a CPU machine")'

jupyter-from-wheelhouse:
ifneq ($(WHEELHOUSE),)
	$(PYTHON) -m pip install -q --no-index --find-links $(WHEELHOUSE) $(JUPYTER_PACKAGES)
endif

# The GPU suite runs GPU_WORKERS pytest processes on the one GPU (Triton's and nvcc's compiles are CPU work;
# tests go to workers one at a time, those of one xdist_group together: --dist loadgroup). Its
# notebook pass runs every cell on the GPU at the CPU's sizes (KERNEL_COURSE_SIZES=small, see bench.full_sizes):
# it proves they work; `make execute` stores the full runs. GPU_WORKERS: the cores less two, at most one a
# 8 GiB of GPU memory (each process holds a CUDA context and its tests' tensors), between 2 and 14; evaluated
# only when test-gpu runs. 14 on an H200 with 16 cores: the suite is mostly Triton compiles.
GPU_WORKERS ?= $(shell $(PYTHON) -c "import os, torch; cores = os.cpu_count() or 8; \
  gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 16; \
  print(max(2, min(cores - 2, int(gib // 8), 14)))")
test-gpu: check-gpu jupyter-from-wheelhouse ## GPU suite: pytest (GPU tests too) and nbval over every notebook at small sizes, in parallel
	$(RUN) $(PYTHON) -m pytest -n $(GPU_WORKERS) --dist loadgroup tests
	$(RUN) KERNEL_COURSE_SIZES=small $(PYTHON) -m pytest -n $(GPU_WORKERS) --dist loadfile $(NBVAL) $(NOTEBOOKS)

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
