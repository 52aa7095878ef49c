"""Tests of engine.moments: batch norm moments folded over micro-batches."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.engine import moments


def _Moments(x):
  """The [3, channels] (count, mean, population variance) of x's rows."""
  return moments.Moments(x.shape[0], np.mean(x, 0), np.var(x, 0))


def testCombiningMicroBatchesGivesTheMomentsOfTheWholeBatch():
  """Chan et al.: uneven parts, a large mean, and 0 samples on either side."""
  x = 1000.0 + np.random.RandomState(0).randn(12, 3)
  parts = [x[:2], x[2:7], x[7:]]
  total = moments.ZeroMoments([3], tf.float64)
  for part in parts:
    total = moments.CombineMoments(total, _Moments(part))
  total = total.numpy()
  np.testing.assert_array_equal(total[moments.COUNT], [12.0] * 3)
  np.testing.assert_allclose(total[moments.MEAN], np.mean(x, 0), rtol=1e-14)
  np.testing.assert_allclose(total[moments.VARIANCE], np.var(x, 0),
                             rtol=1e-10)
  # A side with no samples leaves the other bit for bit.
  one = _Moments(x[:5])
  zero = moments.ZeroMoments([3], tf.float64)
  np.testing.assert_array_equal(moments.CombineMoments(zero, one), one)
  np.testing.assert_array_equal(moments.CombineMoments(one, zero), one)


def testMomentsOfHandPickedSamples():
  # Samples 1 and 3: mean 2, population variance 1; with 5: mean 3, var 8/3.
  a = moments.Moments(2, np.array([2.0]), np.array([1.0]))
  b = moments.Moments(1, np.array([5.0]), np.array([0.0]))
  np.testing.assert_allclose(moments.CombineMoments(a, b).numpy(),
                             [[3.0], [3.0], [8.0 / 3.0]])
  assert moments.ZeroMoments([2]).numpy().tolist() == [[0.0, 0.0]] * 3

