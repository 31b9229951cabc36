# Entry points for a fresh machine: `make demo` runs the main job, `make test` runs every test (CI runs it
# too, through .ci/run), `make test-fast` the unit and contract tests for the edit-test loop. Each creates
# .venv and installs everything it needs. torch is pinned here (the CPU wheel), while the package itself only
# asks for torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Two workers, one per core of the 2-core machines CI and developers have; each xdist_group (torchrun
# groups, memory cgroups) runs on one worker, its tests one after another. `make test TEST_WORKERS=0` runs in
# this process alone.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: venv demo test test-fast mutants browser plan bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[all]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/layerstream generate --output out/tiny-wan.gif
	@echo "next: source $(VENV)/bin/activate (once per shell), then the README's quick starts run as written"

plan: venv
	$(VENV)/bin/layerstream plan tiny-wan

test: venv browser
	$(PY) -m pytest -q --durations=15 $(XDIST)

# no process, no socket, no browser (tests/conftest.py holds a `fast` test to that), on the same two workers
test-fast: venv
	$(PY) -m pytest -q -m fast $(XDIST)

# named one-line mutants of the central guarantees, each against the tests that should catch it (docs/testing.md)
mutants: venv
	$(PY) tests/mutants.py

# The web page's browser test drives Debian's Chromium through its chromedriver: installed here where apt can
# (as root); anywhere else one line says so, and only the browser tests skip.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && apt-get update -qq >/dev/null 2>&1 \
	    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; then \
	    exit 0; \
	fi; \
	echo "warning: could not install chromium and chromium-driver (needs root and apt); the web page's browser tests will skip" >&2

bench: venv
	$(VENV)/bin/python benchmarks/strategies.py --smoke

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
