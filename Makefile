# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# Re-install when the dependency lists change.
DEPS_HASH := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
RUN_STAMP := $(VENV)/.installed-run-$(DEPS_HASH)
TEST_STAMP := $(VENV)/.installed-test-$(DEPS_HASH)
# The dashboard's JavaScript (its chart library) from npm, re-installed when the lock changes.
JS_HASH := $(shell cat dashboards/package.json dashboards/package-lock.json | sha256sum | cut -c1-12)
JS_STAMP := dashboards/node_modules/.installed-$(JS_HASH)
CHROMIUM := /usr/bin/chromium
# The failure tests on nodes that are hosts (tests/hosts.py): namespaces, a bridge, nftables.
NFT := /usr/sbin/nft
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test lint typecheck clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): | $(PY)
	$(PIP) install -c constraints.txt -e .
	@touch $@

$(TEST_STAMP): | $(PY)
	$(PIP) install -c constraints.txt -e '.[test]'
	@touch $@ $(RUN_STAMP)

$(JS_STAMP):
	@command -v npm >/dev/null || { echo "npm (Node.js 18+) is needed for the dashboard's JavaScript"; exit 1; }
	cd dashboards && npm ci --no-audit --no-fund
	@touch $@

# The browser tests drive Debian's Chromium (Playwright never downloads a browser here); the
# tests on nodes that are hosts need iproute2 and nftables. One install for all of them.
$(CHROMIUM) $(NFT) &:
	$(SUDO) apt-get update
	$(SUDO) apt-get install -y chromium nftables iproute2

run: $(RUN_STAMP) $(JS_STAMP)
	$(VENV)/bin/etrain serve

# Two pytest-xdist workers (tests/conftest.py): the Ray pool's tests in order on one, the rest
# on the other. On 2 cores a serial run leaves a third of the CPU idle while tests wait.
# PYTEST_WRAP runs pytest under another command, e.g. where its CPU goes:
# PYTEST_WRAP="$(PY) -m bench.suite_cpu --" make test
test: $(TEST_STAMP) $(JS_STAMP) $(CHROMIUM) $(NFT)
	$(VENV)/bin/ruff check service jobs elastic elastic_train tests bench examples
	$(VENV)/bin/ruff format --check service jobs elastic elastic_train tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PYTEST_WRAP) $(PY) -m pytest -n 2 --dist loadgroup -ra --durations=40

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check service jobs elastic elastic_train tests bench examples
	$(VENV)/bin/ruff format --check service jobs elastic elastic_train tests bench examples
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .etrain dashboards/node_modules
