# darkroom: `make demo` runs the worker on the embedded default, `make test` passes the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The full team corpus where it exists beside the repo, else the bundled sample photos.
PHOTOS := $(if $(wildcard ../shared/corpus/MANIFEST.md),../shared/corpus,tests/photos)
IMAGES  = $(filter-out %.md,$(wildcard $(PHOTOS)/*))

PROMTOOL := $(VENV)/bin/promtool

.PHONY: demo lock test lint imports typecheck pytest chaos bench bench-encoders services clean

# Every package comes from uv.lock, exactly and with its hashes (docs/development.md): uv
# itself is pinned by hash in requirements-uv.txt and lives apart in .tools/, since a sync
# removes whatever the lock does not name. `--locked` refuses a lock that pyproject.toml outgrew.
TOOLS := .tools
UV    := $(TOOLS)/bin/uv
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
# Installed packages get their bytecode at install time, as in the image: a process then
# starts in about a third of the CPU where PYTHONDONTWRITEBYTECODE is set (this project's
# machines set it), which every worker, CLI call and test subprocess pays.
export UV_COMPILE_BYTECODE := 1
SYNC  := $(UV) sync --quiet --locked --python $(PYTHON)

$(UV): requirements-uv.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install -q --require-hashes -r requirements-uv.txt
	touch $@

$(STAMP): pyproject.toml uv.lock | $(UV)
	$(SYNC) --group test
	touch $@

# The newest versions pyproject.toml allows, then every check on them: run it to take a
# dependency's fixes or before a release, and commit uv.lock when `make test` passes.
lock: | $(UV)
	$(UV) lock --upgrade --python $(PYTHON)
	$(MAKE) test

# Start PostgreSQL and Redis if they are down (as on this project's machines).
services:
	@pg_isready -q -h 127.0.0.1 -p 5432 || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || { mkdir -p /var/lib/redis /var/log/redis; \
	  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
	  --dir /var/lib/redis --logfile /var/log/redis/ci.log; }
	@for i in $$(seq 50); do pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && exit 0; sleep 0.2; done; \
	  echo "PostgreSQL or Redis did not start" >&2; exit 1

# The browser tests drive Debian's Chromium (Playwright cannot download its own browsers here).
/usr/bin/chromium:
	apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }

# promtool alone, unpacked from Debian's prometheus package: no server installed or started.
$(PROMTOOL): | $(STAMP)
	@tmp=$$(mktemp -d) && chmod 755 $$tmp && cd $$tmp && \
	  { apt-get download -q prometheus 2>/dev/null || { apt-get update -q && apt-get download -q prometheus; }; } && \
	  dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool && \
	  mv usr/bin/promtool $(CURDIR)/$(PROMTOOL) && rm -rf $$tmp

demo: $(STAMP) services
	$(BIN)/darkroom migrate
	@echo "ingesting $(words $(IMAGES)) photos from $(PHOTOS)"
	$(BIN)/darkroom ingest $(IMAGES) >/dev/null
	DARKROOM_LOG_FORMAT=console $(BIN)/darkroom run --drain
	$(BIN)/darkroom photos --limit $(words $(IMAGES))
	$(BIN)/darkroom status

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

imports: $(STAMP)
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

# The Node example's packages, exactly as locked (tests/test_examples.py runs it; node >= 20).
examples/node/node_modules: examples/node/package-lock.json
	cd examples/node && npm ci --no-audit --no-fund
	touch $@

# Real camera RAW files (tests/test_real_raw.py) from PyPI and Debian's archive, each checked
# by its SHA-256. Run every time: the script only hashes the files it has (a missing or
# damaged one is fetched again); the standard library alone, so no venv is needed first.
.PHONY: samples
samples:
	$(PYTHON) tests/fetch_samples.py .cache/samples

# darkroom's own modules too (an editable install is not compiled by the sync).
COMPILE := $(BIN)/python -m compileall -q src

pytest: $(STAMP) services /usr/bin/chromium $(PROMTOOL) examples/node/node_modules samples
	@$(COMPILE)
	$(BIN)/pytest -q

test: lint imports typecheck pytest

# 3 workers, 520 photos, SIGKILL/SIGSTOP/Redis restart/PG and S3 faults (docs/reliability.md),
# the failover test, the traces under SIGKILLs and a Redis restart (docs/tracing.md), then ten times the interleaving test's schedules of `make test`.
chaos: $(STAMP) services
	@$(COMPILE)
	$(BIN)/pytest -m chaos -s tests/chaos
	DARKROOM_SCHEDULES=5000 $(BIN)/pytest -q tests/test_interleavings.py

# Each bench script rewrites only its own section of docs/benchmarks.md: add scripts here.
BENCH_SCRIPTS := bench/render.py bench/pool.py bench/e2e.py bench/sweep.py bench/pages.py bench/history.py \
                 bench/events.py bench/hdr.py bench/limit.py bench/capacity.py bench/lanes.py \
                 bench/fairness.py bench/intake.py bench/flat.py bench/limits.py bench/bulk.py bench/quality.py \
                 bench/avif.py bench/tracing.py bench/pause.py
BENCH_STAMP   := $(VENV)/.bench-installed

$(BENCH_STAMP): pyproject.toml uv.lock $(STAMP)
	$(SYNC) --group test --group bench
	touch $@

# sharp for bench/limit.py's comparison, exactly as locked (node >= 20); without npm the column is n/a.
bench/sharp/node_modules: bench/sharp/package-lock.json
	@if command -v npm >/dev/null; then cd bench/sharp && { npm ci --no-audit --no-fund && touch node_modules \
	  || echo "npm ci failed: bench/limit.py reports the sharp column as n/a" >&2; }; \
	  else echo "npm not found: bench/limit.py reports the sharp column as n/a" >&2; fi

bench: $(BENCH_STAMP) services bench/sharp/node_modules
	@$(COMPILE)
	@for script in $(BENCH_SCRIPTS); do \
	  echo "== $$script" >&2; $(BIN)/python $$script --out docs/benchmarks.md || exit 1; done

# The encoder-settings sweep behind pipeline.py's save options (about 30 min on 2 cores).
bench-encoders: $(BENCH_STAMP)
	$(BIN)/python bench/encoders.py --out docs/benchmarks.md

clean:
	rm -rf $(VENV) $(TOOLS) var .pytest_cache .mypy_cache .ruff_cache
