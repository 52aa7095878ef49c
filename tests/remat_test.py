"""Re-materialization with dropout: exact gradients and replayed masks.

Where the recompute really happens is asserted in placement_test.py (with
remat='always' every forward kernel of a stage runs twice, with 'never' once).
"""

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import cells
import engine_util
import test_util

RNG = np.random.RandomState(3)
X = RNG.randn(8, 8).astype(np.float32)
NUM_MICRO_BATCHES = 4


def DropoutCells():
  cells = []
  for i in range(2):
    cells.append(layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
                                             output_dim=8))
    cells.append(layers.DeterministicDropoutLayer.Params().Set(
        name=f'drop{i}', keep_prob=0.5))
  return cells


def SeededPlain(theta, x, num_micro_batches):
  """The plain stack, run per micro-batch with the pipeline's seeds."""
  ref = test_util.Reference(DropoutCells())
  outputs = []
  for m, part in enumerate(tf.split(x, num_micro_batches)):
    with cells.MicroBatchSeeds(tf.constant(m, tf.int64)):
      for cell in ref.children.values():
        py_utils.ResetStepSeed(py_utils.GenerateSeedFromName(cell.path))
        part = cell.FProp(theta[cell.params.name], part)
    outputs.append(part)
  return tf.concat(outputs, 0)


def _Run(k):
  """Outputs + gradients per (engine, remat) at K=k, and the seeded plain."""
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    x = tf.constant(X)
    fetches = {}
    pipe = None
    for engine, remat in engine_util.ENGINE_REMAT_MODES:
      with py_utils.OpportunisticVariableReuseScope(pipe is not None):
        pipe = test_util.PipeParams(
            DropoutCells(), num_stages=k, num_micro_batches=NUM_MICRO_BATCHES,
            remat=remat, engine=engine).Instantiate()
      y = pipe.FProp(pipe.theta, x)
      fetches[engine, remat] = [y] + tf.gradients(
          tf.reduce_sum(y * y), pipe.vars.Flatten() + [x])
    y = SeededPlain(pipe.theta, x, NUM_MICRO_BATCHES)
    fetches['plain'] = [y] + tf.gradients(tf.reduce_sum(y * y),
                                          pipe.vars.Flatten() + [x])
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches)


@pytest.mark.parametrize('k', [1, 2, 4])
def testDropoutGradientsExactInEveryRematMode(k):
  values = _Run(k)
  # Dropout is active: about half the activations are zero.
  zeros = np.mean(values['plain'][0] == 0)
  assert 0.3 < zeros < 0.95, zeros
  for engine_remat in engine_util.ENGINE_REMAT_MODES:
    engine_util.AssertTransparent(values[engine_remat], values['plain'])


def testEachMicroBatchDrawsItsOwnMask(engine):
  """Identical micro-batches come out different: masks differ per micro-batch."""
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(DropoutCells(), num_stages=2,
                                num_micro_batches=NUM_MICRO_BATCHES,
                                engine=engine).Instantiate()
    x = tf.tile(tf.constant(X[:2]), [NUM_MICRO_BATCHES, 1])
    y = pipe.FProp(pipe.theta, x)
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      parts = np.split(sess.run(y), NUM_MICRO_BATCHES)
  masks = [tuple((p == 0).ravel()) for p in parts]
  assert len(set(masks)) == NUM_MICRO_BATCHES
