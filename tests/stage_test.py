"""Tests of engine.stage: a stage body traced once, split for the loop engine."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import stage as stage_lib


def _Split(body, x):
  """A SplitCall of `body` with weight 3 on input `x`, and its arguments."""
  stage = stage_lib.Stage(body, 'stage 0', device='')
  theta = stage.FlattenTheta([tf.constant(3.0)])
  inputs, state = stage.FlattenCall([tf.constant(x)], ())
  micro_batch_id = tf.constant(0, tf.int64)
  split = stage_lib.SplitCall(
      stage.forward.get_concrete_function(theta, inputs, state,
                                          micro_batch_id), 'stage 0')
  return split, theta + inputs + state + [micro_batch_id]


@pytest.mark.parametrize('nonlinear', [False, True])
def testSplitCallStashesOnlyWhatIsNotAnArgument(nonlinear):
  """theta x needs only its arguments; tanh(theta x) its output too."""

  def Body(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    y = theta[0] * inputs[0]
    return (tf.tanh(y) if nonlinear else y,), state

  x = np.array([0.1, -0.2], np.float32)
  split, args = _Split(Body, x)
  (y,), stash = split.Forward(args)
  expected = np.tanh(3.0 * x) if nonlinear else 3.0 * x
  np.testing.assert_allclose(y, expected, rtol=1e-6)
  assert len(stash) == (1 if nonlinear else 0)
  assert [s.shape for s in split.stash_specs] == [s.shape for s in stash]
  d_theta, d_x, d_id = split.Backward([tf.ones([2])], args, stash)
  slope = 1.0 - expected**2 if nonlinear else np.ones(2, np.float32)
  np.testing.assert_allclose(d_theta, np.sum(slope * x), rtol=1e-6)
  np.testing.assert_allclose(d_x, slope * 3.0, rtol=1e-6)
  assert d_id is None  # The micro-batch id is an integer.


def testIsDifferentiable():
  assert stage_lib.IsDifferentiable(tf.constant(1.0))
  assert stage_lib.IsDifferentiable(tf.constant(1j))
  assert not stage_lib.IsDifferentiable(tf.constant(1))
  assert not stage_lib.IsDifferentiable(tf.constant(True))
