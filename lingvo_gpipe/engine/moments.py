"""Batch moments that add up across micro-batches: the deferred batch-norm sum.

TensorFlow only. A batch norm inside a pipeline normalizes each micro-batch
with that micro-batch's statistics, but should update its moving statistics
once per step from the whole mini-batch (the GPipe paper's rule). Both front
ends (`lingvo_gpipe.batchnorm` for Lingvo, `lingvo_gpipe.keras` for Keras)
thread a [3, ...] tensor of rows (count, mean, variance) through the
micro-batches as stage state and fold each micro-batch in with
`CombineMoments`; the result is exactly the whole mini-batch's moments.
A batch of four examples of one channel in two micro-batches:

    >>> acc = ZeroMoments([1])
    >>> for micro_batch in ([[0.0], [2.0]], [[4.0], [6.0]]):
    ...   mean, variance = tf.nn.moments(tf.constant(micro_batch), axes=[0])
    ...   acc = CombineMoments(acc, Moments(2, mean, variance))
    >>> acc.numpy().tolist()  # Count, mean and variance of [0, 2, 4, 6].
    [[4.0], [3.0], [5.0]]
"""

import tensorflow as tf

# Rows of a moments tensor: [3, ...] = (count, mean, variance).
COUNT, MEAN, VARIANCE = 0, 1, 2


def ZeroMoments(shape, dtype=tf.float32) -> tf.Tensor:
  """The moments of zero samples: count, mean and variance 0, [3] + shape."""
  return tf.zeros([3] + list(shape), dtype=dtype)


def Moments(count, mean: tf.Tensor, variance: tf.Tensor) -> tf.Tensor:
  """Stacks (count, mean, variance) into a [3, ...] moments tensor.

  Args:
    count: The number of samples (scalar, or the shape of `mean`).
    mean: The per-channel mean.
    variance: The per-channel population variance (divided by count).

  Returns:
    [3] + mean.shape, with the count broadcast to every channel.
  """
  count = tf.cast(count, mean.dtype)
  return tf.stack([tf.broadcast_to(count, tf.shape(mean)), mean, variance])


def CombineMoments(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """Moments of the union of two disjoint sets of samples (Chan et al.).

  Each argument is a [3, ...] tensor of rows (count, mean, variance), the
  variance being the population variance (divided by count). Combining means
  and variances is exact and, unlike sums of squares, free of cancellation
  when the mean is large compared with the standard deviation. A side with
  count 0 is ignored exactly, so folding a single micro-batch into the zero
  initial value gives back its moments bit for bit.

  Args:
    a: [3, ...] moments of the first set.
    b: [3, ...] moments of the second set.

  Returns:
    [3, ...] moments of both sets together.
  """
  count_a, mean_a, var_a = a[COUNT], a[MEAN], a[VARIANCE]
  count_b, mean_b, var_b = b[COUNT], b[MEAN], b[VARIANCE]
  count = count_a + count_b
  safe_count = tf.maximum(count, tf.ones_like(count))
  weight_a, weight_b = count_a / safe_count, count_b / safe_count
  delta = mean_b - mean_a
  mean = mean_a + weight_b * delta
  variance = (weight_a * var_a + weight_b * var_b +
              weight_a * weight_b * tf.square(delta))
  merged = tf.stack([count, mean, variance])
  zeros = tf.zeros_like(count)
  a_empty = tf.broadcast_to(tf.equal(count_a, zeros)[tf.newaxis], tf.shape(a))
  b_empty = tf.broadcast_to(tf.equal(count_b, zeros)[tf.newaxis], tf.shape(b))
  return tf.where(a_empty, b, tf.where(b_empty, a, merged))
