"""microbatch: split and merge along the batch dimension, and their checks."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import microbatch


def testSplitMergeRoundTripKeepsNone():
  x = tf.reshape(tf.range(24.0), [2, 6, 2])
  parts = microbatch.Split([x, None], 3, batch_dim=1)
  assert len(parts) == 3 and all(p[1] is None for p in parts)
  np.testing.assert_array_equal(parts[1][0].numpy(), x.numpy()[:, 2:4])
  merged = microbatch.Merge(parts, batch_dim=1)
  np.testing.assert_array_equal(merged[0].numpy(), x.numpy())
  assert merged[1] is None


def testMicroBatchSize():
  assert microbatch.MicroBatchSize(12, 4) == 3
  with pytest.raises(ValueError, match=r'num_micro_batches=5 does not divide'
                     r'.* 12; valid values are \[1, 2, 3, 4, 6, 12\]'):
    microbatch.MicroBatchSize(12, 5)
  with pytest.raises(ValueError, match=r'num_micro_batches=16 is larger than '
                     r'the batch size 12; use a value in \[1, 12\]'):
    microbatch.MicroBatchSize(12, 16)


def testStaticBatchSize():
  a, b = tf.zeros([4, 3]), tf.zeros([4, 5])
  assert microbatch.StaticBatchSize([a, None, b], 0) == 4
  with pytest.raises(ValueError, match='disagree'):
    microbatch.StaticBatchSize([a, tf.zeros([3, 4])], 0)
  with pytest.raises(ValueError, match='batch_dim=2'):
    microbatch.StaticBatchSize([a], 2)
