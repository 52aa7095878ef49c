"""Re-materialization with dropout: exact gradients and replayed masks.

Where the recompute really happens is asserted in placement_test.py (with
remat='always' every forward kernel of a stage runs twice, with 'never' once).
"""

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import layers
from lingvo.core import py_utils

import engine_util
import test_util

RNG = np.random.RandomState(3)
X = RNG.randn(8, 8).astype(np.float32)
NUM_MICRO_BATCHES = 4
GRAPH_SEED = 1


def DropoutCells():
  cells = []
  for i in range(2):
    cells.append(layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
                                             output_dim=8))
    cells.append(layers.DeterministicDropoutLayer.Params().Set(
        name=f'drop{i}', keep_prob=0.5))
  return cells


def SeededPlain(theta, x, num_micro_batches, step):
  """The plain stack, run per micro-batch at the seeds GPipe promises.

  Micro-batch m of global step s must draw the masks that plain Lingvo draws
  at global step s * M + m (Lingvo's GPipe rule). Lingvo's own
  `GenerateStepSeedPair` is the oracle here, with its global step overridden
  per micro-batch; `cells.MicroBatchSeeds` is not used, so a pipeline whose
  seeds ignore the micro-batch or the step does not agree with it.

  Args:
    theta: The cells' variables.
    x: The mini-batch.
    num_micro_batches: M.
    step: The global step s (a Python int).

  Returns:
    The per-micro-batch outputs, concatenated.
  """
  ref = test_util.Reference(DropoutCells())
  outputs = []
  for m, part in enumerate(tf.split(x, num_micro_batches)):
    micro_batch_id = tf.constant(step * num_micro_batches + m, tf.int64)
    with py_utils.GlobalStepContext(micro_batch_id):
      for cell in ref.children.values():
        py_utils.ResetStepSeed(py_utils.GenerateSeedFromName(cell.path))
        part = cell.FProp(theta[cell.params.name], part)
    outputs.append(part)
  return tf.concat(outputs, 0)


def _Run(k, step):
  """Outputs + gradients per (engine, remat) at K=k, and the seeded plain.

  Args:
    k: K.
    step: The global step the graph runs at.

  Returns:
    {(engine, remat) or 'plain': [output] + gradients of variables and x}.
  """
  graph = tf.Graph()
  # The same weights in every run: with a graph seed, Lingvo seeds each
  # variable's initializer from the variable's name (plain output 75% zeros
  # at step 0, 69% at step 3). Without one they were drawn anew in every run,
  # and about 1 draw in 750 (4 in 3000 sampled) made the ReLUs zero so much
  # that the output was over 95% zeros, failing the dropout check below.
  graph.seed = GRAPH_SEED
  with graph.as_default():
    global_step = py_utils.GetOrCreateGlobalStepVar()
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
    y = SeededPlain(pipe.theta, x, NUM_MICRO_BATCHES, step)
    fetches['plain'] = [y] + tf.gradients(tf.reduce_sum(y * y),
                                          pipe.vars.Flatten() + [x])
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      global_step.load(step, sess)
      return sess.run(fetches)


@pytest.mark.parametrize('k,step', [(1, 0), (2, 0), (4, 0), (2, 3)])
def testDropoutMasksFollowTheSeedRuleAndGradientsAreExact(k, step):
  """Masks are plain Lingvo's at global step s * M + m, in every remat mode.

  Guards the seed rule (each micro-batch, at every step, gets its own masks)
  and the recompute's replay of the same masks (the gradients are exact).

  Args:
    k: K.
    step: The global step.
  """
  values = _Run(k, step)
  # Dropout is active: about half the activations are zero.
  zeros = np.mean(values['plain'][0] == 0)
  assert 0.3 < zeros < 0.95, zeros
  for engine_remat in engine_util.ENGINE_REMAT_MODES:
    engine_util.AssertTransparent(values[engine_remat], values['plain'])


def testEachMicroBatchDrawsItsOwnMask(engine):
  """Identical micro-batches of ones come out different: one mask each.

  The stages are dropout layers alone, so the zeros of the output are the
  masks themselves, whatever the initial weights of other tests were (with
  FC layers in front, ReLU zeros hid the masks' differences in one order of
  the suite).

  Args:
    engine: The pipeline engine.
  """
  cells = [layers.DeterministicDropoutLayer.Params().Set(
      name=f'drop{i}', keep_prob=0.5) for i in range(2)]
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(cells, num_stages=2,
                                num_micro_batches=NUM_MICRO_BATCHES,
                                engine=engine).Instantiate()
    y = pipe.FProp(pipe.theta, tf.ones([2 * NUM_MICRO_BATCHES, 8]))
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      parts = np.split(sess.run(y), NUM_MICRO_BATCHES)
  masks = [tuple((p == 0).ravel()) for p in parts]
  assert 0.5 < np.mean(masks) < 0.95  # Two layers keep 1/4 of the values.
  assert len(set(masks)) == NUM_MICRO_BATCHES
