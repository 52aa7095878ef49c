# The two commands: `make train` (the main job) and `make test` (the suite;
# `make test-fast` runs its quick part).
# Both create .venv on first use with pinned versions and reuse it afterwards.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINGVO := lingvo==0.14.2
LOGDIR ?= /tmp/lingvo_gpipe/lm

BAZELRC := $(VENV)/bazelrc
STANDINS := $(CURDIR)/third_party/bazel
BAZEL_TARGETS ?= //...

.PHONY: setup train test test-fast lingvo-suite bazel-test clean

setup: $(STAMP)

# Installs the library alone, editable (PEP 660): nothing else of the
# repository lands on sys.path; tools/ find the repository root themselves
# (tools/__init__.py), the tests through setup.cfg.
$(STAMP): requirements.txt setup.py $(wildcard glibc_compat/*.py) glibc_compat/shim.cc
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "lingvo_gpipe needs Python 3.11 (tensorflow 2.21 + lingvo 0.14.2); $(PYTHON) is " + sys.version.split()[0] + ". Run: make PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(LINGVO)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --use-pep517 -e .
	$(PY) -m glibc_compat --venv $(VENV)
	@touch $@

# The LM on 4 local CPU devices through Lingvo's runner, with Lingvo's evaler
# on held-out text beside it. Run it again to continue from the checkpoint.
train: $(STAMP)
	$(PY) tools/train.py --model=lm.GPipeCharLm --num_devices=4 \
	    --job=trainer_client,evaler_dev --logdir=$(LOGDIR)

# Every test, in two processes (pytest-xdist), each test file in one of them
# (module fixtures such as train_test's training runs then run once): 11 to
# 12 min on a quiet 2-core machine with oneDNN on or off (docs/install.md).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The tests not marked slow (no subprocesses, servers or training runs), in
# two processes (pytest-xdist): 4 to 6 min on a quiet 2-core machine.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m 'not slow' tests

# Lingvo's own lingvo/core/gpipe_test.py and layers_with_gpipe_test.py, run
# unchanged on lingvo_gpipe.stacks' drop-ins (10 to 15 min, 5 GB). They are
# not in this repository: LINGVO_SRC is a clone of
# https://github.com/tensorflow/lingvo or its git directory (LINGVO_COMMIT
# picks a commit; LINGVO_SUITE_FLAGS adds flags, e.g. --reference to run them
# on Lingvo's own classes, or --tests=gpipe_test for the 30 s part).
lingvo-suite: $(STAMP)
	$(PY) tools/lingvo_suite.py run --lingvo_src="$(LINGVO_SRC)" \
	    $(if $(LINGVO_COMMIT),--lingvo_commit="$(LINGVO_COMMIT)") $(LINGVO_SUITE_FLAGS)

# The tests under Bazel 4.2.3 (Debian's bazel-bootstrap, installed if
# missing), offline. Not what CI runs; see docs/install.md for what passes.
bazel-test: $(BAZELRC)
	@command -v bazel >/dev/null || apt-get install -y bazel-bootstrap
	bazel test $(BAZEL_TARGETS)

# Bazel flags naming absolute paths; .bazelrc imports this file.
$(BAZELRC): $(STAMP) Makefile
	@printf '%s\n' \
	    '# Written by make; imported by .bazelrc.' \
	    $(foreach cmd,build query,$(foreach repo,rules_cc rules_java remote_coverage_tools,'$(cmd) --override_repository=$(repo)=$(STANDINS)/$(repo)') \
	        '$(cmd) --override_repository=platforms=/usr/share/bazel/platforms') \
	    'build --python_path=$(CURDIR)/$(PY)' \
	    "test --test_env=PYTHONPATH=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	    'test --test_env=PATH=$(CURDIR)/$(VENV)/bin:/usr/bin:/bin' \
	    > $@

clean:
	rm -rf $(VENV)
