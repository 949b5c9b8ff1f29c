# Two commands on a fresh machine: `make demo` and `make test`. Each creates or refreshes .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint docs docs-build promtool chromium real-vllm test-realvllm bench bench-soak bench-realvllm rollout rollout-canary rollout-real-vllm scale-down clean

# xds-protos ships an old copy of the OpenTelemetry protos in the same files as opentelemetry-proto;
# whichever pip installs last wins. The OTLP exporter (--tracing) needs opentelemetry-proto's, so it goes last.
$(STAMP): pyproject.toml sim/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./sim -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall \
	  "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@touch $(STAMP)

# The demo runs the harness (loadtest/) from this checkout: it is never installed.
demo: $(STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/picker demo
	PYTHONPATH=$(CURDIR) $(BIN)/picker demo --proxy

# The whole suite, the real-vLLM tier included (it installs vLLM's CPU build on first use), then
# that tier alone. The rest runs on two workers (pytest-xdist, a file each; `WORKERS=1` for one):
# 321-327 s against 815 here (README "Two commands").
WORKERS ?= 2
PARALLEL := $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadfile,)
# Checks marked `alone` load the whole box (1,100 live streams): they run by themselves after the rest.
test: $(STAMP) real-vllm promtool chromium
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) -m 'not realvllm and not alone'
	$(BIN)/python -m pytest -q -p no:cacheprovider -m 'alone and not realvllm'
	$(BIN)/python -m pytest -q -p no:cacheprovider -m realvllm

# promtool checks the shipped alert rules (tests/observability). Installed from Debian's prometheus
# package when missing and this is root (as CI); otherwise those two checks skip, saying why.
promtool:
	@command -v promtool >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  echo "promtool did not install: the alert-rule checks will skip"

# Headless Chromium for the status page's browser tests (tests/envoy/test_status_page.py), from
# Debian's chromium package when missing and this is root (as CI); otherwise those tests skip, saying why.
chromium:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
	  echo "chromium did not install: the status-page browser tests will skip"

# Everything but the real-vLLM tier.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) -m 'not realvllm'

# Style, formatting, the import contracts in pyproject.toml (core planes: no network, no frontend), and
# the house rules (module sizes, parts; comments without figures, dates or issue numbers).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/docs/test_house.py tests/docs/test_comments.py

# The documentation site (docs/, mkdocs.yml): served with live reload; the reference pages are
# generated from the code first (`python -m picker.cli.reference_pages`).
docs: $(STAMP)
	$(BIN)/python -m picker.cli.reference_pages
	$(BIN)/mkdocs serve

docs-build: $(STAMP)
	$(BIN)/python -m picker.cli.reference_pages
	$(BIN)/mkdocs build --strict

# A real vLLM (CPU build) and a tiny random local model, for the realvllm test tier.
real-vllm: $(STAMP)
	bash loadtest/realvllm/install.sh

# Every benchmark in order, or the ones named: `make bench ONLY=bench_prefix,bench_flow`
# (`python -m loadtest.run --list` says what exists; loadtest/run.py holds the list).
bench: $(STAMP)
	@test -n "$(ONLY)" || test -x .venv-router/bin/vllm-router || ($(PYTHON) -m venv .venv-router && .venv-router/bin/pip install --quiet vllm-router) || echo 'vllm-router did not install: its column is left out'
	$(BIN)/python -m loadtest.run $(if $(ONLY),--only $(ONLY),)

# The picker's memory with 10,000 live streams and over a 10-minute soak of 100k requests, through
# Envoy + picker + simulators (issue 15; ~11 min). Not part of `make bench`.
bench-soak: $(STAMP)
	$(BIN)/python -m loadtest.bench_soak

# Two real vLLM replicas (CPU build, one core each): the same seeded Poisson load through Envoy round
# robin and Envoy + picker (shipped, --no-scrape, flow control relaxed), issue 15 (README, "Benchmarks").
bench-realvllm: $(STAMP) real-vllm
	$(BIN)/python -m loadtest.bench_realvllm
	$(BIN)/python -m loadtest.bench_realvllm_affinity
	$(BIN)/python -m loadtest.bench_realvllm_slo

# A rolling update under streaming load, without and with the picker (README, "Rollouts"): prints
# both tables and the drains' scorecard, and redraws the README's timeline picture.
rollout: $(STAMP)
	$(BIN)/python -m loadtest.rollout --png docs/img/rollout-timeline.png

# The same rolling update of real vLLM CPU servers (`make real-vllm`: the tiny model; 2 replicas, a low
# rate, short streams; a vLLM starts in ~25 s idle, ~2 min under load: ~10 min): README, "Rollouts".
rollout-real-vllm: $(STAMP) real-vllm
	$(BIN)/python -m loadtest.rollout --real-vllm --png docs/img/rollout-timeline-real-vllm.png

# The canary picture (docs, "Canary and rollback"): a good candidate promoted step by step and a bad
# one (3x the TTFT) rolled back, through `picker proxy` over simulators (~40 s).
rollout-canary: $(STAMP)
	$(BIN)/python -m loadtest.rollout.canary --png docs/img/rollout-canary.png

# Scale-downs that choose their victim (issue 55; docs, "Scale-downs"): a Deployment of 4 simulated replicas
# under streaming load taken to 2, six times, the ReplicaSet controller played on the fake API server
# choosing by its own rule and, side by side, by the picker's pod-deletion-cost (~2.5 min).
scale-down: $(STAMP)
	$(BIN)/python -m loadtest.scale_down

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
