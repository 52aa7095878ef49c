"""Runs test files under pytest: the main program of every Bazel test.

tests/BUILD declares each test with `pytest_test` (tests/pytest.bzl), whose
main is this file and whose arguments are the test's files. pytest reads
setup.cfg from the runfiles, as `make test` reads it from the checkout, and
tests/conftest.py sets up flags and devices. A file in which pytest collects
no test fails (exit status 5).
"""

import os
import sys

import pytest


def Main(argv):
  """Runs pytest on argv[1:] quietly; returns its exit status."""
  args = ['-q', '-p', 'no:cacheprovider', *argv[1:]]
  if os.environ.get('XML_OUTPUT_FILE'):  # Bazel's per-test result file.
    args.append('--junitxml=' + os.environ['XML_OUTPUT_FILE'])
  return pytest.main(args)


if __name__ == '__main__':
  sys.exit(Main(sys.argv))
