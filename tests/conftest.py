"""Test set-up shared by every test: flags, quiet logs, four CPU devices.

TensorFlow starts with the environment of the measuring tools
(`host.WorkerEnvironment`: quiet logs and an allocator that keeps peak
statistics whether or not oneDNN is on), and the tests' subprocesses inherit
it; TF_ENABLE_ONEDNN_OPTS stays as the caller set it.
"""

import collections
import gc
import os

from benchmarks import host

os.environ.update(host.WorkerEnvironment())

from absl import flags  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.planning import schedule  # pylint: disable=g-import-not-at-top

NUM_CPU_DEVICES = 4

# Python's collector every 50000 allocations instead of 700, and a full
# collection after 100 young ones instead of 10: building TF graphs allocates
# millions of objects, which the default thresholds scan again and again (9%
# of pipeline_test's time, 2% with these; the graphs are freed by reference
# counting either way).
gc.set_threshold(50000, 20, 100)

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
def _SameGlobalSeedInEveryTest():
  """Runs every test with TensorFlow's global seed 1, unset afterwards.

  With a global seed, Lingvo seeds each variable from its name, eagerly as
  in a seeded graph, so a test draws the same weights in every run and on
  every host. Without one, an eager test's weights were new in every run, and
  a transparency check failed about once in 30 runs: a gradient summed in
  another order by the pipeline is exact to float round-off, which a rare
  draw of weights (cancelling terms in a small bias gradient) amplifies past
  1e-5. Unsetting the seed afterwards keeps a test that sets its own from
  changing the tests after it in the same process (which depends on how
  pytest-xdist spreads the files).
  """
  tf.random.set_seed(1)
  yield
  tf.random.set_seed(None)


@pytest.fixture(autouse=True)
def _InLingvosDefaultCluster():
  """Runs every test inside one default Lingvo cluster, as trainers do.

  Outside any cluster scope `cluster_factory.Current()` builds a new default
  cluster (deep-copying its params) at every call, and Lingvo calls it for
  each flag it reads while a layer builds its graph: 13% of the CPU time of
  layers_test's circular grid went there. Lingvo's trainers always run in a
  cluster scope; a test that needs another cluster enters its own inside
  this one.
  """
  with cluster_factory.Current():
    yield


# The files that take longest in `make test`, longest first: their
# subprocess fixtures (train_test 175 to 205 s of CPU, benchmark_test 105 to
# 120 s, plan_test 80 to 90 s on the AMD EPYC host of docs/install.md) and
# the longest in-process files (1 to 2 min of CPU each), measured 2026-12-07.
LONGEST_FILES = (
    'train_test.py', 'benchmark_test.py', 'sparse_gradients_test.py',
    'layers_test.py', 'plan_test.py', 'pipeline_test.py', 'docs_test.py',
    'unet_params_test.py', 'stacks_test.py', 'keras_layer_test.py',
    'zero_bubble_test.py',
)


def pytest_configure(config):
  """Keeps the file order of `pytest_collection_modifyitems` under xdist.

  pytest-xdist (3.x) hands `--dist loadfile` files to its processes in
  descending number of tests unless told otherwise (`--loadscope-reorder`,
  on by default), which put the minute-long files with few tests (the tool
  and training runs, the parameter sets) at the end, one process running
  them alone.

  Args:
    config: pytest's config (of the controlling process under xdist).
  """
  if getattr(config.option, 'loadscopereorder', False):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """Runs the longest files first, then the other slow ones, then the rest.

  `make test` spreads whole files over two processes (pytest-xdist's
  `--dist loadfile`) in collection order (see `pytest_configure`). A process
  that takes a long file at the end keeps running long after the other has
  finished; started first, the long files run side by side and the many
  quick files fill in behind them: `LONGEST_FILES` in their order, then the
  other files with `slow` tests (tool subprocesses, training runs) in name
  order, then the others, those with the most tests first. The order of the
  tests within each file is kept.

  Args:
    items: The collected tests, reordered in place.
  """
  counts = collections.Counter(item.path for item in items)
  slow_files = {item.path for item in items if item.get_closest_marker('slow')}

  def Key(item):
    if item.path.name in LONGEST_FILES:
      return (0, LONGEST_FILES.index(item.path.name))
    if item.path in slow_files:
      return (1, 0)
    return (2, -counts[item.path])

  items.sort(key=Key)  # Stable: ties keep the collection order.
