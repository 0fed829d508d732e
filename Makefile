# Setup installs the exact versions in requirements/ (hash-locked, made by `make lock`) into project-local
# venvs, re-installed only when a lock changes. pyproject.toml keeps the ranges users install against.
PYTHON ?= python3.11
PYTHON_NEWEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV ?= .venv
VENV_NEWEST ?= .venv-newest-jax
VENV_LATEST ?= .venv-latest
PROMPT ?= And God said
PORT ?= 8000
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=30
UV_VERSION ?= 0.13.9
# A folder of local wheels (this machine keeps the CPU build of torch in /opt/wheels); WHEELS= turns it off.
WHEELS ?= /opt/wheels
UV_FIND = $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))
LOCK = requirements/py311-dev.txt
LOCK_NEWEST = requirements/py312-kernels.txt
EXTRAS = serve train ray dev

LINT_PATHS = jaxinfra pallas_kernels sharding serve benchmarks tests scripts

.PHONY: setup run generate lint test test-fast test-kernels-newest test-latest lock ci gpu-wheels

setup: $(VENV)/.installed

# uv itself comes from PyPI at a pinned version into the venv; everything else from the lock, hashes checked.
$(VENV)/.installed: $(LOCK)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	test -x $(VENV)/bin/uv || $(VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)
	$(VENV)/bin/uv pip sync --quiet --python $(VENV)/bin/python --require-hashes $(UV_FIND) $(LOCK)
	$(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python --no-deps -e .
	-$(VENV)/bin/python -m pallas_kernels.cpu_paged_attention  # our CPU attention kernel (without a C++ compiler: XLA's)
	-$(VENV)/bin/python -m serve.core.pipe_tap  # the decode loop's C++ token tap (without a C++ compiler: a Python callback)
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

# Lint, then the test suite and the notebooks (executed top to bottom by nbmake), in random order: what CI runs.
# The run compiles each step shape once (tests/run_cache.py) and ends with its 30 slowest files against the budget.
test: lint
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) --nbmake tests notebooks

# The inner loop (under 5 minutes on 2 cores): every test not marked slow, on the same fixtures; no lint.
test-fast: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) -m "not slow" tests

# Kernel tests (Pallas interpret mode) on Python 3.12 with the newest jax, as on the GPU machine (locked too;
# `make lock` moves it to the newest jax, `make test-latest` tries the newest without the lock).
$(VENV_NEWEST)/.installed: $(LOCK_NEWEST) $(VENV)/.installed
	test -x $(VENV_NEWEST)/bin/python || $(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV)/bin/uv pip sync --quiet --python $(VENV_NEWEST)/bin/python --require-hashes $(LOCK_NEWEST)
	$(VENV)/bin/uv pip install --quiet --python $(VENV_NEWEST)/bin/python --no-deps -e .
	touch $@

test-kernels-newest: $(VENV_NEWEST)/.installed
	$(VENV_NEWEST)/bin/python -c "import jax; print('newest-jax venv: jax', jax.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/kernels

# Refresh every lock to the newest versions pyproject.toml allows, then run the whole suite on them.
lock: $(VENV)/.installed
	for extra in "" $(EXTRAS); do \
	  $(VENV)/bin/uv pip compile --quiet --upgrade --generate-hashes --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 $(UV_FIND) pyproject.toml $${extra:+--extra $$extra} \
	    -o requirements/py311$${extra:+-$$extra}.txt || exit 1; \
	done
	$(VENV)/bin/uv pip compile --quiet --upgrade --generate-hashes --python-version 3.12 \
	  --python-platform x86_64-manylinux_2_28 requirements/py312-kernels.in -o $(LOCK_NEWEST)
	$(MAKE) ci

# The guard for the ranges: the newest versions pyproject.toml allows, no lock, then the fast tests (and the
# kernel tests on the newest jax), so an upstream release that breaks us shows up here first.
test-latest: $(VENV)/.installed
	rm -rf $(VENV_LATEST) && $(PYTHON) -m venv $(VENV_LATEST)
	$(VENV)/bin/uv pip install --quiet --python $(VENV_LATEST)/bin/python --upgrade $(UV_FIND) -e ".[dev]"
	$(VENV)/bin/uv pip freeze --python $(VENV_LATEST)/bin/python > $(VENV_LATEST)/versions.txt
	-$(VENV_LATEST)/bin/python -m pallas_kernels.cpu_paged_attention
	-$(VENV_LATEST)/bin/python -m serve.core.pipe_tap
	$(VENV_LATEST)/bin/python -m pytest -q $(PYTEST_ARGS) -m "not slow" tests

ci: test test-kernels-newest

# The packages the GPU machine's image lacks (serving, data), as Python 3.12 wheels at our lock's versions, into the
# gitignored benchmarks/wheels/: carry it in a device call and benchmarks/gpu_check.sh installs them offline.
gpu-wheels: setup
	mkdir -p benchmarks/wheels
	eval "$$($(VENV)/bin/python -m benchmarks.gpu_preflight --download-command benchmarks/wheels)"
	du -sh benchmarks/wheels
