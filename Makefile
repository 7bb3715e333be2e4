# The two commands of the README: `make serve` and `make test`. Both set everything up first.
PY := .venv/bin/python

.PHONY: setup serve test bench
setup:
	@bash scripts/setup.sh

serve: setup
	$(PY) -m server serve $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)
