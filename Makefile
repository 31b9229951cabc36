# Two entry points for a fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything they need. torch is pinned here (the CPU wheel), while the
# package itself only asks for torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test plan bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[all]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/layerstream generate --output out/tiny-wan.gif

plan: venv
	$(VENV)/bin/layerstream plan tiny-wan

test: venv
	$(PY) -m pytest -q

bench: venv
	$(VENV)/bin/layerstream bench --smoke

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
