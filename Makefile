# The two commands of the README: `make serve` and `make test`. Both set everything up first.
PY := .venv/bin/python

.PHONY: setup serve test test-fast bench
setup:
	@bash scripts/setup.sh

serve: setup
	$(PY) -m server serve $(ARGS)

# two workers, each a whole test file at a time (module fixtures start their servers once);
# TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the edit loop: everything but the tests marked slow (under 4 minutes on 2 cores)
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)
