# The two commands of the README: `make serve` and `make test`. Both set everything up first.
PY := .venv/bin/python

.PHONY: setup serve test test-fast bench
setup:
	@bash scripts/setup.sh

serve: setup
	$(PY) -m server serve $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# the edit loop: everything but the tests marked slow (under 4 minutes on 2 cores)
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)
