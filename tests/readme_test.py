"""The README's Lingvo model example builds and trains as written."""

import importlib.util
import re
import sys

import numpy as np
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import cluster_factory
from lingvo.core import py_utils

import engine_util
import tool_util


def _ImportReadmeExample(folder):
  """Imports the README code block that registers a model as a module.

  Args:
    folder: Where to write readme_example.py (Lingvo's registry wants a file).
  """
  with open(f'{tool_util.ROOT}/README.md') as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  (source,) = [b for b in blocks if 'RegisterSingleTaskModel' in b]
  path = folder / 'readme_example.py'
  path.write_text(source)
  spec = importlib.util.spec_from_file_location('readme_example', path)
  module = importlib.util.module_from_spec(spec)
  sys.modules['readme_example'] = module
  spec.loader.exec_module(module)


def testReadmeModelTrains(tmp_path):
  _ImportReadmeExample(tmp_path)
  cfg = model_registry.GetParams('readme_example.GPipeCharLm', 'Train')
  cfg.input.batch_size = 8
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = tf.Graph()
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
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
