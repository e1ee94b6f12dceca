# The two commands a newcomer needs: `make demo` and `make test`.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-k8s test lint demo bench clean

setup:
	@bash tools/setup.sh

lint: setup
	.venv/bin/ruff check .

setup-k8s: setup
	@bash tools/k8s/build.sh

test: setup setup-k8s lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m devtools.demo

bench: setup
	@$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) -m bench $(BENCH)

clean:
	rm -rf .venv .cache .pytest_cache .ruff_cache build *.egg-info
