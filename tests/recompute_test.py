"""Tests of engine.recompute: calls whose gradient recomputes the forward."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.engine import recompute


def testGatePassesValuesOnOnlyAfterItsInputs():
  graph = tf.Graph()
  with graph.as_default():
    x, after = tf.constant([1.0, 2.0]), tf.constant(3.0)
    gated, = recompute.Gate([x], [after, None])
    with tf.compat.v1.Session(graph=graph) as session:
      np.testing.assert_array_equal(session.run(gated), [1.0, 2.0])
  # It waits for the op that made `after` and for an identity that reads it
  # (which still waits for the outputs once a call is inlined).
  controls = gated.op.control_inputs
  assert after.op in controls
  assert [op.inputs[0] for op in controls if op.type == 'Identity'] == [after]


def testJointGradientsAreTheGradientsOfTheTensors():
  x, y = tf.constant([1.0, 2.0]), tf.constant(3.0)
  with tf.GradientTape() as tape:
    tape.watch([x, y])
    jx, jy = recompute.JointGradients([x, y])
    loss = tf.reduce_sum(jx * jx) * jy
  np.testing.assert_array_equal(jx, x)
  dx, dy = tape.gradient(loss, [x, y])
  np.testing.assert_array_equal(dx, [6.0, 12.0])  # 2 x y.
  assert dy.numpy() == 5.0  # sum(x^2).
  assert recompute.JointGradients([]) == []


def testRecomputingCallTakesItsGradientFromBackward():
  """y = w x; the loss sum(y^2): dw = sum(2 y x), dx = 2 y w, from backward."""
  calls = []

  def Forward(theta, x, state, micro_batch_id):
    del state, micro_batch_id
    return [theta[0] * x[0]]

  def Backward(theta, x, state, micro_batch_id, d_results, waits):
    del state, micro_batch_id, waits
    calls.append('backward')
    y = Forward(theta, x, [], None)[0]  # Recomputed.
    assert np.array_equal(y, 3.0 * np.array([1.0, 2.0]))
    return [tf.reduce_sum(d_results[0] * x[0]), d_results[0] * theta[0]]

  w, x = tf.constant(3.0), tf.constant([1.0, 2.0])
  with tf.GradientTape() as tape:
    tape.watch([w, x])
    results, token, passed = recompute.RecomputingCall(
        Forward, Backward, [w], [x], [], tf.constant(0, tf.int64),
        token=tf.constant(0.0), pass_theta=False, device='')
    loss = tf.reduce_sum(results[0] * results[0]) + token
  assert passed == [] and token.numpy() == 0.0
  np.testing.assert_array_equal(results[0], [3.0, 6.0])
  dw, dx = tape.gradient(loss, [w, x])
  assert calls == ['backward']
  assert dw.numpy() == 2 * (3.0 * 1.0 + 6.0 * 2.0)
  np.testing.assert_array_equal(dx, [18.0, 36.0])
