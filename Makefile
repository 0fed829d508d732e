# Setup is idempotent: a project-local venv, re-installed only when pyproject.toml changes.
PYTHON ?= python3.11
PYTHON_NEWEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV ?= .venv
VENV_NEWEST ?= .venv-newest-jax
PROMPT ?= And God said
PORT ?= 8000
PYTEST_ARGS ?= -n 2 --dist loadfile

LINT_PATHS = jaxinfra pallas_kernels sharding serve benchmarks tests scripts

.PHONY: setup run generate lint test test-kernels-newest ci

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	-$(VENV)/bin/python -m pallas_kernels.cpu_paged_attention  # our CPU attention kernel (without a C++ compiler: XLA's)
	-$(VENV)/bin/python -m serve.pipe_tap  # the decode loop's C++ token tap (without a C++ compiler: a Python callback)
	touch $@

# The main job: the OpenAI-compatible server on the embedded default model (prints how to query it).
run: setup
	$(VENV)/bin/jaxinfra serve --config configs/serve/cpu.yaml --port $(PORT)

generate: setup
	$(VENV)/bin/jaxinfra generate --prompt "$(PROMPT)" --max-tokens 40

# Lint (ruff), format check and types (mypy on the four packages).
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# Lint, then the test suite and the notebooks (executed top to bottom by nbmake), in random order.
test: lint
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) --nbmake tests notebooks

# Kernel tests (Pallas interpret mode) on Python 3.12 with the newest jax, as on the GPU machine.
$(VENV_NEWEST)/.installed: pyproject.toml Makefile
	test -x $(VENV_NEWEST)/bin/python || $(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install --quiet --upgrade jax jaxtyping numpy pytest pytest-xdist
	$(VENV_NEWEST)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

test-kernels-newest: $(VENV_NEWEST)/.installed
	$(VENV_NEWEST)/bin/python -c "import jax; print('newest-jax venv: jax', jax.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/kernels

ci: test test-kernels-newest
