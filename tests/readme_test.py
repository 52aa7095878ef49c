"""The Lingvo model examples of README.md and docs/training.md train as written."""

import importlib.util
import re
import sys

import numpy as np
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import pytest

import engine_util
import test_util
import tool_util

# Each example trains a Lingvo model for 5 steps.
pytestmark = pytest.mark.slow


def _ImportExample(document, module_name, folder):
  """Imports the code block of `document` that registers a model.

  Args:
    document: A Markdown file, relative to the repository root.
    module_name: The module name to import the block as (the model's
      registry key is '<module_name>.<class name>').
    folder: Where to write the module (Lingvo's registry wants a file).
  """
  with open(f'{tool_util.ROOT}/{document}') as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  (source,) = [b for b in blocks if 'RegisterSingleTaskModel' in b]
  path = folder / f'{module_name}.py'
  path.write_text(source)
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  spec.loader.exec_module(module)


@pytest.mark.parametrize('document, module_name', [
    ('README.md', 'readme_example'),
    ('docs/training.md', 'training_example'),
])
def testExampleModelTrains(tmp_path, document, module_name):
  _ImportExample(document, module_name, tmp_path)
  cfg = model_registry.GetParams(f'{module_name}.GPipeCharLm', 'Train')
  cfg.input.batch_size = 8
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = test_util.SeededGraph()  # The same weights in every run.
  with graph.as_default(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    model = cfg.Instantiate()
    model.ConstructFPropBPropGraph()
    task = model.GetTask()
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses = [sess.run([task.train_op, task.loss])[1] for _ in range(5)]
  assert task.stack.num_stages == 4
  assert task.stack.partition == [2, 1, 1, 2]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
