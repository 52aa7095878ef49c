"""Test set-up shared by every test: flags, quiet logs, four CPU devices.

TensorFlow starts with the environment of the measuring tools
(`host.WorkerEnvironment`: quiet logs and an allocator that keeps peak
statistics whether or not oneDNN is on), and the tests' subprocesses inherit
it; TF_ENABLE_ONEDNN_OPTS stays as the caller set it.
"""

import os

from benchmarks import host

os.environ.update(host.WorkerEnvironment())

from absl import flags  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.planning import schedule  # pylint: disable=g-import-not-at-top

NUM_CPU_DEVICES = 4

# Lingvo reads absl flags at import and layer construction time.
flags.FLAGS(['pytest'], known_only=True)

# Four logical CPU devices for eager / tf.function tests; graph-mode tests ask
# their session for the same number with ConfigProto(device_count=...).
_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_DEVICES)


@pytest.fixture(params=schedule.ENGINES)
def engine(request):
  """Runs a test once per engine ('unrolled', 'loop')."""
  return request.param


@pytest.fixture(autouse=True)
def _NoGlobalSeedAfterTheTest():
  """Unsets TensorFlow's global seed after every test.

  A test that calls `tf.random.set_seed` would otherwise change the eager
  ops' seeds of the tests after it in the same process (e.g. the order of a
  seeded `Dataset.shuffle`), which depends on how pytest-xdist spreads the
  files.
  """
  yield
  tf.random.set_seed(None)


def pytest_collection_modifyitems(items):
  """Runs the files that hold `slow` tests first, the others after them.

  `make test` spreads whole files over two processes (pytest-xdist's
  `--dist loadfile`) in collection order. The files with slow tests (tool
  subprocesses, training runs: minutes each) come last in name order, and a
  process that takes one of them at the end keeps running long after the
  other has finished; started first, the many quick files fill in behind
  them. The order of the tests within each file is kept.

  Args:
    items: The collected tests, reordered in place.
  """
  slow_files = {item.path for item in items if item.get_closest_marker('slow')}
  items.sort(key=lambda item: item.path not in slow_files)
